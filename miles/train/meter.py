"""Per-step performance figures of the trainer: peak device memory and model TFLOP/s.

`perf/peak_memory_gib`: torch.cuda.max_memory_allocated over the step (the peak is reset when the
step starts), this rank's, in GiB. Only on CUDA: on a CPU there is no per-step peak to read (the
process's peak RSS never resets), so the key is left out rather than filled with another figure.

`perf/train_tflops`: model FLOPs of the step / its wall time, this rank's. Model FLOPs per real
(non-padding) token: 2N for each scoring forward (policy, and reference when there is one) plus 6N
for the training forward and backward, where N = `matmul_parameters` (every parameter but the
input embedding; a tied embedding is counted once, as lm_head). Not counted: attention's
sequence-length term, and work that is not the model's (recomputation under
--gradient-checkpointing, the lm_head chunks recomputed in backward). MFU = this / the device's
peak dense bf16 TFLOP/s (989 for an H100/H200 SXM).
"""

from __future__ import annotations

import contextlib
import time

import torch


def matmul_parameters(model: torch.nn.Module) -> int:
    """Parameters that take part in a matmul for every token: all but an untied input embedding."""
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # a tied weight is listed once
    return total - (embed.numel() if embed is not head else 0)


class StepMeter:
    """Started when a step starts; `metrics` when it ends."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        self.start = time.perf_counter()
        self.hash_s: float | None = None  # time in the step's digests (--debug-determinism), once one ran

    @contextlib.contextmanager
    def hashing(self):
        """Times a digest of the step into `perf/hash_s`, the device's queued work finished first so that only
        the digest is counted (each digest ends in a host copy, which waits for that work anyway)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.hash_s = (self.hash_s or 0.0) + time.perf_counter() - start

    def metrics(self, *, flops: float) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        out = {"perf/train_tflops": flops / (time.perf_counter() - self.start) / 1e12}
        if self.hash_s is not None:
            out["perf/hash_s"] = self.hash_s
        if self.cuda:
            out["perf/peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out
