"""Digests of tensors, each named by what it hashes.

Shared by weight-sync verification (engine vs trainer), the determinism hashes and checks that
compare weights, so every part of miles means the same thing by "the same tensor".

Two kinds: sha256 of a tensor's bytes (copied to the host), for digests compared with other
programs (engine servers); and `named_tensors_digest16`, computed where the tensors live, for the
per-step hashes of `--debug-determinism` (no host copy of a model's parameters and gradients).

The on-device digest: a tensor's bytes are read as signed integers of its element size (int8,
int16, int32, int64), sign-extended to int64 and cut into blocks of BLOCK positions; each block
sums word * M[position in block] modulo 2^64 (int64 arithmetic wraps, on CPU and CUDA alike), where
M are fixed odd 64-bit multipliers (splitmix64 of the position). A flip of bit b of one word moves
its block's sum by +-2^b * M (mod 2^64), never 0 because M is odd: every single-bit change shows.
Integer addition is associative, so the sums do not depend on reduction order, kernel or device.
The block sums (numel / BLOCK words per tensor) are then hashed on the host with sha256, with each
tensor's name, dtype and shape.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import torch

BLOCK = 1 << 16  # positions sharing no multiplier; one int64 block sum each
CHUNK_BLOCKS = {"cpu": 4, "cuda": 64}  # blocks per step: an int64 product of 2 MiB on CPU (cache), 32 MiB on GPU
_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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


def multipliers(n: int = BLOCK) -> np.ndarray:
    """The first n odd multipliers (int64): splitmix64 of 1..n with the low bit set. numpy's uint64
    arithmetic wraps modulo 2^64 by definition, so they are the same on every platform."""
    x = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x | np.uint64(1)).view(np.int64)


_ON_DEVICE: dict[torch.device, torch.Tensor] = {}
_HOST = multipliers()


def _multipliers_on(device: torch.device) -> torch.Tensor:
    if device not in _ON_DEVICE:
        _ON_DEVICE[device] = torch.from_numpy(_HOST).to(device)
    return _ON_DEVICE[device]


def block_sums(t: torch.Tensor) -> torch.Tensor:
    """t's block sums: ceil(numel / BLOCK) int64 words, on t's device (not yet synchronised there).

    The same integers on every device: a GPU computes them with torch kernels, a CPU with numpy
    (one thread, cache-sized chunks), both wrapping modulo 2^64."""
    words = t.detach().contiguous().reshape(-1).view(_SIGNED[t.element_size()])  # (N,) row-major
    if words.device.type == "cpu":
        return torch.from_numpy(_block_sums_numpy(words.numpy()))
    return _block_sums_torch(words)


def _block_sums_torch(words: torch.Tensor) -> torch.Tensor:
    """Two kernels per CHUNK_BLOCKS blocks (multiply, sum), two for the partial last block."""
    m = _multipliers_on(words.device)  # (BLOCK,)
    full, step = words.numel() // BLOCK, CHUNK_BLOCKS["cuda"]
    sums = [(words[a * BLOCK:min(a + step, full) * BLOCK].view(-1, BLOCK) * m).sum(1)  # (blocks,) int64
            for a in range(0, full, step)]
    if tail := words.numel() - full * BLOCK:
        sums.append((words[full * BLOCK:] * m[:tail]).sum().reshape(1))
    if len(sums) == 1:
        return sums[0]
    return torch.cat(sums) if sums else torch.zeros(0, dtype=torch.int64, device=words.device)


def _block_sums_numpy(words: np.ndarray) -> np.ndarray:
    full, step = len(words) // BLOCK, CHUNK_BLOCKS["cpu"]
    out = np.empty(-(-len(words) // BLOCK), dtype=np.int64)
    product = np.empty((min(step, full), BLOCK), dtype=np.int64)
    for a in range(0, full, step):
        b = min(a + step, full)
        np.multiply(words[a * BLOCK:b * BLOCK].reshape(b - a, BLOCK), _HOST, out=product[:b - a])
        product[:b - a].sum(1, out=out[a:b])
    if tail := len(words) - full * BLOCK:
        out[full] = np.multiply(words[full * BLOCK:], _HOST[:tail], dtype=np.int64).sum()
    return out


def named_tensors_digest16(named: Iterable[tuple[str, torch.Tensor | None]]) -> str:
    """16 hex digits of sha256 over (name, dtype, shape, block sums) in the given order; None hashes
    as `none`. The block sums are computed on the tensors' device and copied to the host at once.

    Over a model's parameters (or their gradients) in `named_parameters()` order, it is the
    `parameters` (or `gradients`) entry of hashes.jsonl; over one tensor, `trainer_log_probs`.
    """
    entries, pieces = [], []  # entries: (header, number of block sums); pieces: the device tensors
    for name, t in named:
        if t is None:
            entries.append((f"{name}\0none\0".encode(), 0))
            continue
        sums = block_sums(t)
        entries.append((f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode(), sums.numel()))
        pieces.append(sums)
    words = _to_host(pieces)
    h, at = hashlib.sha256(), 0
    for header, n in entries:
        h.update(header)
        h.update(words[at:at + n].tobytes())
        at += n
    return h.hexdigest()[:16]


def _to_host(pieces: list[torch.Tensor]) -> np.ndarray:
    """The block sums as little-endian int64 on the host: one copy (one sync) per device."""
    if not pieces:
        return np.zeros(0, dtype="<i8")
    if len({p.device for p in pieces}) == 1:
        return torch.cat(pieces).cpu().numpy().astype("<i8", copy=False)
    return np.concatenate([p.cpu().numpy() for p in pieces]).astype("<i8", copy=False)
