"""Load test of `miles serve`: N concurrent clients on loopback, next to LocalEngine.generate in
process on the same workload.

    python benchmarks/serve_load.py                           # the demo model if cached, else a tiny one
    python benchmarks/serve_load.py --clients 16 --requests 64 --max-new-tokens 48 --repeats 3
    python benchmarks/serve_load.py --hf-checkpoint DIR --cpu-threads 2

Workload: R requests, each one sequence: the bundled arithmetic prompts in the model's chat template
(when it has one), max_new_tokens T, temperature 1, `sampling_seed` = sample_seed(seed, 0, i) for
request i. C clients (asyncio + httpx) send them back to back, so at most C are in flight.
In process, LocalEngine.generate runs the same prompts with the same seeds in batches of C (the
same concurrency, static batching): the same seeds make the same sequences, so both sides make
the same tokens (the script checks the totals).

Per repeat: wall time, generated tokens/s, p50/p99 request latency, failed requests (non-200 or
aborted; must be 0), the server's RSS before the load, at its peak, and after. Printed as a
markdown table of the median and [min, max] over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil


def workload(tokenizer, n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """n prompt token lists (the bundled task, cycled) and their per-request seeds."""
    from miles.data.prompts import BUNDLED_TASK
    from miles.rollout.sampling import sample_seed

    rows = [json.loads(line)["prompt"] for line in BUNDLED_TASK.read_text().splitlines() if line.strip()]
    chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = []
    for i in range(n):
        text = rows[i % len(rows)]
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=not chat)["input_ids"])
    return prompts, [sample_seed(seed, 0, i) for i in range(n)]


class Server:
    """`miles serve` in a subprocess on a free loopback port."""

    def __init__(self, model: str, extra: list[str]):
        command = [sys.executable, "-m", "miles", "serve", "--hf-checkpoint", model, "--port", "0", *extra]
        self.log = tempfile.NamedTemporaryFile(prefix="miles-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        if "ready on http://" not in line:
            self.proc.kill()
            raise SystemExit(f"miles serve did not start; log: {self.log.name}")
        self.url = line.split("ready on ")[1].split()[0]
        self.ps = psutil.Process(self.proc.pid)

    def rss_mib(self) -> float:
        return self.ps.memory_info().rss / 2**20

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class PeakRSS:
    """Samples a process's RSS every 0.1 s while the load runs."""

    def __init__(self, server: Server):
        self.server, self.peak, self._stop = server, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.server.rss_mib())
            time.sleep(0.1)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


async def run_clients(url: str, prompts, seeds, clients: int, max_new_tokens: int) -> dict:
    """C clients draining one queue of requests; per-request latency, tokens and failures."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    latencies, tokens, failures = [], [0] * len(prompts), []

    async def client(session: httpx.AsyncClient):
        while not queue.empty():
            i = queue.get_nowait()
            body = {"input_ids": prompts[i], "return_logprob": True, "sampling_params": {
                "max_new_tokens": max_new_tokens, "temperature": 1.0, "sampling_seed": seeds[i]}}
            start = time.perf_counter()
            try:
                r = await session.post(url + "/generate", json=body)
                out = r.json()
                if r.status_code != 200 or out["meta_info"]["finish_reason"]["type"] == "abort":
                    failures.append(f"{r.status_code}: {r.text[:120]}")
                else:
                    tokens[i] = len(out["output_ids"])
            except (httpx.HTTPError, ValueError, KeyError) as e:
                failures.append(repr(e))
            latencies.append(time.perf_counter() - start)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=None, limits=limits) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        wall = time.perf_counter() - start
    latencies.sort()
    return {"wall_s": wall, "tokens": sum(tokens), "tok_s": sum(tokens) / wall, "failed": len(failures),
            "p50_s": latencies[len(latencies) // 2], "p99_s": latencies[min(len(latencies) - 1,
                                                                            int(0.99 * len(latencies)))],
            "failures": failures[:3]}


def run_local(model: str, prompts, seeds, clients: int, max_new_tokens: int, repeats: int, *, device: str,
              precision: str) -> list[dict]:
    """LocalEngine.generate in process: the same prompts and seeds, batches of `clients`."""
    import torch

    from miles.config import SamplingParams
    from miles.rollout.local import LocalEngine
    from miles.utils.models import eos_token_ids, load_causal_lm, load_tokenizer

    tok = load_tokenizer(model)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    lm = load_causal_lm(model, device=device, attention_backend="sdpa", dtype=dtype)
    engine = LocalEngine(lm, eos_token_ids=eos_token_ids(lm, tok), pad_token_id=tok.pad_token_id)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0)
    engine.generate(prompts[:2], sampling, seeds[:2])  # warm-up
    results = []
    for _ in range(repeats):
        start, made, latencies = time.perf_counter(), 0, []
        for b in range(0, len(prompts), clients):
            batch_start = time.perf_counter()
            outs = engine.generate(prompts[b:b + clients], sampling, seeds[b:b + clients])
            made += sum(len(o.token_ids) for o in outs)
            latencies += [time.perf_counter() - batch_start] * len(outs)  # a batch's sequences end together
        wall = time.perf_counter() - start
        latencies.sort()
        results.append({"wall_s": wall, "tokens": made, "tok_s": made / wall, "failed": 0,
                        "p50_s": latencies[len(latencies) // 2],
                        "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]})
    return results


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def default_model() -> str:
    from miles.utils.models import DEMO_MODEL_NAME, cache_dir

    demo = cache_dir() / "models" / DEMO_MODEL_NAME
    if (demo / "config.json").is_file():
        return str(demo)
    from miles.testing.tiny import build_model_dir

    print("(the demo model is not cached: using a tiny random model)", file=sys.stderr)
    return str(build_model_dir(Path(tempfile.mkdtemp(prefix="miles-tiny-"))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-checkpoint", default=None, help="(default: the demo model if cached, else a tiny model)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--cpu-threads", type=int, default=None, help="torch threads, for the server and in process")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--skip-local", action="store_true", help="the server only")
    args = ap.parse_args()

    import torch

    from miles.utils.models import load_tokenizer, quiet_transformers

    quiet_transformers()
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    model = args.hf_checkpoint or default_model()
    prompts, seeds = workload(load_tokenizer(model), args.requests, args.seed)
    extra = ["--max-running-requests", str(args.clients), "--device", args.device, "--precision", args.precision]
    if args.cpu_threads:
        extra += ["--cpu-threads", str(args.cpu_threads)]
    server = Server(model, extra)
    served = []
    try:
        asyncio.run(run_clients(server.url, prompts[:2], seeds[:2], 2, 4))  # warm-up
        rss_before = server.rss_mib()
        for _ in range(args.repeats):
            with PeakRSS(server) as peak:
                result = asyncio.run(run_clients(server.url, prompts, seeds, args.clients, args.max_new_tokens))
            served.append({**result, "rss_peak_mib": peak.peak})
        rss_after = server.rss_mib()
        stats = httpx.get(server.url + "/get_server_info").json()
    finally:
        server.stop()
    local = [] if args.skip_local else run_local(model, prompts, seeds, args.clients, args.max_new_tokens,
                                                 args.repeats, device=args.device, precision=args.precision)

    print(f"model {model} ({args.device} {args.precision}); {args.requests} requests x max {args.max_new_tokens} "
          f"new tokens, temperature 1, {args.clients} clients; {args.repeats} repeats, median [min, max]; torch "
          f"threads {args.cpu_threads or torch.get_num_threads()}")
    print("\n| | miles serve | LocalEngine.generate (batches of %d) |\n|---|---|---|" % args.clients)
    rows = [("generated tokens/s", "tok_s", ".1f"), ("wall time (s)", "wall_s", ".2f"),
            ("p50 request latency (s)", "p50_s", ".2f"), ("p99 request latency (s)", "p99_s", ".2f"),
            ("tokens generated", "tokens", ".0f"), ("failed requests", "failed", ".0f")]
    for label, key, fmt in rows:
        right = spread([r[key] for r in local], fmt) if local else "-"
        print(f"| {label} | {spread([r[key] for r in served], fmt)} | {right} |")
    print(f"| server RSS (MiB) before / peak / after | {rss_before:.0f} / "
          f"{max(r['rss_peak_mib'] for r in served):.0f} / {rss_after:.0f} | |")
    print(f"\nserver: max batch {stats['max_batch_size']}, sequences that joined a running batch "
          f"{stats['joined_running_batch']}, decode steps {stats['steps']}, prefill forwards "
          f"{stats['prefill_batches']}")
    failures = [f for r in served for f in r["failures"]]
    if failures:
        print("failures:", failures)
    if local and {r["tokens"] for r in served} != {r["tokens"] for r in local}:
        print("note: the two sides made different token totals (floating-point noise flipped a draw)")


if __name__ == "__main__":
    main()
