"""Alias: ``varcomm.doctor`` is ``varcomm.tools.doctor``, the same module object (one
module state, private names included). The code lives in
python/varcomm/tools/doctor.py; this name stays for ``python -m varcomm.doctor``."""
import importlib
import sys

if __name__ == "__main__":  # run by runpy: the file is __main__, so run the tool rather than alias __main__
    sys.exit(importlib.import_module("varcomm.tools.doctor").main())
sys.modules[__name__] = importlib.import_module("varcomm.tools.doctor")
