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
    size = (tl.zeros((), tl.int64) + M) * N  # a partial's elements, in int64: SPLITS of them pass 2^31 first
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < size
    acc = tl.load(partials + i, mask=inside, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(partials + s * size + i, mask=inside, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + i % N, mask=inside, other=0.0).to(tl.float32)
    tl.store(c + i, acc.to(c.dtype.element_ty), mask=inside)


@triton.jit
def exact_sum(values):
    """The sum of a block of fp32 `values` (at most 2^14 of them) whatever the order of its additions, in fp64: each
    value truncated to a multiple of 2^-k, k set by the block's largest magnitude so that each is below 2^48 times
    it, and the integers added exactly. Any kernel summing a block with it gets the same bits, however Triton lays
    the block out over threads (the order of a float sum depends on that layout). A block holding an inf or a nan
    sums in floating point (inf or nan in any order)."""
    wide = values.to(tl.float64)
    floating = tl.sum(wide, axis=0)
    top = tl.max(tl.abs(values), axis=0)
    biased = (top.to(tl.int32, bitcast=True) >> 23) & 0xFF  # the exponent of the largest magnitude
    scale = ((1023 + 174 - biased).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # 2^k, k = 174 - biased
    finite = (floating == floating) & (tl.abs(floating) < float("inf"))
    fixed = tl.where(finite, wide * scale, 0.0).to(tl.int64)  # exact products, truncated toward zero
    return tl.where(finite, tl.sum(fixed, axis=0).to(tl.float64) / scale, floating)


@triton.jit
def row_mean(x, out, N, BLOCK: tl.constexpr):
    """The mean of a row, its sum exact (`exact_sum`) and divided once, rounded to fp32 and then to out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    values = tl.load(x + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out + row, (exact_sum(values) / N).to(tl.float32).to(out.dtype.element_ty))


@triton.jit
def softmax_block(m, total, acc, scores, values, IEEE: tl.constexpr):
    """One block of keys into an online softmax: the rows' running max, sum and output after `scores` (rows x keys,
    -inf where a row does not see a key) and the keys' `values`."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
    return m_new, total, acc


@triton.jit
def attention(q, k, v, o, tile_first, tile_count, tile_position, tile_base, s_qn, s_qh, s_key, s_head, s_on,
              s_oh, scale, group, step, D, ROUND: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_D: tl.constexpr, KEYS: tl.constexpr):
    """A tile's rows are queries at positions tile_position + r * step (the trainer: consecutive positions of one
    sequence, step 1; the decode: the query heads of one KV head at a slot's position, step 0)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    first, count = tl.load(tile_first + t), tl.load(tile_count + t)
    position = tl.load(tile_position + t) + tl.arange(0, BLOCK_M) * step  # each row's position: it sees keys <= it
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
    last = tl.load(tile_position + t) + (count - 1) * step + 1  # keys [0, last) serve the tile
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
        m, total, acc = softmax_block(m, total, acc, scores, values, IEEE)
    tl.store(o + (first + r)[:, None] * s_on + h * s_oh + d[None, :], (acc / total[:, None]).to(o.dtype.element_ty),
             mask=rows)

# The softmax's mass is summed in fixed point, a block of CHUNK logits at a time: each exp(x - the block's max) in
# [0, 1] as a whole number of `unit`s (rounded down; unit = 2^-F with F = 62 - bits of V, so V such terms fit int64:
# 2^-44 at 151,936 tokens), added as int64; then each block's mass is brought to the row's max (times exp(its max -
# the row's), rounded down; the max's own block exactly) and the blocks' masses added as int64. Integer addition is
# exact, so a row's sum, its log-sum-exp and its draw do not depend on the order the kernel adds a block in, which
# Triton picks from the layout of the loads (16 bytes a thread: 8 bf16 logits, 4 fp32 ones), so the engine's draw
# over bf16 logits and the trainer's log-probs over fp32 ones agree bit for bit. Each block needs only its own max,
# so the draw reads the logits once (one pass for the blocks' maxes and masses) and then one block a row.


@triton.jit
def divided(x, temperature, DIVIDE: tl.constexpr):
    """x / temperature, rounded as IEEE division rounds; x itself where DIVIDE is off (temperature 1: the same bits,
    without a division's instructions for every logit)."""
    return tl.div_rn(x, temperature) if DIVIDE else x


@triton.jit
def raw(base, at, V):
    """The logits at `at` of one row in fp32; -inf past V."""
    return tl.load(base + at, mask=at < V, other=float("-inf")).to(tl.float32)


@triton.jit
def scaled(base, at, V, temperature, DIVIDE: tl.constexpr):
    """The logits at `at` of one row in fp32, divided by the temperature (`divided`); -inf past V."""
    return divided(raw(base, at, V), temperature, DIVIDE)


@triton.jit
def fixed_masses(x, m, units):
    """exp(x - m) of the values x, in whole units (int64, rounded down)."""
    return (tl.exp(x - m) * units).to(tl.int64)


@triton.jit
def max_and_mass(base, at, V, temperature, units, DIVIDE: tl.constexpr):
    """One block of a row (the logits at `at`): the max of logits / temperature (exact) and the fixed-point mass of
    exp(x - that max)."""
    x = scaled(base, at, V, temperature, DIVIDE)
    m = tl.max(x, axis=0)
    return m, tl.sum(fixed_masses(x, m, units), axis=0)


@triton.jit
def row_of_blocks(maxes, masses):
    """A row from its blocks' maxes and masses (vectors; -inf and 0 past the last block): the row's max (exact),
    each block's scale exp(its max - the row's) and mass in the row's units (its own mass times the scale, in float64,
    rounded down; the max's own block as it is; 0 for a block of -inf logits, whatever its own mass), and the row's
    mass, their integer sum."""
    m = tl.max(maxes, axis=0)
    scale = tl.exp(maxes - m)
    weighted = tl.where(maxes == m, masses, (masses.to(tl.float64) * scale.to(tl.float64)).to(tl.int64))
    return m, scale, weighted, tl.sum(weighted, axis=0)


@triton.jit
def log_sum_exp(m, mass, unit):
    """A row's log-sum-exp from its max and its fixed-point mass: the one expression both sides compute it by."""
    return m + tl.log(mass.to(tl.float32) * unit)


@triton.jit
def row_log_z(base, V, temperature, units, unit, CHUNK: tl.constexpr, BLOCKS: tl.constexpr, DIVIDE: tl.constexpr):
    """(max, mass, log-sum-exp) of one row's V logits / temperature, from its blocks of CHUNK as the draw cuts it
    (`row_of_blocks`): log-sum-exp = max + log(mass * unit)."""
    offs, b = tl.arange(0, CHUNK), tl.arange(0, BLOCKS)
    maxes = tl.full((BLOCKS,), float("-inf"), tl.float32)
    masses = tl.zeros((BLOCKS,), tl.int64)
    for c0 in range(0, V, CHUNK):
        top, mass = max_and_mass(base, c0 + offs, V, temperature, units, DIVIDE)
        here = b == c0 // CHUNK
        maxes, masses = tl.where(here, top, maxes), tl.where(here, mass, masses)
    m, _, _, mass = row_of_blocks(maxes, masses)
    return m, mass, log_sum_exp(m, mass, unit)


@triton.jit
def token_log_probs(x, s_row, targets, log_probs, log_z, V, temperature, units, unit, CHUNK: tl.constexpr,
                    BLOCKS: tl.constexpr, DIVIDE: tl.constexpr):
    """Each row's log-prob of its target, as `sample` reports it for the token it draws; and its log-sum-exp."""
    row = tl.program_id(0).to(tl.int64)
    base = x + row * s_row
    _, _, z = row_log_z(base, V, temperature, units, unit, CHUNK, BLOCKS, DIVIDE)
    target = tl.load(targets + row)
    tl.store(log_probs + row, scaled(base, target, V, temperature, DIVIDE) - z)
    tl.store(log_z + row, z)


@triton.jit
def block_masses(logits, s_row, maxes, masses, V, temperature, units, CHUNK: tl.constexpr, DIVIDE: tl.constexpr):
    """The draw's one pass over the logits, a program per (row, block of CHUNK logits): the block's max and mass
    (`max_and_mass`)."""
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    top, mass = max_and_mass(logits + row * s_row, block * CHUNK + tl.arange(0, CHUNK), V, temperature, units, DIVIDE)
    at = row * tl.num_programs(1) + block
    tl.store(maxes + at, top)
    tl.store(masses + at, mass)


@triton.jit
def draw(logits, s_row, maxes, masses, uniforms, tokens, log_probs, V, temperature, units, unit, blocks,
         CHUNK: tl.constexpr, BLOCKS: tl.constexpr, DIVIDE: tl.constexpr):
    """The last step, one program per row: the row's mass from its blocks' (`row_of_blocks`), the block whose
    cumulative mass first exceeds uniform * mass, then the token within it, by the block's own masses (the remainder
    brought back to the block's units); its log-prob as `token_log_probs` computes it. The sums are integers, so a
    token's interval does not depend on the order a block's logits are added in."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * s_row
    b = tl.arange(0, BLOCKS)
    tops = tl.load(maxes + row * blocks + b, mask=b < blocks, other=float("-inf"))
    own = tl.load(masses + row * blocks + b, mask=b < blocks, other=0)
    m, scale, weighted, mass = row_of_blocks(tops, own)
    z = log_sum_exp(m, mass, unit)
    target = (tl.load(uniforms + row) * mass.to(tl.float64)).to(tl.int64)  # in [0, mass)
    ends = tl.cumsum(weighted, axis=0)
    block = tl.minimum(tl.sum((ends <= target).to(tl.int32), axis=0), blocks - 1)  # first block ending past it
    here = b == block
    rest = target - tl.sum(tl.where(b < block, weighted, 0), axis=0)  # in [0, the block's weighted mass)
    top = tl.max(tl.where(here, tops, float("-inf")), axis=0)
    own_mass = tl.sum(tl.where(here, own, 0), axis=0)
    own_scale = tl.sum(tl.where(here, scale, 0.0), axis=0).to(tl.float64)
    rest = tl.where(top == m, rest, tl.minimum((rest.to(tl.float64) / own_scale).to(tl.int64), own_mass - 1))
    at = block * CHUNK + tl.arange(0, CHUNK)
    cdf = tl.cumsum(fixed_masses(scaled(base, at, V, temperature, DIVIDE), top, units), axis=0)
    token = block * CHUNK + tl.sum((cdf <= rest).to(tl.int64), axis=0)
    token = tl.minimum(token, V - 1)
    tl.store(tokens + row, token)
    tl.store(log_probs + row, scaled(base, token, V, temperature, DIVIDE) - z)
