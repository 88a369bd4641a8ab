# Used by bench/results/redesign-compare-2026-12-01.md (table 5): python -m varcomm.run -n 2 redesign-pp2.py
import sys, time
import numpy as np
import varcomm
comm = varcomm.init(transport="shm", bound=16 << 20, slots=8, timeout=60, array="numpy")
peer = 1 - comm.rank
res = {}
for name, n, N in (("8B", 2, 3000), ("8MiB", 2 << 20, 20)):
    x = np.ones(n, dtype=np.float32); out = np.zeros(4 << 20, dtype=np.float32)
    rounds = []
    for rep in range(8):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(N):
            if comm.rank == 0:
                comm.send(x, peer); comm.recv(peer, out=out)
            else:
                comm.recv(peer, out=out); comm.send(x, peer)
        rounds.append((time.perf_counter() - t0) / N / 2 * 1e6)
    res[name] = min(rounds)
if comm.rank == 0:
    print("RESULT", " ".join(f"{k}={v:.2f}" for k, v in res.items()), flush=True)
comm.close()
