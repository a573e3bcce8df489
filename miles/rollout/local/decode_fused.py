"""The fast engine's decode step on a GPU: Triton kernels for the pointwise work around a layer's GEMMs.

A decode step's layer is four GEMMs, the attention, and the pointwise work between them. In the layer functions
(compiled by Inductor, at dynamic shapes) the SiLU-and-multiply and RoPE alone took 16% of a batch-512 step's GPU
time on the H100 against the GEMMs' 27%, at about a third of copy bandwidth, with the KV-cache writes and the
cos/sin gathers as kernels of their own. Here each piece is one kernel, one program per token row (+14% tok/s at
batch 512 and +20% at batch 128 on the H200; BENCHMARKS.md):

- `rms_norm`: HF's Llama RMSNorm (normalised in fp32, rounded to the input's dtype, then scaled) in one pass; with a
  `residual`, the residual add before it too (x + residual rounded as torch's add rounds, written into x).
- `rope_and_cache`: RoPE of the queries and keys read from the fused q/k/v projection's output, the keys and
  values written into the slot cache at each row's position, the queries returned; cos and sin read at the
  position from the runner's tables. (A decode step with decode_attention's kernel runs it inside that kernel
  instead: `decode_attention.rope_and_attend`; this one serves the prefill, the mode and SDPA's decode.)
- `silu_and_mul`: SiLU(gate) * up of the fused gate/up projection's output, rounded once.

The residual adds go into the next norm's kernel. A decode step's layers fold the norms away (runner.py's
`_folded_layer`): `row_scale` gives rope_and_attend and `silu_and_mul` each row's 1 / rms. Used by ModelRunner's
decode steps and (outside --true-on-policy-mode) its prefill where it runs: a CUDA GPU (or Triton's interpreter in
the tests) and a model without per-head q/k norms. Under --true-on-policy-mode, whose decode must compute the
trainer's bits, the norm and RoPE run `exact` (EXACT below; the norm's sum is the trainer's exact row sum) and the
SiLU-and-multiply stays torch's. Shapes: N rows (a decode step's row j decodes slot j; a prefill's packed tokens
name their slots), Q query heads, H KV heads, D head dim, F the MLP width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles.utils import invariant
from miles.utils.invariant_kernels import exact_sum

MLP_BLOCK = 1024  # MLP columns a program
# Each product rounded before it is added, as torch's separate kernels round it (no fused multiply-add): with this,
# `rms_norm` and `rope_and_cache` (their `exact`) compute the bits of the layer functions' ops, which
# --true-on-policy-mode needs.
EXACT = dict(enable_fp_fusion=False)


def supported(head_dim: int, hidden: int, exact: bool = False) -> bool:
    """Whether the kernels take this shape: `rope_and_cache` a head dim that is a power of two of 4 or more (a tile's
    width); with `exact` (--true-on-policy-mode), `rms_norm` only a width the trainer's invariant row
    mean sums exactly too (invariant.ROW_MEAN_MAX): above it the trainer takes torch's sum, which no kernel repeats."""
    return head_dim >= 4 and head_dim & (head_dim - 1) == 0 and not (exact and hidden > invariant.ROW_MEAN_MAX)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             dtype: torch.dtype | None = None, exact: bool = False, **launch) -> torch.Tensor:
    """x (N, hidden) -> weight * (x / rms(x)) as HF's RMSNorm computes it: in fp32, rounded to x's dtype, scaled;
    returned in `dtype` (default: torch's promotion of x and weight; an autocast's dtype rounds as its cast would).
    With `residual` (N, hidden), x += residual first, in place (rounded to x's dtype), and the sum is normalised.
    With `exact` (--true-on-policy-mode) the mean square is the square of each column rounded, summed exactly
    (miles.utils.invariant_kernels.exact_sum, the invariant row mean's sum) and divided by the width, each product
    rounded before the next op (EXACT): the bits of the layer functions' torch ops with the invariant kernels,
    whatever Triton's layout of the row. Without it the squares are summed in floating point (faster). `launch`
    (Triton's num_warps) is for benchmarks/pointwise_launch.py's sweep."""
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm takes rows with contiguous columns")
    out = torch.empty(x.shape, dtype=dtype or torch.result_type(x, weight), device=x.device)
    _rms_norm[(x.shape[0],)](x, residual if residual is not None else x, weight, out, x.shape[1], x.stride(0),
                             residual.stride(0) if residual is not None else 0, out.stride(0), eps,
                             ADD=residual is not None, BLOCK=max(16, triton.next_power_of_2(x.shape[1])),
                             EXACT_SUM=exact, **(EXACT if exact else {}), **launch)
    return out


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   keys: torch.Tensor, values: torch.Tensor, heads: int, exact: bool = False,
                   slots: torch.Tensor | None = None, repeat: int | None = None,
                   norm: tuple[torch.Tensor, float] | None = None, bias: torch.Tensor | None = None):
    """qkv (N, (Q + 2H) * D), the fused projection's rows; cos and sin (L, 1, D) by position; row j at positions[j]
    of slot j, or of slots[j] with `slots` (N,) (a prefill's packed tokens). Writes the rotated keys and the values
    into the (S, H, L, D) caches; returns the rotated queries (N, Q, D) in torch's promotion of q * cos. With
    `repeat` R, returns (queries, keys, values): the rows' rotated keys (in the queries' dtype, as the layer functions
    compute them) and values (qkv's dtype), each (N, H * R, D) with KV head h as heads h * R .. h * R + R - 1
    (repeat_interleave's order: R = Q / H gives each query head its KV head, for attention without GQA). With
    `exact` each product is rounded before it is added (EXACT): the bits of torch's ops. With `norm` (x (N, hidden),
    eps): qkv is the projection of the unnormalised rows x by the folded weights, scaled as
    decode_attention.rope_and_attend's `norm` says; `bias` ((Q + 2H) * D) is added to what is read."""
    n, kv_heads, d = qkv.shape[0], keys.shape[1], keys.shape[-1]
    x, eps = norm if norm is not None else (qkv, 0.0)
    if x.stride(-1) != 1:
        raise ValueError("rope_and_cache's norm takes rows with contiguous columns")
    q = torch.empty(n, heads, d, dtype=torch.result_type(qkv, cos), device=qkv.device)  # as q * cos promotes
    k_out = v_out = q  # unused without `repeat`
    if repeat is not None:
        k_out = torch.empty(n, kv_heads * repeat, d, dtype=q.dtype, device=qkv.device)
        v_out = torch.empty(n, kv_heads * repeat, d, dtype=qkv.dtype, device=qkv.device)
    _rope_and_cache[(n,)](qkv, cos, sin, positions, slots if slots is not None else positions, q, keys, values,
                          k_out, v_out, x, bias, qkv.stride(0), cos.stride(0), keys.stride(0), keys.stride(1),
                          keys.stride(2), q.stride(0), q.stride(1), k_out.stride(0), x.stride(0), x.shape[1], eps,
                          HEADS=heads, KV_HEADS=kv_heads, QB=triton.next_power_of_2(heads),
                          KB=triton.next_power_of_2(kv_heads), D=d, SLOTS=slots is not None, REPEAT=repeat or 0,
                          NORM=norm is not None, HIDDEN=triton.next_power_of_2(x.shape[1]),
                          **(EXACT if exact else {}))
    return q if repeat is None else (q, k_out, v_out)


def silu_and_mul(gate_up: torch.Tensor, block: int = MLP_BLOCK, norm: tuple[torch.Tensor, float] | None = None,
                 **launch) -> torch.Tensor:
    """gate_up (N, 2F), the fused projection's [gate | up] -> SiLU(gate) * up (N, F), computed in fp32. With
    `norm` (x (N, hidden), eps): gate_up is the projection of the unnormalised rows x by weights with the RMSNorm's
    weight folded in, and both halves are first multiplied by each row's `row_scale` of x (the norm's 1 / rms).
    `block` (columns a program) and `launch` (Triton's num_warps) are for benchmarks/pointwise_launch.py's sweep."""
    n, width = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    out = torch.empty(n, width, dtype=gate_up.dtype, device=gate_up.device)
    x, eps = norm if norm is not None else (gate_up, 0.0)
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul's norm takes rows with contiguous columns")
    _silu_and_mul[(n, triton.cdiv(width, block))](gate_up, out, width, gate_up.stride(0), out.stride(0), x,
                                                 x.shape[1], x.stride(0), eps, BLOCK=block, NORM=norm is not None,
                                                 HIDDEN=triton.next_power_of_2(x.shape[1]), **launch)
    return out


@triton.jit
def _rms_norm(x, residual, weight, out, N, s_x, s_r, s_o, eps, ADD: tl.constexpr, BLOCK: tl.constexpr,
              EXACT_SUM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < N
    h = tl.load(x + row * s_x + cols, mask=inside, other=0.0)
    if ADD:  # the residual stream's add, rounded to its dtype as torch's add rounds it
        h = (h.to(tl.float32) + tl.load(residual + row * s_r + cols, mask=inside, other=0.0).to(tl.float32))
        h = h.to(x.dtype.element_ty)
        tl.store(x + row * s_x + cols, h, mask=inside)
    h = h.to(tl.float32)
    if EXACT_SUM:  # the invariant row mean's sum: the same bits however h is laid out
        mean = (exact_sum(h * h) / N).to(tl.float32)
    else:
        mean = tl.sum(h * h, axis=0) / N
    normed = h * tl.math.rsqrt(mean + eps)
    normed = normed.to(x.dtype.element_ty).to(tl.float32)  # HF rounds to the input's dtype before scaling
    w = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + row * s_o + cols, (w * normed).to(out.dtype.element_ty), mask=inside)


@triton.jit
def rope(at, heads, rows, c, s, D: tl.constexpr, r=None, bias=None):
    """RoPE of heads `heads` (masked by `rows`) of one token, each D wide at at + head * D, at one position (c, s:
    its cos and sin, (D,) fp32): x * cos + rotate_half(x) * sin, (len(heads), D) fp32. rotate_half(x)[d] is
    -x[d + D/2] in the first half and x[d - D/2] in the second: sign * x at the column half a width away, so each
    product is rounded before the add as torch's ops round them (under EXACT). x is read by `projected` (with `r` and
    `bias`, the projection of the unnormalised row made the normalised row's). Shared by `_rope_and_cache` and the
    decode attention's `_rope_and_attend`: the prefill and a decode step rotate a key alike."""
    d = tl.arange(0, D)
    half = (d + D // 2) % D
    sign = tl.where(d < D // 2, -1.0, 1.0)
    x = projected(at, bias, heads[:, None] * D + d[None, :], rows[:, None], r)
    x_half = projected(at, bias, heads[:, None] * D + half[None, :], rows[:, None], r)
    return x * c[None, :] + sign[None, :] * x_half * s[None, :]


@triton.jit
def projected(at, bias, offsets, mask, r=None):
    """A projection's values at `at + offsets` (masked), fp32. With `r` (fp32; `row_scale`) they are first multiplied
    by it, and with `bias` (a pointer laid out as `at`, or None) the bias at the same offsets is added: the projection
    of an unnormalised row by weights with the norm's weight folded in, made the normalised row's (runner.py's
    `_folded_layer`)."""
    x = tl.load(at + offsets, mask=mask, other=0.0).to(tl.float32)
    if r is not None:
        x = x * r
    if bias is not None:
        x += tl.load(bias + offsets, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def row_scale(x, N, eps, BLOCK: tl.constexpr):
    """1 / rms of the row of N values at x (fp32, summed in floating point): what an RMSNorm multiplies the row by
    before its weight. A decode step whose norm weights are folded into the next projection's (runner.py's
    `_folded_layer`) scales that projection's output by it, in the kernel that reads the output next."""
    cols = tl.arange(0, BLOCK)
    h = tl.load(x + cols, mask=cols < N, other=0.0).to(tl.float32)
    return tl.math.rsqrt(tl.sum(h * h, axis=0) / N + eps)


@triton.jit
def _rope_and_cache(qkv, cos, sin, positions, slots, q, keys, values, k_out, v_out, normed, bias, s_row, s_pos, s_ks,
                    s_kh, s_kl, s_qn, s_qh, s_on, s_n, N, eps, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                    QB: tl.constexpr, KB: tl.constexpr, D: tl.constexpr, SLOTS: tl.constexpr, REPEAT: tl.constexpr,
                    NORM: tl.constexpr, HIDDEN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + row)
    if SLOTS:
        slot = tl.load(slots + row).to(tl.int64)
    else:
        slot = row
    d = tl.arange(0, D)
    c = tl.load(cos + pos * s_pos + d).to(tl.float32)
    s = tl.load(sin + pos * s_pos + d).to(tl.float32)
    base = qkv + row * s_row
    h = tl.arange(0, QB)
    rows = h < HEADS
    kh = tl.arange(0, KB)
    kv_rows = kh < KV_HEADS
    scaled = row_scale(normed + row * s_n, N, eps, HIDDEN) if NORM else None  # the norm folded: `projected`
    query = rope(base, h, rows, c, s, D, scaled, bias)
    key = rope(base + HEADS * D, kh, kv_rows, c, s, D, scaled, bias + HEADS * D if bias is not None else None)
    value = projected(base, bias, (HEADS + KV_HEADS) * D + kh[:, None] * D + d[None, :], kv_rows[:, None], scaled)
    tl.store(q + row * s_qn + h[:, None] * s_qh + d[None, :], query.to(q.dtype.element_ty), mask=rows[:, None])
    at = slot * s_ks + kh[:, None] * s_kh + pos * s_kl + d[None, :]  # the row's slot, its position
    tl.store(keys + at, key.to(keys.dtype.element_ty), mask=kv_rows[:, None])
    tl.store(values + at, value.to(values.dtype.element_ty), mask=kv_rows[:, None])
    out = row * s_on + kh[:, None] * (REPEAT * D) + d[None, :]  # head kh's first copy in k_out / v_out
    for r in tl.static_range(REPEAT):
        tl.store(k_out + out + r * D, key.to(k_out.dtype.element_ty), mask=kv_rows[:, None])
        tl.store(v_out + out + r * D, value.to(v_out.dtype.element_ty), mask=kv_rows[:, None])


@triton.jit
def _silu_and_mul(x, out, F, s_x, s_o, normed, N, s_n, eps, BLOCK: tl.constexpr, NORM: tl.constexpr,
                  HIDDEN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < F
    gate = tl.load(x + row * s_x + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(x + row * s_x + F + cols, mask=inside, other=0.0).to(tl.float32)
    if NORM:  # the projection of the unnormalised row: scaled as the norm would have scaled its input
        r = row_scale(normed + row * s_n, N, eps, HIDDEN)
        gate, up = gate * r, up * r
    tl.store(out + row * s_o + cols, (gate * tl.sigmoid(gate) * up).to(out.dtype.element_ty), mask=inside)
