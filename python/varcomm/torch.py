"""``import varcomm.torch`` registers the ``"varcomm"`` backend of torch.distributed;
see varcomm.integrations.torch_backend. (Inside the package, ``import torch`` still means
PyTorch: imports are absolute.)"""
from __future__ import annotations

from .integrations.torch_backend import BACKEND, VarcommProcessGroup, VarcommWork, comm_of, placeholder, register

register()

__all__ = ["BACKEND", "VarcommProcessGroup", "VarcommWork", "comm_of", "placeholder", "register"]
