# Used by bench/results/p2p-small-2026-12-02.md (table 3): MASTER_ADDR=127.0.0.1 MASTER_PORT=29655 PYTHONPATH=<tree>/python python p2p-small-floor.py
"""1 rank, send to self then recv: CPU cost per send+recv pair, and the cost of the pieces a
receive cannot avoid (ns, best of 9 rounds)."""
import time, numpy as np, torch
import varcomm
comm = varcomm.init(transport="shm", bound=1 << 16, slots=8, timeout=60, array="numpy", rank=0, world_size=1)
N = 20000
x = np.ones(8, np.uint8); out = np.zeros(1 << 16, np.uint8)
xt = torch.ones(2); outt = torch.zeros(1 << 14)
def best(f):
    b = 1e9
    for _ in range(9):
        t0 = time.perf_counter(); f(); b = min(b, (time.perf_counter() - t0) / N * 1e9)
    return b
def np_out():
    for _ in range(N): comm.send(x, 0); comm.recv(0, out=out)
def np_new():
    for _ in range(N): comm.send(x, 0); comm.recv(0)
def zc():
    for _ in range(N): comm.send(x, 0); y = comm.recv(0, copy=False); del y
def t_out():
    for _ in range(N): comm.send(xt, 0); comm.recv(0, out=outt)
def t_new():
    for _ in range(N): comm.send(xt, 0); comm.recv(0, array="torch")
def t_zc():
    for _ in range(N): comm.send(xt, 0); y = comm.recv(0, copy=False, array="torch"); del y
def call2():
    f = len
    for _ in range(N): f(x); f(x)
def npslice():
    for _ in range(N): out[:8]
def npempty():
    for _ in range(N): np.empty((8,), np.uint8)
def tslice():
    for _ in range(N): outt[:2]
def tempty():
    for _ in range(N): torch.empty((2,), dtype=torch.float32)
def tattrs():
    for _ in range(N): xt.is_cpu; xt.is_contiguous(); xt.is_neg(); xt.dtype; xt.data_ptr(); xt.shape
r = {k: best(f) for k, f in [("np_out", np_out), ("np_new", np_new), ("np_zerocopy", zc), ("torch_out", t_out),
                              ("torch_new", t_new), ("torch_zerocopy", t_zc), ("two_builtin_calls", call2),
                              ("np_slice", npslice), ("np_empty", npempty), ("torch_slice", tslice),
                              ("torch_empty", tempty), ("torch_6_attrs", tattrs)]}
print("RESULT " + " ".join(f"{k}={v:.0f}" for k, v in r.items()))
comm.close()
