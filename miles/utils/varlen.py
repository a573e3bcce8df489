"""Causal attention within each of several sequences packed into one row of tokens.

Shared by the trainer's packed micro-batches (miles/train/attention.py) and the engine's packed
prefill (miles/rollout/local/runner.py). Queries (T, Hq, D), keys and values (T, Hkv, D) hold the
sequences back to back; `cu_seq_lens` (N + 1,) int32 on their device gives where each starts, and
T. On CUDA, torch's `varlen_attn` (the FlashAttention-style varlen kernel) runs bf16/fp16, and other
dtypes run one batched SDPA over the sequences scattered to a padded grid; on the CPU each sequence
runs its own `scaled_dot_product_attention(is_causal=True)`. Under autocast all of them compute in
autocast's dtype, as SDPA does. None attends across sequences.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from miles.utils import forward_kernels, invariant
from miles.utils.autocast import autocast_dtype


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor,
                            max_len: int, scale: float | None, dropout: float = 0.0) -> torch.Tensor:
    """(T, Hq, D) attention outputs of the packed sequences, by the kernel `kernel_for` names
    (attention dropout `dropout`: SDPA's, so never the varlen kernel); under --true-on-policy-mode on a
    GPU, miles.utils.invariant's kernel (whose backward is `torch_causal_attention`'s)."""
    if invariant.enabled() and q.is_cuda and not dropout:
        return invariant.packed_attention(q, k, v, cu_seq_lens, scale)
    return torch_causal_attention(q, k, v, cu_seq_lens, max_len, scale, dropout)


def torch_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor,
                           max_len: int, scale: float | None, dropout: float = 0.0) -> torch.Tensor:
    """packed_causal_attention by torch's kernels (varlen_attn, SDPA), whatever the mode."""
    q, k, v = _autocast(q, k, v)
    kernel = kernel_for(q, scale, dropout)
    if kernel == "varlen_attn":
        flash = _flash_kwargs(q, scale)
        groups = q.shape[1] // k.shape[1]
        if groups > 1 and "enable_gqa" not in flash:  # this torch's varlen_attn wants as many kv heads as q heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return _varlen_attn()(q, k, v.contiguous(), cu_seq_lens, cu_seq_lens, max_len, max_len, **flash)
    if kernel == "padded_sdpa":
        return padded_causal_attention(q, k, v, cu_seq_lens, max_len, scale, dropout)
    return per_sequence_attention(q, k, v, cu_seq_lens, scale, dropout)


def kernel_for(q: torch.Tensor, scale: float | None, dropout: float = 0.0) -> str:
    """Which kernel packed attention of `q` (already in its compute dtype) runs: "varlen_attn" (torch's
    FlashAttention-style varlen kernel: CUDA, bf16/fp16, no dropout), "padded_sdpa" (other CUDA cases:
    one batched SDPA beats a kernel launch per sequence there) or "per_sequence" (CPU, where the loop is
    faster). Under torch's deterministic algorithms in warn-only form (the mode outside the trainer's
    passes) it is never "varlen_attn": there its flash backward accumulates dQ with atomics, where the
    padded grid runs SDPA's kernel of the mode's choice. Strict (the trainer's passes under the mode,
    miles.utils.forward_kernels.strict_backward) it is, as for SDPA's flash kernel: FlashAttention's
    backward then accumulates in a fixed order (tests/test_gpu.py checks the gradients repeat bitwise)."""
    if not q.is_cuda:
        return "per_sequence"
    warn_only = torch.are_deterministic_algorithms_enabled() and not forward_kernels.strict()
    if dropout or warn_only or _flash_kwargs(q, scale) is None:
        return "padded_sdpa"
    return "varlen_attn"


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in autocast's dtype when it is on for their device, as SDPA would cast them: under
    bf16 autocast over fp32 weights the rotary embedding hands attention fp32 queries and keys."""
    dtype = autocast_dtype(tensors[0].device.type)
    return tensors if dtype is None else tuple(t.to(dtype) for t in tensors)


def per_sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor,
                           scale: float | None, dropout: float = 0.0) -> torch.Tensor:
    """One `scaled_dot_product_attention(is_causal=True)` per sequence, (T, Hq, D)."""
    # split, not slices: split's backward is one cat, where each slice's would zero a full-size gradient
    lengths = cu_seq_lens.diff().tolist()
    gqa = q.shape[1] != k.shape[1]
    parts = [F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                            vs.transpose(0, 1)[None], is_causal=True, scale=scale,
                                            dropout_p=dropout, enable_gqa=gqa)[0].transpose(0, 1)
             for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
    return torch.cat(parts)


def padded_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor,
                            max_len: int, scale: float | None, dropout: float = 0.0) -> torch.Tensor:
    """The packed sequences scattered to a right-padded (N, H, max_len, D) grid, one batched
    `scaled_dot_product_attention(is_causal=True)` over it, and the real rows gathered back, (T, Hq, D).
    A causal query never sees the padding after its own sequence, so no mask is needed."""
    n, t = cu_seq_lens.numel() - 1, q.shape[0]
    tokens = torch.arange(t, device=q.device)
    seq = torch.searchsorted(cu_seq_lens[1:].long(), tokens, right=True)  # (T,) each token's sequence
    slot = seq * max_len + tokens - cu_seq_lens[:-1].long()[seq]  # each token's row in the grid

    def grid(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(n * max_len, *x.shape[1:]).index_copy(0, slot, x)
        return out.view(n, max_len, *x.shape[1:]).transpose(1, 2)

    out = F.scaled_dot_product_attention(grid(q), grid(k), grid(v), is_causal=True, scale=scale, dropout_p=dropout,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).reshape(n * max_len, *q.shape[1:])[slot]


@functools.cache
def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


@functools.cache
def _varlen_params() -> frozenset[str]:
    return frozenset(inspect.signature(_varlen_attn()).parameters) if _varlen_attn() else frozenset()


def _flash_kwargs(q: torch.Tensor, scale: float | None) -> dict | None:
    """The causal/GQA/scale keywords for this torch's `varlen_attn` (their names changed between
    releases), or None where it cannot run (CPU, fp32, no varlen_attn, a scale it cannot take)."""
    params = _varlen_params()
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and params):
        return None
    extra = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        extra["enable_gqa"] = True
    if "scale" in params:
        extra["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        return None
    return extra
