# Used by bench/results/redesign-compare-2026-12-01.md (table 4); run with the build to measure on PYTHONPATH.
"""1 rank, send to self then recv: the CPU cost of the blocking paths, no scheduling between processes."""
import sys, time
import numpy as np, torch
import varcomm
N, REPS = int(sys.argv[1]), int(sys.argv[2])
comm = varcomm.init(transport="shm", bound=1 << 16, slots=8, timeout=60)
res = {}
for name in ("np_out", "np_new", "torch_out", "torch_new"):
    if name.startswith("np"):
        x = np.zeros(1, dtype=np.int64); out = np.zeros(1, dtype=np.int64)
    else:
        x = torch.zeros(1, dtype=torch.int64); out = torch.zeros(1, dtype=torch.int64)
    o = out if name.endswith("out") else None
    comm._array = "numpy" if name.startswith("np") else "torch"
    best = 1e9
    for rep in range(REPS):
        t0 = time.perf_counter()
        for _ in range(N):
            comm.send(x, 0)
            comm.recv(0, out=o)
        best = min(best, (time.perf_counter() - t0) / N * 1e6)
    res[name] = best
print("RESULT", " ".join(f"{k}={v:.3f}" for k, v in res.items()), flush=True)
comm.close()
