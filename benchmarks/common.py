"""Helpers shared by the benchmark scripts: the issue's model shape, `miles train` in process, its metrics, GPU time,
copy bandwidth, matmul throughput."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from miles.cli.main import main

# The speed benchmarks' model: Qwen2.5-0.5B's shape (random weights, built in code on the GPU machine).
QWEN_0_5B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                 rope_theta=1000000.0, rms_norm_eps=1e-6)
# Its dimensions by the names the kernel benchmarks use.
HIDDEN, FFN, VOCAB = QWEN_0_5B["hidden_size"], QWEN_0_5B["intermediate_size"], QWEN_0_5B["vocab_size"]
HEADS, KV_HEADS = QWEN_0_5B["num_attention_heads"], QWEN_0_5B["num_key_value_heads"]
HEAD_DIM = HIDDEN // HEADS


def train(argv: list[str]) -> list[dict]:
    """Runs `miles train ARGV` (which must hold --output-dir) and returns its metrics rows."""
    assert main(["train", *argv]) == 0
    out = Path(argv[argv.index("--output-dir") + 1])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def steady(rows: list[dict], key: str) -> float:
    """Mean of KEY over steps 2.. (step 1 carries one-off warm-up), or over all if there is one."""
    values = [r[key] for r in (rows[1:] if len(rows) > 1 else rows) if key in r]
    return statistics.fmean(values) if values else float("nan")


def gpu_times(fn, repeats: int = 5, calls: int = 20) -> list[float]:
    """Seconds a call of FN on the GPU alone: REPEATS replays of a CUDA graph holding CALLS calls (no launch time)."""
    return graph_times([fn] * calls, repeats)


def graph_times(calls, repeats: int = 5) -> list[float]:
    """Seconds a call, over REPEATS replays of one CUDA graph holding every call in CALLS in turn (each called once
    before the capture)."""
    import torch

    for call in dict.fromkeys(calls):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / len(calls))
    return times


def fastest_seconds(fn, device, runs: int = 5) -> float:
    """The shortest of `runs` timed calls of FN (each waited for on a GPU), after one untimed."""
    import torch

    times = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def copy_bandwidth(device) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (read + write counted; 64 MiB on a CPU)."""
    import torch

    n = (1 << 30) // 4 if device.type == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / fastest_seconds(lambda: b.copy_(a), device)


def matmul_flops(device, dtype) -> float:
    """FLOP/s of an n x n by n x n matmul in `dtype` (n 8192 on a GPU, 1024 on a CPU), the fastest of five."""
    import torch

    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn_like(a)
    return 2 * n ** 3 / fastest_seconds(lambda: a @ b, device)
