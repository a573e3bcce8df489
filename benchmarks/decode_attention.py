"""The fast engine's decode attention alone: its Triton kernels (miles.rollout.local.decode_attention, the runner's
on a GPU: a program per slot, KV head and chunk of cached columns reads them once, up to the slot's own position;
a second kernel combines a split slot's chunks) against the SDPA call the runner makes without them (g query heads
of a KV head as g queries, a (b, 1, 1, Lb) mask over the width bucket). Prints, per batch and --chunks size (0:
one program a slot and KV head reads all its columns), the largest difference from SDPA and, on a GPU, the time
of a call replayed in a CUDA graph (no launch time).

    python benchmarks/decode_attention.py [--batch 32 128 512] [--prompt 128] [--new 256] [--chunks 0 64 128 256]
    TRITON_INTERPRET=1 python benchmarks/decode_attention.py --device cpu --batch 4 --prompt 16 --new 16  # check

Shape: Qwen2.5-0.5B's attention (14 query heads, 2 KV heads, head dim 64), bf16 on a GPU (fp32 on the CPU);
each slot at a position drawn between --prompt and --prompt + --new (a batch halfway through its rollout).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from common import gpu_times

from miles.rollout.local.decode_attention import decode_attention

HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64
LENGTH_STEP = 128  # the runner's width buckets


def sdpa_decode(q, keys, values, positions, scale, width):
    """What the runner runs without the kernel (`ModelRunner.triton_decode` False, or a CPU)."""
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
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 64, 128, 256],
                    help="cached columns a program (multiples of 64; 0: a slot in one program)")
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
        sdpa = None
        if args.device == "cuda":
            sdpa = statistics.median(gpu_times(lambda: sdpa_decode(q, keys, values, positions, scale, width))) * 1e6
            print(f"batch {b:4}, width {width}: SDPA {sdpa:6.1f} us", flush=True)
        for chunk in args.chunks:
            got = decode_attention(q, keys, values, positions, scale, width, chunk)
            line = (f"batch {b:4}, width {width}, chunk {chunk:3}: largest difference from SDPA "
                    f"{(got.float() - want.float()).abs().max():.2e}")
            if sdpa is not None:
                ours = statistics.median(gpu_times(
                    lambda: decode_attention(q, keys, values, positions, scale, width, chunk))) * 1e6
                line += f"; Triton {ours:6.1f} us ({ours / sdpa:.2f}x SDPA)"
            print(line, flush=True)

if __name__ == "__main__":
    main()
