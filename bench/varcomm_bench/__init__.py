"""varcomm-bench: varcomm measured against its baselines (the fallback, mpi4py,
raw libfabric, memcpy), a package of its own beside the library.

    varcomm-bench p2p|varlen|alltoall|all [options]      or python -m varcomm_bench ...

The command line is in varcomm_bench.cli, the timing rules in varcomm_bench.core.
"""
from .cli import main

__all__ = ["main"]
