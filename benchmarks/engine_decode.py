"""miles' engine decode vs HF `generate`, side by side in one run, on a random model of a real shape.

    python benchmarks/engine_decode.py                      # GPU: Qwen2.5-0.5B shape, bf16
    python benchmarks/engine_decode.py --batch 32 128 512 --repeats 3 --compiled
    python benchmarks/engine_decode.py --device cpu --shape smol --batch 8 32 --new-tokens 64 --prompt-len 64

Workload (the issue's): random prompts of --prompt-len token ids, --new-tokens new tokens each, EOS
off (every row makes every token), temperature 1. Rows, each timed --repeats times after one
warm-up at the same batch (which captures the CUDA graphs):
  miles fast          LocalEngine.generate, the default path (CUDA graphs on a GPU)
  miles fast eager    the same path without CUDA graphs
  miles fast compiled the same path with --enable-torch-compile
  Suffixes of a fast* row, on a GPU: `-sdpa` runs its decode attention in SDPA instead of the Triton kernel of
  miles.rollout.local.decode_attention, `-torchdraw` samples with the torch path instead of the device draw
  (miles.rollout.sampling.DEVICE_DRAW); both: the engine as it was before the two (2026-12-05). `-unfused` runs
  the decode step's pointwise work in the layer functions instead of miles.rollout.local.decode_fused's kernels
  (the engine before 2026-12-05's eleventh session). `-torchadvance` updates each step's slot state and results in
  torch ops instead of miles.rollout.local.advance's kernel (the engine before 2026-12-07). `-unfolded` runs each
  decode layer's two RMSNorms as kernels of their own (the runner's `_fused_layer`) instead of folded into the
  projections after them (`_folded_layer`; the engine before 2026-12-07's twenty-eighth session). `-drained` has
  the host's checks wait for every queued step (miles.rollout.local.batching.LAGGED_CHECKS off; the engine before
  2026-12-07's twenty-ninth session) instead of reading the done flags copied before the last one.
  miles hf            LocalEngine's HF-forward path (the reference decode loop)
  HF generate         model.generate(do_sample=True), dynamic cache
  HF static compiled  model.generate(cache_implementation="static"), which transformers compiles (--compiled)
tok/s counts generated tokens; "bound" is the decode bandwidth bound at that batch: the weights
plus the mean KV read per step, at the copy bandwidth measured in the same run (the issue's measure; it leaves out
the prefill and the matmuls). "roofline" adds them: the prefill at the bf16 matmul throughput measured in the same
run (an 8192^3 matmul), each decode step at the slower of its reads and its matmuls (`roofline`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import QWEN_0_5B, copy_bandwidth, matmul_flops
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from miles.config import SamplingParams
from miles.rollout.local import LocalEngine
from miles.rollout.local import batching as batching_module
from miles.rollout.local import engine as engine_module
from miles.rollout import sampling as sampling_module
from miles.rollout.local.runner import ModelRunner

SHAPES = {
    "qwen2.5-0.5b": lambda: Qwen2Config(**QWEN_0_5B),
    "smol": lambda: LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                                tie_word_embeddings=True),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int, device) -> list[float]:
    fn()  # warm-up at this batch
    out = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        made = fn()
        sync(device)
        out.append(made / (time.perf_counter() - start))
    return out


def roofline(model, config, batch: int, prompt_len: int, new_tokens: int, weights: int, kv_per_token: int,
             bandwidth: float, flops: float) -> float:
    """tok/s if each phase of a generate ran at the slower of its two ceilings: the prefill's matmuls (the layers' for
    every prompt token, attention's causal scores and sums, the LM head for the last one) at the matmul ceiling `flops`;
    each decode step at the larger of its reads (the `weights` bytes and `kv_per_token` bytes of each cached token,
    at `bandwidth`) and its matmuls (the layers', attention over the step's context, the LM head, at `flops`)."""
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    layer_params = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    head_params = model.lm_head.weight.numel()
    attention = 4 * layers * heads * (config.hidden_size // heads)  # FLOP a query spends on each key it sees
    seconds = batch * (2 * layer_params * prompt_len + attention * prompt_len * (prompt_len + 1) / 2
                       + 2 * head_params) / flops
    for t in range(1, new_tokens):  # the first token comes from the prefill; each step feeds the last one
        seen = prompt_len + t
        reads = weights + batch * seen * kv_per_token
        work = batch * (2 * layer_params + 2 * head_params + attention * seen)
        seconds += max(reads / bandwidth, work / flops)
    return batch * new_tokens / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=list(SHAPES))
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on a GPU, fp32 on a CPU")
    p.add_argument("--batch", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prefill-tokens", type=int, default=None,
                   help="the fast engine's packed prompt tokens per prefill forward (default: the engine's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default="fast,fast-eager,hf-generate",
                   help="fast,fast-eager,fast-compiled,miles-hf,hf-generate,hf-static-compiled; fast* rows also with "
                        "-sdpa, -torchdraw, -unfused, -torchadvance, -unfolded, -drained")
    p.add_argument("--profile", type=int, default=0, metavar="B",
                   help="profile one fast-eager generate at batch B first: top CUDA kernels")
    p.add_argument("--profile-compiled", action="store_true",
                   help="--profile's engines with torch.compile'd layer functions (--enable-torch-compile)")
    p.add_argument("--compiled", action="store_true", help="add HF generate with a static cache under torch.compile")
    args = p.parse_args()
    device = torch.device(args.device)
    if args.prefill_tokens:
        engine_module.PREFILL_TOKENS[device.type] = args.prefill_tokens
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    torch.manual_seed(0)
    config = SHAPES[args.shape]()
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    bandwidth, flops = copy_bandwidth(device), matmul_flops(device, dtype)
    kv_per_token = (2 * config.num_hidden_layers * config.num_key_value_heads
                    * (config.hidden_size // config.num_attention_heads) * dtype.itemsize)
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"{args.shape} ({sum(t.numel() for t in model.parameters()) / 1e6:.0f}M params, {dtype}) on {name}; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, matmul {flops / 1e12:.3g} TFLOP/s; prompts {args.prompt_len}, "
          f"new tokens {args.new_tokens}, EOS off; {args.repeats} timed runs each (median [min, max] tok/s)",
          flush=True)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0)
    engines = {"fast": dict(decoder="fast"), "fast-eager": dict(decoder="fast", cuda_graphs=False),
               "fast-compiled": dict(decoder="fast", compile=True), "miles-hf": dict(decoder="hf")}
    rows = [r for r in args.rows.split(",") if r]
    if args.compiled:
        rows.append("hf-static-compiled")
    results: dict[tuple[str, int], list[float]] = {}
    if args.profile:
        profile(model, config, args, sampling)
    for batch in args.batch:
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, config.vocab_size, (batch, args.prompt_len), generator=gen)
        seeds = list(range(batch))
        mean_len = args.prompt_len + args.new_tokens / 2
        bound = batch * bandwidth / (weights + batch * mean_len * kv_per_token)
        ceiling = roofline(model, config, batch, args.prompt_len, args.new_tokens, weights, kv_per_token, bandwidth,
                           flops)
        for row in rows:
            try:
                kind = row
                for suffix in ("-drained", "-unfolded", "-torchadvance", "-unfused", "-torchdraw", "-sdpa"):
                    kind = kind.removesuffix(suffix)
                if kind in engines:
                    ModelRunner.triton_decode = "-sdpa" not in row  # the three read at every decode step
                    ModelRunner.fused_decode = "-unfused" not in row
                    ModelRunner.fold_norms = "-unfolded" not in row
                    sampling_module.DEVICE_DRAW = "-torchdraw" not in row
                    batching_module.FUSED_ADVANCE = "-torchadvance" not in row
                    batching_module.LAGGED_CHECKS = "-drained" not in row
                    engine = LocalEngine(model, eos_token_ids=[], pad_token_id=0, **engines[kind])
                    fn = lambda: sum(len(o.token_ids) for o in engine.generate(prompts.tolist(), sampling, seeds))  # noqa: E731
                else:
                    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens)
                    if row == "hf-static-compiled":  # transformers compiles the forward for a static cache itself
                        kw.update(cache_implementation="static")
                    ids = prompts.to(device)
                    mask = torch.ones_like(ids)
                    fn = lambda: int(model.generate(input_ids=ids, attention_mask=mask, **kw)[:, ids.shape[1]:].numel())  # noqa: E731
                rates = timed(fn, args.repeats, device)
            except Exception as e:  # one row failing must not lose the others
                print(f"batch {batch:4} | {row:20} | error: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                      flush=True)
                continue
            results[(row, batch)] = rates
            base = results.get(("hf-generate", batch))
            ratio = f"{statistics.median(rates) / statistics.median(base):6.2f}x HF" if base else ""
            print(f"batch {batch:4} | {row:20} | {statistics.median(rates):9.0f} [{min(rates):.0f}, {max(rates):.0f}] "
                  f"| {100 * statistics.median(rates) / bound:5.1f}% of bound {bound:.0f} "
                  f"| {100 * statistics.median(rates) / ceiling:5.1f}% of roofline {ceiling:.0f} | {ratio}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print("ratios to HF generate (median / median; every run's min over HF's max in brackets):")
    for batch in args.batch:
        base = results.get(("hf-generate", batch))
        for row in rows:
            got = results.get((row, batch))
            if base and got and row != "hf-generate":
                print(f"  batch {batch:4} {row:20} {statistics.median(got) / statistics.median(base):6.2f}x "
                      f"[worst {min(got) / max(base):.2f}x]")


def profile(model, config, args, sampling) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batch = args.profile
    prompts = torch.randint(0, config.vocab_size, (batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    for graphs in (False, True):
        engine = LocalEngine(model, eos_token_ids=[], pad_token_id=0, cuda_graphs=graphs,
                             compile=args.profile_compiled)
        engine.generate(prompts.tolist(), sampling, list(range(batch)))
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts.tolist(), sampling, list(range(batch)))
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / 1e6
        launches = sum(e.count for e in events if e.device_type.name == "CUDA")
        print(f"profile batch {batch}, graphs {graphs}, compiled {args.profile_compiled}: wall {wall:.3f} s "
              f"(profiled), GPU busy {gpu:.3f} s, {launches} kernels", flush=True)
        print(events.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60), flush=True)
        print(idle_gaps(prof), flush=True)


def idle_gaps(prof) -> str:
    """Where the GPU waited in a profiled call: the gaps between its kernels (us), summed by size, and the largest
    with their offset from the first kernel: a gap every few steps is the host's check, a long one its work. For the
    three largest, the host's recorded ops (aten ops, CUDA runtime calls) that overlap them most: none recorded means
    Python between ops."""
    events = prof.events()
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA")
    if not spans:
        return "no GPU kernels recorded"
    gaps, end = [], spans[0][1]
    for start, stop in spans[1:]:
        if start > end:
            gaps.append((start - end, end, start))
        end = max(end, stop)
    first = spans[0][0]
    by_size = {f">{lo} us": sum(g for g, _, _ in gaps if g > lo) / 1e3 for lo in (5, 50, 500)}
    largest = sorted(gaps, reverse=True)
    listed = ", ".join(f"{g / 1e3:.2f} ms at {(at - first) / 1e3:.1f} ms" for g, at, _ in largest[:10])
    host = [(e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type.name == "CPU"]
    lines = []
    for g, at, until in largest[:3]:
        overlaps = sorted(((min(stop, until) - max(start, at), name) for start, stop, name in host
                           if start < until and stop > at), reverse=True)[:5]
        ops = ", ".join(f"{name[:40]} {o / 1e3:.2f} ms" for o, name in overlaps) or "none recorded"
        lines.append(f"  the {g / 1e3:.2f} ms gap at {(at - first) / 1e3:.1f} ms overlaps host ops: {ops}")
    idle = sum(g for g, _, _ in gaps)
    return "\n".join([f"GPU idle between kernels: {idle / 1e3:.1f} ms of {(end - first) / 1e3:.1f} ms; in gaps "
                      f"{', '.join(f'{k}: {v:.1f} ms' for k, v in by_size.items())}; largest: {listed}", *lines])


if __name__ == "__main__":
    main()
