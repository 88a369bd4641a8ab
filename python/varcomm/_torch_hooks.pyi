"""The torch adapter of the core's fast paths (csrc/adapters/torch_hooks.cpp); see arrays.use_torch_hooks."""
from typing import Any

torch_version: str  # the torch it was built against: its C++ ABI is that version's

def install(tensor_type: type, pairs: list[tuple[Any, int]], kind: int, error: type[Exception]) -> object: ...
