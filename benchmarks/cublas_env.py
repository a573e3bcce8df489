"""Host time of one cuBLAS GEMM under the ways CUBLAS_WORKSPACE_CONFIG can be set (issue 13: what the
deterministic mode's training cost was made of).

torch's strict deterministic algorithms require CUBLAS_WORKSPACE_CONFIG=:4096:8; while it is set, torch
also parses it at every GEMM. Each configuration runs in a fresh process (torch reads the variable at
its first handle and first GEMM), the configurations in turn, --repeats times round. Each times --calls
small GEMMs (64 x 256 by 256 x 256, bf16: the GPU finishes each faster than the host issues the next)
as `torch.mm` and as `F.linear` with a bias (cuBLASLt), plain and under strict deterministic
algorithms, and prints the host time per call: median [min..max] over the rounds.

    python benchmarks/cublas_env.py [--calls 4000] [--repeats 3]

Configurations: `unset`; `at launch` (the variable set before torch starts: 4 MiB workspaces);
`after handle` (set after torch's first handle: the mode before this change); `mode`
(miles.debug.determinism's part: set for torch's check at one GEMM, then removed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = ("unset", "at launch", "after handle", "mode")


def one(config: str, calls: int) -> dict:
    import torch
    import torch.nn.functional as F

    if config == "after handle":
        torch.cuda.current_blas_handle()
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    elif config == "mode":
        from miles.debug.determinism import _cublas_workspace

        _cublas_workspace()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    ops = {"mm": lambda: torch.mm(x, w), "linear+bias": lambda: F.linear(x, w, b)}
    out = {}
    for strict in (False, True):
        torch.use_deterministic_algorithms(strict)
        for name, op in ops.items():
            key = f"{name}{' strict' if strict else ''}"
            try:
                for _ in range(50):  # warm-up
                    op()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(calls):
                    op()
                out[key] = (time.perf_counter() - start) / calls * 1e6  # host us a call (the GPU keeps up)
                torch.cuda.synchronize()
            except RuntimeError as e:
                out[key] = f"raises: {str(e).split('.')[0][:60]}"
    out["variable after"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "unset")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--config", help=argparse.SUPPRESS)  # one configuration, in this process (the parent's child)
    args = ap.parse_args()
    if args.config:
        print(json.dumps(one(args.config, args.calls)))
        return 0
    results: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    for r in range(args.repeats):
        for config in CONFIGS:
            env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
            if config == "at launch":
                env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
            done = subprocess.run([sys.executable, __file__, "--config", config, "--calls", str(args.calls)],
                                  env=env, capture_output=True, text=True, check=True)
            results[config].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  round {r + 1} {config}: {results[config][-1]}", file=sys.stderr)
    keys = [k for k in results["unset"][0] if k != "variable after"]
    print(f"host us per GEMM call, {args.calls} calls, median [min..max] of {args.repeats} processes each")
    print(f"{'configuration':14}" + "".join(f"{k:>26}" for k in keys) + "   variable after")
    for config, rows in results.items():
        cells = []
        for k in keys:
            values = [row[k] for row in rows]
            if all(isinstance(v, float) for v in values):
                cells.append(f"{statistics.median(values):.1f} [{min(values):.1f}..{max(values):.1f}]")
            else:
                cells.append(next(str(v) for v in values if not isinstance(v, float))[:24])
        print(f"{config:14}" + "".join(f"{c:>26}" for c in cells) + f"   {rows[-1]['variable after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
