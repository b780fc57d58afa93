"""Digests shared across the package: of named tensors (checkpoints: which weights a tool loaded; the prompt-embedding
cache: which tensors belong to which text) and of a file, streamed (checkpoint manifests, shipped models, eval's
prompt file)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

CHUNK = 1 << 20  # bytes a file is read at a time: memory stays flat whatever the file's size


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read CHUNK at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of named tensors (sorted by name: each name, dtype, shape and raw bytes): identifies weights whatever
    the directory they came from is called."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()
