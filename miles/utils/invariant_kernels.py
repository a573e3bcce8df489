"""The Triton kernels of miles.utils.invariant (imported only where they run: Triton and a GPU, or Triton's
interpreter). Each output row is computed from its own inputs alone, in an order fixed by the kernel's
constants, never by how many rows run with it."""

import triton
import triton.language as tl


@triton.jit
def matmul(a, b, bias, c, M, N, K, K_SPLIT, s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_bias, HAS_BIAS: tl.constexpr,
           IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C = A @ B (+ bias) over the K columns [k_lo, k_lo + K_SPLIT) of program_id(2)'s split; with more than
    one split, C is split-major fp32 partials (no bias) that `split_sum` adds in split order."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(2) * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    c += tl.program_id(2).to(tl.int64) * M * N
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        x = tl.load(a + rm[:, None] * s_am + kk[None, :] * s_ak, mask=(rm[:, None] < M) & (kk[None, :] < k_hi),
                    other=0.0)
        w = tl.load(b + kk[:, None] * s_bk + rn[None, :] * s_bn, mask=(kk[:, None] < k_hi) & (rn[None, :] < N),
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
def split_sum(partials, bias, c, M, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """C = the SPLITS fp32 partials (SPLITS, M, N) added in split order (+ bias, in fp32), rounded once."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < M * N
    acc = tl.load(partials + i, mask=inside, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(partials + s * M * N + i, mask=inside, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + i % N, mask=inside, other=0.0).to(tl.float32)
    tl.store(c + i, acc.to(c.dtype.element_ty), mask=inside)

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
def row_logsumexp(base, V, temperature, CHUNK: tl.constexpr):
    """log-sum-exp of one row's V entries / temperature, chunk by chunk (shared by the two kernels below)."""
    offs = tl.arange(0, CHUNK)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    for c0 in range(0, V, CHUNK):
        x = tl.load(base + c0 + offs, mask=c0 + offs < V, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    return m + tl.log(total)

@triton.jit
def logsumexp(x, s_row, out, V, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tl.store(out + row, row_logsumexp(x + row * s_row, V, 1.0, CHUNK))

@triton.jit
def sample(logits, s_row, uniforms, tokens, log_probs, V, temperature, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * s_row
    offs = tl.arange(0, CHUNK)
    log_z = row_logsumexp(base, V, temperature, CHUNK)
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
