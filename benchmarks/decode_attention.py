"""An experiment for the fast engine's decode attention: the SDPA call the runner makes now (g query heads of a
KV head as g queries, a (b, 1, 1, Lb) mask over the width bucket) against a Triton kernel that reads each
slot's cached keys once per KV head and stops at the slot's own position (one program per slot and KV head,
the group's queries in one tile, an online softmax over blocks of KEYS keys). Prints the largest difference
from SDPA and, on a GPU, the time of a call replayed in a CUDA graph (no launch time), per batch.

    python benchmarks/decode_attention.py [--batch 32 128 512] [--prompt 128] [--new 256]
    TRITON_INTERPRET=1 python benchmarks/decode_attention.py --device cpu --batch 4 --prompt 16 --new 16  # check

Shape: Qwen2.5-0.5B's attention (14 query heads, 2 KV heads, head dim 64), bf16 on a GPU (fp32 on the CPU);
each slot at a position drawn between --prompt and --prompt + --new (a batch halfway through its rollout).
Not used by the engine: it moves into miles.rollout.local.runner if it wins on the H200.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import gpu_times

from miles.utils.invariant_kernels import softmax_block

HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64
KEYS = 64
LENGTH_STEP = 128  # the runner's width buckets


@triton.jit
def _decode_attention(q, keys, values, positions, out, s_qb, s_qh, s_ks, s_kh, s_kl, s_ob, s_oh, scale, group,
                      D: tl.constexpr, G: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr):
    slot, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    r = tl.arange(0, G)
    d = tl.arange(0, D)
    rows = r < group
    query = tl.load(q + slot * s_qb + (head * group + r)[:, None] * s_qh + d[None, :], mask=rows[:, None], other=0.0)
    last = tl.load(positions + slot)  # keys 0..last
    base = slot * s_ks + head * s_kh
    m = tl.full((G,), float("-inf"), tl.float32)
    total = tl.zeros((G,), tl.float32)
    acc = tl.zeros((G, D), tl.float32)
    for n0 in range(0, last + 1, KEYS):
        n = n0 + tl.arange(0, KEYS)
        seen = n <= last
        k = tl.load(keys + base + n[:, None] * s_kl + d[None, :], mask=seen[:, None], other=0.0)
        v = tl.load(values + base + n[:, None] * s_kl + d[None, :], mask=seen[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(query, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(query, tl.trans(k)) * scale
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m, total, acc = softmax_block(m, total, acc, scores, v, IEEE)
    tl.store(out + slot * s_ob + (head * group + r)[:, None] * s_oh + d[None, :],
             (acc / total[:, None]).to(out.dtype.element_ty), mask=rows[:, None])


def triton_decode(q, keys, values, positions, scale):
    """q (b, Q, D) of slots [0, b) at `positions`; the (S, H, L, D) cache -> (b, Q, D)."""
    b, heads, d = q.shape
    kv_heads = keys.shape[1]
    out = torch.empty_like(q)
    group = heads // kv_heads
    _decode_attention[(b, kv_heads)](q, keys, values, positions, out, q.stride(0), q.stride(1), keys.stride(0),
                                     keys.stride(1), keys.stride(2), out.stride(0), out.stride(1), scale, group,
                                     D=d, G=max(16, triton.next_power_of_2(group)), KEYS=KEYS,
                                     IEEE=q.dtype == torch.float32)
    return out


def sdpa_decode(q, keys, values, positions, scale, width):
    """What the runner's `_decode_step` runs now."""
    b = q.shape[0]
    visible = torch.arange(width, device=q.device)[None] <= positions[:, None]
    grouped = q.view(b, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    out = F.scaled_dot_product_attention(grouped, keys[:b, :, :width], values[:b, :, :width],
                                         attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(b, HEADS, HEAD_DIM)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    length = -(-(args.prompt + args.new) // LENGTH_STEP) * LENGTH_STEP
    scale = HEAD_DIM ** -0.5
    for b in args.batch:
        keys, values = (torch.randn(b, KV_HEADS, length, HEAD_DIM, generator=g).to(args.device, dtype) for _ in range(2))
        q = torch.randn(b, HEADS, HEAD_DIM, generator=g).to(args.device, dtype)
        positions = torch.randint(args.prompt, args.prompt + args.new, (b,), generator=g).to(args.device)
        width = -(-(int(positions.max()) + 1) // LENGTH_STEP) * LENGTH_STEP
        want = sdpa_decode(q, keys, values, positions, scale, width)
        got = triton_decode(q, keys, values, positions, scale)
        line = f"batch {b:4}, width {width}: largest difference from SDPA {(got.float() - want.float()).abs().max():.2e}"
        if args.device == "cuda":
            sdpa = statistics.median(gpu_times(lambda: sdpa_decode(q, keys, values, positions, scale, width))) * 1e6
            ours = statistics.median(gpu_times(lambda: triton_decode(q, keys, values, positions, scale))) * 1e6
            line += f"; SDPA {sdpa:6.1f} us, Triton {ours:6.1f} us ({ours / sdpa:.2f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
