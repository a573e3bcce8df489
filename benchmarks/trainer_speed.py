"""Trainer throughput, side by side in one run: miles' former log-prob path, the chunked path padded
(--qkv-format bshd) and packed (thd, the default), with --gradient-checkpointing, and a plain
PyTorch fwd+bwd+AdamW loop on the same model and tokens.

    python benchmarks/trainer_speed.py                       # GPU: Qwen2.5-0.5B shape, 64 x 384, mbs 8
    python benchmarks/trainer_speed.py --device cpu --shape tiny --samples 16 --seq 96 --prompt 32 --micro-batch 4
    python benchmarks/trainer_speed.py --ragged              # responses of 1..R tokens: where packing pays

Random weights (seeded), fp32 master weights under bf16 autocast on CUDA (fp32 on CPU), as
`Trainer.train` runs them; prompts of --prompt tokens, responses of --seq - --prompt (EOS off).
Each variant runs in its own process (so its peak memory is its own): one warm-up `train` call,
then --steps timed ones. Columns: tok/s (real tokens per second), TFLOP/s and MFU of model FLOPs
(miles: 8N per token, scoring forward 2N + training fwd/bwd 6N; the plain loop: 6N; N = parameters
but the untied input embedding; MFU against --peak-tflops, 989 = H100/H200 dense bf16), peak GiB
(CUDA: max_memory_allocated over the timed steps; CPU: the process's peak RSS, model included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from common import QWEN_0_5B

SHAPES = {  # Qwen2.5-0.5B, and a tiny one for a CPU
    "qwen0.5b": QWEN_0_5B,
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=4096, tie_word_embeddings=True, max_position_embeddings=4096),
}
VARIANTS = {  # name -> Trainer layout (dict), or the plain loop's (weights, micro-batch or None: --micro-batch)
    "miles former: full logits padded": dict(qkv_format="bshd", log_probs_chunk_size=-1, former=True),
    "miles chunked: padded (bshd)": dict(qkv_format="bshd"),
    "miles chunked: packed (thd)": dict(qkv_format="thd"),
    "miles packed + grad ckpt": dict(qkv_format="thd", gradient_checkpointing=True),
    # --use-dynamic-batch-size: micro-batches of a token budget (bshd counts the padded grid)
    "miles dynamic 12k tokens: bshd": dict(qkv_format="bshd", max_tokens_per_gpu=12288),
    "miles dynamic 24k tokens: bshd": dict(qkv_format="bshd", max_tokens_per_gpu=24576),
    "miles dynamic 24k tokens: thd": dict(qkv_format="thd", max_tokens_per_gpu=24576),
    # --trainer-torch-compile: each decoder layer and the log-prob chunks through torch.compile
    "miles dynamic 24k tokens: thd compiled": dict(qkv_format="thd", max_tokens_per_gpu=24576, torch_compile=True),
    # the packed sequences' attention as one padded SDPA (scatter, SDPA, gather) instead of varlen_attn
    "miles dynamic 24k tokens: thd padded-sdpa": dict(qkv_format="thd", max_tokens_per_gpu=24576, kernel="padded"),
    # --deterministic-mode (strict deterministic algorithms and flash's deterministic backward in the
    # trainer) as it is, and with CUBLAS_WORKSPACE_CONFIG=:4096:8 set at launch and left set (4 MiB cuBLAS
    # workspaces, and torch parsing the variable at every GEMM: benchmarks/cublas_env.py)
    "miles bshd: deterministic mode": dict(qkv_format="bshd", deterministic=True),
    "miles bshd: deterministic mode + 4 MiB cuBLAS workspace": dict(
        qkv_format="bshd", deterministic=True, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    "miles bshd: 4 MiB cuBLAS workspace": dict(qkv_format="bshd", env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    # the same with --trainer-torch-compile, which the mode allows (Inductor in its deterministic setting)
    "miles bshd compiled": dict(qkv_format="bshd", torch_compile=True),
    "miles bshd compiled: deterministic mode": dict(qkv_format="bshd", torch_compile=True, deterministic=True),
    # the mode on the default packed layout: varlen_attn, its flash backward strict (deterministic)
    "miles thd: deterministic mode": dict(qkv_format="thd", deterministic=True),
    "miles thd compiled": dict(qkv_format="thd", torch_compile=True),
    "miles thd compiled: deterministic mode": dict(qkv_format="thd", torch_compile=True, deterministic=True),
    "plain PyTorch: autocast fp32 master": ("autocast", None),
    "plain PyTorch: bf16 weights": ("bf16", None),
    "plain PyTorch: autocast 24k tokens": ("autocast", 64),
}


def former_response_log_probs(model, batch, temperature, *, with_entropy=False, with_logits=False, **_layout):
    """miles' log-prob path before chunking: fp32 logits (B, L-1, V) of every position."""
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=position_ids).logits[:, :-1].float()
    logits = logits / temperature if temperature > 0 else logits
    log_z = logits.logsumexp(-1)
    token_logp = logits.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1) - log_z
    log_probs = token_logp.gather(1, batch.response_positions)
    if not with_entropy:
        return log_probs, None
    with torch.no_grad():
        entropy = log_z - ((logits - log_z[..., None]).exp() * logits).sum(-1)
    return log_probs, entropy.gather(1, batch.response_positions)


def make_model(args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[args.shape], attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).to(args.device)


def make_samples(args, vocab: int):
    from miles.bridge.types import Sample

    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(args.samples):
        r = args.seq - args.prompt
        if args.ragged:
            r = int(torch.randint(1, r + 1, (1,), generator=g))
        tokens = torch.randint(3, vocab, (args.prompt + r,), generator=g).tolist()
        out.append(Sample(group_index=i // 8, index=i, prompt="", tokens=tokens, response_length=r,
                          loss_mask=[1] * r, reward=float(i % 3)))
    return out


def run_miles(args, layout: dict, model, samples):
    from miles.config import TrainConfig
    from miles.train import batch as batch_module
    from miles.train import trainer as trainer_module

    if layout.pop("former", False):
        batch_module.response_log_probs = trainer_module.response_log_probs = former_response_log_probs
    layout.pop("env", None)  # the parent set it for this process
    layout.pop("deterministic", None)  # one_variant enabled the mode
    if layout.pop("kernel", None) == "padded":
        from miles.train import attention
        from miles.utils import varlen

        attention.packed_causal_attention = varlen.padded_causal_attention
    cfg = TrainConfig(num_steps_per_rollout=1, global_batch_size=len(samples), micro_batch_size=args.micro_batch,
                      lr=1e-6, weight_decay=0.0, clip_grad=1.0, advantage_estimator="grpo", eps_clip=0.2,
                      eps_clip_high=0.2, kl_coef=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1",
                      use_tis=False, tis_clip=2.0, calculate_per_token_loss=False, **layout)
    trainer = trainer_module.Trainer(cfg, model, None, temperature=1.0, group_size=8, pad_token_id=0,
                                     precision=args.precision)
    return lambda: trainer.train(samples), 8


def run_plain(args, spec: tuple[str, int | None], model, samples):
    """fwd + bwd (next-token cross-entropy on the padded micro-batch) + AdamW, one step per rollout."""
    import contextlib

    weights, micro_batch = spec
    micro_batch = micro_batch or args.micro_batch
    if weights == "bf16":
        model = model.to(torch.bfloat16)
    autocast = (torch.autocast(args.device, dtype=torch.bfloat16) if args.precision == "bf16" and weights != "bf16"
                else contextlib.nullcontext())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.full((len(samples), args.seq), 0, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s.tokens)] = torch.tensor(s.tokens)
    ids = ids.to(args.device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(samples), micro_batch):
            mb = ids[start:start + micro_batch]
            with autocast:
                logits = model(input_ids=mb).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), mb[:, 1:].flatten())
            loss.backward()
        optimizer.step()

    return step, 6


def one_variant(args) -> dict:
    from miles.train.meter import matmul_parameters

    spec = VARIANTS[args.variant]
    if isinstance(spec, dict) and spec.get("deterministic"):  # before the first cuBLAS handle, as `miles train`
        from miles.debug.determinism import enable_deterministic_mode

        enable_deterministic_mode(0, args.device, "sdpa")
    model = make_model(args)
    samples = make_samples(args, model.config.vocab_size)
    n_params = matmul_parameters(model)
    step, flops_per_param = (run_miles(args, dict(spec), model, samples) if isinstance(spec, dict)
                             else run_plain(args, spec, model, samples))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    step()  # warm-up
    sync()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    if args.profile:  # one more step under the profiler: its top ops by device time, to stderr
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with profile(activities=acts, record_shapes=True) as prof:
            step()
            sync()
        key = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=args.profile), file=sys.stderr)
        print(prof.key_averages().table(sort_by="count", row_limit=args.profile),  # what a launch-bound step launches
              file=sys.stderr)
        print(prof.key_averages(group_by_input_shape=True).table(  # which tensors the top ops ran on
            sort_by=key, row_limit=args.profile, max_name_column_width=28, max_shapes_column_width=90),
            file=sys.stderr)
    tokens = sum(len(s.tokens) for s in samples)
    seconds = statistics.median(times)
    peak = (torch.cuda.max_memory_allocated() if args.device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
    tflops = flops_per_param * n_params * tokens / seconds / 1e12
    from miles.utils.digest import named_tensors_digest16

    weights = named_tensors_digest16(model.named_parameters())  # equal in two processes: a bitwise repeat
    return {"tok_s": tokens / seconds, "tflops": tflops, "step_s": seconds, "peak_gib": peak, "params": n_params,
            "weights": weights}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=SHAPES, default="qwen0.5b")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq", type=int, default=384, help="tokens per sample (prompt + response)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ragged", action="store_true", help="response lengths uniform in 1..seq-prompt")
    ap.add_argument("--peak-tflops", type=float, default=None, help="for MFU (default: 989 on CUDA)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the names")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed steps, profile one more and print its top N ops by device time")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in this process (the parent's child)
    args = ap.parse_args()
    args.precision = "bf16" if args.device == "cuda" else "fp32"
    if args.variant:
        print(json.dumps(one_variant(args)))
        return
    peak = args.peak_tflops or (989.0 if args.device == "cuda" else None)
    base, argv = [], sys.argv[1:]  # this command's flags but --variants, for each variant's process
    for i, a in enumerate(argv):
        if not (a.startswith("--variants") or (i and argv[i - 1] == "--variants")):
            base.append(a)
    print(f"{args.device} {args.precision}, shape {args.shape}, {args.samples} x {args.seq} tokens "
          f"({'ragged responses' if args.ragged else f'prompt {args.prompt}'}), micro-batch {args.micro_batch}, "
          f"median of {args.steps} steps after 1 warm-up")
    print(f"{'variant':56}{'tok/s':>10}{'TFLOP/s':>10}{'MFU':>8}{'step s':>9}{'peak GiB':>10}  weights after")
    r = None
    for name in args.variants.split(","):
        spec = VARIANTS[name]
        env = {**os.environ, **(spec.get("env", {}) if isinstance(spec, dict) else {})}
        proc = subprocess.run([sys.executable, __file__, *base, "--variant", name], capture_output=True, text=True,
                              env=env)
        if args.profile:
            print(f"-- {name}: profile of one step\n{proc.stderr}")
        if proc.returncode:
            print(f"{name:56} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:120]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        mfu = f"{r['tflops'] / peak:.1%}" if peak else "-"
        print(f"{name:56}{r['tok_s']:>10.0f}{r['tflops']:>10.2f}{mfu:>8}{r['step_s']:>9.3f}{r['peak_gib']:>10.2f}"
              f"  {r['weights'][:12]}")
    if r:
        print(f"N = {r['params'] / 1e6:.1f}M parameters in matmuls")


if __name__ == "__main__":
    main()
