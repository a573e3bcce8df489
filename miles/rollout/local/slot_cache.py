"""The fast engine's slot KV cache, its batch buckets, and the one-copy upload of the host's index lists.

A decode call's sequences each own a slot of the cache; a step runs the lowest slots at a bucket's size (a CUDA
graph per bucket on a GPU). `ModelRunner` owns the cache and sends its index lists up through `upload`, as
batching.py does; the continuous batchers (batching.py, `miles serve`'s serve/batch.py) pick the buckets (`bucket`).
"""

from __future__ import annotations

import numpy as np
import torch


def batch_buckets(limit: int) -> list[int]:
    """Batch sizes a decode step is run at: 1, 2, 4, 8, then steps of 16 to 128, 32 to 256,
    64 to 512, 128 beyond; up to and including the first >= limit."""
    sizes, b = [], 1
    while not sizes or sizes[-1] < limit:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (16 if b < 128 else 32 if b < 256 else 64 if b < 512 else 128)
    return sizes


def bucket(n: int, sizes: list[int]) -> int:
    return next(s for s in sizes if s >= n)


def upload(lists: list[list[int] | np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Lists of ints (or integer arrays) as int64 tensors on `device`, made on the host and copied in one transfer.
    On a GPU the copy is from pinned memory, queued behind the GPU's work: a copy from pageable memory
    (`torch.tensor(..., device=...)`) waits for the stream's queued work first, so the host would build the next
    prefill forward only after the GPU finished the last (3.5-4.4 ms of idle GPU between batch 512's prefill forwards
    on an H100: BENCHMARKS.md)."""
    host = torch.from_numpy(np.concatenate([np.asarray(values, np.int64) for values in lists]))
    if device.type == "cuda":
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split([len(values) for values in lists]))


class SlotKVCache:
    """Every layer's keys and values in one (2, layers, S, H, L, D) tensor; `keys[i]` and `values[i]` are layer i's
    (S, H, L, D) views. One tensor lets a slot's columns move for every layer in one copy: moving two slots as 60
    per-layer indexed copies took 9.9 ms on the 2-core CPU (each opened a parallel region whose sleeping thread had
    to be woken), one basic-slice copy per slot 0.6 ms (BENCHMARKS.md, 2026-12-06)."""

    def __init__(self, *, layers: int, slots: int, length: int, kv_heads: int, head_dim: int, dtype, device):
        self.data = torch.zeros((2, layers, slots, kv_heads, length, head_dim), dtype=dtype, device=device)
        self.keys, self.values = list(self.data[0]), list(self.data[1])
        self.slots, self.length = slots, length

    @staticmethod
    def slot_bytes(*, layers: int, length: int, kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * layers * kv_heads * length * head_dim * torch.empty(0, dtype=dtype).element_size()

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def move(self, src: list[int], dst: list[int]) -> None:
        """Copies slot src[j] to slot dst[j] in every layer (no slot both a source and a destination)."""
        self.copy_columns(src, dst, self.length)

    def copy_columns(self, src: list[int], dst: list[int], columns: int) -> None:
        """Copies columns [0, columns) of slot src[j] to slot dst[j] in every layer, one copy per pair (a source may
        repeat; no slot both a source and a destination)."""
        for s, d in zip(src, dst):
            self.data[:, :, d, :, :columns] = self.data[:, :, s, :, :columns]
