"""Alias: ``varcomm.alltoall`` is ``varcomm.collectives.alltoall``, the same module object (one
module state, private names included). The code lives in
python/varcomm/collectives/alltoall.py; this name stays for existing imports."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("varcomm.collectives.alltoall")
