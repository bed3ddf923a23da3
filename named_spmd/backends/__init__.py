"""Backends: simulated (nested vmap in this process), distributed (torch.distributed, loaded
lazily), abstract (meta tensors, check only)."""
