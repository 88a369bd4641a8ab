"""Alias: ``varcomm.torch_backend`` is ``varcomm.integrations.torch_backend``, the same module object (one
module state, private names included). The code lives in
python/varcomm/integrations/torch_backend.py; this name stays for existing imports."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("varcomm.integrations.torch_backend")
