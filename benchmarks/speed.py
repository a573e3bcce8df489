"""Every speed figure of issue 13 side by side, in one run, printed as one table.

    python benchmarks/speed.py [--device cuda|cpu] [--only ceilings,engine,trainer,grpo,determinism]
                               [--repeats 3] [--time-limit 440] [--batches 32,128] [--new-tokens 256]
                               [--vllm-python PATH]

On the GPU machine: `bash benchmarks/gpu_speed.sh` (installs the carried TRL wheels first).

CUDA (the default where a GPU is): the Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 heads, 2 KV
heads, ffn 4864, vocab 151936, tied embeddings) with random bf16 weights built in code, and a
character-level tokenizer built in code (miles.testing.tiny). CPU: the demo model (SmolLM2-135M,
fp32) and its tokenizer at small sizes, so a run here checks the script. Prompts are random
token ids (engine, trainer) or random letter strings (GRPO); EOS is off (no EOS ids; HF with
min_new_tokens = max_new_tokens), so every row makes all its tokens.

Sections (each in try/except: an error is one line, the run goes on; --time-limit cuts repeats
and skips what no longer fits, the table so far is printed after every section):
  ceilings     device copy bandwidth (2 x bytes / time), matmul TFLOP/s (bf16 on CUDA), and from
               them the decode bandwidth bound: weights + KV read per step at the copy bandwidth.
  engine       decode tok/s of LocalEngine.generate vs HF generate (dynamic cache) vs HF generate
               with cache_implementation="static" and its automatic compile (CUDA only).
  trainer      Trainer.train on R x L tokens (score + one optimizer step over micro-batches) vs a
               plain bf16-autocast fwd+bwd+AdamW loop on the same model and tokens; MFU from
               8N (miles: scoring forward + training forward/backward) or 6N FLOP per token.
  grpo         one GRPO step in process (LiveRollout on LocalEngine, reward, Trainer.train,
               InProcessTransport) vs TRL GRPOTrainer's step (HF generate, no gradient
               checkpointing, same batch, micro-batch and reward: share of even token ids).
  determinism  `miles train` step time (median of steps 2..) plain, --deterministic-mode, with
               --debug-determinism hashes, and --true-on-policy-mode; each run in a subprocess,
               since deterministic mode sets process-wide switches. These are plain `miles train`
               runs (the model saved to a temporary dir on CUDA): the tokenizer's EOS ends a
               response (a random model all but never samples it), the reward is digit_share.
  vllm         (CPU, with --vllm-python) miles' engine vs a vLLM server on the demo prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from common import QWEN_0_5B

SECTIONS = ("ceilings", "engine", "trainer", "grpo", "determinism", "vllm")
H200_BF16_TFLOPS = 989.0  # dense bf16 nominal
ROOT = str(Path(__file__).resolve().parents[1])


@dataclass(frozen=True, kw_only=True)
class Sizes:
    batches: tuple[int, ...]  # engine decode batch sizes
    prompt_len: int
    new_tokens: int
    train_rows: int  # trainer section: rows of prompt_len + new_tokens tokens
    micro_batch: int
    grpo_prompts: int  # GRPO: grpo_prompts x group completions of new_tokens
    group: int
    det_steps: int  # determinism: `miles train` steps per variant (step 1 is warm-up)
    copy_mib: int
    matmul_n: int


GPU = Sizes(batches=(32, 128, 512), prompt_len=128, new_tokens=256, train_rows=64, micro_batch=8, grpo_prompts=8,
            group=8, det_steps=4, copy_mib=2048, matmul_n=8192)
CPU = Sizes(batches=(8, 32), prompt_len=32, new_tokens=64, train_rows=8, micro_batch=4, grpo_prompts=2, group=4,
            det_steps=3, copy_mib=256, matmul_n=1024)


class Clock:
    """The run's time limit, shared out over the sections by weight: time a section leaves unused
    goes to the ones after it. Repeats stop and work is skipped once a section's share is spent."""

    WEIGHTS = {"ceilings": 1, "engine": 10, "trainer": 3, "grpo": 6, "determinism": 6, "vllm": 4}

    def __init__(self, limit_s: float | None):
        self.end = time.monotonic() + limit_s if limit_s else float("inf")
        self.section_end = self.end

    def start(self, name: str, remaining: list[str]) -> str:
        """Starts section `name` (`remaining` holds it and those after it); returns its budget as text."""
        share = self.WEIGHTS[name] / sum(self.WEIGHTS[n] for n in remaining)
        now = time.monotonic()
        self.section_end = now + share * (self.end - now)
        return "" if self.end == float("inf") else f" (budget {self.section_end - now:.0f} s)"

    def left(self) -> float:
        return self.section_end - time.monotonic()

    def timeout(self) -> float | None:
        """What is left of the section as a subprocess timeout (None: no limit)."""
        return None if self.end == float("inf") else max(self.left(), 1.0)

    def over(self) -> bool:
        return self.left() <= 0

    def part(self, parts: int) -> Clock:
        """A clock for one of `parts` equal pieces of what is left of this section."""
        return Clock(None if self.end == float("inf") else max(self.left(), 0.0) / parts or 1e-9)

    def run_over(self) -> bool:
        return time.monotonic() >= self.end


class Report:
    """Table rows and raw runs, printed (flushed) as they come."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, str, str]] = []
        self.raw: dict[str, list[float]] = {}

    def runs(self, name: str, values: list[float], unit: str) -> list[float]:
        self.raw[f"{name} [{unit}]"] = values
        say(f"  {name}: {', '.join(f'{v:.4g}' for v in values)} {unit}")
        return values

    def row(self, figure: str, miles: str, alternative: str = "-", ratio: str = "-", ceiling: str = "-") -> None:
        self.rows.append((figure, miles, alternative, ratio, ceiling))

    def print(self, title: str) -> None:
        say(f"\n## {title}\n")
        say("| figure | miles | alternative | ratio (>1: miles faster) | % of ceiling |")
        say("|---|---|---|---|---|")
        for r in self.rows:
            say("| " + " | ".join(r) + " |")
        say("\nraw runs:")
        for name, values in self.raw.items():
            say(f"  {name}: {' '.join(f'{v:.4g}' for v in values)}")
        say("")


def say(text: str) -> None:
    print(text, flush=True)


def spread(values: list[float], fmt: str = "{:,.0f}") -> str:
    """Median with min-max and the number of runs."""
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))}, n={len(values)})"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def repeat(fn, repeats: int, clock: Clock, device: str) -> list[float]:
    """Seconds of each call of fn; at least one, then up to `repeats` while the clock allows."""
    times = []
    for i in range(repeats):
        if i and clock.over():
            say(f"  (time limit: {i} of {repeats} runs)")
            break
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


# -- models and data ----------------------------------------------------------------------------------

def build_model(device: str, dtype, seed: int = 0):
    """The benchmark model: on CUDA the Qwen2.5-0.5B shape with random weights, on CPU the demo model."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from miles.utils.models import (
        load_causal_lm,
        quiet_transformers,
        resolve_checkpoint,
    )

    quiet_transformers()
    if device == "cpu":
        return load_causal_lm(resolve_checkpoint(None), device="cpu", attention_backend="sdpa", dtype=dtype)
    torch.manual_seed(seed)
    config = Qwen2Config(**QWEN_0_5B, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # EOS off for HF generate
    return model


def build_tokenizer(device: str):
    from miles.testing.tiny import build_tokenizer as char_tokenizer
    from miles.utils.models import load_tokenizer, resolve_checkpoint

    return load_tokenizer(resolve_checkpoint(None)) if device == "cpu" else char_tokenizer()


def check_tokenizer(tokenizer, where: str) -> None:
    """The issue's trap: a tokenizer that loads but encodes text to no tokens."""
    text = "abc123xyz"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids or tokenizer.decode(ids) != text:
        raise RuntimeError(f"the tokenizer of {where} encodes {text!r} to {ids} (decoded {tokenizer.decode(ids)!r})")


def matmul_params(model) -> int:
    """N of the 6N rule: parameters that take part in a matmul (the input embedding does not,
    unless it is tied to the output layer)."""
    total = sum(p.numel() for p in model.parameters())
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    return total if tied else total - model.get_input_embeddings().weight.numel()


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def random_texts(n: int, length: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_lowercase + string.digits, k=length)) for _ in range(n)]


def free(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# -- sections -------------------------------------------------------------------------------------------

def copy_gbs(ctx) -> list[float]:
    """Device copy bandwidth: read + write bytes over time."""
    x = torch.empty(ctx.sizes.copy_mib << 20, dtype=torch.uint8, device=ctx.device)
    y = torch.empty_like(x)
    y.copy_(x)
    times = repeat(lambda: y.copy_(x), max(ctx.repeats, 5), ctx.clock, ctx.device)
    return [2 * x.numel() / t / 1e9 for t in times]


def matmul_tflops(ctx, dtype) -> list[float]:
    n = ctx.sizes.matmul_n
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    b = torch.randn_like(a)
    a @ b
    return [2 * n ** 3 / t / 1e12 for t in repeat(lambda: a @ b, max(ctx.repeats, 5), ctx.clock, ctx.device)]


def ceilings(ctx) -> None:
    s = ctx.sizes
    ctx.copy_gbs = ctx.report.runs("copy bandwidth", copy_gbs(ctx), "GB/s")
    dtype = torch.bfloat16 if ctx.device == "cuda" else torch.float32
    name = f"{str(dtype).removeprefix('torch.')} matmul {s.matmul_n}^3"
    ctx.matmul_tflops = ctx.report.runs(name, matmul_tflops(ctx, dtype), "TFLOP/s")
    nominal = f"{H200_BF16_TFLOPS:.0f} nominal (H200)" if "H200" in ctx.device_name else "-"
    ctx.report.row("copy bandwidth, GB/s", spread(ctx.copy_gbs, "{:,.1f}"))
    ctx.report.row(f"{name}, TFLOP/s", spread(ctx.matmul_tflops, "{:.3g}"), nominal, "-",
                   f"{100 * statistics.median(ctx.matmul_tflops) / H200_BF16_TFLOPS:.0f}% of nominal"
                   if nominal != "-" else "-")
    for batch in s.batches:
        ctx.report.row(f"decode bandwidth bound, batch {batch}, tok/s", f"{bandwidth_bound(ctx, batch):,.0f}")


def bandwidth_bound(ctx, batch: int) -> float:
    """Tokens/s if each decode step only read the weights once and the batch's KV cache at the
    measured copy bandwidth (the mean context over the response: prompt + new_tokens / 2)."""
    c, s = ctx.model_shape, ctx.sizes
    kv_per_token = 2 * c["layers"] * c["kv_heads"] * c["head_dim"] * c["bytes"]
    step_bytes = c["weight_bytes"] + batch * kv_per_token * (s.prompt_len + s.new_tokens / 2)
    return batch * statistics.median(ctx.copy_gbs) * 1e9 / step_bytes


def engine(ctx) -> None:
    from transformers import CompileConfig

    from miles.config import SamplingParams
    from miles.rollout.local import LocalEngine

    dev, s = ctx.device, ctx.sizes
    model = ctx.engine_model
    vocab = model.config.vocab_size
    local = LocalEngine(model, eos_token_ids=[], pad_token_id=0)

    def miles(prompts, seeds, tokens=s.new_tokens):
        outs = local.generate(prompts, SamplingParams(max_new_tokens=tokens, temperature=1.0, top_p=1.0), seeds)
        made = sum(len(o.token_ids) for o in outs)
        assert made == len(prompts) * tokens, f"LocalEngine made {made} tokens, not {len(prompts) * tokens} (EOS off)"

    def hf(ids, tokens=s.new_tokens, **extra):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_p=1.0, top_k=0, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0, **extra)
        assert out.shape[1] == ids.shape[1] + tokens, f"HF generate made {out.shape[1] - ids.shape[1]} tokens"

    static = dict(cache_implementation="static", compile_config=CompileConfig())  # compiles on CUDA only
    for k, batch in enumerate(s.batches):
        clock = ctx.clock.part(len(s.batches) - k)  # each batch size an equal share of what is left
        if clock.over():
            say(f"  engine batch {batch}: skipped (time limit)")
            continue
        prompts = random_prompts(batch, s.prompt_len, vocab, seed=batch)
        seeds = list(range(batch))
        ids = torch.tensor(prompts, device=dev)
        tok = batch * s.new_tokens
        bound = bandwidth_bound(ctx, batch) if ctx.copy_gbs else None
        results = {}
        # (name, warm-up, timed call); warm-ups make 8 tokens, but the static one is the compile, so
        # it must be the timed call's own shapes
        variants = [("HF generate", partial(hf, ids, 8), partial(hf, ids)),
                    ("miles LocalEngine", partial(miles, prompts, seeds, 8), partial(miles, prompts, seeds))]
        if dev == "cuda":
            variants.append(("HF generate static+compile", partial(hf, ids, **static), partial(hf, ids, **static)))
        for name, warm, run in variants:
            if clock.over():
                say(f"  {name}, batch {batch}: skipped (time limit)")
                continue
            try:
                start = time.perf_counter()
                warm()
                sync(dev)
                say(f"  {name}, batch {batch}: warm-up {time.perf_counter() - start:.1f} s")
                times = repeat(run, ctx.repeats, clock, dev)
                results[name] = ctx.report.runs(f"{name}, batch {batch}", [tok / t for t in times], "tok/s")
            except Exception as e:  # one engine failing leaves the others' rows
                say(f"  {name}, batch {batch}: error: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            free(dev)
        mine = results.get("miles LocalEngine")
        for name in ("HF generate", "HF generate static+compile"):
            if name not in results:
                continue
            alt = statistics.median(results[name])
            ratio = f"{statistics.median(mine) / alt:.2f}x" if mine else "-"
            ceiling = "-" if bound is None else ", ".join(
                f"{who} {100 * statistics.median(r) / bound:.2f}%"
                for who, r in (("miles", mine), ("alt", results[name])) if r) + f" of {bound:,.0f}"
            vs_hf = ""
            if name != "HF generate" and "HF generate" in results:
                vs_hf = f" = {alt / statistics.median(results['HF generate']):.2f}x HF generate"
            ctx.report.row(f"decode tok/s, batch {batch} (alt: {name}{vs_hf})", spread(mine), spread(results[name]),
                           ratio, ceiling)


def train_samples(rows: int, prompt_len: int, new_tokens: int, vocab: int, group: int):
    from miles.bridge.types import Sample

    tokens = random_prompts(rows, prompt_len + new_tokens, vocab, seed=7)
    return [Sample(group_index=i // group, index=i, prompt="", tokens=t, response_length=new_tokens,
                   loss_mask=[1] * new_tokens, rollout_log_probs=[0.0] * new_tokens, reward=float(i % 3))
            for i, t in enumerate(tokens)]


def make_trainer(model, rows: int, micro_batch: int, group: int, precision: str, args=None):
    """miles' Trainer on `model`; `args` (speed.py's) adds --trainer-torch-compile and --max-tokens-per-gpu."""
    from miles.config import TrainConfig
    from miles.train.trainer import Trainer

    cfg = TrainConfig(num_steps_per_rollout=1, global_batch_size=rows, micro_batch_size=micro_batch, lr=1e-6,
                      weight_decay=0.0, clip_grad=1.0, advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.2,
                      kl_coef=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", use_tis=False,
                      tis_clip=2.0, calculate_per_token_loss=False,
                      torch_compile=bool(args and args.trainer_torch_compile),
                      max_tokens_per_gpu=args.max_tokens_per_gpu if args else None)
    return Trainer(cfg, model, None, temperature=1.0, group_size=group, pad_token_id=0, precision=precision)


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def time_trainer(ctx, model, samples) -> tuple[list[float], float | None]:
    """Trainer.train tok/s over `samples` (after a warm-up call) and the peak memory, GiB."""
    t = make_trainer(model, len(samples), ctx.sizes.micro_batch, ctx.sizes.group, ctx.precision, ctx.args)
    t.train(samples)
    free(ctx.device)
    times = repeat(lambda: t.train(samples), ctx.repeats, ctx.clock, ctx.device)
    tokens = sum(len(x.tokens) for x in samples)
    return ctx.report.runs("Trainer.train", [tokens / x for x in times], "tok/s"), peak_gib(ctx.device)


def time_plain_loop(ctx, model, ids) -> tuple[list[float], float | None]:
    """A plain bf16-autocast fwd+bwd+AdamW step over `ids` (R, L) in micro-batches: tok/s, peak GiB."""
    from miles.train.trainer import mixed_precision

    dev, mbs = ctx.device, ctx.sizes.micro_batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model.train()

    def step():
        opt.zero_grad(set_to_none=True)
        for start in range(0, len(ids), mbs):
            mb = ids[start:start + mbs]
            with mixed_precision(ctx.precision, dev):
                logits = model(input_ids=mb).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), mb[:, 1:].flatten())
            (loss * len(mb) / len(ids)).backward()
        opt.step()

    step()
    free(dev)
    times = repeat(step, ctx.repeats, ctx.clock, dev)
    peak = peak_gib(dev)
    opt.zero_grad(set_to_none=True)
    return ctx.report.runs("plain fwd+bwd+AdamW", [ids.numel() / x for x in times], "tok/s"), peak


def trainer(ctx) -> None:
    dev, s = ctx.device, ctx.sizes
    model = ctx.train_model
    n_params = matmul_params(model)
    samples = train_samples(s.train_rows, s.prompt_len, s.new_tokens, model.config.vocab_size, s.group)
    miles_rates, peak = time_trainer(ctx, model, samples)
    plain_rates, plain_peak = time_plain_loop(ctx, model, torch.tensor([x.tokens for x in samples], device=dev))
    shape = f"{s.train_rows} x {s.prompt_len + s.new_tokens} tokens, micro-batch {s.micro_batch}"
    ratio = f"{statistics.median(miles_rates) / statistics.median(plain_rates):.2f}x"
    ctx.report.row(f"trainer tok/s ({shape}; miles: Trainer.train, alt: plain loop)", spread(miles_rates),
                   spread(plain_rates), ratio)
    for name, rates, flops in (("Trainer.train, 8N", miles_rates, 8), ("plain loop, 6N", plain_rates, 6)):
        mfu = [flops * n_params * r / 1e12 for r in rates]
        ceiling = f"{100 * statistics.median(mfu) / statistics.median(ctx.matmul_tflops):.1f}% of measured matmul" \
            if ctx.matmul_tflops else ""
        if dev == "cuda":
            ceiling += f", {100 * statistics.median(mfu) / H200_BF16_TFLOPS:.1f}% of {H200_BF16_TFLOPS:.0f}"
        ctx.report.row(f"trainer TFLOP/s, {name} (N={n_params / 1e6:.3g}M)",
                       spread(mfu, "{:.3g}") if flops == 8 else "-", spread(mfu, "{:.3g}") if flops == 6 else "-",
                       "-", ceiling or "-")
    if peak is not None:
        ctx.report.row("trainer peak memory, GiB", f"{peak:.1f}", f"{plain_peak:.1f}")


def even_share(token_ids: list[int]) -> float:
    """The GRPO benchmark's reward: the share of even token ids (varies across random samples)."""
    return sum(t % 2 == 0 for t in token_ids) / max(len(token_ids), 1)


def time_miles_grpo(ctx, texts: list[str]) -> tuple[list[float], dict[str, list[float]]]:
    """Seconds of miles' GRPO steps after a warm-up one (LiveRollout on LocalEngine, reward,
    Trainer.train, InProcessTransport), and of each phase."""
    from miles.bridge.transports import InProcessTransport
    from miles.config import RolloutConfig, SamplingParams
    from miles.data.prompts import PromptDataset, PromptRecord
    from miles.rollout.local import LocalEngine
    from miles.rollout.source import LiveRollout

    dev, s = ctx.device, ctx.sizes
    cfg = RolloutConfig(batch_size=s.grpo_prompts, n_samples_per_prompt=s.group,
                        sampling=SamplingParams(max_new_tokens=s.new_tokens, temperature=1.0, top_p=1.0),
                        rm_type="math", custom_rm_path=None, reward_timeout=60.0)
    local = LocalEngine(ctx.engine_model, eos_token_ids=[], pad_token_id=0, compile=ctx.args.enable_torch_compile)
    dataset = PromptDataset([PromptRecord(x, None) for x in texts], shuffle=False, seed=0)
    source = LiveRollout(cfg, local, ctx.tokenizer, dataset, lambda sample: even_share(sample.response_tokens),
                         apply_chat_template=False, seed=0)
    t = make_trainer(ctx.train_model, s.grpo_prompts * s.group, s.micro_batch, s.group, ctx.precision, ctx.args)
    transport = InProcessTransport(local)
    phases = {"generate+reward": [], "train": [], "sync": []}

    def step(i):
        marks = [time.perf_counter()]
        batch = source.generate(i)
        sync(dev)
        marks.append(time.perf_counter())
        t.train(batch.samples)
        sync(dev)
        marks.append(time.perf_counter())
        t.send_weights(transport, i + 1)
        marks.append(time.perf_counter())
        for key, a, b in zip(phases, marks, marks[1:], strict=False):
            phases[key].append(b - a)

    step(0)  # warm-up
    for values in phases.values():
        values.clear()
    counter = iter(range(1, 1000))
    times = ctx.report.runs("miles GRPO step", repeat(lambda: step(next(counter)), ctx.repeats, ctx.clock, dev), "s")
    for key, values in phases.items():
        ctx.report.runs(f"miles GRPO {key}", values, "s")
    ctx.train_model.zero_grad(set_to_none=True)
    return times, phases


def grpo(ctx) -> None:
    dev, s = ctx.device, ctx.sizes
    n = s.grpo_prompts * s.group
    texts = random_texts(s.grpo_prompts * (ctx.repeats + 2), s.prompt_len)
    tokenizer = ctx.tokenizer
    check_tokenizer(tokenizer, "the GRPO section")
    prompt_tokens = statistics.fmean(len(tokenizer(x, add_special_tokens=False)["input_ids"]) for x in texts)
    miles_times, phases = time_miles_grpo(ctx, texts)
    free(dev)
    trl_times = []
    if ctx.clock.over():
        say("  TRL GRPOTrainer: skipped (time limit)")
    else:
        try:
            trl_times = ctx.report.runs("TRL GRPOTrainer step", trl_steps(ctx, texts), "s")
        except Exception as e:
            say(f"  TRL GRPOTrainer: error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    shape = f"{n} completions x {s.new_tokens} tokens, prompts ~{prompt_tokens:.0f} tokens"
    ratio = f"{statistics.median(trl_times) / statistics.median(miles_times):.2f}x" if trl_times else "-"
    ctx.report.row(f"GRPO step s ({shape}; alt: TRL GRPOTrainer)", spread(miles_times, "{:.2f}"),
                   spread(trl_times, "{:.2f}"), ratio)
    phase_text = ", ".join(f"{k} {statistics.median(v):.3g} s" for k, v in phases.items() if v)
    ctx.report.row("GRPO step phases (miles, medians)", phase_text)


def trl_steps(ctx, texts: list[str]) -> list[float]:
    """Seconds of each of TRL GRPOTrainer's optimizer steps after the first (the warm-up)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    dev, s = ctx.device, ctx.sizes
    ends = []

    lengths = set()

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            sync(dev)
            ends.append(time.perf_counter())
            if len(ends) >= 2 and ctx.clock.over():
                say(f"  (time limit: TRL stopped after {len(ends)} steps)")
                control.should_training_stop = True

    def reward(completion_ids, **_):
        lengths.update(len(ids) for ids in completion_ids)
        return [even_share(ids) for ids in completion_ids]

    steps = ctx.repeats + 1
    model = ctx.train_model
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=s.micro_batch,
                          gradient_accumulation_steps=s.grpo_prompts * s.group // s.micro_batch,
                          num_generations=s.group, max_completion_length=s.new_tokens, max_steps=steps,
                          learning_rate=1e-6, beta=0.0, temperature=1.0, top_p=1.0, top_k=0,
                          generation_kwargs={"min_new_tokens": s.new_tokens}, gradient_checkpointing=False,
                          bf16=ctx.precision == "bf16", use_cpu=dev == "cpu", logging_steps=1000, report_to="none",
                          save_strategy="no", disable_tqdm=True, seed=0, shuffle_dataset=False)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=ctx.tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": texts}), callbacks=[StepTimes()])
        start = time.perf_counter()
        trainer.train()
        say(f"  TRL GRPOTrainer: {len(ends)} steps in {time.perf_counter() - start:.1f} s (first is warm-up)")
    if lengths != {s.new_tokens}:
        raise RuntimeError(f"TRL made completions of {sorted(lengths)} tokens, not {s.new_tokens} (EOS should be off)")
    return [b - a for a, b in zip(ends, ends[1:], strict=False)]


def determinism(ctx) -> None:
    s = ctx.sizes
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ctx.model_dir(Path(tmp) / "model")
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": x}) + "\n" for x in random_texts(64, s.prompt_len)))
        common = ["--hf-checkpoint", str(model_dir), "--prompt-data", str(prompts), "--input-key", "prompt",
                  "--custom-rm-path", "miles.testing.rewards:digit_share", "--rollout-batch-size", str(s.grpo_prompts),
                  "--n-samples-per-prompt", str(s.group), "--rollout-max-response-len", str(s.new_tokens),
                  "--rollout-temperature", "1.0", "--micro-batch-size", str(s.micro_batch),
                  "--num-rollout", str(s.det_steps), "--device", ctx.device, "--precision", ctx.precision,
                  "--alignment-check", "off"]
        variants = {"plain": [], "--deterministic-mode": ["--deterministic-mode"],
                    "--deterministic-mode --debug-determinism": ["--deterministic-mode", "--debug-determinism"],
                    "--true-on-policy-mode": ["--true-on-policy-mode"]}
        results = {}
        for k, (name, flags) in enumerate(variants.items()):
            if ctx.clock.left() < 20:
                say(f"  {name}: skipped (time limit)")
                continue
            out = Path(tmp) / name.replace(" ", "_").strip("-")
            argv = [sys.executable, "-m", "miles", "train", *common, *flags, "--output-dir", str(out)]
            timeout = ctx.clock.timeout() and ctx.clock.timeout() / (len(variants) - k)  # an equal share each
            start = time.perf_counter()
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                      env={**os.environ,
                                           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
                if proc.returncode != 0:
                    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()] or proc.stderr.splitlines()
                    say(f"  {name}: miles train exited {proc.returncode}: {lines[-1] if lines else ''}")
                    continue
            except subprocess.TimeoutExpired:  # the steps it finished are in metrics.jsonl
                say(f"  {name}: stopped at its time share ({timeout:.0f} s)")
            metrics = out / "metrics.jsonl"
            rows = [json.loads(ln) for ln in metrics.read_text().splitlines()] if metrics.is_file() else []
            say(f"  {name}: {len(rows)} steps in {time.perf_counter() - start:.0f} s wall (step 1 is warm-up)")
            if len(rows) > 1:
                results[name] = ctx.report.runs(f"miles train step, {name}", [r["perf/step_time_s"] for r in rows[1:]],
                                                "s")
    base = results.get("plain")
    for name, times in results.items():
        cost = f"{100 * (statistics.median(times) / statistics.median(base) - 1):+.0f}% a step" \
            if base and name != "plain" else "-"
        ctx.report.row(f"step s, {name} ({s.grpo_prompts * s.group} x {s.new_tokens}, steps 2..{s.det_steps})",
                       spread(times, "{:.2f}"), spread(base, "{:.2f}") if base and name != "plain" else "-", cost)


def vllm(ctx) -> None:
    """miles' engine vs a vLLM server (started here, eager) on the demo model and prompts."""
    from engines import DEMO_TASK, timed

    from miles.config import SamplingParams
    from miles.data.prompts import load_prompt_data
    from miles.rollout.local import LocalEngine
    from miles.rollout.remote.engine import RemoteEngine
    from miles.rollout.remote.http import ServerClient
    from miles.rollout.remote.launcher import ServerFleet
    from miles.rollout.remote.vllm import VLLMServer
    from miles.rollout.sampling import sample_seed
    from miles.rollout.source import tokenize_prompt
    from miles.utils.models import eos_token_ids, resolve_checkpoint

    if ctx.device != "cpu" or not ctx.vllm_python:
        say("  vllm: needs --device cpu and --vllm-python")
        return
    s, tokenizer, model_dir = ctx.sizes, ctx.tokenizer, resolve_checkpoint(None)
    n = max(s.batches)
    records = load_prompt_data(DEMO_TASK, "prompt", "label").records[:n]
    prompts = [tokenize_prompt(r.prompt, tokenizer, True) for r in records]
    seeds = [sample_seed(42, 0, i) for i in range(n)]
    sampling = SamplingParams(max_new_tokens=s.new_tokens, temperature=1.0, top_p=1.0)
    eos = eos_token_ids(ctx.engine_model, tokenizer)
    local = ctx.report.runs("demo rollout, miles LocalEngine",
                            timed(LocalEngine(ctx.engine_model, eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id),
                                  prompts, sampling, seeds, ctx.repeats), "tok/s")
    with ServerFleet("vllm", str(model_dir), 1, log_dir="/tmp/miles-bench-logs", start_timeout=900, precision="fp32",
                     seed=0, max_model_len=2048, python=ctx.vllm_python, weight_version=0) as fleet:
        server = VLLMServer(ServerClient(fleet.start()[0], flag="vllm", timeout=900, retries=1), eos_token_ids=eos,
                            vocab_size=len(tokenizer))
        remote = ctx.report.runs("demo rollout, vLLM server (eager)",
                                 timed(RemoteEngine([server], concurrency=64), prompts, sampling, seeds, ctx.repeats),
                                 "tok/s")
    ctx.report.row(f"demo rollout tok/s ({n} prompts x {s.new_tokens}, EOS on; alt: vLLM eager)", spread(local),
                   spread(remote), f"{statistics.median(local) / statistics.median(remote):.2f}x")


RUNNERS = {"ceilings": ceilings, "engine": engine, "trainer": trainer, "grpo": grpo,
           "determinism": determinism, "vllm": vllm}


# -- driver ---------------------------------------------------------------------------------------------

class Context:
    """What the sections share: device, sizes, models (built once, on first use), ceilings, report."""

    def __init__(self, args):
        self.args = args
        self.device = args.device
        self.sizes = GPU if args.device == "cuda" else CPU
        if args.batches:
            self.sizes = dataclasses.replace(self.sizes, batches=tuple(int(b) for b in args.batches.split(",")))
        if args.new_tokens:
            self.sizes = dataclasses.replace(self.sizes, new_tokens=args.new_tokens)
        if args.micro_batch:
            self.sizes = dataclasses.replace(self.sizes, micro_batch=args.micro_batch)
        self.precision = "bf16" if args.device == "cuda" else "fp32"
        self.repeats = args.repeats
        self.clock = Clock(args.time_limit)
        self.vllm_python = args.vllm_python
        self.report = Report()
        self.copy_gbs: list[float] = []
        self.matmul_tflops: list[float] = []
        self.device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        self._engine_model = self._train_model = self._tokenizer = None

    @property
    def engine_model(self):  # bf16 on CUDA (the engine's and HF generate's), fp32 on CPU
        if self._engine_model is None:
            self._engine_model = build_model(self.device, torch.bfloat16 if self.device == "cuda" else torch.float32)
        return self._engine_model

    @property
    def train_model(self):  # fp32 master weights (autocast to bf16 on CUDA)
        if self._train_model is None:
            self._train_model = build_model(self.device, torch.float32)
        return self._train_model

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = build_tokenizer(self.device)
        return self._tokenizer

    @property
    def model_shape(self) -> dict:
        c, m = self.engine_model.config, self.engine_model
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        weight_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
        return dict(layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads, head_dim=head_dim,
                    bytes=next(m.parameters()).element_size(), weight_bytes=weight_bytes)

    def model_dir(self, path: Path) -> Path:
        """A model dir `miles train` can load: the demo model's on CPU; on CUDA the random model
        (bf16 safetensors) with the character tokenizer, its encoding checked after loading."""
        from miles.utils.models import load_tokenizer, resolve_checkpoint

        if self.device == "cpu":
            return resolve_checkpoint(None)
        self.engine_model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        check_tokenizer(load_tokenizer(path), str(path))
        return path


def miles_flags(args) -> str:
    """The options of miles' side this run took (they change its figures, so the header says them)."""
    flags = [name for name, on in (("--enable-torch-compile", args.enable_torch_compile),
                                   ("--trainer-torch-compile", args.trainer_torch_compile)) if on]
    if args.max_tokens_per_gpu:
        flags.append(f"--use-dynamic-batch-size --max-tokens-per-gpu {args.max_tokens_per_gpu}")
    return " ".join(flags) or "none"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default="ceilings,engine,trainer,grpo,determinism",
                    help=f"comma-separated sections of {', '.join(SECTIONS)}")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each figure (default: 3)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds; repeats stop and sections are skipped after")
    ap.add_argument("--batches", default=None, help="engine batch sizes (default: 32,128,512 on cuda, 8,32 on cpu)")
    ap.add_argument("--new-tokens", type=int, default=None,
                    help="tokens per response (default: 256 on cuda, 64 on cpu)")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="rows per forward/backward of miles' trainer, the plain loop and TRL's "
                         "per_device_train_batch_size alike (default: 8 on cuda, 4 on cpu)")
    ap.add_argument("--enable-torch-compile", action="store_true",
                    help="the GRPO section's engine with torch.compile'd layer functions (miles train's flag)")
    ap.add_argument("--trainer-torch-compile", action="store_true",
                    help="miles' Trainer (trainer and GRPO sections) with --trainer-torch-compile")
    ap.add_argument("--max-tokens-per-gpu", type=int, default=None,
                    help="miles' Trainer with --use-dynamic-batch-size --max-tokens-per-gpu N (the alternatives keep "
                         "--micro-batch)")
    ap.add_argument("--vllm-python", default=None, help="a vLLM install's Python: adds the vllm section (cpu)")
    args = ap.parse_args()
    sections = [x for x in args.only.split(",") if x]
    unknown = [x for x in sections if x not in SECTIONS]
    if unknown:
        ap.error(f"--only: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available; pass --device cpu")
    if args.vllm_python and "vllm" not in sections:
        sections.append("vllm")
    ctx = Context(args)
    import transformers

    say(f"# speed.py on {ctx.device_name}: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads; sizes {ctx.sizes}; repeats {args.repeats}; "
        f"miles flags: {miles_flags(args)}")
    if sections[0] != "ceilings" and "ceilings" in sections:
        sections.remove("ceilings")
        sections.insert(0, "ceilings")
    for i, name in enumerate(sections):
        if ctx.clock.run_over():
            say(f"\n### {name}: skipped (time limit)")
            continue
        say(f"\n### {name}{ctx.clock.start(name, sections[i:])}")
        start = time.perf_counter()
        try:
            RUNNERS[name](ctx)
        except Exception as e:  # one section failing leaves the others' figures
            say(f"  {name}: error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
            say("  " + traceback.format_exc().strip().splitlines()[-3].strip())
        free(ctx.device)
        say(f"  ({name}: {time.perf_counter() - start:.0f} s)")
        ctx.report.print(f"table so far (after {name})" if name != sections[-1] else "table")


if __name__ == "__main__":
    main()
