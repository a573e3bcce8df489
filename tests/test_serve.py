"""`miles serve` as a real subprocess on the tiny model: every endpoint's shape against SGLang's,
determinism against LocalEngine in process, continuous batching, pause modes, weight updates from
disk, memory release and resume (and --mem-fraction-static; on CUDA with the `gpu` marker), the
API key, and malformed requests (hand-picked and fuzzed) that get a 4xx while the server
keeps serving. One server per purpose, shared by the module: `server` (open, loopback) for
generation, `keyed` (--api-key, small limits) for auth, limits and weight updates."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles.config import SamplingParams
from miles.rollout.local import LocalEngine
from miles.rollout.sampling import sample_seed
from miles.utils.digest import tensor_bytes_sha256
from miles.utils.models import eos_token_ids, load_causal_lm, load_tokenizer

PACKAGE = Path(__file__).resolve().parents[1] / "miles"
KEY = "test-key-123"
VOCAB = 100  # the tiny tokenizer's
EOS = 3  # <|im_end|>


class ServeProcess:
    """`python -m miles serve ... --port 0`, up once its ready line names the port."""

    def __init__(self, *args: str, log: Path):
        self.log = log
        # One thread: the test machine runs other work too, and spinning OpenMP threads slow a tiny model 10x.
        command = [sys.executable, "-m", "miles", "serve", *args, "--port", "0", "--cpu-threads", "1"]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True)
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=180)
        line = ready[0] if ready else ""
        if "ready on http://" not in line:
            self.stop()
            raise RuntimeError(f"miles serve did not start: {line!r}; log: {log.read_text()[-2000:]}")
        self.ready_line = line.strip()
        self.url = line.split("ready on ")[1].split()[0]

    def stop(self, sig=signal.SIGTERM, timeout=20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    s = ServeProcess("--hf-checkpoint", str(tiny_model), log=tmp_path_factory.mktemp("serve") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed(tiny_model, tmp_path_factory):
    s = ServeProcess("--hf-checkpoint", str(tiny_model), "--api-key", KEY, "--max-running-requests", "3",
                     "--max-total-tokens", "400", "--max-queued-requests", "8",
                     "--weight-version", "0",
                     log=tmp_path_factory.mktemp("serve") / "keyed.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def small(tiny_model, tmp_path_factory):
    """A 40-token KV budget: fuzzed requests that pass validation stay short. (--mem-fraction-static:
    logged as ignored on a CPU.)"""
    s = ServeProcess("--hf-checkpoint", str(tiny_model), "--max-total-tokens", "40", "--mem-fraction-static", "0.5",
                     log=tmp_path_factory.mktemp("serve") / "small.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(tiny_model):
    """The same checkpoint in process: the reference the server must match."""
    tok = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    return LocalEngine(model, eos_token_ids=eos_token_ids(model, tok), pad_token_id=tok.pad_token_id), tok


def post(s: ServeProcess, path: str, body=None, *, key: str | None = None, timeout=120, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(s.url + path, json=body, headers=headers, timeout=timeout, **kw)


def get(s: ServeProcess, path: str, *, key: str | None = None) -> httpx.Response:
    return httpx.get(s.url + path, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60)


def gen(s: ServeProcess, body: dict, key: str | None = None):
    r = post(s, "/generate", body, key=key)
    assert r.status_code == 200, r.text
    return r.json()


def info(s: ServeProcess, key: str | None = None) -> dict:
    return get(s, "/get_server_info", key=key).json()


def wait_until(predicate, timeout=30.0, every=0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(every)
    raise AssertionError("condition not reached in time")


def long_body(rid: str, tokens: int = 450, seed: int = 1) -> dict:
    return {"input_ids": [10, 11, 12], "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "sampling_seed": seed}}


def in_background(fn, *args, **kwargs):
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


def start_running(s: ServeProcess, body: dict, key=None, n=1):
    """Sends `body` in the background; returns (its future) once its n sequences decode. The server
    is paused in place while the request queues, so on continue they start at once and a poll
    cannot miss them on a busy machine."""
    post(s, "/pause_generation", {"mode": "in_place"}, key=key)
    future = in_background(gen, s, body, key)
    try:
        wait_until(lambda: info(s, key)["num_waiting_reqs"] >= n)
    finally:
        post(s, "/continue_generation", {}, key=key)
    wait_until(lambda: info(s, key)["num_running_reqs"] >= n or future.done())
    assert not future.done(), "the request finished before it could be observed running"
    return future


def check_response_shape(item: dict, *, logprobs: bool, text_in_logprobs: bool = False):
    """SGLang's non-streaming /generate object (io_struct, tokenizer_manager._handle_batch_output)."""
    assert set(item) >= {"text", "output_ids", "meta_info"} and isinstance(item["text"], str)
    ids, meta = item["output_ids"], item["meta_info"]
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    for key, kind in (("id", str), ("finish_reason", dict), ("prompt_tokens", int), ("completion_tokens", int),
                      ("cached_tokens", int), ("weight_version", str), ("e2e_latency", float)):
        assert isinstance(meta[key], kind), (key, meta)
    assert meta["completion_tokens"] == len(ids)
    reason = meta["finish_reason"]
    assert reason["type"] in ("stop", "length", "abort")
    if reason["type"] == "length":
        assert reason == {"type": "length", "length": len(ids)}
    elif reason["type"] == "stop":
        assert set(reason) == {"type", "matched"} and isinstance(reason["matched"], (int, str))
    if logprobs:
        triples = meta["output_token_logprobs"]
        assert [t[1] for t in triples] == ids  # 1:1 with the tokens, EOS included
        for lp, tok, text in triples:
            assert isinstance(lp, float) and lp <= 0 and isinstance(tok, int)
            assert isinstance(text, str) if text_in_logprobs else text is None
        assert isinstance(meta["input_token_logprobs"], list)
    else:
        assert "output_token_logprobs" not in meta


# -- in process: the batch's cache arithmetic, the parser -----------------------------------------


@pytest.mark.parametrize("kind", ["hf cache", "slots"])
def test_running_batch_merge_step_and_drop_match_each_sequence_alone(engine, kind):
    """Rows prefilled at different times, merged (hf: left-padded; slots: into free slots, the cache
    grown for the longer newcomer), stepped together and dropped (slots: the high row moves down)
    give each row the logits its own uncached forward gives."""
    from miles.serve.batch import RunningBatch, SlotBatch

    local, tok = engine
    model = local.model
    batch = RunningBatch(model, pad_token_id=tok.pad_token_id) if kind == "hf cache" else SlotBatch(local.runner)
    seqs = [[10, 11, 12, 13, 14], [20, 21]]
    logits = list(batch.prefill(seqs)[:, -1])
    gen_ = torch.Generator().manual_seed(0)

    def feed(rows_logits):
        tokens = torch.randint(4, VOCAB, (len(seqs),), generator=gen_)
        for seq, t in zip(seqs, tokens.tolist()):
            seq.append(t)
        return list(batch.step(tokens))

    def check(rows_logits):
        for seq, got in zip(seqs, rows_logits):
            with torch.no_grad():
                want = model(input_ids=torch.tensor([seq])).logits[0, -1]
            assert torch.allclose(got, want, atol=1e-4), (seq, (got - want).abs().max())

    check(logits)
    for _ in range(3):
        logits = feed(logits)
    seqs.append([30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40])  # wider than the running batch
    logits += list(batch.prefill([seqs[-1]])[:, -1])
    check(logits)
    for _ in range(2):
        logits = feed(logits)
    check(logits)
    batch.keep([0, 2])  # the short row leaves; the cache narrows to the longest row left
    seqs = [seqs[0], seqs[2]]
    assert batch.width == max(len(s) for s in seqs)
    if kind == "slots":
        assert sorted(batch.slots) == [0, 1]  # slot 2's row moved into the freed slot 1
    logits = feed(logits)
    check(logits)


@settings(max_examples=1500, deadline=None)
@given(body=st.deferred(lambda: bodies))
def test_the_parser_takes_any_json_to_sequences_or_a_bad_request(body):
    """In process, thousands of times faster than over HTTP: BadRequest or well-formed sequences."""
    import random

    from miles.serve.protocol import BadRequest, ModelLimits, parse_generate

    limits = ModelLimits(vocab_size=VOCAB, context_len=64, max_total_tokens=48, max_sequences=64)
    try:
        parsed = parse_generate(body, limits, lambda t: [ord(c) % VOCAB for c in t], random.Random(0))
    except BadRequest as e:
        assert str(e)
        return
    assert parsed.sequences and len({s.rid for s in parsed.sequences}) == len(parsed.sequences)
    for seq in parsed.sequences:
        assert seq.input_ids and all(0 <= t < VOCAB for t in seq.input_ids)
        assert seq.final_len <= 48 and seq.sampling.max_new_tokens >= 0
        assert seq.sampling.temperature >= 0 and 0 < seq.sampling.top_p <= 1


# -- /generate shapes ----------------------------------------------------------------------------


def test_generate_single_request_has_sglangs_shape(server):
    out = gen(server, {"text": "hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                       "return_logprob": True, "return_text_in_logprobs": True, "rid": "one"})
    check_response_shape(out, logprobs=True, text_in_logprobs=True)
    assert out["meta_info"]["id"] == "one" and out["meta_info"]["input_token_logprobs"] == []
    assert out["meta_info"]["weight_version"] == "default" and out["meta_info"]["cached_tokens"] == 0
    plain = gen(server, {"input_ids": [10, 11], "sampling_params": {"max_new_tokens": 3}})
    check_response_shape(plain, logprobs=False)
    assert plain["meta_info"]["prompt_tokens"] == 2
    no_text = gen(server, {"input_ids": [10, 11], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True})
    check_response_shape(no_text, logprobs=True, text_in_logprobs=False)  # the third element is null


def test_batched_input_ids_and_text_return_lists_in_input_order(server):
    prompts = [[10, 11, 12], [40], [50, 51]]
    params = [{"max_new_tokens": 2 + i, "temperature": 0} for i in range(3)]
    out = gen(server, {"input_ids": prompts, "sampling_params": params, "return_logprob": True, "rid": "b"})
    assert isinstance(out, list) and len(out) == 3
    for i, item in enumerate(out):
        check_response_shape(item, logprobs=True)
        assert item["meta_info"]["id"] == f"b_{i}" and item["meta_info"]["prompt_tokens"] == len(prompts[i])
        single = gen(server, {"input_ids": prompts[i], "sampling_params": params[i]})
        assert item["output_ids"] == single["output_ids"]  # greedy: batched or alone, the same
    one = gen(server, {"input_ids": [[10, 11]], "sampling_params": {"max_new_tokens": 2}})
    assert isinstance(one, list) and len(one) == 1  # a batch of one is still a batch
    texts = gen(server, {"text": ["hi", "there"], "sampling_params": {"max_new_tokens": 2}})
    assert isinstance(texts, list) and len(texts) == 2
    many = gen(server, {"input_ids": [10, 11], "sampling_params": {"max_new_tokens": 4, "n": 3}})
    assert isinstance(many, list) and len(many) == 3 and len({m["meta_info"]["id"] for m in many}) == 3


def test_finish_reasons_stop_token_stop_string_and_length(server):
    """A stop token ends the sequence and stays in output_ids and the logprobs (not in text);
    ignore_eos runs to the length cap; a stop string ends it and is cut from text."""
    free = gen(server, {"input_ids": [10], "return_logprob": True,
                        "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 5}})
    first = free["output_ids"][2]
    stopped = gen(server, {"input_ids": [10], "return_logprob": True, "sampling_params": {
        "max_new_tokens": 12, "sampling_seed": 5, "stop_token_ids": [first], "skip_special_tokens": False}})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert stopped["output_ids"][-1] == first and first not in stopped["output_ids"][:-1]
    assert stopped["output_ids"] == free["output_ids"][:len(stopped["output_ids"])]
    assert stopped["meta_info"]["output_token_logprobs"][-1][1] == first
    assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    text = free["text"]
    stop = text[3:5]
    cut = gen(server, {"input_ids": [10], "sampling_params": {"max_new_tokens": 12, "ignore_eos": True,
                                                              "sampling_seed": 5, "stop": [stop]}})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[:text.find(stop)]
    # EOS: the tiny model samples it within 60 tokens for some seeds.
    outs = gen(server, {"input_ids": [[10]] * 8, "sampling_params": [{"max_new_tokens": 60, "sampling_seed": s}
                                                                     for s in range(8)], "return_logprob": True})
    eos_ended = [(s, o) for s, o in enumerate(outs) if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert eos_ended, "no sequence sampled EOS"
    for _, o in eos_ended:
        assert o["meta_info"]["finish_reason"]["matched"] == EOS == o["output_ids"][-1]
        assert o["meta_info"]["output_token_logprobs"][-1][1] == EOS
    # EOS as the last token the budget allows: SGLang checks the length cap first.
    seed, o = eos_ended[0]
    capped = gen(server, {"input_ids": [10], "sampling_params": {"max_new_tokens": len(o["output_ids"]),
                                                                 "sampling_seed": seed}})
    assert capped["output_ids"] == o["output_ids"]
    assert capped["meta_info"]["finish_reason"] == {"type": "length", "length": len(o["output_ids"])}


def test_per_row_sampling_params_in_one_batch(server):
    """Greedy, top_k=1 at temperature 0.5, and top_p sampling share one batch; each row gets what it
    gets alone with its own parameters."""
    params = [{"max_new_tokens": 8, "temperature": 0},
              {"max_new_tokens": 8, "temperature": 0.5, "top_k": 1, "sampling_seed": 3},
              {"max_new_tokens": 5, "temperature": 1.3, "top_p": 0.8, "sampling_seed": 3}]
    rows = gen(server, {"input_ids": [[20, 21]] * 3, "return_logprob": True, "sampling_params": params})
    for row, p in zip(rows, params):
        alone = gen(server, {"input_ids": [20, 21], "sampling_params": p, "return_logprob": True})
        assert row["output_ids"] == alone["output_ids"] and len(row["output_ids"]) == p["max_new_tokens"]
        assert ([t[0] for t in row["meta_info"]["output_token_logprobs"]]
                == pytest.approx([t[0] for t in alone["meta_info"]["output_token_logprobs"]], abs=1e-5))
    # top_k=1 samples the argmax, and reports log-probs at its own temperature, before truncation.
    assert rows[1]["output_ids"] == rows[0]["output_ids"]
    greedy, top1 = ([t[0] for t in r["meta_info"]["output_token_logprobs"]] for r in rows[:2])
    assert all(b < 0 for b in top1) and top1 != pytest.approx(greedy, abs=1e-3)


def test_input_token_logprobs_rescore_a_generation(server):
    """Miles' prefill rescoring: prompt + response with max_new_tokens 0 and logprob_start_len =
    len(prompt) - 1 gives back the response's log-probs (first entry null), as SGLang does."""
    prompt = [10, 11, 12]
    out = gen(server, {"input_ids": prompt, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 10, "sampling_seed": 9, "ignore_eos": True}})
    response = out["output_ids"]
    scored = gen(server, {"input_ids": prompt + response, "return_logprob": True, "logprob_start_len": len(prompt) - 1,
                          "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}})
    triples = scored["meta_info"]["input_token_logprobs"]
    assert scored["output_ids"] == [] and scored["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert triples[0][0] is None and [t[1] for t in triples] == [prompt[-1]] + response
    want = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    assert [t[0] for t in triples[1:]] == pytest.approx(want, abs=1e-5)


# -- determinism ---------------------------------------------------------------------------------


def test_one_batched_request_matches_local_engine(server, engine):
    """Sample i with sampling_seed = sample_seed(seed, rollout_id, i): the tokens LocalEngine.generate
    makes in process, log-probs within 1e-5 — as one batched request and as concurrent single
    requests that land in (and join) different batches."""
    local, tok = engine
    prompts = [tok.encode(t) for t in ("hello", "what is seven plus two?", "x", "a longer prompt here", "1+1=")] * 2
    seeds = [sample_seed(42, 3, i) for i in range(len(prompts))]
    sampling = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95)
    want = local.generate(prompts, sampling, seeds)
    params = [{"max_new_tokens": 24, "temperature": 0.9, "top_p": 0.95, "sampling_seed": s} for s in seeds]
    got = gen(server, {"input_ids": prompts, "sampling_params": params, "return_logprob": True})
    for g, w in zip(got, want):
        assert g["output_ids"] == w.token_ids
        assert [t[0] for t in g["meta_info"]["output_token_logprobs"]] == pytest.approx(w.log_probs, abs=1e-5)
    with ThreadPoolExecutor(len(prompts)) as pool:
        singles = list(pool.map(lambda i: gen(server, {"input_ids": prompts[i], "sampling_params": params[i],
                                                       "return_logprob": True}), range(len(prompts))))
    for g, w in zip(singles, want):
        assert g["output_ids"] == w.token_ids
        assert [t[0] for t in g["meta_info"]["output_token_logprobs"]] == pytest.approx(w.log_probs, abs=1e-5)


def test_a_request_joins_the_running_batch_at_the_next_step(server):
    """A short request sent while a long one decodes finishes first (it joined the running batch,
    it did not wait for it), the scheduler counts the join, and the long sequence's tokens are
    those it makes alone."""
    joined = info(server)["joined_running_batch"]
    long = start_running(server, long_body("long-join"))
    short = gen(server, {"input_ids": [30, 31], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    assert not long.done(), "the short request waited for the long one"
    assert len(short["output_ids"]) == 4
    assert info(server)["joined_running_batch"] == joined + 1
    alone = gen(server, long_body("long-alone"))
    together = long.result(timeout=120)
    assert together["output_ids"] == alone["output_ids"]
    assert ([t[0] for t in together["meta_info"]["output_token_logprobs"]]
            == pytest.approx([t[0] for t in alone["meta_info"]["output_token_logprobs"]], abs=1e-5))


def test_a_client_that_hangs_up_has_its_sequence_aborted(server):
    """(While paused, so that the sequence cannot finish first.)"""
    aborted = info(server)["aborted"]
    post(server, "/pause_generation", {"mode": "in_place"})
    try:
        with pytest.raises(httpx.ReadTimeout):
            post(server, "/generate", long_body("hangs-up"), timeout=1.0)
        wait_until(lambda: info(server)["aborted"] == aborted + 1, timeout=10)
        assert info(server)["num_waiting_reqs"] == 0
    finally:
        post(server, "/continue_generation", {})


# -- control endpoints ---------------------------------------------------------------------------


def test_health_model_info_weight_version_flush_and_server_info(server):
    for path in ("/health", "/health_generate"):
        r = get(server, path)
        assert r.status_code == 200 and r.content == b""
    for path in ("/get_model_info", "/model_info"):
        mi = get(server, path).json()
        assert {"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params", "weight_version",
                "has_image_understanding", "has_audio_understanding", "model_type", "architectures"} <= set(mi)
        assert mi["is_generation"] is True and mi["weight_version"] == "default"
    assert get(server, "/get_weight_version").json() == {"weight_version": "default"}
    for method in (httpx.get, httpx.post):
        r = method(server.url + "/flush_cache")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert r.text.startswith("Cache flushed.")
    si = info(server)
    assert {"max_running_requests", "max_total_num_tokens", "joined_running_batch", "num_running_reqs",
            "internal_states", "version"} <= set(si) and "api_key" not in si
    sums = get(server, "/weights_checksum").json()
    assert sums["weight_version"] == "default"
    assert all(set(v) == {"dtype", "sha256"} and len(v["sha256"]) == 64 for v in sums["tensors"].values())
    assert "model.embed_tokens.weight" in sums["tensors"]


def test_pause_abort_aborts_in_flight_and_new_requests_wait_until_continue(server):
    long = start_running(server, long_body("long-abort"))
    r = post(server, "/pause_generation", {})
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    aborted = long.result(timeout=30)
    assert aborted["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                     "err_type": None}
    assert len(aborted["output_ids"]) == len(aborted["meta_info"]["output_token_logprobs"]) < 300
    waiting = in_background(gen, server, {"input_ids": [10], "sampling_params": {"max_new_tokens": 2}})
    wait_until(lambda: info(server)["num_waiting_reqs"] == 1)
    time.sleep(0.3)
    assert not waiting.done()
    assert get(server, "/health_generate").status_code == 503  # nothing can generate while paused
    r = post(server, "/continue_generation", {})
    assert r.json() == {"message": "Generation continued successfully.", "status": "ok"}
    assert len(waiting.result(timeout=30)["output_ids"]) == 2


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_retract_or_in_place_then_continue_makes_the_same_tokens(server, mode):
    """retract frees the KV (flush_cache succeeds) and re-prefills on continue; in_place keeps the
    batch frozen (flush_cache fails). Either way the sequence continues its own random stream."""
    alone = gen(server, long_body(f"ref-{mode}", seed=4))  # long enough to be running when the pause lands
    long = start_running(server, long_body(f"paused-{mode}", seed=4))
    assert post(server, "/pause_generation", {"mode": mode}).status_code == 200
    made = info(server)["generated_tokens"]
    time.sleep(0.3)
    assert info(server)["generated_tokens"] == made and not long.done()  # frozen
    flush = post(server, "/flush_cache")
    assert flush.status_code == (200 if mode == "retract" else 400)
    assert info(server)["num_running_reqs"] == (0 if mode == "retract" else 1)
    post(server, "/continue_generation", {})
    out = long.result(timeout=60)
    assert out["output_ids"] == alone["output_ids"]
    assert out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)


def test_abort_request_by_rid_prefix_and_in_the_waiting_queue(server):
    batch = start_running(server, {"input_ids": [[10, 11], [12, 13]], "rid": "grp", "sampling_params": {
        "max_new_tokens": 450, "ignore_eos": True}}, n=2)
    r = post(server, "/abort_request", {"rid": "grp"})
    assert r.status_code == 200 and r.content == b""
    for i, item in enumerate(batch.result(timeout=30)):
        assert item["meta_info"]["id"] == f"grp_{i}" and item["meta_info"]["finish_reason"]["type"] == "abort"
    post(server, "/pause_generation", {"mode": "abort"})
    try:
        waiter = in_background(gen, server, {"input_ids": [10], "rid": "waiter", "return_logprob": True,
                                             "sampling_params": {"max_new_tokens": 2}})
        wait_until(lambda: info(server)["num_waiting_reqs"] == 1)
        post(server, "/abort_request", {"rid": "", "abort_all": True})
        out = waiter.result(timeout=30)
    finally:
        post(server, "/continue_generation", {})
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in out["meta_info"] and out["output_ids"] == []


# -- bad requests --------------------------------------------------------------------------------

BAD_BODIES = [
    b"{not json", b"[1, 2]", b'"text"', b"{}", b"", b'{"input_ids": [5], "sampling_params": {"temperature": NaN}}',
    {"text": "a", "input_ids": [5]}, {"input_ids": "abc"}, {"input_ids": [5, "x"]}, {"input_ids": [-1]},
    {"input_ids": [VOCAB]}, {"input_ids": []}, {"input_ids": [[5], 6]}, {"input_ids": [5.0]}, {"input_ids": [True]},
    {"text": 5}, {"text": []}, {"input_ids": [5], "sampling_params": {"temperature": -1}},
    {"input_ids": [5], "sampling_params": {"temperature": "hot"}},
    {"input_ids": [5], "sampling_params": {"temperature": 1e400}},
    {"input_ids": [5], "sampling_params": {"top_p": 0}}, {"input_ids": [5], "sampling_params": {"top_p": 1.5}},
    {"input_ids": [5], "sampling_params": {"top_k": 0}}, {"input_ids": [5], "sampling_params": {"max_new_tokens": -1}},
    {"input_ids": [5], "sampling_params": {"max_new_tokens": 10**9}},
    {"input_ids": [5], "sampling_params": {"max_new_tokens": 1.5}}, {"input_ids": [5] * 512},
    {"input_ids": [5], "sampling_params": {"sampling_seed": 2**64}},
    {"input_ids": [5], "sampling_params": {"foo": 1}}, {"input_ids": [5], "sampling_params": {"min_p": 0.5}},
    {"input_ids": [5], "sampling_params": "greedy"}, {"input_ids": [[5], [6]], "sampling_params": [{}]},
    {"input_ids": [[5], [6]], "rid": ["a", "a"]}, {"input_ids": [5], "sampling_params": {"n": 0}},
    {"input_ids": [5], "stream": True}, {"input_ids": [5], "return_logprob": "yes"},
    {"input_ids": [5], "return_logprob": True, "logprob_start_len": 9},
    {"input_ids": [5], "sampling_params": {"stop_token_ids": "3"}},
    {"input_ids": [5], "image_data": "http://x/cat.png"}, {"input_ids": [5], "sampling_params": {"n": 2**62}},
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_malformed_requests_get_400_with_a_message_and_the_server_keeps_serving(server, body):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/generate", content=content, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert isinstance(message, str) and message
    assert get(server, "/health").status_code == 200


def test_max_total_tokens_and_running_cap_bound_the_batch(keyed):
    """--max-total-tokens 400: a request that alone needs more is refused; --max-running-requests 3:
    eight concurrent requests all succeed, never more than three decoded together."""
    r = post(keyed, "/generate", {"input_ids": [5] * 200, "sampling_params": {"max_new_tokens": 201}}, key=KEY)
    assert r.status_code == 400 and "--max-total-tokens" in r.json()["error"]["message"]
    body = {"input_ids": [10, 11], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: post(keyed, "/generate", body, key=KEY), range(8)))
    assert all(o.status_code == 200 and len(o.json()["output_ids"]) == 40 for o in outs)
    assert info(keyed, KEY)["max_batch_size"] <= 3
    # 400 tokens of KV: rows x the longest final length (2 + 150) fits two rows, not three.
    big = {"input_ids": [10, 11], "sampling_params": {"max_new_tokens": 150, "ignore_eos": True}}
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(post, keyed, "/generate", big, key=KEY) for _ in range(3)]
        wait_until(lambda: (lambda i: (i["num_running_reqs"], i["num_waiting_reqs"]) == (2, 1))(info(keyed, KEY)))
        assert all(f.result().status_code == 200 for f in futures)


def test_a_full_queue_answers_503_and_a_request_larger_than_the_queue_400(keyed):
    body = {"input_ids": [[10]] * 8, "sampling_params": {"max_new_tokens": 1}}
    assert post(keyed, "/generate", {**body, "input_ids": [[10]] * 9}, key=KEY).status_code == 400
    post(keyed, "/pause_generation", {"mode": "in_place"}, key=KEY)
    try:
        queued = in_background(post, keyed, "/generate", body, key=KEY)
        wait_until(lambda: info(keyed, KEY)["num_waiting_reqs"] == 8)
        r = post(keyed, "/generate", {"input_ids": [10], "sampling_params": {"max_new_tokens": 1}}, key=KEY)
        assert r.status_code == 503 and "queue is full" in r.json()["error"]["message"]
    finally:
        post(keyed, "/continue_generation", {}, key=KEY)
    assert queued.result(timeout=30).status_code == 200


# Fuzzing: valid bodies with zero to two spots replaced by any JSON value (numbers too big for a
# float, NaN and Infinity included), and plain JSON values; generation stays within 3 tokens.
garbage = st.recursive(st.none() | st.booleans() | st.integers() | st.sampled_from([10**400, -(2**64), 2**63])
                       | st.floats() | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                   max_size=4), max_leaves=12)
prompt_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
valid_sampling = st.fixed_dictionaries({"max_new_tokens": st.integers(0, 3)}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.sampled_from([-1, 1, 3]),
    "sampling_seed": st.integers(-2**63, 2**63 - 1), "n": st.integers(1, 2), "stop": st.text(max_size=2),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=2), "ignore_eos": st.booleans()})
valid_bodies = st.fixed_dictionaries(
    {"sampling_params": valid_sampling | st.lists(valid_sampling, min_size=2, max_size=2)},
    optional={"return_logprob": st.booleans(), "logprob_start_len": st.integers(-1, 1), "rid": st.text(max_size=4),
              "return_text_in_logprobs": st.booleans()}).flatmap(
    lambda body: st.fixed_dictionaries({**{k: st.just(v) for k, v in body.items()}, "input_ids": (
        st.lists(prompt_ids, min_size=2, max_size=2) if isinstance(body["sampling_params"], list) else prompt_ids)}))


odd_numbers = st.sampled_from([10**400, -10**400, 2**63, -(2**63) - 1, 2**64, -1, 0, 1e-7, 1e308, float("inf"),
                               float("nan"), -0.0, True, "1", None]) | st.integers() | st.floats()


@st.composite
def corrupted_bodies(draw):
    body = draw(valid_bodies)
    spots = [(body, key, garbage) for key in [*body, "text", "stream", "n"]]
    params = body["sampling_params"]
    for d in params if isinstance(params, list) else [params]:
        spots += [(d, key, odd_numbers) for key in ("temperature", "top_p", "top_k", "sampling_seed", "max_new_tokens",
                                                   "n")]
        spots += [(d, key, garbage) for key in d]
    ids = body["input_ids"]
    spots += [(ids, i, odd_numbers | garbage) for i in range(len(ids))]
    for _ in range(draw(st.integers(0, 2))):
        container, key, values = draw(st.sampled_from(spots))
        container[key] = draw(values)
    return body


bodies = corrupted_bodies() | garbage


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies)
def test_fuzzed_generate_bodies_get_200_or_4xx_never_500(small, body):
    r = httpx.post(small.url + "/generate", content=json.dumps(body).encode(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code in (200, 400), (r.status_code, r.text, body)
    if r.status_code == 400:
        assert isinstance(r.json()["error"]["message"], str)


def test_server_survives_the_fuzzing(small):
    assert get(small, "/health").status_code == 200
    assert gen(small, {"input_ids": [10], "sampling_params": {"max_new_tokens": 2}})["output_ids"]
    assert info(small)["requests"] > 0  # the fuzzer got past validation too


# -- API key, weights ----------------------------------------------------------------------------

GUARDED = [("POST", "/generate", {"input_ids": [10], "sampling_params": {"max_new_tokens": 1}}),
           ("GET", "/get_model_info", None), ("GET", "/model_info", None), ("GET", "/get_weight_version", None),
           ("GET", "/get_server_info", None), ("GET", "/flush_cache", None), ("POST", "/flush_cache", None),
           ("GET", "/weights_checksum", None), ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
           ("POST", "/pause_generation", {"mode": "in_place"}), ("POST", "/continue_generation", {}),
           ("POST", "/abort_request", {"rid": "nothing"}), ("POST", "/release_memory_occupation", {"tags": ["bogus"]}),
           ("POST", "/resume_memory_occupation", {})]


@pytest.mark.parametrize("method, path, body", GUARDED, ids=[f"{m} {p}" for m, p, _ in GUARDED])
def test_api_key_is_required_on_every_non_health_endpoint(keyed, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.request(method, keyed.url + path, json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (headers, r.text)
    r = httpx.request(method, keyed.url + path, json=body, headers={"Authorization": f"bearer {KEY}"}, timeout=60)
    assert r.status_code != 401, r.text
    post(keyed, "/continue_generation", {}, key=KEY)


def test_health_needs_no_key(keyed):
    assert get(keyed, "/health").status_code == 200 and get(keyed, "/health_generate").status_code == 200


def checkpoint_digests(path: Path) -> dict[str, str]:
    from safetensors.torch import load_file

    return {name: tensor_bytes_sha256(t.float()) for name, t in load_file(str(path / "model.safetensors")).items()}


def perturbed_checkpoint(tiny_model: Path, out: Path, *, edit=None) -> Path:
    """The tiny model with every weight moved (and, if given, `edit(state_dict)` applied), as safetensors."""
    from safetensors.torch import save_file

    model = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    state = {name: (p.detach() + 0.05 * torch.randn_like(p)).contiguous() for name, p in model.named_parameters()}
    if edit is not None:
        edit(state)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    return out


def test_update_weights_from_disk_changes_outputs_and_checksums_match_the_file(keyed, tiny_model, tmp_path):
    probe = {"input_ids": [10, 11, 12], "return_logprob": True, "sampling_params": {"max_new_tokens": 8,
                                                                                    "temperature": 0}}
    before = gen(keyed, probe, KEY)
    new = perturbed_checkpoint(tiny_model, tmp_path / "step7")
    r = post(keyed, "/update_weights_from_disk", {"model_path": str(new), "weight_version": "7"}, key=KEY)
    assert r.status_code == 200
    assert r.json() == {"success": True, "message": "Succeeded to update model weights. Weight version updated to 7.",
                        "num_paused_requests": 0}
    after = gen(keyed, probe, KEY)
    assert after["meta_info"]["weight_version"] == "7"
    assert ([t[0] for t in after["meta_info"]["output_token_logprobs"]]
            != [t[0] for t in before["meta_info"]["output_token_logprobs"]])
    assert get(keyed, "/get_weight_version", key=KEY).json() == {"weight_version": "7"}
    model_info = get(keyed, "/model_info", key=KEY).json()
    assert (model_info["model_path"], model_info["weight_version"]) == (str(new), "7")
    sums = get(keyed, "/weights_checksum", key=KEY).json()
    assert sums["weight_version"] == "7"
    assert {n: v["sha256"] for n, v in sums["tensors"].items()} == checkpoint_digests(new)


def _drop_one(state):
    state.pop(next(iter(state)))


def _reshape_one(state):
    name = next(iter(state))
    state[name] = state[name].reshape(-1)


def _nan_one(state):
    name = next(iter(state))
    state[name][0] = float("nan")


def _extra(state):
    state["model.layers.99.mlp.up_proj.weight"] = torch.zeros(2, 2)


@pytest.mark.parametrize("edit", [None, _drop_one, _reshape_one, _nan_one, _extra],
                         ids=["no-such-path", "missing-tensor", "wrong-shape", "nan", "unknown-tensor"])
def test_a_bad_weight_update_is_400_and_keeps_the_old_weights(keyed, tiny_model, tmp_path, edit):
    probe = {"input_ids": [10, 11, 12], "return_logprob": True, "sampling_params": {"max_new_tokens": 8,
                                                                                    "temperature": 0}}
    sums, before = get(keyed, "/weights_checksum", key=KEY).json(), gen(keyed, probe, KEY)
    path = tmp_path / "missing" if edit is None else perturbed_checkpoint(tiny_model, tmp_path / "bad", edit=edit)
    r = post(keyed, "/update_weights_from_disk", {"model_path": str(path), "weight_version": "99"}, key=KEY)
    assert r.status_code == 400
    body = r.json()
    assert body["success"] is False and body["num_paused_requests"] == 0 and "old weights are kept" in body["message"]
    assert get(keyed, "/weights_checksum", key=KEY).json() == sums
    after = gen(keyed, probe, KEY)
    assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] != "99"


def test_a_weight_update_waits_for_running_requests_unless_paused(keyed, tiny_model, tmp_path):
    """Not paused: the update waits for the running sequence, which finishes on the old weights (as
    SGLang's model-update lock). Paused in place: it applies at once and the frozen sequence is
    counted in num_paused_requests."""
    old = get(keyed, "/get_weight_version", key=KEY).json()["weight_version"]
    new = perturbed_checkpoint(tiny_model, tmp_path / "w")
    long = start_running(keyed, long_body("before-update", tokens=200), KEY)
    r = post(keyed, "/update_weights_from_disk", {"model_path": str(new), "weight_version": "8"}, key=KEY)
    assert r.status_code == 200
    finished = long.result(timeout=60)  # made whole on the old weights: the update waited for it
    assert finished["meta_info"]["weight_version"] == old and len(finished["output_ids"]) == 200
    frozen = start_running(keyed, long_body("frozen", tokens=200), KEY)
    post(keyed, "/pause_generation", {"mode": "in_place"}, key=KEY)
    r = post(keyed, "/update_weights_from_disk", {"model_path": str(new), "weight_version": "9"}, key=KEY)
    assert r.status_code == 200 and r.json()["num_paused_requests"] == 1 and not frozen.done()
    post(keyed, "/continue_generation", {}, key=KEY)
    assert frozen.result(timeout=60)["meta_info"]["weight_version"] == "9"


# -- memory: release and resume (the colocate choreography) --------------------------------------

ALL_TAGS = ["weights", "kv_cache", "cuda_graph"]
GREEDY = {"input_ids": [10, 11, 12], "return_logprob": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


def release(s: ServeProcess, body=None, key=None) -> httpx.Response:
    return post(s, "/release_memory_occupation", {} if body is None else body, key=key)


def resume(s: ServeProcess, body=None, key=None) -> httpx.Response:
    return post(s, "/resume_memory_occupation", {} if body is None else body, key=key)


def test_released_memory_holds_new_requests_until_every_tag_is_resumed(server):
    before = gen(server, GREEDY)
    r = release(server)
    try:
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["success"] is True and answer["tags"] == ALL_TAGS
        assert answer["released_tags"] == sorted(ALL_TAGS) == info(server)["memory_released"]
        assert (answer["gpu_memory"] is None) == (not torch.cuda.is_available())  # the server's device: auto
        assert get(server, "/health").status_code == 200 and get(server, "/health_generate").status_code == 503
        waiting = in_background(gen, server, GREEDY)
        wait_until(lambda: info(server)["num_waiting_reqs"] == 1)
        assert release(server).json()["released_tags"] == sorted(ALL_TAGS)  # twice: no change
        assert resume(server, {"tags": ["kv_cache"]}).json()["released_tags"] == ["cuda_graph", "weights"]
        made = info(server)["generated_tokens"]
        time.sleep(0.3)
        assert not waiting.done() and info(server)["generated_tokens"] == made  # still held: weights released
    finally:
        resumed = resume(server)
    assert resumed.status_code == 200 and resumed.json()["released_tags"] == []
    assert waiting.result(timeout=30)["output_ids"] == before["output_ids"]
    assert get(server, "/health_generate").status_code == 200


def test_a_release_while_sequences_run_is_refused_and_changes_nothing(server):
    long = start_running(server, long_body("running-at-release"))
    try:
        r = release(server)
        assert r.status_code == 400 and "needs an idle engine, but 1 sequence(s) are running" in \
            r.json()["error"]["message"]
        assert info(server)["memory_released"] == [] and not long.done()
    finally:
        post(server, "/abort_request", {"rid": "running-at-release"})
        resume(server)
    assert long.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize("body", [{"tags": ["gpu"]}, {"tags": "weights"}, {"tags": [1]}, [1]])
def test_unknown_memory_tags_are_400(server, body):
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
    assert info(server)["memory_released"] == []


def test_weights_updated_while_released_are_served_after_the_resume(keyed, tiny_model, tmp_path):
    before = gen(keyed, GREEDY, KEY)
    new = perturbed_checkpoint(tiny_model, tmp_path / "while-released")
    assert release(keyed, {"tags": ["weights"]}, key=KEY).json()["released_tags"] == ["weights"]
    try:
        r = post(keyed, "/update_weights_from_disk", {"model_path": str(new), "weight_version": "11"}, key=KEY)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
    finally:
        assert resume(keyed, key=KEY).json()["released_tags"] == []
    after = gen(keyed, GREEDY, KEY)
    assert after["meta_info"]["weight_version"] == "11"
    assert [t[0] for t in after["meta_info"]["output_token_logprobs"]] != \
        [t[0] for t in before["meta_info"]["output_token_logprobs"]]
    from safetensors.torch import load_file

    sums = get(keyed, "/weights_checksum", key=KEY).json()["tensors"]  # in the server's dtype (bf16 on a GPU)
    assert {n: v["sha256"] for n, v in sums.items()} == {
        n: tensor_bytes_sha256(t.to(getattr(torch, sums[n]["dtype"])))
        for n, t in load_file(str(new / "model.safetensors")).items()}


def test_local_engine_release_refuses_generation_and_resume_brings_updated_weights(engine, tiny_model):
    local, tok = engine
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0, top_p=1.0)
    prompt = [tok("hi")["input_ids"]]
    original = {n: p.detach().clone() for n, p in local.model.named_parameters()}
    try:
        local.release_memory()
        with pytest.raises(RuntimeError, match="memory is released"):
            local.generate(prompt, sampling, [1])
        local.release_memory()  # twice: no change
        moved = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
        with torch.no_grad():
            moved.lm_head.weight.mul_(-1)
        local.update_weights(moved.named_parameters(), weight_version=3)
        local.resume_memory()
        out = local.generate(prompt, sampling, [1])[0]
        fresh = LocalEngine(moved, eos_token_ids=local.eos_token_ids, pad_token_id=tok.pad_token_id)
        assert out.weight_version == 3 and out.token_ids == fresh.generate(prompt, sampling, [1])[0].token_ids
        assert local.weights_checksum() == fresh.weights_checksum()
    finally:
        local.resume_memory()
        local.update_weights(original.items(), weight_version=0)


@pytest.fixture(scope="module")
def wide_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model at hidden size 1024 (32M parameters): enough memory to see it move."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from miles.testing.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("wide")
    config = LlamaConfig.from_pretrained(tiny_model)
    config.hidden_size, config.intermediate_size, config.head_dim = 1024, 4096, 128
    config.num_attention_heads, config.num_key_value_heads = 8, 8
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def bytes_of(model_dir: Path, element_size: int) -> int:
    model = load_causal_lm(model_dir, device="cpu", attention_backend="sdpa")
    return sum(p.numel() for p in model.parameters()) * element_size


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_local_engine_release_moves_the_weights_off_and_returns_the_cache(wide_model):
    tok = load_tokenizer(wide_model)
    model = load_causal_lm(wide_model, device="cuda", attention_backend="sdpa")
    local = LocalEngine(model, eos_token_ids=eos_token_ids(model, tok), pad_token_id=tok.pad_token_id)
    prompt, sampling = [tok("hi")["input_ids"]], SamplingParams(max_new_tokens=6, temperature=0.0, top_p=1.0)
    before = local.generate(prompt, sampling, [1])[0]
    params = dict(model.named_parameters())
    weights = sum(p.numel() * p.element_size() for p in params.values())
    held = torch.cuda.memory_allocated()
    local.release_memory()
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert torch.cuda.memory_allocated() <= held - weights
    assert torch.cuda.memory_reserved() <= torch.cuda.memory_allocated() + (8 << 20)  # the cache went back
    local.resume_memory()
    assert all(p is params[n] and p.is_cuda for n, p in model.named_parameters())  # the same Parameters, back
    assert local.generate(prompt, sampling, [1])[0].token_ids == before.token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_release_gives_the_memory_back_and_the_fraction_caps_the_server(wide_model, tmp_path):
    s = ServeProcess("--hf-checkpoint", str(wide_model), "--device", "cuda", "--mem-fraction-static", "0.5",
                     log=tmp_path / "cuda.log")
    try:
        before = gen(s, GREEDY)
        memory = release(s).json()["gpu_memory"]
        held, freed = memory["before"], memory["after"]
        weights = bytes_of(wide_model, 2)  # bf16 on a GPU
        assert freed["allocated"] <= held["allocated"] - weights
        assert freed["reserved"] <= freed["allocated"] + (8 << 20) and freed["free"] >= held["free"] + weights
        back = resume(s).json()["gpu_memory"]["after"]
        assert back["allocated"] >= freed["allocated"] + weights
        assert gen(s, GREEDY)["output_ids"] == before["output_ids"]
        assert "--mem-fraction-static 0.5: this server takes at most" in (tmp_path / "cuda.log").read_text()
    finally:
        s.stop()
    try:  # 1e-6 of the GPU (~0.14 MB): the weights do not fit
        capped = ServeProcess("--hf-checkpoint", str(wide_model), "--device", "cuda", "--mem-fraction-static", "1e-6",
                              log=tmp_path / "capped.log")
    except RuntimeError as e:
        assert "did not start" in str(e) and "out of memory" in (tmp_path / "capped.log").read_text().lower()
    else:
        capped.stop()
        pytest.fail("a server capped at 1e-6 of the GPU loaded its weights")


# -- the command line ----------------------------------------------------------------------------


def test_a_non_loopback_host_without_an_api_key_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "miles", "serve", "--host", "0.0.0.0"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --host 0.0.0.0") and "--api-key" in lines[0]


def test_a_checkpoint_dir_without_a_config_is_one_error_line_before_the_port_binds(tmp_path):
    r = subprocess.run([sys.executable, "-m", "miles", "serve", "--hf-checkpoint", str(tmp_path / "nowhere"),
                        "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: --hf-checkpoint {tmp_path / 'nowhere'}: not a Hugging Face "
                                             "model dir (no config.json)"]


def test_a_port_in_use_is_a_usage_error(server):
    port = server.url.rsplit(":", 1)[1]
    r = subprocess.run([sys.executable, "-m", "miles", "serve", "--port", port], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(f"error: --host 127.0.0.1 --port {port}: cannot bind")


@pytest.mark.parametrize("fraction", ["0", "1.5", "-0.1", "nan"])
def test_a_mem_fraction_outside_0_1_is_one_error_line(fraction):
    r = subprocess.run([sys.executable, "-m", "miles", "serve", "--mem-fraction-static", fraction, "--port", "0",
                        "--hf-checkpoint", "/nonexistent"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: --mem-fraction-static {float(fraction):g}: must be in (0, 1], "
                                             "a fraction of the GPU's memory"]


def test_a_mem_fraction_is_logged_as_ignored_on_a_cpu(small):
    line = ("--mem-fraction-static 0.5: this server takes at most" if torch.cuda.is_available() else
            "--mem-fraction-static 0.5 applies to CUDA devices only; ignored on cpu")
    assert line in small.log.read_text()


def test_sigterm_aborts_in_flight_requests_and_exits_promptly(tiny_model, tmp_path):
    s = ServeProcess("--hf-checkpoint", str(tiny_model), log=tmp_path / "sigterm.log")
    try:
        long = start_running(s, long_body("dies"))
        start = time.monotonic()
        rc = s.stop(signal.SIGTERM)
        assert time.monotonic() - start < 10
        assert rc in (-signal.SIGTERM, 128 + signal.SIGTERM, 0)
        assert long.result(timeout=5)["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        s.stop(signal.SIGKILL)


def test_serve_imports_neither_the_trainer_nor_the_debug_tools():
    bad = []
    for path in (PACKAGE / "serve").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            bad += [(path.name, n) for n in names if n.startswith(("miles.train", "miles.debug", "miles.loop"))]
    assert bad == []


def test_serve_help_needs_no_torch():
    code = ("import sys; from miles.cli.main import main; rc = main(sys.argv[1:]); "
            "sys.exit(7 if 'torch' in sys.modules else rc)")
    r = subprocess.run([sys.executable, "-c", code, "serve", "--help"], capture_output=True, text=True,
                       env={**os.environ})
    assert r.returncode == 0 and "--max-running-requests" in r.stdout
