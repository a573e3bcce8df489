"""How Triton lays out the row a norm kernel sums, compiled for a Hopper GPU on any machine (no GPU needed).

A sum's result depends on its order, and a Triton reduction's order on the layout of the tensor it reduces: how
many columns each thread holds and adds first. --true-on-policy-mode needs the decode's fused RMSNorm
(miles.rollout.local.decode_fused) to sum a row's squares in the order of the trainer's row mean
(miles.utils.invariant_kernels.row_mean), so both must reduce the same layout. This script compiles both kernels
with the runtime's specialisations (pointers and widths divisible by 16) for sm_90 and prints each reduction's
layout, per output dtype and with or without the residual add.

    python benchmarks/triton_layouts.py [--width 896]

With Triton 3.6 (the device's, torch 2.11): the row mean reduces four columns a thread; the fused norm does too
only with an fp32 output and no residual add (a bf16 store or a bf16 residual makes it eight: another order).
"""

from __future__ import annotations

import argparse
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from miles.rollout.local import decode_fused
from miles.utils import invariant_kernels

TARGET = GPUTarget("cuda", 90, 32)


def reduce_layouts(fn, signature: dict, constexprs: dict, **options) -> list[str]:
    """The layouts of the tensors `fn`'s reductions take, in its TTGIR for sm_90."""
    divisible = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind != "constexpr"
                 and not kind.startswith("fp")}
    ir = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=divisible), target=TARGET,
                        options=options).asm["ttgir"]
    layouts = dict(re.findall(r"^(#blocked\d*) = #ttg\.blocked<\{(.*?)\}>", ir, re.M))
    return [layouts[name] for name in re.findall(r"\}\) : \(tensor<\d+xf32, (#blocked\d*)>\) -> f32", ir)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=896, help="the hidden size (its power-of-two block is what counts)")
    block = triton.next_power_of_2(ap.parse_args().width)
    print(f"Triton {triton.__version__}, sm_90, block {block}")
    mean = reduce_layouts(invariant_kernels.row_mean, {"x": "*fp32", "out": "*fp32", "N": "i32", "BLOCK": "constexpr"},
                          {"BLOCK": block})
    print(f"  invariant row mean:                 {mean}")
    for out in ("fp32", "bf16"):
        for add in (False, True):
            sig = {"x": "*fp32", "residual": "*bf16", "weight": "*fp32", "out": f"*{out}", "N": "i32", "s_x": "i32",
                   "s_r": "i32", "s_o": "i32", "eps": "fp32", "ADD": "constexpr", "BLOCK": "constexpr"}
            got = reduce_layouts(decode_fused._rms_norm, sig, {"ADD": add, "BLOCK": block}, **decode_fused.EXACT)
            same = "same order" if got == mean else "another order"
            print(f"  fused norm, {out} out, {'with' if add else 'no'} residual add: {got} ({same})")


if __name__ == "__main__":
    main()
