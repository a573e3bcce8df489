"""The decode step's pointwise kernels alone (miles.rollout.local.decode_fused's `rms_norm` with the residual add, and
`silu_and_mul`), at other launch settings than the engine's, on a GPU: each call replayed in a CUDA graph of --calls
calls (no launch time; the gaps between kernels counted, as in a decode step), median of --repeats replays, with the
bytes it moves a second against the copy bandwidth measured in the run, and its largest difference from the launch
the engine uses.

    python benchmarks/pointwise_launch.py [--batch 128 512] [--norm-warps 1 2 4 8] [--mlp 1024:4 512:4 2048:8]

Shape: Qwen2.5-0.5B's (hidden 896, MLP width 4,864), bf16. The engine's launches: rms_norm one program a row at
Triton's default warps (4), silu_and_mul MLP_BLOCK columns a program at 4 warps.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import FFN, HIDDEN, copy_bandwidth, gpu_times

from miles.rollout.local.decode_fused import MLP_BLOCK, rms_norm, silu_and_mul


def timed(fn, moved: int, bandwidth: float, repeats: int, calls: int) -> str:
    us = statistics.median(gpu_times(fn, repeats, calls)) * 1e6
    return f"{us:6.2f} us, {moved / (us * 1e-6) / bandwidth:4.0%} of copy"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--norm-warps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--mlp", nargs="+", default=["512:2", "512:4", "1024:2", "1024:8", "2048:4", "2048:8", "4096:8"],
                    metavar="BLOCK:WARPS", help="silu_and_mul launches beside the engine's")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=24)
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    bandwidth = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    g = torch.Generator().manual_seed(0)
    for b in args.batch:
        x0 = torch.randn(b, HIDDEN, generator=g).to(device, dtype)
        delta = torch.randn(b, HIDDEN, generator=g).to(device, dtype)
        weight = torch.randn(HIDDEN, generator=g).to(device, dtype)
        moved = 4 * x0.numel() * x0.element_size()  # x and the residual read, x and the norm written
        want = rms_norm(x0.clone(), weight, 1e-6, delta)
        x = x0.clone()  # the timed calls add the residual into it again and again; the differences start from x0
        for warps in [None, *args.norm_warps]:
            launch = {} if warps is None else {"num_warps": warps}
            got = rms_norm(x0.clone(), weight, 1e-6, delta, **launch)
            name = "engine's" if warps is None else f"{warps} warps"
            took = timed(lambda: rms_norm(x, weight, 1e-6, delta, **launch), moved, bandwidth, args.repeats, args.calls)
            print(f"batch {b:4} rms_norm + residual, {name:>10}: {took}"
                  f"; largest difference {(got.float() - want.float()).abs().max():.1e}", flush=True)
        gate_up = torch.randn(b, 2 * FFN, generator=g).to(device, dtype)
        moved = 3 * b * FFN * gate_up.element_size()
        want = silu_and_mul(gate_up)
        for setting in [None, *args.mlp]:
            block, launch = MLP_BLOCK, {}
            if setting is not None:
                block, warps = map(int, setting.split(":"))
                launch = {"num_warps": warps}
            got = silu_and_mul(gate_up, block, **launch)
            name = "engine's" if setting is None else setting
            took = timed(lambda: silu_and_mul(gate_up, block, **launch), moved, bandwidth, args.repeats, args.calls)
            print(f"batch {b:4} silu_and_mul, {name:>10}: {took}"
                  f"; largest difference {(got.float() - want.float()).abs().max():.1e}", flush=True)


if __name__ == "__main__":
    main()
