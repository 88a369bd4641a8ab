"""Arrays through DLPack (any object with __dlpack__ / __dlpack_device__) and
array="auto" (a receive answers in the kind the sender sent), on every transport.
cupy on a GPU: tests/test_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import varcomm
from conftest import TRANSPORTS
from varcomm.testing import world

BOUND = 64 * 1024


class DLPackOnly:
    """An array of no known library: it speaks DLPack and nothing else (no shape,
    no reshape), delegating to the numpy array or torch tensor it wraps."""

    def __init__(self, a, device=None):
        self.a = a
        self._device = device

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._device or self.a.__dlpack_device__()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=90)
def test_dlpack_objects_send_and_recv_out(transport):
    with varcomm.init(transport=transport, bound=BOUND, slots=4, timeout=30) as comm:
        if comm.rank == 0:
            comm.send(DLPackOnly(np.arange(12, dtype=np.int32).reshape(3, 4)), dst=1)  # numpy's __dlpack__
            comm.send(DLPackOnly(torch.arange(5, dtype=torch.bfloat16)), dst=1)  # a dtype numpy lacks
            comm.send(DLPackOnly(np.arange(6, dtype=np.float64)), dst=1)
            comm.send(DLPackOnly(np.arange(3, dtype=np.int16)), dst=1)
            comm.isend(DLPackOnly(np.arange(4, dtype=np.uint8)), dst=1).wait()
            comm.send(DLPackOnly(np.arange(8, dtype=np.int64)[::2]), dst=1)  # strided: numpy's DLPack says so
        else:
            a = comm.recv(src=0)  # kind not said by the sender: torch (the default kind)
            assert isinstance(a, torch.Tensor) and a.dtype == torch.int32 and a.shape == (3, 4)
            assert a.flatten().tolist() == list(range(12))
            b = comm.recv(src=0)
            assert b.dtype == torch.bfloat16 and b.tolist() == [0, 1, 2, 3, 4]
            out = DLPackOnly(np.full(100, -1.0))
            c = comm.recv(src=0, out=out)
            # out has no reshape: the prefix comes back as a numpy view of its memory
            assert isinstance(c, np.ndarray) and np.shares_memory(c, out.a) and c.tolist() == list(range(6))
            assert out.a[6] == -1.0, "recv wrote past the message"
            exact = DLPackOnly(np.zeros(3, dtype=np.int16))
            assert comm.recv(src=0, out=exact) is exact and exact.a.tolist() == [0, 1, 2]
            iout = DLPackOnly(np.zeros(16, dtype=np.uint8))
            d = comm.irecv(src=0, out=iout).wait()
            assert np.shares_memory(d, iout.a) and d.tolist() == [0, 1, 2, 3]
            e = comm.recv(src=0)
            assert e.tolist() == [0, 2, 4, 6]
        comm.barrier()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=90)
def test_dlpack_refusals_leave_the_channel_usable(transport):
    with varcomm.init(transport=transport, bound=BOUND, slots=4, timeout=30) as comm:
        if comm.rank == 0:
            with pytest.raises(varcomm.InvalidArgument, match="__dlpack__"):
                comm.send(object(), dst=1)
            with pytest.raises(varcomm.InvalidArgument, match="opencl memory"):
                comm.send(DLPackOnly(np.zeros(3), device=(4, 0)), dst=1)
            comm.send(np.arange(4.0), dst=1)
            comm.send(np.arange(4.0), dst=1)
        else:
            ro = np.zeros(8)
            ro.flags.writeable = False
            with pytest.raises(varcomm.InvalidArgument, match="writeable"):
                comm.recv(src=0, out=DLPackOnly(ro))
            with pytest.raises(varcomm.InvalidArgument, match="array='jax'"):
                comm.recv(src=0, array="jax")
            assert comm.recv(src=0).tolist() == [0, 1, 2, 3]  # nothing was consumed by the refusals
            try:
                import cupy  # noqa: F401
            except ImportError:  # without cupy, array="cupy" refuses and leaves the message
                with pytest.raises(varcomm.InvalidArgument, match="varcomm\\[cupy\\]"):
                    comm.recv(src=0, array="cupy")
            assert comm.recv(src=0).tolist() == [0, 1, 2, 3]
        comm.barrier()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=90)
def test_array_auto_answers_in_the_senders_kind(transport):
    with varcomm.init(transport=transport, bound=BOUND, slots=4, timeout=30) as comm:
        assert comm.options.array == "auto"  # the default
        if comm.rank == 0:
            comm.send(np.arange(3, dtype=np.int64), dst=1)
            comm.send(torch.arange(3), dst=1)
            comm.isend(np.arange(3.0), dst=1).wait()
            comm.isend(torch.arange(3.0), dst=1).wait()
            comm.send(np.arange(6, dtype=np.int32).reshape(2, 3)[:, :2], dst=1)  # strided numpy: still numpy
            comm.send(torch.arange(3), dst=1)
            comm.send(np.arange(3), dst=1)
            comm.send(np.arange(3), dst=1)
            comm.send(torch.arange(3), dst=1)
            comm.isend_descriptor(1, 1 << 30, varcomm.dtypes.word(varcomm.dtypes.FLOAT, 32), (1 << 28,)).wait()
        else:
            assert isinstance(comm.recv(src=0), np.ndarray)
            assert isinstance(comm.recv(src=0), torch.Tensor)
            assert isinstance(comm.irecv(src=0).wait(), np.ndarray)  # the irecv path too
            assert isinstance(comm.irecv(src=0).wait(), torch.Tensor)
            s = comm.recv(src=0)
            assert isinstance(s, np.ndarray) and s.tolist() == [[0, 1], [3, 4]]
            assert isinstance(comm.recv(src=0, array="numpy"), np.ndarray)  # the caller's kind wins
            assert isinstance(comm.recv(src=0, array="torch"), torch.Tensor)
            loan = comm.recv(src=0, copy=False)  # a loaned slot view answers in kind too
            assert isinstance(loan, np.ndarray) and loan.tolist() == [0, 1, 2]
            del loan
            assert isinstance(comm.irecv(src=0, array="numpy").wait(), np.ndarray)
            st = comm.recv(src=0)  # a descriptor: its Status, whose array kind is not said
            assert st.descriptor and st.array == 0 and len(st) == 7
        comm.barrier()


@pytest.mark.parametrize("array", ["torch", "numpy"])
@world(2, timeout=60)
def test_a_fixed_array_kind_ignores_the_sender(array):
    want = torch.Tensor if array == "torch" else np.ndarray
    with varcomm.init(transport="shm", bound=BOUND, timeout=30, array=array) as comm:
        if comm.rank == 0:
            for x in (np.arange(3), torch.arange(3), np.arange(3), torch.arange(3)):
                comm.send(x, dst=1)
        else:
            assert isinstance(comm.recv(src=0), want)
            assert isinstance(comm.recv(src=0), want)
            assert isinstance(comm.irecv(src=0).wait(), want)
            assert isinstance(comm.irecv(src=0).wait(), want)
        comm.barrier()
