"""Digests of tensors: equal digests mean bitwise-equal tensors of one dtype.

Shared by weight-sync verification (engine vs trainer), the determinism hashes and checks that
compare weights, so every part of miles means the same thing by "the same tensor".
"""

from __future__ import annotations

import hashlib

import torch


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (hex)."""
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def digest(*parts: bytes) -> str:
    """A short digest (16 hex digits) over several byte strings, for per-step hashes."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()[:16]
