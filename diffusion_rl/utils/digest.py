"""One digest of named tensors, shared by checkpoints (which weights a tool loaded) and the prompt-embedding cache
(which tensors belong to which text)."""

from __future__ import annotations

import hashlib

import torch


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of named tensors (sorted by name: each name, dtype, shape and raw bytes): identifies weights whatever
    the directory they came from is called."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()
