"""What each switch of --deterministic-mode costs, and what the per-step hashes cost, measured apart.

Steps: every configuration runs `miles train` in a fresh process (the switches are process-wide and
cuBLAS reads CUBLAS_WORKSPACE_CONFIG once), with the parts named applied before the run starts;
the configurations take turns, --repeats times round. Printed per configuration: the steady step
time (steps 2.., the mean of each run; median [min..max] over the runs), its generation and
training shares (train+rest: the step less generation and weight sync), and the change against `off`. Two runs of each
configuration that writes hashes are then compared with `miles diff-runs`, and the share of each steady step its
digests took (`perf/hash_s`) is printed: the hashes' cost measured inside the step, where the difference against
`off` also holds the 8-15% that runs of one configuration vary by between processes.

    python benchmarks/determinism_parts.py [--steps 4] [--repeats 3] [--configs a,b,..] [miles train flags...]

On the GPU machine, `--qwen-shape DIR` first writes the speed benchmark's model there (Qwen2.5-0.5B shape,
random bf16 weights, the character tokenizer; benchmarks/speed.py) and random prompts, and trains on them
(bf16, EOS off by the tokenizer, the digit-share reward; add --rollout-batch-size etc. to size the step).

Hashing alone, host sha256 (the digest before this one: parameters copied to the host) against the
on-device digest, over a Qwen2.5-0.5B-shaped set of tensors (494M parameters):

    python benchmarks/determinism_parts.py --digest [--device cuda] [--dtype fp32|bf16] [--repeats 3]

Configurations: `off`; each part of miles.debug.determinism.PARTS alone; `fill_memory` (torch's
NaN fill of uninitialised memory, which the mode used to leave on); `mode` (--deterministic-mode);
`mode_4mib` (the mode with CUBLAS_WORKSPACE_CONFIG=:4096:8 set at launch, which the mode then keeps:
4 MiB cuBLAS workspaces, and torch parsing the variable at every GEMM); `mode_before` (the mode as it was:
fill on); `strict` (torch.use_deterministic_algorithms(True) without warn_only, which makes flash /
memory-efficient SDPA backwards deterministic, so no math kernel; float cumsum on CUDA raises under it);
`hashes` (--deterministic-mode --debug-determinism); `true_on_policy` (--true-on-policy-mode, its check chosen
by the device: `stop` on a GPU since 2026-12-05's twelfth session, `rescore` on a CPU);
`true_on_policy_rescore` (--true-on-policy-check rescore: the engine scores each rollout with the trainer's
computation and re-draws a disagreeing token); `true_on_policy_stop` (--true-on-policy-check stop: no scoring
pass of each rollout; the run stops if the engine's log-probs are not the trainer's bit for bit);
`true_on_policy_scored` and `true_on_policy_stop_scored` (rescore and stop with --no-use-rollout-logprobs: the
trainer scores every rollout again, as the mode did before 2026-12-05).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _fill_memory() -> str:
    import torch.utils.deterministic

    torch.utils.deterministic.fill_uninitialized_memory = True
    return "fill_uninitialized_memory=True"


def _strict() -> str:
    import torch

    torch.use_deterministic_algorithms(True)
    return "use_deterministic_algorithms(True) strict"


def _workspace_4mib() -> str:
    import os

    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # at launch: torch sizes its cuBLAS workspaces from it
    return "CUBLAS_WORKSPACE_CONFIG=:4096:8 at launch (4 MiB cuBLAS workspaces)"


def part(name: str):
    from miles.debug.determinism import PARTS

    extra = {"fill_memory": _fill_memory, "strict": _strict, "workspace_4mib": _workspace_4mib}
    return extra[name] if name in extra else next(p.enable for p in PARTS if p.name == name)


# name -> (parts applied before `miles train`, flags added to it); parts apply in the order listed
CONFIGS = {
    "off": ([], []),
    "cublas_workspace": (["cublas_workspace"], []),
    "algorithms": (["algorithms"], []),
    "fill_memory": (["algorithms", "fill_memory"], []),
    "cudnn": (["cudnn"], []),
    "sdpa_math": (["sdpa_math"], []),
    "mode": ([], ["--deterministic-mode"]),
    "mode_4mib": (["workspace_4mib"], ["--deterministic-mode"]),
    "mode_before": (["cublas_workspace", "algorithms", "fill_memory", "cudnn", "sdpa_math"], []),
    "strict": (["cublas_workspace", "strict", "cudnn"], []),
    "hashes": ([], ["--deterministic-mode", "--debug-determinism"]),
    "true_on_policy": ([], ["--true-on-policy-mode"]),
    "true_on_policy_rescore": ([], ["--true-on-policy-mode", "--true-on-policy-check", "rescore"]),
    "true_on_policy_stop": ([], ["--true-on-policy-mode", "--true-on-policy-check", "stop"]),
    "true_on_policy_scored": ([], ["--true-on-policy-mode", "--true-on-policy-check", "rescore",
                                   "--no-use-rollout-logprobs"]),
    "true_on_policy_stop_scored": ([], ["--true-on-policy-mode", "--true-on-policy-check", "stop",
                                        "--no-use-rollout-logprobs"]),
}


def child(parts: list[str], argv: list[str]) -> int:
    """One run: the parts, then `miles train ARGV` in this process."""
    for name in parts:
        part(name)()
    if profile := os.environ.get("MILES_BENCH_PROFILE"):
        _profile_third_calls(Path(profile))
    from miles.cli.main import main

    return main(["train", *argv])


def _profile_third_calls(out: Path) -> None:
    """--profile: the third call of the engine's generate (the rollout, with true on-policy's check) and of the
    trainer's train, each under torch's profiler; its table of the largest GPU times goes to OUT/<what>.txt."""
    from torch.profiler import ProfilerActivity, profile

    from miles.rollout.local.batching import ContinuousBatcher
    from miles.rollout.local.engine import LocalEngine
    from miles.rollout.local.true_on_policy import TrainerComputationVerifier
    from miles.train.trainer import Trainer

    def wrap(cls, method: str):
        inner, calls = getattr(cls, method), [0]

        def profiled(*args, **kwargs):
            calls[0] += 1
            if calls[0] != 3:
                return inner(*args, **kwargs)
            import torch

            start = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                result = inner(*args, **kwargs)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            wall = time.perf_counter() - start
            events = prof.key_averages()
            # (the "## " ranges below are annotations: the profiler gives them their range's device time)
            busy = sum(e.self_device_time_total for e in events if not e.key.startswith("## ")) / 1e6
            # The host's side too: a call whose GPU idles waits on Python, and the CPU table says on what.
            (out / f"{cls.__name__}.{method}.txt").write_text(
                f"wall {wall:.3f} s (profiled), GPU busy {busy:.3f} s\n"
                + events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
                + "\n" + events.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70))
            return result

        setattr(cls, method, profiled)

    def label(cls, method: str):  # a range in the CPU table: how much of the call each part is
        inner = getattr(cls, method)

        def labelled(*args, **kwargs):
            import torch

            with torch.profiler.record_function(f"## {getattr(cls, '__name__', '')}.{method}"):
                return inner(*args, **kwargs)

        setattr(cls, method, labelled)

    import miles.loop as loop

    wrap(LocalEngine, "generate")
    wrap(Trainer, "train")
    label(ContinuousBatcher, "decode")
    label(TrainerComputationVerifier, "verify")
    label(loop, "score_sequences")  # the check's scoring forward (the loop hands it to the verifier)


def one_run(name: str, steps: int, extra: list[str], out: Path, profile: Path | None = None) -> dict:
    parts, flags = CONFIGS[name]
    argv = ["--num-rollout", str(steps), *extra, *flags, "--output-dir", str(out)]
    cmd = [sys.executable, __file__, "--child", ",".join(parts), "--", *argv]
    env = dict(os.environ)
    if profile is not None:
        (profile / name).mkdir(parents=True, exist_ok=True)
        env["MILES_BENCH_PROFILE"] = str(profile / name)
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"failed": last[:160]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_time_s" in r]  # the steps (not a step-0 evaluation's row)
    # Steps 2.., less step 3 when it was profiled: building the profiler's tables takes seconds inside its calls.
    steady = [r for i, r in enumerate(rows) if i > 0 and not (profile is not None and i == 2)] or rows
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in steady)
    step, gen, sync = mean("perf/step_time_s"), mean("perf/rollout_time_s"), mean("perf/weight_sync_s")
    result = {"step": step, "generate": gen, "train": step - gen - sync}
    if any("rollout/true_on_policy_redrawn" in r for r in rows):  # tokens re-drawn per rollout, every step
        result["redrawn"] = [r["rollout/true_on_policy_redrawn"] for r in rows]
    # The mode's trainer/engine gap: the scoring's, or on steps on the engine's log-probs the training forward's
    if any("rollout/true_on_policy_redrawn" in r or r.get("train/rollout_logprobs_used") for r in rows):
        result["forward_logp_max_diff"] = max(r.get("forward_logp_max_diff", 0.0) for r in rows)
    if all("perf/hash_s" in r for r in steady):  # --debug-determinism: the digests' share of each steady step
        shares = [r["perf/hash_s"] / r["perf/step_time_s"] for r in steady]
        result["hash_share"] = (min(shares), max(shares))
    return result


def bench(configs: list[str], steps: int, repeats: int, extra: list[str], profile: Path | None = None) -> None:
    results: dict[str, list[dict]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):  # round-robin: drift of the machine spreads over every configuration
            for name in configs:
                results[name].append(one_run(name, steps, extra, Path(tmp) / f"{name}-{r}",
                                             profile if r == 0 else None))
                print(f"  round {r + 1} {name}: {results[name][-1]}", flush=True)  # a cut run keeps what it had
        identical = {}
        for name in configs:
            runs = [Path(tmp) / f"{name}-{r}" for r in range(repeats)]
            if repeats > 1 and all((p / "hashes.jsonl").is_file() for p in runs):
                from miles.cli.main import main

                identical[name] = all(main(["diff-runs", str(runs[0]), str(p)]) == 0 for p in runs[1:])
    print(f"steady steps 2..{steps}, {repeats} runs each, median [min..max] of each run's mean; "
          f"flags: {' '.join(extra) or '(demo recipe)'}")
    print(f"{'':26}{'step s':>24}{'vs off':>9}{'generate s':>24}{'train+rest s':>24}")
    base = _median(results.get("off", []), "step")
    for name, runs in results.items():
        failed = [r["failed"] for r in runs if "failed" in r]
        if failed:
            print(f"{name:26}failed: {failed[0]}")
            continue
        vs = f"{100 * (_median(runs, 'step') / base - 1):+.1f}%" if base else ""
        print(f"{name:26}{_spread(runs, 'step'):>24}{vs:>9}{_spread(runs, 'generate'):>24}{_spread(runs, 'train'):>24}")
    for name, runs in results.items():
        shares = [share for r in runs for share in r.get("hash_share", ())]
        if shares:
            print(f"{name}: the digests took {100 * min(shares):.2f}% to {100 * max(shares):.2f}% of each steady step "
                  f"(perf/hash_s, {len(runs)} runs)")
    for name, same in identical.items():
        print(f"{name}: {repeats} runs hash identically at every step: {same}")


def _median(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else 0.0


def _spread(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs]
    return f"{statistics.median(values):.3f} [{min(values):.3f}..{max(values):.3f}]"


# -- hashing alone -------------------------------------------------------------------------------

def qwen05_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2.5-0.5B's parameters: vocab 151936, hidden 896, 24 layers, 14 + 2 heads of 64, ffn 4864."""
    h, kv, ffn = 896, 128, 4864
    shapes = [("embed_tokens.weight", (151936, h))]
    for i in range(24):
        p = f"layers.{i}."
        shapes += [(p + "q_proj.weight", (h, h)), (p + "q_proj.bias", (h,)), (p + "k_proj.weight", (kv, h)),
                   (p + "k_proj.bias", (kv,)), (p + "v_proj.weight", (kv, h)), (p + "v_proj.bias", (kv,)),
                   (p + "o_proj.weight", (h, h)), (p + "gate_proj.weight", (ffn, h)), (p + "up_proj.weight", (ffn, h)),
                   (p + "down_proj.weight", (h, ffn)), (p + "input_layernorm.weight", (h,)),
                   (p + "post_attention_layernorm.weight", (h,))]
    return shapes + [("norm.weight", (h,))]


def host_sha256_digest16(named) -> str:
    """The per-step digest as it was: sha256 over (name, bytes copied to the host)."""
    from miles.utils.digest import tensor_bytes

    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()[:16]


def qwen_shape_flags(path: Path) -> list[str]:
    """Writes the speed benchmark's model and 64 random 128-character prompts under PATH; the flags to train on them."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from speed import build_model, build_tokenizer, check_tokenizer, random_texts

    from miles.utils.models import load_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_model("cuda", torch.bfloat16).save_pretrained(path / "model")
    build_tokenizer("cuda").save_pretrained(path / "model")
    check_tokenizer(load_tokenizer(path / "model"), str(path / "model"))
    prompts = path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": x}) + "\n" for x in random_texts(64, 128)))
    return ["--hf-checkpoint", str(path / "model"), "--prompt-data", str(prompts), "--input-key", "prompt",
            "--custom-rm-path", "miles.testing.rewards:digit_share", "--device", "cuda", "--precision", "bf16",
            "--rollout-temperature", "1.0", "--alignment-check", "off"]


def bench_digest(device: str, dtype_name: str, repeats: int) -> None:
    import torch

    from miles.utils.digest import named_tensors_digest16

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    g = torch.Generator(device=device).manual_seed(0)
    named = [(n, torch.randn(s, generator=g, device=device, dtype=dtype)) for n, s in qwen05_shapes()]
    numel = sum(t.numel() for _, t in named)
    gib = sum(t.numel() * t.element_size() for _, t in named) / 2**30
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    print(f"{len(named)} tensors, {numel / 1e6:.0f}M {dtype_name} parameters ({gib:.2f} GiB) on {device}; "
          f"{repeats} repeats after one warm-up, median [min..max]")
    for label, fn in (("host sha256 (before)", host_sha256_digest16), ("on-device digest", named_tensors_digest16)):
        times = []
        for _ in range(repeats + 1):
            sync()
            start = time.perf_counter()
            fn(named)  # returns a str: the device work is finished
            times.append(time.perf_counter() - start)
        times = times[1:]
        med = statistics.median(times)
        print(f"{label:22}{med:9.4f} s [{min(times):.4f}..{max(times):.4f}]  {gib / med:8.2f} GiB/s")


def main() -> None:
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        parts = [p for p in sys.argv[i + 1].split(",") if p]
        sys.exit(child(parts, sys.argv[sys.argv.index("--") + 1:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    ap.add_argument("--digest", action="store_true", help="time hashing alone (host sha256 vs on-device digest)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--qwen-shape", metavar="DIR", type=Path, help="GPU: write and train the Qwen2.5-0.5B-shaped "
                                                                   "random model and prompts under DIR")
    ap.add_argument("--profile", metavar="DIR", type=Path, help="first round: profile each configuration's third "
                                                                "generate and train call (GPU), tables under DIR; "
                                                                "that run's step 3 is left out of its mean")
    known, extra = ap.parse_known_args()
    if known.digest:
        bench_digest(known.device, known.dtype, known.repeats)
        return
    configs = known.configs.split(",")
    if unknown := [c for c in configs if c not in CONFIGS]:
        ap.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if "off" not in configs:
        configs.insert(0, "off")
    if known.qwen_shape:
        extra = qwen_shape_flags(known.qwen_shape) + extra
    bench(configs, known.steps, known.repeats, extra, known.profile)


if __name__ == "__main__":
    main()
