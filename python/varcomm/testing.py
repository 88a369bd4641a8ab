"""Alias: ``varcomm.testing`` is ``varcomm.tools.testing``, the same module object (one
module state, private names included). The code lives in
python/varcomm/tools/testing.py; this name stays for ``from varcomm.testing import world, seeded``."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("varcomm.tools.testing")
