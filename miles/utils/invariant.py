"""Batch-invariant kernels: `--true-on-policy-mode` on a GPU, where the engine's decode computes what the
trainer's forward computes, bit for bit.

The engine decodes a token at a time over its KV cache (matmuls of a batch's rows, attention of one
query over its cached keys); the trainer scores the same tokens in packed micro-batches (matmuls of
thousands of rows, attention of every position at once). cuBLAS, FlashAttention and torch's
reductions pick their kernels and reduction splits by shape, so in bf16 the two disagree in the last
bits, and a sampled token near a CDF boundary differs (about 8% of tokens on a random model's flat
distributions). Here every operation whose result could depend on the shape it runs in is replaced by
a Triton kernel whose result for one row depends on that row alone:

  - matmuls (`aten::mm`, `aten::addmm`: every linear layer and the LM head, forward and backward): tiles
    chosen from K alone (`tiles_for`), so each output element is accumulated over K in the same order
    whatever M and N are; bias added in fp32 before the one rounding;
  - row means (`aten::mean.dim` over the last dimension: RMSNorm): one program per row, the row summed exactly
    in fixed point (`invariant_kernels.exact_sum`: any order, so the decode's fused norm sums it alike);
  - attention (`packed_attention` for packed sequences, `slot_attention` for the engine's slot KV
    cache): one program per head and tile of QUERIES consecutive queries of one sequence (the decode: the
    query heads of one KV head at one position), keys visited from the sequence's first in blocks of KEYS
    with an online softmax in fp32; q, k and v rounded to the autocast dtype as SDPA's autocast would;
    backward through torch's SDPA (gradients need no invariance);
  - the sampler's draw (`sample`): the softmax's mass summed in fixed point (int64: each exp(x - its block's max)
    in whole units of 2^-44 at 151,936 tokens, a block of CHUNK logits at a time, the blocks' masses brought to the
    row's max in float64 and added as integers), so neither the sum, nor the log-sum-exp, nor the inverse CDF over
    the same integers depends on the order of additions within a block (which Triton picks by the logits' dtype: a
    bf16 row and its fp32 copy were summed in other orders, one float32 ulp apart at times); the trainer's log-probs
    come from the same code (`token_log_probs`), so both sides give a token the same log-prob, bit for bit. A token
    below one unit of its block's likeliest one's probability cannot be drawn (total variation <= V * unit: 8.6e-9 at
    151,936 tokens, about float32's own rounding of the probabilities).

`enable()` registers the aten kernels for the process (torch.library, the CUDA dispatch key; CPU ops
are untouched). Other reductions (losses, metrics) stay torch's: one side alone computes them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from miles.utils.autocast import autocast_dtype

KEYS = 64  # keys per attention block
QUERIES = 64  # queries per attention program (the decode's query heads of one KV head fill some rows of it)
CHUNK = 4096  # vocabulary entries per sampler block (a multiple of 128)
_library = None


@functools.cache
def available() -> bool:
    """Whether the kernels can run here: a CUDA device and Triton (checked once: the sampler asks at every draw)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def enabled() -> bool:
    return _library is not None


def enable() -> None:
    """Routes the process's CUDA matmuls and last-dimension means through the invariant kernels, and
    turns on the attention and sampler dispatch that reads `enabled()`. Idempotent."""
    global _library
    if _library is not None:
        return
    import warnings

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        lib.impl("mm", mm, "CUDA")
        lib.impl("addmm", addmm, "CUDA")
        lib.impl("mean.dim", mean_dim, "CUDA")
    _library = lib


def disable() -> None:
    """Puts torch's own kernels back (tests)."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None


# -- matmul ----------------------------------------------------------------------------------------

def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _matmul(a, b, None)


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    row_vector = bias.dim() == 1 or (bias.dim() == 2 and (bias.shape[0] == 1 or bias.stride(0) == 0))
    if beta == 1 and alpha == 1 and row_vector:
        return _matmul(a, b, bias.reshape(-1) if bias.dim() == 1 or bias.shape[0] == 1 else bias[0])
    out = _matmul(a, b, None)
    return out.mul_(alpha).add_(bias, alpha=beta) if beta else out.mul_(alpha)


class Tiles(NamedTuple):
    """How the matmul kernel cuts a problem: tile sizes, warps, pipeline stages, and how many slices of K are
    accumulated apart (then added in slice order)."""
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    splits: int = 1


def tiles_for(k: int, dtype: torch.dtype) -> Tiles:
    """The tiles of a (M, K) @ (K, N) matmul, from K and the dtype alone: never from M (a row's result never depends
    on the rows run with it) nor from N (a fused projection's column block, the engine's q/k/v or gate/up in one
    matmul, runs as the block alone does).

    Long reductions (4096 <= K <= 16384: the MLP's down projection, K 4864 at the Qwen2.5-0.5B shape) run in four
    slices of K added in order. The engine's decode has 64 rows and N 896 there, which unsliced 128 x 128 tiles
    spread over 7 of the H200's 132 SMs: 33 us against cuBLAS's 7; 8 us in four slices of 64 x 64 tiles (the
    trainer's 3072 rows: 59 -> 93 us; a decode step has 24 such matmuls, 256 steps a rollout). The rest run 128 x 128
    tiles, which the trainer's matmuls, the LM head and the weight gradients (K = a micro-batch's tokens) need
    (`benchmarks/invariant_tiles.py`; BENCHMARKS.md). Sliced, a matmul holds its four fp32 partials (16 bytes an
    output element) until they are added: the LM head's weight gradient at a large model's shape takes gigabytes."""
    if dtype == torch.float32:
        return Tiles(128, 128, 32, 8, 3)
    if 4096 <= k <= 16384:
        return Tiles(64, 64, 64, 4, 4, splits=4)
    return Tiles(128, 128, 64, 8, 3)


def _matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, tiles: Tiles | None = None) -> torch.Tensor:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({tuple(a.shape)} and {tuple(b.shape)})")
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected mat1 and mat2 to have the same dtype, but got: {a.dtype} != {b.dtype}")
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    t = tiles or tiles_for(k, a.dtype)
    per_split = -(-k // t.splits)  # K / splits, rounded up
    k_split = -(-per_split // t.block_k) * t.block_k  # ... to whole K blocks
    splits = -(-k // k_split)
    into = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=a.device)
    kernels = _kernels()
    kernels.matmul[(-(-m // t.block_m), -(-n // t.block_n), splits)](
        a, b, bias if bias is not None and splits == 1 else a, into, m, n, k, k_split, a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), into.stride(-2), into.stride(-1), bias.stride(0) if bias is not None else 0,
        HAS_BIAS=bias is not None and splits == 1, IEEE=a.dtype == torch.float32, BLOCK_M=t.block_m,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.warps, num_stages=t.stages)
    if splits > 1:
        block = 1024
        kernels.split_sum[(-(-m * n // block),)](into, bias.contiguous() if bias is not None else into, out, m, n,
                                                 SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=block)
    return out


# -- row mean --------------------------------------------------------------------------------------

ROW_MEAN_MAX = 16384  # the widest row the kernel's exact mean takes (one block); wider rows take torch's sum


def mean_dim(x: torch.Tensor, dim, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
    dims = [d % x.dim() for d in dim] if dim and x.dim() else list(range(x.dim()))  # none or []: every dim
    if dtype is not None:
        x = x.to(dtype)
    if dims != [x.dim() - 1] or not x.is_contiguous() or not x.is_floating_point() or x.shape[-1] > ROW_MEAN_MAX:
        count = 1
        for d in dims:
            count *= x.shape[d]
        return (torch.sum(x, dim, keepdim, dtype=torch.float32) / count).to(x.dtype)
    n = x.shape[-1]
    out = torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device)
    rows = out.numel()
    if rows:
        _kernels().row_mean[(rows,)](x, out, n, BLOCK=max(16, 1 << (n - 1).bit_length()))
    return out.unsqueeze(-1) if keepdim else out


# -- attention -------------------------------------------------------------------------------------

def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """What SDPA computes in here: the autocast dtype inside an autocast region, else the input's."""
    return autocast_dtype(t.device.type) or t.dtype


def _attend(q, k, v, tiles: tuple[torch.Tensor, ...], *, key_stride: int, head_stride: int, scale: float,
            group: int, step: int) -> torch.Tensor:
    """q (N, Q, D); k and v one layout (strides key_stride per key, head_stride per KV head). Each tile of
    `tiles` (first query row, rows, position of the first, element offset of key 0; int64 tensors) holds up to
    QUERIES rows of q at positions first + r * step; the query at position p attends to keys 0..p -> (N, Q, D).
    With step 1 a tile is consecutive queries of one sequence, run for each of the Q heads (a KV head per
    `group` of them); with step 0 a tile's rows are q's rows of one head each (q of shape (N, 1, D)), keys at
    the tile's own offset."""
    n, heads, d = q.shape
    dtype = _compute_dtype(q)
    out = torch.empty((n, heads, d), dtype=dtype, device=q.device)
    if n:
        first, count, position, base = tiles
        _kernels().attention[(first.numel(), heads)](
            q, k, v, out, first, count, position, base, q.stride(0), q.stride(1), key_stride, head_stride,
            out.stride(0), out.stride(1), float(scale), group, step, d, ROUND=dtype != torch.float32,
            IEEE=dtype == torch.float32, BLOCK_M=QUERIES, BLOCK_D=max(16, 1 << (d - 1).bit_length()), KEYS=KEYS)
    return out


_last_tiles: tuple = (None, None, None)  # (cu_seq_lens, key stride, its tiles): every layer packs alike


def _packed_tiles(cu_seq_lens: torch.Tensor, key_stride: int) -> tuple[tuple[torch.Tensor, ...], int]:
    """The tiles of QUERIES consecutive queries of each packed sequence, and the longest sequence (one host
    read per new cu_seq_lens)."""
    global _last_tiles
    if _last_tiles[0] is cu_seq_lens and _last_tiles[1] == key_stride:
        return _last_tiles[2]
    starts = cu_seq_lens.tolist()
    rows = [(lo + j, min(QUERIES, hi - lo - j), j, lo * key_stride)
            for lo, hi in zip(starts, starts[1:]) for j in range(0, hi - lo, QUERIES)]
    columns = list(zip(*rows)) if rows else [()] * 4
    tiles = tuple(torch.tensor(column, dtype=torch.long, device=cu_seq_lens.device) for column in columns)
    longest = max((hi - lo for lo, hi in zip(starts, starts[1:])), default=0)
    _last_tiles = (cu_seq_lens, key_stride, (tiles, longest))
    return tiles, longest


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seq_lens, scale):
        k, v = k.contiguous(), v.contiguous()
        tiles, ctx.max_len = _packed_tiles(cu_seq_lens, k.stride(0))
        out = _attend(q, k, v, tiles, key_stride=k.stride(0), head_stride=k.stride(1), scale=scale,
                      group=q.shape[1] // k.shape[1], step=1)
        ctx.save_for_backward(q, k, v, cu_seq_lens)
        ctx.scale, ctx.dtype = scale, out.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        from miles.utils.varlen import torch_causal_attention

        q, k, v, cu_seq_lens = ctx.saved_tensors
        with torch.enable_grad():  # recomputed by torch's kernels, outside the forward's autocast: cast as it did
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            out = torch_causal_attention(q.to(ctx.dtype), k.to(ctx.dtype), v.to(ctx.dtype), cu_seq_lens, ctx.max_len,
                                         ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
        return dq, dk, dv, None, None


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Causal attention within each packed sequence: q (T, Q, D), k and v (T, H, D) -> (T, Q, D)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _PackedAttention.apply(q, k, v, cu_seq_lens, scale)


def slot_tiles(heads: int, keys: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`slot_attention`'s tiles for `heads` query heads of slots [0, b) at `positions` (b,) over a cache laid out
    as `keys` (S, H, L, D): a tile per KV head of a slot (per QUERIES of its query heads), all at the slot's
    position. The same for every layer of a decode step (the runner makes them once a step)."""
    b, kv_heads = positions.shape[0], keys.shape[1]
    group = heads // kv_heads
    per_tile = min(group, QUERIES)
    slot, kv_head, lo = torch.meshgrid(torch.arange(b, device=keys.device), torch.arange(kv_heads, device=keys.device),
                                       torch.arange(0, group, per_tile, device=keys.device), indexing="ij")
    slot, kv_head, lo = slot.flatten(), kv_head.flatten(), lo.flatten()
    return (slot * heads + kv_head * group + lo, (group - lo).clamp(max=per_tile), positions.long()[slot],
            slot * keys.stride(0) + kv_head * keys.stride(1))


def slot_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                   scale: float, tiles: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """The engine's decode: q (b, Q, D) of slots [0, b) at `positions` (b,), each attending to columns
    [0, position] of its slot in the (S, H, L, D) cache -> (b, Q, D); `tiles`: slot_tiles(Q, keys, positions),
    made here when not given.

    A tile holds the query heads of one KV head of one slot, all at the slot's position (up to QUERIES of them),
    so the program reads that head's keys once for all of them. Each row is the trainer's row at that position:
    the same kernel with the same blocks, and a row's result depends on its own query alone."""
    b, heads, d = q.shape
    tiles = tiles if tiles is not None else slot_tiles(heads, keys, positions)
    rows = q.contiguous().view(b * heads, 1, d)  # row i: slot i // Q, head i % Q
    out = _attend(rows, keys, values, tiles, key_stride=keys.stride(2), head_stride=0, scale=scale, group=1, step=0)
    return out.view(b, heads, d)


# -- sampling --------------------------------------------------------------------------------------

def _rows(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def _blocks(vocab: int) -> tuple[int, int]:
    """The sampler's blocks of CHUNK logits in a row of `vocab`, and a power of two >= that (a vector's width)."""
    blocks = -(-vocab // CHUNK)
    return blocks, max(2, 1 << (blocks - 1).bit_length())


def fixed_point(vocab: int) -> tuple[float, float]:
    """(units in 1, the unit) of the draw's fixed-point masses for a vocabulary of `vocab` tokens: the unit is
    2^-(62 - bits of vocab), so a row's vocab terms in [0, 1] add up within int64 (2^-44 at 151,936 tokens)."""
    bits = 62 - vocab.bit_length()
    return float(2 ** bits), float(2.0 ** -bits)


def sample(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` (B, V), drawn from softmax(logits / temperature) by inverse CDF with
    uniforms (B,) in float64; returns (tokens (B,), their log-probs (B,) in fp32, as `token_log_probs` gives them).

    Two kernels: one pass over every (row, block of CHUNK logits) at once, each block's max and fixed-point mass
    against it; then per row the blocks brought to the row's max, the block and the token the uniform falls on."""
    batch, vocab = logits.shape
    tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
    log_probs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch:
        logits, kernels = _rows(logits), _kernels()
        blocks, width = _blocks(vocab)
        maxes = torch.empty(batch, blocks, dtype=torch.float32, device=logits.device)
        masses = torch.empty(batch, blocks, dtype=torch.int64, device=logits.device)
        divide = temperature != 1.0  # x / 1 is x: no division at temperature 1
        units, unit = fixed_point(vocab)
        kernels.block_masses[(batch, blocks)](logits, logits.stride(0), maxes, masses, vocab, float(temperature),
                                              units, CHUNK=CHUNK, DIVIDE=divide)
        kernels.draw[(batch,)](logits, logits.stride(0), maxes, masses,
                               uniforms.to(logits.device, torch.float64).contiguous(), tokens, log_probs, vocab,
                               float(temperature), units, unit, blocks, CHUNK=CHUNK, BLOCKS=width, DIVIDE=divide)
    return tokens, log_probs


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature):
        rows, vocab = logits.shape
        log_probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
        log_z = torch.empty(rows, dtype=torch.float32, device=logits.device)
        if rows:
            logits = _rows(logits)
            _kernels().token_log_probs[(rows,)](logits, logits.stride(0), targets.contiguous(), log_probs, log_z,
                                                vocab, float(temperature), *fixed_point(vocab), CHUNK=CHUNK,
                                                BLOCKS=_blocks(vocab)[1], DIVIDE=temperature != 1.0)
        ctx.save_for_backward(logits, targets, log_z)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(log_z)
        return log_probs, log_z

    @staticmethod
    def backward(ctx, grad, _grad_log_z):
        logits, targets, log_z = ctx.saved_tensors
        scale = (grad / ctx.temperature)[:, None]  # d log p_t / d logit_j = ([j = t] - softmax_j) / temperature
        out = torch.exp(logits.float() / ctx.temperature - log_z[:, None]).mul_(-scale)
        return out.scatter_add_(-1, targets[:, None], scale).to(logits.dtype), None, None


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """log softmax(logits / temperature) at `targets` (rows,), and the log-sum-exp (rows,), for `logits` (rows, V)
    of any float dtype: bitwise what `sample` reports for a token it draws from the same logits, whichever
    dtype either side holds them in (the trainer's fp32, the engine's bf16). Differentiable in `logits`."""
    return _TokenLogProbs.apply(logits, targets, temperature)


# -- the kernels -----------------------------------------------------------------------------------

def _kernels():
    """miles.utils.invariant_kernels, the Triton kernels (imported, and Triton with them, only where they run)."""
    from miles.utils import invariant_kernels

    return invariant_kernels
