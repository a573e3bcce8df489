"""Tile shapes for the batch-invariant matmul (miles.utils.invariant.tiles_for): each candidate against cuBLAS
on every matmul of a Qwen2.5-0.5B-shape step, timed on the GPU alone (CUDA graphs of --calls calls, so no launch
time counts), and checked for the property the tiles are chosen for: rows and fused column blocks equal alone.

    python benchmarks/invariant_tiles.py [--repeats 5] [--calls 20]

Rows: the engine's decode (64 rows; q/k/v and gate/up fused), the trainer's forward (3072 rows; q, k, v,
gate, up apart) and its backward (the input's gradient: K = the forward's N; the weight's: K = 3072).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import FFN, HEAD_DIM, HIDDEN, KV_HEADS, VOCAB, gpu_times  # noqa: E402

from miles.utils import invariant  # noqa: E402
from miles.utils.invariant import Tiles  # noqa: E402

KV = KV_HEADS * HEAD_DIM  # the width of k (and of v)
CANDIDATES = {
    "128x128x64 w8": Tiles(128, 128, 64, 8, 3),
    "64x64x64 w4": Tiles(64, 64, 64, 4, 4),
    "64x128x64 w4": Tiles(64, 128, 64, 4, 4),
    "64x32x64 w4": Tiles(64, 32, 64, 4, 4),
    "64x64x128 w4": Tiles(64, 64, 128, 4, 3),
    "128x64x64 w4": Tiles(128, 64, 64, 4, 4),
    "64x64x64 w4 /2": Tiles(64, 64, 64, 4, 4, 2),
    "64x64x64 w4 /4": Tiles(64, 64, 64, 4, 4, 4),
    "64x128x64 w4 /4": Tiles(64, 128, 64, 4, 4, 4),
    "128x128x64 w8 /4": Tiles(128, 128, 64, 8, 3, 4),
    "128x256x64 w8": Tiles(128, 256, 64, 8, 3),
}


def shapes(decode: int, trainer: int):
    """(label, M, K, N) of each matmul of one layer and the LM head."""
    for m, where in ((decode, "decode"), (trainer, "fwd")):
        fused = where == "decode"
        yield from ([(f"{where} qkv", m, HIDDEN, HIDDEN + 2 * KV)] if fused else
                    [(f"{where} q", m, HIDDEN, HIDDEN), (f"{where} k|v", m, HIDDEN, KV)])
        yield f"{where} o", m, HIDDEN, HIDDEN
        yield from ([(f"{where} gate_up", m, HIDDEN, 2 * FFN)] if fused else [(f"{where} gate|up", m, HIDDEN, FFN)])
        yield f"{where} down", m, FFN, HIDDEN
        yield f"{where} lm_head", m, HIDDEN, VOCAB
    yield "bwd dx of down", trainer, HIDDEN, FFN
    yield "bwd dx of gate|up", trainer, FFN, HIDDEN
    yield "bwd dW of down", HIDDEN, trainer, FFN
    yield "bwd dW of gate|up", FFN, trainer, HIDDEN
    yield "bwd dW of q/o", HIDDEN, trainer, HIDDEN


def invariant_rows(tiles: Tiles, g) -> bool:
    """Rows alone equal rows in a batch, and a column block alone equals it in a wider matmul, bitwise."""
    a = torch.randn(3072, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(HIDDEN + 2 * KV, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)
    full = invariant._matmul(a, w.t(), None, tiles)
    return (torch.equal(invariant._matmul(a[100:164], w.t(), None, tiles), full[100:164])
            and torch.equal(invariant._matmul(a[7:8], w.t(), None, tiles), full[7:8])
            and torch.equal(invariant._matmul(a, w[HIDDEN:].t(), None, tiles), full[:, HIDDEN:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--decode-rows", type=int, default=64)
    ap.add_argument("--trainer-rows", type=int, default=8 * 384)
    ap.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated names of CANDIDATES")
    args = ap.parse_args()
    names = args.candidates.split(",")
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        ap.error(f"--candidates: no candidate named {', '.join(map(repr, unknown))}; the names: "
                 + ", ".join(CANDIDATES))
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us a call on the GPU, median of "
          f"{args.repeats} graph replays of {args.calls} calls; in brackets the ratio to cuBLAS")
    print("invariant (rows and a column block equal alone, bitwise): "
          + ", ".join(f"{n} {'yes' if invariant_rows(CANDIDATES[n], g) else 'NO'}" for n in names))
    print(f"{'matmul (M x K x N)':34}{'cuBLAS':>9}" + "".join(f"{n:>20}" for n in names))
    chosen = {}
    for label, m, k, n in shapes(args.decode_rows, args.trainer_rows):
        a = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16)
        base = statistics.median(gpu_times(lambda: torch.mm(a, w.t()), args.repeats, args.calls)) * 1e6
        cells = []
        for name in names:
            t = statistics.median(gpu_times(lambda: invariant._matmul(a, w.t(), None, CANDIDATES[name]),
                                           args.repeats, args.calls)) * 1e6
            cells.append(f"{t:8.1f} ({t / base:4.2f}x)")
        now = statistics.median(gpu_times(lambda: invariant.mm(a, w.t()), args.repeats, args.calls)) * 1e6
        chosen[label] = (base, now)
        print(f"{f'{label} ({m}x{k}x{n})':34}{base:9.1f}" + "".join(f"{c:>20}" for c in cells), flush=True)
    print("\ntiles_for as it stands:")
    for label, (base, now) in chosen.items():
        print(f"  {label:28} cuBLAS {base:8.1f} us, invariant {now:8.1f} us ({now / base:.2f}x)")


if __name__ == "__main__":
    main()
