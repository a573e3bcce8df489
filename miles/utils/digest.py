"""Digests of tensors, each named by what it hashes.

Shared by weight-sync verification (engine vs trainer), the determinism hashes and checks that
compare weights, so every part of miles means the same thing by "the same tensor".
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes, in row-major order (neither its dtype nor its shape)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def tensor_bytes_sha256(t: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's raw bytes: equal digests mean bitwise-equal tensors of one dtype."""
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def typed_tensor_sha256(t: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's dtype, shape and raw bytes: equal digests mean identical tensors,
    whatever their dtypes (check-weights compares weight sets that may differ in either)."""
    h = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode())
    h.update(tensor_bytes(t))
    return h.hexdigest()


def bytes_digest16(*parts: bytes) -> str:
    """The first 16 hex digits of sha256 over several byte strings, for per-step hashes."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()[:16]


def named_tensors_digest16(named: Iterable[tuple[str, torch.Tensor | None]]) -> str:
    """16 hex digits of sha256 over (name, raw bytes) pairs in the given order; None hashes as `none`.

    Over a model's parameters (or their gradients) in `named_parameters()` order, it is the
    `parameters` (or `gradients`) entry of hashes.jsonl.
    """
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(tensor_bytes(t) if t is not None else b"none")
    return h.hexdigest()[:16]
