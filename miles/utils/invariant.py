"""Batch-invariant kernels: `--true-on-policy-mode` on a GPU, where the engine's decode computes what the
trainer's forward computes, bit for bit.

The engine decodes a token at a time over its KV cache (matmuls of a batch's rows, attention of one
query over its cached keys); the trainer scores the same tokens in packed micro-batches (matmuls of
thousands of rows, attention of every position at once). cuBLAS, FlashAttention and torch's
reductions pick their kernels and reduction splits by shape, so in bf16 the two disagree in the last
bits, and a sampled token near a CDF boundary differs (about 8% of tokens on a random model's flat
distributions). Here every operation whose result could depend on the shape it runs in is replaced by
a Triton kernel whose result for one row depends on that row alone:

  - matmuls (`aten::mm`, `aten::addmm`: every linear layer and the LM head, forward and backward): one
    tile shape for every problem, each output element accumulated over K in the same order, bias added
    in fp32 before the one rounding;
  - row means (`aten::mean.dim` over the last dimension: RMSNorm): one program per row, one fixed tree;
  - attention (`packed_attention` for packed sequences, `slot_attention` for the engine's slot KV
    cache): one program per head and tile of QUERIES consecutive queries of one sequence (the decode: one
    query), keys visited from the sequence's first in blocks of KEYS with an online softmax in fp32;
    q, k and v rounded to the autocast dtype as SDPA's autocast would; backward through torch's SDPA
    (gradients need no invariance);
  - the sampler's draw (`sample`): one program per row, log-sum-exp in fixed chunks, the inverse CDF
    in float64 over the same chunks.

`enable()` registers the aten kernels for the process (torch.library, the CUDA dispatch key; CPU ops
are untouched). Other reductions stay torch's: the trainer's log-probs and losses are computed by one
side only.
"""

from __future__ import annotations

import functools

import torch

KEYS = 64  # keys per attention block
QUERIES = 64  # queries per attention program (the decode's one query fills one row of it)
CHUNK = 4096  # vocabulary entries per sampler block (a multiple of 128)
_library = None


def available() -> bool:
    """Whether the kernels can run here: a CUDA device and Triton."""
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


def _matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
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
    kernels = _kernels()
    block_k = 32 if a.dtype == torch.float32 else 64
    grid = (-(-m // 128), -(-n // 128))
    kernels.matmul[grid](a, b, bias if bias is not None else a, out, m, n, k, a.stride(0), a.stride(1),
                         b.stride(0), b.stride(1), out.stride(0), out.stride(1),
                         bias.stride(0) if bias is not None else 0, HAS_BIAS=bias is not None,
                         IEEE=a.dtype == torch.float32, BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k,
                         num_warps=8, num_stages=3)
    return out


# -- row mean --------------------------------------------------------------------------------------

def mean_dim(x: torch.Tensor, dim, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
    dims = [d % x.dim() for d in (dim if dim is not None else range(x.dim()))] if x.dim() else []
    if dtype is not None:
        x = x.to(dtype)
    if dims != [x.dim() - 1] or not x.is_contiguous() or not x.is_floating_point() or x.shape[-1] > 16384:
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
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


def _attend(q, k, v, tiles: tuple[torch.Tensor, ...], *, key_stride: int, head_stride: int,
            scale: float) -> torch.Tensor:
    """q (N, Q, D); k and v one layout (strides key_stride per key, head_stride per KV head). Each tile of
    `tiles` (first query, queries, position of the first, element offset of key 0; int64 tensors) holds
    consecutive queries of one sequence; the query at position p attends to keys 0..p -> (N, Q, D)."""
    n, heads, d = q.shape
    kv_heads = k.shape[-3] if k.dim() == 4 else k.shape[1]
    dtype = _compute_dtype(q)
    out = torch.empty((n, heads, d), dtype=dtype, device=q.device)
    if n:
        first, count, position, base = tiles
        _kernels().attention[(first.numel(), heads)](
            q, k, v, out, first, count, position, base, q.stride(0), q.stride(1), key_stride, head_stride,
            out.stride(0), out.stride(1), float(scale), heads // kv_heads, d, ROUND=dtype != torch.float32,
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
        out = _attend(q, k, v, tiles, key_stride=k.stride(0), head_stride=k.stride(1), scale=scale)
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


def slot_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """The engine's decode: q (b, Q, D) of slots [0, b) at `positions` (b,), each attending to columns
    [0, position] of its slot in the (S, H, L, D) cache -> (b, Q, D)."""
    slots = torch.arange(q.shape[0], device=q.device)
    tiles = (slots, torch.ones_like(slots), positions.long(), slots * keys.stride(0))  # a tile per query
    return _attend(q, keys, values, tiles, key_stride=keys.stride(2), head_stride=keys.stride(1), scale=scale)


# -- sampling --------------------------------------------------------------------------------------

def sample(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` (B, V), drawn from softmax(logits / temperature) by inverse CDF with
    uniforms (B,) in float64; returns (tokens (B,), their log-probs (B,) in fp32)."""
    batch, vocab = logits.shape
    tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
    log_probs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _kernels().sample[(batch,)](logits, logits.stride(0), uniforms.to(logits.device, torch.float64).contiguous(),
                                    tokens, log_probs, vocab, float(temperature), CHUNK=CHUNK)
    return tokens, log_probs


# -- the kernels -----------------------------------------------------------------------------------

@functools.cache
def _kernels():
    """The Triton kernels, compiled on first use (Triton is imported only where they run)."""
    import triton
    import triton.language as tl

    @triton.jit
    def matmul(a, b, bias, c, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_bias, HAS_BIAS: tl.constexpr,
               IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(a + rm[:, None] * s_am + kk[None, :] * s_ak, mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            w = tl.load(b + kk[:, None] * s_bk + rn[None, :] * s_bn, mask=(kk[:, None] < K) & (rn[None, :] < N),
                        other=0.0)
            if IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        if HAS_BIAS:
            acc += tl.load(bias + rn * s_bias, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c + rm[:, None] * s_cm + rn[None, :] * s_cn, acc.to(c.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def row_mean(x, out, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        values = tl.load(x + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(out + row, (tl.sum(values, axis=0) / N).to(out.dtype.element_ty))

    @triton.jit
    def attention(q, k, v, o, tile_first, tile_count, tile_position, tile_base, s_qn, s_qh, s_key, s_head, s_on,
                  s_oh, scale, group, D, ROUND: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr, KEYS: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        first, count = tl.load(tile_first + t), tl.load(tile_count + t)
        position = tl.load(tile_position + t) + tl.arange(0, BLOCK_M)  # each row's position: it sees keys <= it
        base = tl.load(tile_base + t) + (h // group) * s_head
        r = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        in_d = d < D
        rows = (r < count)[:, None] & in_d[None, :]
        query = tl.load(q + (first + r)[:, None] * s_qn + h * s_qh + d[None, :], mask=rows, other=0.0)
        if ROUND:
            query = query.to(o.dtype.element_ty)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        last = tl.load(tile_position + t) + count  # keys [0, last) serve the tile
        for n0 in range(0, last, KEYS):
            n = n0 + tl.arange(0, KEYS)
            at = base + n[:, None] * s_key + d[None, :]
            inside = (n[:, None] < last) & in_d[None, :]
            keys = tl.load(k + at, mask=inside, other=0.0)
            values = tl.load(v + at, mask=inside, other=0.0)
            if ROUND:
                keys, values = keys.to(o.dtype.element_ty), values.to(o.dtype.element_ty)
            if IEEE:
                scores = tl.dot(query, tl.trans(keys), input_precision="ieee") * scale
            else:
                scores = tl.dot(query, tl.trans(keys)) * scale
            scores = tl.where(n[None, :] <= position[:, None], scores, float("-inf"))
            # A block a row sees nothing of leaves it exactly as it was (alpha 1, p 0): a row's result
            # depends only on the blocks up to its own position, as the decode's lone query sees them.
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
            m = m_new
        tl.store(o + (first + r)[:, None] * s_on + h * s_oh + d[None, :], (acc / total[:, None]).to(o.dtype.element_ty),
                 mask=rows)

    @triton.jit
    def sample(logits, s_row, uniforms, tokens, log_probs, V, temperature, CHUNK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * s_row
        offs = tl.arange(0, CHUNK)
        m = tl.full((), float("-inf"), tl.float32)
        total = tl.zeros((), tl.float32)
        for c0 in range(0, V, CHUNK):  # log-sum-exp, chunk by chunk
            x = tl.load(base + c0 + offs, mask=c0 + offs < V, other=float("-inf")).to(tl.float32) / temperature
            m_new = tl.maximum(m, tl.max(x, axis=0))
            total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        log_z = m + tl.log(total)
        mass = tl.zeros((), tl.float64)
        for c0 in range(0, V, CHUNK):  # the total mass the draw is scaled by, in float64
            x = tl.load(base + c0 + offs, mask=c0 + offs < V, other=float("-inf")).to(tl.float32) / temperature
            mass += tl.sum(tl.exp(x - log_z).to(tl.float64), axis=0)
        target = tl.load(uniforms + row) * mass
        below = tl.zeros((), tl.float64)  # the mass of the chunks before
        token = tl.full((), -1, tl.int64)
        for c0 in range(0, V, CHUNK):  # the first token whose cumulative mass exceeds the target
            x = tl.load(base + c0 + offs, mask=c0 + offs < V, other=float("-inf")).to(tl.float32) / temperature
            cdf = below + tl.cumsum(tl.exp(x - log_z).to(tl.float64), axis=0)
            passed = tl.sum((cdf <= target).to(tl.int64), axis=0)  # entries still at or below the target
            token = tl.where((token < 0) & (passed < CHUNK) & (c0 + passed < V), c0 + passed, token)
            below = tl.max(cdf, axis=0)
        token = tl.where(token < 0, V - 1, token)
        x = tl.load(base + token).to(tl.float32) / temperature
        tl.store(tokens + row, token)
        tl.store(log_probs + row, x - log_z)

    class Kernels:
        pass

    kernels = Kernels()
    kernels.matmul, kernels.row_mean, kernels.attention, kernels.sample = matmul, row_mean, attention, sample
    return kernels
