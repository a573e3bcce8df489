"""`miles selftest`: does this install reproduce a known-good recipe?

The guide's advice when all else fails is to drop to a tiny model on a known-good recipe, to
tell framework bugs from model bugs. This runs such a recipe (a tiny random Llama built in code,
3 deterministic steps on one thread) and compares it with the reference shipped in
`miles/testing/selftest_expected.json`: per step, the hashes of `--debug-determinism`, a digest
of each sample's tokens and the metrics, with the platform it was made on (versions, CPU model
and flags, the kernel path torch picked, kernel settings, threads).

Which claim applies depends on the two platforms:

* bitwise, when torch, transformers, Python, the machine, the CPU model, the kernel path
  (`torch.backends.cpu.get_cpu_capability()`), the kernel settings and the thread count all
  match: every hash, sample digest and metric must be equal;
* within tolerance otherwise (other kernels round differently): prompts, each sample's tokens and
  the rewards must still be equal, the metrics within the rounding drift measured across kernel
  paths (the constants below), and the engine/trainer log-prob gap under a bound.

Either way the first step and component that departs is named. Regenerate the reference with
`miles selftest --write-expected miles/testing/selftest_expected.json`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from miles.debug.diff_runs import COMPONENTS, WHAT_IT_MEANS
from miles.errors import UsageError

EXPECTED = Path(__file__).resolve().parent.parent / "testing" / "selftest_expected.json"
FORMAT = "miles.selftest/2"
RECIPE_THREADS = 1  # CPU reductions depend on the thread count, so the recipe pins it
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")  # the ones torch and MKL dispatch on
# Settings that pick other kernels on the same CPU (MKL_CBWR=COMPATIBLE changes the recipe's bits here;
# ATEN_CPU_CAPABILITY shows in cpu_capability).
KERNEL_ENV = ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
# A bitwise claim needs all of these equal: they decide which kernels run and how they round. The
# CPU model is in as a precaution: MKL picks its code path from the CPU it finds (vendor and
# generation), which the ISA name alone does not pin down.
BITWISE_KEY = ("torch", "transformers", "python", "machine", "cpu_model", "cpu_capability", "kernel_env", "threads")

# -- Tolerances, measured (torch 2.13.0+cpu, transformers 5.24.0, this 3-step recipe) ------------
# Healthy drift across kernel paths: ATEN_CPU_CAPABILITY=default and MKL_CBWR=COMPATIBLE, each vs
# the native AVX2 path of an AMD EPYC, for 9 sampling seeds, plus the reference an AVX-512 machine
# made vs this AVX2 install. Prompts, every sampled token, rewards and train/loss stayed equal in
# all of them (also over 10 steps); the largest relative drift over the 3 steps was
# rollout/log_probs 7.8e-7, train/grad_norm 9.1e-7, train/entropy 3.1e-6 (step 3; step 1 stays
# under 3e-7), and the AVX-512 reference's 2.9e-7.
# Planted faults, on both kernel paths: advantages without the std and a loss over the micro-batch
# move train/grad_norm by 95% and 300% at step 1; a weight not loaded (step 1), the loss's sign and
# lr x10 (step 2) part the sampled tokens of 16 of 16 samples; a weight the trainer did not load or
# the engine did not receive puts the engine/trainer log-prob gap at 1.7 and 0.21.
STEP_RTOL = 1e-4  # 30x the largest healthy drift (3.1e-6), 1e4 times under the smallest metric fault (95%)
LOSS_ATOL = 1e-6  # the on-policy GRPO loss is -mean(advantage), zero up to rounding (|loss| <= 2.9e-7)
TOLERANCE = {  # metric: (rtol, atol)
    "rollout/reward_mean": (STEP_RTOL, 0.0),
    "rollout/response_len_mean": (STEP_RTOL, 0.0),
    "rollout/log_probs": (STEP_RTOL, 0.0),
    "train/loss": (0.0, LOSS_ATOL),
    "train/grad_norm": (STEP_RTOL, 0.0),
    "train/entropy": (STEP_RTOL, 0.0),
}
# The engine/trainer log-prob gap is rounding noise itself (1.4e-6 to 5.7e-6 over 105 healthy steps,
# up to 170% apart between kernel paths), so it is held under a bound, not compared: 17x the
# largest healthy gap, 2000x under the smallest fault's (0.21).
FORWARD_LOGP_MAX = 1e-4
# A rounding flip moves one sampled token across a CDF boundary in one sample (each sample has its
# own random stream); later steps then train on a different rollout and cannot be compared. None
# happened in the runs above (the nearest boundary lay 2.3e-5 from its draw, kernels move the CDF
# by ~1e-7), but it is allowed: more samples than this parting at once is a fault (faults part 16).
FLIP_MAX_SAMPLES = 1
METRICS = (*TOLERANCE, "forward_logp_max_diff")


def register(commands) -> None:
    p = commands.add_parser("selftest", help="run a known-good tiny recipe and compare it with shipped values",
                            description=__doc__.splitlines()[0])
    p.add_argument("--expected", default=str(EXPECTED), metavar="JSON", help="reference values (default: shipped)")
    p.add_argument("--write-expected", metavar="JSON", help="record this install's values as a new reference")
    p.set_defaults(run=run)


# -- The recipe -------------------------------------------------------------------------------------

def run_recipe(workdir: Path) -> dict:
    """Runs the recipe in a subprocess; returns its per-step metrics, hashes and per-sample token digests."""
    from miles.testing.tiny import build_model_dir, train_args, write_prompts

    model = build_model_dir(workdir / "model", "llama", seed=0)
    argv = train_args(model, write_prompts(workdir / "prompts.jsonl"), workdir / "run") + [
        "--num-rollout", "3", "--deterministic-mode", "--debug-determinism", "--alignment-check", "off",
        "--save-debug-rollout-data", str(workdir / "dumps" / "rollout_{rollout_id}.pt")]
    threads = str(RECIPE_THREADS)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    result = subprocess.run([sys.executable, "-m", "miles", *argv], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"error: the selftest recipe itself failed (exit {result.returncode}):\n"
                         f"{result.stderr[-2000:]}")
    read = lambda name: [json.loads(line) for line in (workdir / "run" / name).read_text().splitlines()]  # noqa: E731
    return {"metrics": [{k: row[k] for k in METRICS} for row in read("metrics.jsonl")],
            "hashes": [{k: row[k] for k in COMPONENTS if k in row} for row in read("hashes.jsonl")],
            "samples": sample_digests(workdir / "dumps")}


def sample_digests(dumps: Path) -> list[list[str]]:
    """Per rollout, one digest of each sample's tokens (prompt and response), in sample order, read
    from the `--save-debug-rollout-data` dumps ({"rollout_id", "samples": [{"index", "tokens", ...}]})."""
    import torch

    payloads = sorted((torch.load(p, weights_only=True) for p in dumps.glob("rollout_*.pt")),
                      key=lambda d: d["rollout_id"])
    digest = lambda tokens: hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:12]  # noqa: E731
    return [[digest(s["tokens"]) for s in sorted(d["samples"], key=lambda s: s["index"])] for d in payloads]


# -- The platform -----------------------------------------------------------------------------------

def cpu_info() -> dict:
    """CPU vendor, model and the SIMD flags that decide kernel paths, from /proc/cpuinfo where there is one."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first processor's values
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    return {"cpu_vendor": fields.get("vendor_id") or platform.processor() or "unknown",
            "cpu_model": fields.get("model name") or platform.processor() or "unknown",
            "cpu_flags": [f for f in CPU_FLAGS if f in flags]}


def platform_info() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "machine": platform.machine(),
            "python": platform.python_version(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": RECIPE_THREADS, "kernel_env": {k: os.environ[k] for k in KERNEL_ENV if k in os.environ},
            **cpu_info()}


def describe(p: dict) -> str:
    """One line: the versions, the CPU and the kernel path of a platform record."""
    get = lambda key: p.get(key, "not recorded")  # noqa: E731
    flags = ", ".join(p.get("cpu_flags") or []) or "no avx2/avx512/amx"
    threads = p.get("threads")
    settings = f", {_settings(p['kernel_env'])}" if p.get("kernel_env") else ""
    return (f"torch {get('torch')}, transformers {get('transformers')}, python {get('python')}, {get('machine')}, "
            f"CPU {get('cpu_model')} ({get('cpu_vendor')}; {flags}), torch kernels {get('cpu_capability')}"
            f"{settings}, {threads} thread{'' if threads == 1 else 's'}")


BLOCKER_NAMES = {"torch": "torch differs", "transformers": "transformers differs", "python": "python differs",
                 "machine": "machine differs", "cpu_model": "CPU differs", "cpu_capability": "kernels differ",
                 "kernel_env": "kernel settings differ", "threads": "thread count differs"}


def bitwise_blockers(reference: dict, here: dict) -> list[str]:
    """Why the two platforms cannot agree bitwise, e.g. "kernels differ: AVX512 vs AVX2" (reference
    first); [] when they can."""
    show = lambda p, k: _settings(p[k]) if k == "kernel_env" and k in p else p.get(k, "not recorded")  # noqa: E731
    return [f"{BLOCKER_NAMES[k]}: {show(reference, k)} vs {show(here, k)}"
            for k in BITWISE_KEY if reference.get(k) != here.get(k)]


def _settings(env: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items()) or "no kernel settings"


# -- The comparisons --------------------------------------------------------------------------------

@dataclass
class Departure:
    step: int
    component: str
    detail: str

    def __str__(self) -> str:
        return f"step {self.step}, {self.component}: {self.detail}"


def steps(record: dict) -> list[dict]:
    """A record's per-step hashes, sample digests and metrics, one dict per step."""
    return [{"hashes": h, "samples": s, "metrics": m}
            for h, s, m in zip(record["hashes"], record["samples"], record["metrics"])]


def first_bitwise_departure(got: dict, expected: dict) -> Departure | None:
    """The bitwise claim: every hash, sample digest and metric of every step equal, in data-flow order."""
    for step, (g, e) in enumerate(zip(steps(got), steps(expected)), 1):
        bad = next((c for c in COMPONENTS if g["hashes"].get(c) != e["hashes"].get(c)), None)
        if bad:
            return Departure(step, bad, WHAT_IT_MEANS[bad])
        if g["samples"] != e["samples"]:
            return Departure(step, "rollout_tokens", "same token hash, different per-sample tokens: the reference "
                             "was edited or the dumps changed")
        bad = next((k for k in METRICS if g["metrics"][k] != e["metrics"][k]), None)
        if bad:
            return Departure(step, bad, f"expected {e['metrics'][bad]!r}, got {g['metrics'][bad]!r} (same hashes: "
                             f"the metric's computation changed, or the reference was edited)")
    return None


@dataclass
class ToleranceResult:
    departure: Departure | None = None
    parted_at: int | None = None  # the step where one sample's tokens flipped; later steps not compared
    drift: tuple[float, str, int] = (0.0, "", 0)  # the largest relative metric drift, its metric and step


def compare_within_tolerance(got: dict, expected: dict) -> ToleranceResult:
    """The claims that hold across kernel paths, step by step in data-flow order. After a rounding
    flip only the prompts and the log-prob bound are checked: the rollouts differ from there on."""
    result = ToleranceResult()
    for step, (g, e) in enumerate(zip(steps(got), steps(expected)), 1):
        result.departure = _every_step_departure(step, g, e)
        if result.departure is None and result.parted_at is None:
            result.departure = _aligned_step_departure(step, g, e, result)
        if result.departure:
            break
    return result


def _every_step_departure(step: int, got: dict, expected: dict) -> Departure | None:
    """Checks that hold at every step, even after a flip: same prompts, engine and trainer agree."""
    if got["hashes"]["prompts"] != expected["hashes"]["prompts"]:
        return Departure(step, "prompts", WHAT_IT_MEANS["prompts"])
    gap = got["metrics"]["forward_logp_max_diff"]
    if gap > FORWARD_LOGP_MAX:
        return Departure(step, "forward_logp_max_diff", f"engine and trainer log-probs differ by {gap:.3g} (at most "
                         f"{FORWARD_LOGP_MAX:g} when both hold the same weights): {WHAT_IT_MEANS['trainer_log_probs']}")
    return None


def _aligned_step_departure(step: int, got: dict, expected: dict, result: ToleranceResult) -> Departure | None:
    """A step whose rollout so far matched: equal tokens per sample, equal rewards, metrics within
    tolerance. One sample parting is a rounding flip (recorded in `result`), more is a fault."""
    parted = sum(a != b for a, b in zip(got["samples"], expected["samples"]))
    if parted > FLIP_MAX_SAMPLES:
        cause = WHAT_IT_MEANS["rollout_tokens"]
        if step > 1:  # step - 1 matched up to its gradient norm: what came after it differs
            cause += f"; step {step - 1} matched, so the weights its update made differ (gradient, optimizer, sync)"
        return Departure(step, "rollout_tokens", f"{parted} of {len(expected['samples'])} samples sampled different "
                         f"tokens (a rounding flip parts {FLIP_MAX_SAMPLES}): {cause}")
    if parted:
        result.parted_at = step
        return None
    if got["hashes"]["rewards"] != expected["hashes"]["rewards"]:
        return Departure(step, "rewards", WHAT_IT_MEANS["rewards"])
    for key, (rtol, atol) in TOLERANCE.items():
        g, e = got["metrics"][key], expected["metrics"][key]
        if abs(g - e) > atol + rtol * abs(e):
            return Departure(step, key, f"expected {e:.8g}, got {g:.8g} (tolerance rtol {rtol:g}, atol {atol:g})")
        if rtol and e and abs(g - e) / abs(e) > result.drift[0]:
            result.drift = (abs(g - e) / abs(e), key, step)
    return None


# -- The verdict ------------------------------------------------------------------------------------

def verdict(got: dict, expected: dict, here: dict) -> tuple[int, list[str]]:
    """The lines `miles selftest` prints after running the recipe, and its exit status (0 PASS, 3 FAIL)."""
    there = expected["platform"]
    lines = [f"reference made on: {describe(there)}", f"this install:      {describe(here)}"]
    n_steps = len(expected["hashes"])
    if len(got["hashes"]) != n_steps:
        return 3, lines + [f"Selftest: FAIL, the recipe ran {len(got['hashes'])} steps and the reference has "
                           f"{n_steps}: the recipe changed since the reference was written"]
    blockers = bitwise_blockers(there, here)
    tolerance = compare_within_tolerance(got, expected)
    if not blockers:
        lines.append("claims: bitwise (same torch, transformers, python, machine, CPU, kernels, threads)")
        departure = first_bitwise_departure(got, expected)
        if departure is None:
            return 0, lines + [f"Selftest: PASS, bitwise identical to the reference for {n_steps} steps"]
        lines.append(f"bitwise: first departure at {departure}")
        lines.append(f"tolerance: {f'first departure at {tolerance.departure}' if tolerance.departure else 'passes'}")
        return 3, lines + [f"Selftest: FAIL, not bitwise on a platform that matches the reference, first departs "
                           f"at step {departure.step}, {departure.component}"]
    lines.append(f"claims: within tolerance, not bitwise ({'; '.join(blockers)})")
    if tolerance.departure:
        return 3, lines + [f"Selftest: FAIL, first departs at {tolerance.departure}"]
    return 0, lines + _tolerance_pass_lines(tolerance, n_steps)


def _tolerance_pass_lines(result: ToleranceResult, n_steps: int) -> list[str]:
    drift, metric, step = result.drift
    checked = (f"checked: prompts, each sample's tokens and the rewards equal; metrics within rtol {STEP_RTOL:g} "
               f"(largest drift {drift:.1e}{f', {metric} step {step}' if metric else ''}); engine/trainer "
               f"log-prob gap under {FORWARD_LOGP_MAX:g}")
    if result.parted_at is None:
        return [checked, f"Selftest: PASS within tolerance for {n_steps} steps"]
    rest = _steps(result.parted_at, n_steps)
    flip = (f"at step {result.parted_at} one sample's tokens flipped (a draw within rounding of a CDF boundary), "
            f"so {rest} {'was' if rest.startswith('step ') else 'were'} checked only for prompts and the log-prob gap")
    if result.parted_at == 1:
        return [checked, f"Selftest: PASS within tolerance, but {flip}"]
    return [checked, f"Selftest: PASS within tolerance for {_steps(1, result.parted_at - 1)}; {flip}"]


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def read_reference(path: str) -> dict:
    """The reference at `path`; a UsageError when it is missing, unreadable or of an older format."""
    try:
        reference = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"--expected {path}: cannot read the reference ({e})") from None
    if reference.get("format") != FORMAT:
        raise UsageError(f"--expected {path}: not a {FORMAT} reference (an older miles wrote it, without the CPU "
                         f"kernels and per-sample tokens); regenerate it with `miles selftest --write-expected {path}`")
    return reference


def run(args: argparse.Namespace) -> int:
    if args.write_expected:  # before the recipe runs, not after
        from miles.utils.io import check_writable_dir

        check_writable_dir(Path(args.write_expected).absolute().parent, "--write-expected")
    expected = None if args.write_expected else read_reference(args.expected)
    with tempfile.TemporaryDirectory() as tmp:
        got = run_recipe(Path(tmp))
    here = platform_info()
    if expected is None:
        from miles.utils.io import atomic_write_json

        atomic_write_json(args.write_expected, {"format": FORMAT, "platform": here, **got})
        print(f"wrote the reference values of this install ({describe(here)}) to {args.write_expected}")
        return 0
    code, lines = verdict(got, expected, here)
    print("\n".join(lines))
    return code
