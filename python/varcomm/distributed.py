"""Alias: ``varcomm.distributed`` is ``varcomm.integrations.distributed``, the same module object (one
module state, private names included). The code lives in
python/varcomm/integrations/distributed.py; this name stays for ``import varcomm.distributed as dist``."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("varcomm.integrations.distributed")
