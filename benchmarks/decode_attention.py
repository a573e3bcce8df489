"""The fast engine's decode attention alone: its Triton kernel (miles.rollout.local.decode_attention, the runner's
on a GPU: one program per slot and KV head reads the slot's cached keys once, up to its own position) against
the SDPA call the runner makes without it (g query heads of a KV head as g queries, a (b, 1, 1, Lb) mask over
the width bucket). Prints the largest difference from SDPA and, on a GPU, the time of a call replayed in a CUDA
graph (no launch time), per batch, and the bytes of cached keys and values it reads a second against the copy
bandwidth measured in the run. `--launch BLOCK:WARPS:STAGES[:REGS] ...` times the kernel at other launch
settings too (columns a block, Triton's num_warps, num_stages and maxnreg; `-` for the default), each checked
against SDPA. Then the engine's form of it, `rope_and_attend` (the RoPE and the KV-cache write in the same
kernel), against decode_fused's `rope_and_cache` followed by the kernel (what a step ran before), at each launch
setting.

    python benchmarks/decode_attention.py [--batch 32 128 512] [--prompt 128] [--new 256] [--launch 128:4:3 64:8:-]
    TRITON_INTERPRET=1 python benchmarks/decode_attention.py --device cpu --batch 4 --prompt 16 --new 16  # check

Shape: Qwen2.5-0.5B's attention (14 query heads, 2 KV heads, head dim 64), bf16 on a GPU (fp32 on the CPU);
each slot at a position drawn between --prompt and --prompt + --new (a batch halfway through its rollout).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from common import HEAD_DIM, HEADS, KV_HEADS, copy_bandwidth, gpu_times

from miles.rollout.local import decode_attention as kernels
from miles.rollout.local.decode_attention import KEYS, decode_attention, rope_and_attend
from miles.rollout.local.decode_fused import rope_and_cache

LENGTH_STEP = 128  # the runner's width buckets


def sdpa_decode(q, keys, values, positions, scale, width):
    """What the runner runs without the kernel (`ModelRunner.triton_decode` False, or a CPU)."""
    b = q.shape[0]
    visible = torch.arange(width, device=q.device)[None] <= positions[:, None]
    grouped = q.view(b, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    out = F.scaled_dot_product_attention(grouped, keys[:b, :, :width], values[:b, :, :width],
                                         attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(b, HEADS, HEAD_DIM)


def launch_settings(text: str) -> tuple[int, dict]:
    """BLOCK:WARPS:STAGES[:REGS] -> (block, Triton's launch options); `-` (or REGS left out) leaves one at its
    default. REGS: the registers a thread may use (Triton's maxnreg; `-` or `none`: no cap, the default)."""
    block, warps, stages, regs = (text.split(":") + ["-"])[:4]
    launch = {k: int(v) for k, v in (("num_warps", warps), ("num_stages", stages), ("maxnreg", regs))
              if v not in ("-", "none")}
    return (KEYS if block == "-" else int(block)), launch


def compiled_launches(batch: int) -> list[str]:
    """What ptxas gave each kernel variant Triton compiled in this process (registers a thread, spills, shared memory),
    and what that allows: programs an SM (registers go to a warp in units of 256, each program's shared memory has 1
    KiB of the driver's beside it) and the waves of a batch's batch x KV-head programs."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    regs, shared, threads = (getattr(props, name, default) for name, default in (  # Hopper's where torch lacks one
        ("regs_per_multiprocessor", 65536), ("shared_memory_per_multiprocessor", 233472),
        ("max_threads_per_multi_processor", 2048)))
    lines = []
    for name, jit in (("decode_attention", kernels._decode_attention), ("rope_and_attend", kernels._rope_and_attend)):
        for caches in jit.device_caches.values():
            for k in caches[0].values():  # Triton 3.x: (kernel cache, ...) per device
                meta, warps = k.metadata, k.metadata.num_warps
                by_regs = regs // (warps * -(-k.n_regs * 32 // 256) * 256)
                per_sm = min(by_regs, shared // (meta.shared + 1024), threads // (32 * warps), 32)
                waves = batch * KV_HEADS / (per_sm * props.multi_processor_count)
                lines.append(f"  {name}: {warps} warps, {meta.num_stages} stages, cap {getattr(meta, 'maxnreg', None)}"
                             f": {k.n_regs} registers, {k.n_spills} spilled, {meta.shared / 1024:.1f} KiB shared; "
                             f"{per_sm} programs an SM, {waves:.2f} waves at batch {batch}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--launch", nargs="*", default=[], metavar="BLOCK:WARPS:STAGES",
                    help="more launch settings of the kernel to time (as it is: -:-:-)")
    args = ap.parse_args()
    settings = [("as it is", (KEYS, {}))] + [(text, launch_settings(text)) for text in args.launch]
    bandwidth = copy_bandwidth(torch.device("cuda")) if args.device == "cuda" else None
    if bandwidth:
        print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    length = -(-(args.prompt + args.new) // LENGTH_STEP) * LENGTH_STEP
    scale = HEAD_DIM ** -0.5
    for b in args.batch:
        keys, values = (torch.randn(b, KV_HEADS, length, HEAD_DIM, generator=g).to(args.device, dtype)
                        for _ in range(2))
        q = torch.randn(b, HEADS, HEAD_DIM, generator=g).to(args.device, dtype)
        positions = torch.randint(args.prompt, args.prompt + args.new, (b,), generator=g).to(args.device)
        width = -(-(int(positions.max()) + 1) // LENGTH_STEP) * LENGTH_STEP
        want = sdpa_decode(q, keys, values, positions, scale, width)
        read = int((positions + 1).sum()) * KV_HEADS * HEAD_DIM * 2 * keys.element_size()  # the kernel's keys, values
        sdpa = None
        if args.device == "cuda":
            sdpa = statistics.median(gpu_times(lambda: sdpa_decode(q, keys, values, positions, scale, width))) * 1e6
            print(f"batch {b:4}, width {width}: SDPA {sdpa:6.1f} us", flush=True)
        for name, (block, launch) in settings:
            def call(block=block, launch=launch):
                return decode_attention(q, keys, values, positions, scale, block=block, **launch)

            line = (f"batch {b:4}, {name:>9}: largest difference from SDPA "
                    f"{(call().float() - want.float()).abs().max():.2e}")
            if sdpa is not None:
                ours = statistics.median(gpu_times(call)) * 1e6
                rate = read / (ours * 1e-6)  # bytes/s
                line += (f"; Triton {ours:6.1f} us ({ours / sdpa:.2f}x SDPA), {rate / 1e12:.2f} TB/s read, "
                         f"{rate / bandwidth:.0%} of copy")
            print(line, flush=True)
        qkv = torch.randn(b, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(args.device, dtype)
        angles = torch.rand(length, 1, HEAD_DIM // 2, generator=g) * 6
        cos, sin = (torch.cat([f(angles), f(angles)], -1).to(args.device, dtype) for f in (torch.cos, torch.sin))
        apart_cache = (keys.clone(), values.clone())

        def apart(block, launch):
            q = rope_and_cache(qkv, cos, sin, positions, *apart_cache, HEADS)
            return decode_attention(q, *apart_cache, positions, scale, block=block, **launch)

        for name, (block, launch) in settings:
            def fused(block=block, launch=launch):
                return rope_and_attend(qkv, cos, sin, positions, keys, values, HEADS, scale, block=block, **launch)

            line = (f"batch {b:4}, {name:>9}: rope_and_attend's largest difference from rope_and_cache + the kernel "
                    f"{(fused().float() - apart(block, launch).float()).abs().max():.2e}")
            if args.device == "cuda":
                ours = statistics.median(gpu_times(fused)) * 1e6
                before = statistics.median(gpu_times(lambda: apart(block, launch))) * 1e6
                line += f"; {ours:6.1f} us against {before:6.1f} us ({before / ours:.2f}x)"
            print(line, flush=True)
        if args.device == "cuda":
            print(f"batch {b:4}: the variants compiled so far", *compiled_launches(b), sep="\n", flush=True)


if __name__ == "__main__":
    main()
