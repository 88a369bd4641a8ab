"""varcomm under PyTorch: the torch.distributed backend (torch_backend) and the
torch.distributed-shaped module (distributed). Both import torch."""
