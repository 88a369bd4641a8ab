# One process, send to self: CPU cost per send+recv pair (8 B), torch adapter off/on alternating, numpy for reference.
import time, numpy as np, torch, varcomm
from varcomm import arrays
def bench(on):
    arrays.use_torch_hooks(on)
    comm = varcomm.init(transport="shm")
    ta, tb, na, nb = torch.zeros(2), torch.zeros(1024), np.zeros(2, np.float32), np.zeros(1024, np.float32)
    def loop(body, n=50000):
        for _ in range(2000): body()
        t = time.perf_counter()
        for _ in range(n): body()
        return (time.perf_counter() - t) / n * 1e6
    def out(): comm.send(ta, 0); comm.recv(0, out=tb)
    def fresh(): comm.send(ta, 0); comm.recv(0)
    def zero(): comm.send(ta, 0); comm.recv(0, copy=False)
    def npout(): comm.send(na, 0); comm.recv(0, out=nb)
    r = [min(loop(f) for _ in range(3)) for f in (out, fresh, zero, npout)]
    comm.close()
    return r
res = {True: [], False: []}
for i in range(3):
    for on in (False, True):
        res[on].append(bench(on))
for on in (False, True):
    b = [min(x[k] for x in res[on]) for k in range(4)]
    print(f"adapter {'on ' if on else 'off'}: torch out= {b[0]:.3f} us, torch new {b[1]:.3f} us, "
          f"torch copy=False {b[2]:.3f} us, numpy out= {b[3]:.3f} us")
