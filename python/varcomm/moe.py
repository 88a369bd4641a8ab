"""Alias: ``varcomm.moe`` is ``varcomm.collectives.moe``, the same module object (one
module state, private names included). The code lives in
python/varcomm/collectives/moe.py; this name stays for ``from varcomm import moe``."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("varcomm.collectives.moe")
