"""The embedded engine: sampling, stopping, and log-probs that match the trainer's."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from miles.bridge.types import Sample
from miles.config import SamplingParams
from miles.rollout.local import LocalEngine
from miles.rollout.sampling import sample_tokens
from miles.train.batch import TrainBatch, response_log_probs
from miles.utils.models import eos_token_ids, load_causal_lm, load_tokenizer


def sp(max_new_tokens, temperature, top_p):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)


def make_engine(path):
    tok = load_tokenizer(path)
    model = load_causal_lm(path, device="cpu", attention_backend="sdpa")
    return LocalEngine(model, eos_token_ids=eos_token_ids(model, tok), pad_token_id=tok.pad_token_id), tok


def uniforms(n, seed=0):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_greedy_takes_the_argmax_and_reports_its_log_prob():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    tok, logp = sample_tokens(logits, sp(1, 0.0, 1.0), None)
    assert tok.item() == 1
    assert logp.item() == pytest.approx(3 - math.log(math.e + math.e**3 + math.e**2), abs=1e-6)


def test_top_p_keeps_the_nucleus_and_reports_untruncated_log_probs():
    # probs [0.6, 0.3, 0.1]: top_p 0.5 keeps token 0 alone; top_p 0.8 keeps tokens 0 and 1.
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(400, 1)
    tok, logp = sample_tokens(logits, sp(1, 1.0, 0.5), uniforms(400))
    assert set(tok.tolist()) == {0}
    assert logp[0].item() == pytest.approx(math.log(0.6), abs=1e-6)  # before truncation, as the trainer sees it
    tok, _ = sample_tokens(logits, sp(1, 1.0, 0.8), uniforms(400, 1))
    assert set(tok.tolist()) == {0, 1}
    assert 0.6 < (tok == 0).float().mean().item() < 0.73  # renormalised: 0.6 / 0.9 = 0.667


def test_inverse_cdf_sampling_follows_the_distribution_exactly():
    # u in [0, 0.5) -> token 0 (p 0.5); [0.5, 0.8) -> token 2 (token 1 has p 0); [0.8, 1) -> token 3.
    # (The edges sit where exp(the float32 log-probs) put them, within 1e-7 of 0.5 and 0.8.)
    logits = torch.log(torch.tensor([[0.5, 0.0, 0.3, 0.2]])).repeat(6, 1)
    u = torch.tensor([0.0, 0.49, 0.500001, 0.79, 0.800001, 0.999], dtype=torch.float64)
    tok, _ = sample_tokens(logits, sp(1, 1.0, 1.0), u)
    assert tok.tolist() == [0, 0, 2, 2, 3, 3]


def test_temperature_scales_the_reported_log_probs():
    logits = torch.tensor([[2.0, 0.0]])
    _, logp = sample_tokens(logits.repeat(200, 1), sp(1, 2.0, 1.0), uniforms(200))
    expected = {round(math.log(math.e / (math.e + 1)), 5), round(math.log(1 / (math.e + 1)), 5)}
    assert {round(v, 5) for v in logp.tolist()} == expected  # logits / 2 = [1, 0]


def test_generation_stops_at_eos_or_length(tiny_model):
    engine, tok = make_engine(tiny_model)
    prompts = [tok("hello")["input_ids"], tok("a much longer prompt")["input_ids"]] * 8
    outs = engine.generate(prompts, sp(40, 1.0, 1.0), list(range(16)))
    assert len(outs) == 16
    for out in outs:
        assert len(out.token_ids) == len(out.log_probs) <= 40
        assert all(lp <= 0 for lp in out.log_probs)
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == tok.eos_token_id and tok.eos_token_id not in out.token_ids[:-1]
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 40
    assert {o.finish_reason for o in outs} == {"stop", "length"}  # the scaled random model does both


def test_same_seed_same_tokens(tiny_model):
    engine, tok = make_engine(tiny_model)
    prompts = [tok("hello")["input_ids"]] * 4
    a = engine.generate(prompts, sp(10, 1.0, 1.0), [3, 4, 5, 6])
    b = engine.generate(prompts, sp(10, 1.0, 1.0), [3, 4, 5, 6])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) > 1  # different streams, different samples


def test_a_samples_tokens_do_not_depend_on_its_batch(tiny_model):
    """Sample 0 alone, or in a batch with other (longer) prompts in another order: same tokens."""
    engine, tok = make_engine(tiny_model)
    p0, p1, p2 = (tok(t)["input_ids"] for t in ("hello", "a much longer prompt here", "mid size"))
    alone = engine.generate([p0], sp(16, 1.0, 1.0), [7])[0]
    batched = engine.generate([p1, p2, p0], sp(16, 1.0, 1.0), [8, 9, 7])[2]
    assert alone.token_ids == batched.token_ids
    assert alone.log_probs == pytest.approx(batched.log_probs, abs=1e-5)


def test_a_prompt_that_comes_again_in_a_batch_is_prefilled_once(tiny_model):
    """A GRPO group's samples share their prompt: the fast path prefills each distinct prompt once and
    gives its other samples copies of its cached columns and logits; every sample still gets the tokens
    of decoding it alone, its own draws."""
    engine, tok = make_engine(tiny_model)
    a, b = tok("hello")["input_ids"], tok("a much longer prompt")["input_ids"]
    prefilled, inner = [], engine.runner._prefill

    def spy(slots, prompts, keep):
        prefilled.extend(prompts)
        return inner(slots, prompts, keep)

    engine.runner._prefill = spy
    prompts = [a, a, b, a, b]
    sampling = sp(12, 1.0, 1.0)
    u = torch.rand(len(prompts), 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = engine.decode(prompts, sampling, u)
    assert prefilled == [a, b]
    want = eager_decode(engine.model, prompts, sampling, u, set(engine.eos_token_ids), tok.pad_token_id)
    for out, (tokens, logps) in zip(got, want):
        assert out.token_ids == tokens
        assert out.log_probs == pytest.approx(logps, abs=1e-5)
    assert len({tuple(o.token_ids) for o in got}) > 2  # the samples of one prompt drew apart


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_qwen"])
def test_a_prefix_the_prompts_share_is_prefilled_once_on_the_cpu(fixture, request):
    """Prompts that open alike (a chat template's system prompt): the CPU prefill computes the shared
    prefix once, copies its cached columns to every slot and runs the rest of each prompt over them;
    the tokens are those of decoding each prompt alone, log-probs within fp32 noise."""
    from miles.rollout.local.runner import SHARED_PREFIX_MIN

    engine, tok = make_engine(request.getfixturevalue(fixture))
    system = tok("you are a careful assistant who adds numbers and answers with one number only.")["input_ids"]
    assert len(system) >= SHARED_PREFIX_MIN
    prompts = [system + tok(t)["input_ids"] for t in ("what is two plus two?", "and seven plus one", "x")]
    pieces, inner = [], engine.runner._forward

    def spy(slots, parts, start, keep):
        pieces.append((start, [len(p) for p in parts]))
        return inner(slots, parts, start, keep)

    engine.runner._forward = spy
    sampling = sp(12, 1.0, 1.0)
    u = torch.rand(len(prompts), 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    got = engine.decode(prompts, sampling, u)
    assert pieces == [(0, [len(system)]), (len(system), [len(p) - len(system) for p in prompts])]
    want = eager_decode(engine.model, prompts, sampling, u, set(engine.eos_token_ids), tok.pad_token_id)
    for out, (tokens, logps) in zip(got, want):
        assert out.token_ids == tokens
        assert out.log_probs == pytest.approx(logps, abs=1e-5)


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_qwen"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_log_probs_equal_trainer_log_probs_fp32(fixture, temperature, request):
    """Same weights, fp32: the engine's log-probs (left-padded, KV-cached, one token at a time)
    equal the trainer's (right-padded, one full forward) within 1e-4."""
    path = request.getfixturevalue(fixture)
    engine, tok = make_engine(path)
    prompts = [tok(p)["input_ids"] for p in ["1+1=", "what is seven plus two?", "x"]] * 2
    outs = engine.generate(prompts, sp(16, temperature, 1.0), list(range(len(prompts))))
    samples = [Sample(group_index=i, index=i, prompt="", tokens=p + o.token_ids, response_length=len(o.token_ids),
                      loss_mask=[1] * len(o.token_ids), rollout_log_probs=o.log_probs)
               for i, (p, o) in enumerate(zip(prompts, outs))]
    trainer_model = load_causal_lm(path, device="cpu", attention_backend="sdpa")
    batch = TrainBatch.from_samples(samples, tok.pad_token_id, "cpu")
    with torch.no_grad():
        logp, _ = response_log_probs(trainer_model, batch, temperature)
    diff = ((logp - batch.rollout_log_probs).abs() * batch.mask).max().item()
    assert diff < 1e-4
    assert batch.mask.sum() > 30  # the comparison covered real tokens


def test_update_weights_copies_into_the_engine(tiny_model):
    engine, _ = make_engine(tiny_model)
    other = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    engine.update_weights(other.named_parameters(), weight_version=3)
    for (name, a), (_, b) in zip(engine.model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(KeyError, match="no parameter named 'nope'"):
        engine.update_weights([("nope", torch.zeros(1))], weight_version=4)
    tok = load_tokenizer(tiny_model)
    out = engine.generate([tok("hi")["input_ids"]], sp(3, 1.0, 1.0), [0])[0]
    assert out.weight_version == 3  # outputs carry the version of the weights that made them


def test_the_cpu_decode_runs_packed_weights_and_packs_them_again_after_an_update(tiny_model):
    """fp32 on the CPU: the fast path's projections and LM head run on weights packed for oneDNN; an update
    copied into the parameters after a first generate is packed again, so the next log-probs are those of
    the new weights (the trainer's, within 1e-4)."""
    engine, tok = make_engine(tiny_model)
    runner = engine.decoder.runner
    prompts = [tok(p)["input_ids"] for p in ["1+1=", "what is seven plus two?", "x"]]
    engine.generate(prompts, sp(4, 1.0, 1.0), [0, 1, 2])  # packs the weights
    assert runner.pack and runner._head is not None and all(w.packed for w in runner._weights)
    new = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.update_weights(new.named_parameters(), weight_version=1)
    outs = engine.generate(prompts, sp(16, 1.0, 1.0), [3, 4, 5])
    samples = [Sample(group_index=i, index=i, prompt="", tokens=p + o.token_ids, response_length=len(o.token_ids),
                      loss_mask=[1] * len(o.token_ids), rollout_log_probs=o.log_probs)
               for i, (p, o) in enumerate(zip(prompts, outs))]
    batch = TrainBatch.from_samples(samples, tok.pad_token_id, "cpu")
    with torch.no_grad():
        logp, _ = response_log_probs(new, batch, 1.0)
    assert batch.mask.sum() > 15
    assert ((logp - batch.rollout_log_probs).abs() * batch.mask).max().item() < 1e-4


def test_decode_limits_stop_each_row_at_its_budget(tiny_model):
    engine, tok = make_engine(tiny_model)
    prompts = [tok("hello")["input_ids"], tok("abc")["input_ids"]]
    u = torch.rand(2, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    outs = engine.decode(prompts, sp(10, 1.0, 1.0), u, limits=[3, 10])
    assert len(outs[0].token_ids) <= 3 and len(outs[0].log_probs) == len(outs[0].token_ids)
    if outs[0].finish_reason == "length":
        assert len(outs[0].token_ids) == 3
    # The limited row draws the same first tokens as it would with a full budget.
    full = engine.decode(prompts, sp(10, 1.0, 1.0), u)
    assert full[0].token_ids[: len(outs[0].token_ids)] == outs[0].token_ids


@pytest.mark.parametrize("limits", [[1, 1, 1], [3, 1, 20], [1, 18, 2]])
def test_the_steps_queued_between_checks_stop_at_the_last_token_any_row_may_draw(tiny_model, limits, monkeypatch):
    """Between two checks of the device's state (16 steps on a GPU) the host queues decode steps without looking; it
    queues none past the most tokens a live row may still draw (each row's budget less the tokens it drew if no EOS
    came): a prefill that draws every row's last token runs no decode step at
    all, a call's steps stop at its longest budget, not at the next multiple of 16, and no check finds nothing to
    free. Same tokens either way."""
    from miles.rollout.local import batching

    checks, harvest = [], batching._Call._harvest
    monkeypatch.setattr(batching._Call, "_harvest", lambda call: checks.append(1) or harvest(call))
    tok = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    engine = LocalEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id)  # rows end at their budgets
    engine.decoder.check_every = 16
    steps, decode = [], engine.runner.decode
    engine.runner.decode = lambda batch, *a: steps.append(batch) or decode(batch, *a)
    prompts = [tok(t)["input_ids"] for t in ("hello", "one two", "x")]
    u = torch.rand(3, 20, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    outs = engine.decode(prompts, sp(20, 1.0, 1.0), u, limits=limits)
    assert [len(o.token_ids) for o in outs] == limits
    assert len(steps) == max(limits) - 1
    assert len(checks) == max(1, math.ceil((max(limits) - 1) / 16)) + 1  # the last check finds every row done
    engine.decoder.check_every = 1  # a check after every step: the reference
    assert [o.token_ids for o in engine.decode(prompts, sp(20, 1.0, 1.0), u, limits=limits)] == \
        [o.token_ids for o in outs]


def test_a_prefill_packs_the_waiting_prompts_up_to_its_token_budget(tiny_model):
    """Newcomers are prefilled packed, as many as fit the engine's prefill budget (a prompt longer than it alone):
    with a budget of 30 tokens, 8 prompts of 1-23 tokens (98 in all) take several forwards, none over 30 tokens,
    every prompt in one of them, and the tokens are the reference's."""
    engine, tok = make_engine(tiny_model)
    engine.decoder.prefill_tokens = 30
    calls, prefill = [], engine.runner.prefill
    engine.runner.prefill = lambda slots, prompts: calls.append(prompts) or prefill(slots, prompts)
    prompts = [tok(t)["input_ids"] for t in ("hello", "a much longer prompt", "x", "what is seven plus two?")] * 2
    assert max(map(len, prompts)) < 30 < sum(map(len, prompts))
    sampling = sp(6, 1.0, 1.0)
    u = torch.rand(len(prompts), 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = engine.decode(prompts, sampling, u)
    assert len(calls) > 1 and all(sum(map(len, c)) <= 30 for c in calls), [list(map(len, c)) for c in calls]
    assert sorted(p for c in calls for p in c) == sorted(prompts)
    want = eager_decode(engine.model, prompts, sampling, u, set(engine.eos_token_ids), tok.pad_token_id)
    assert [o.token_ids for o in got] == [tokens for tokens, _ in want]


def test_a_row_moved_down_a_slot_keeps_its_age(tiny_model):
    """2 slots, 3 requests, 4 steps between checks: a short row in slot 0 finishes, the next request takes slot 0
    later and finishes too, and the long row of slot 1, prefilled first, moves down into slot 0. Its cached length
    and the tokens it may still draw follow from the steps since its own prefill, not the slot's last occupant's:
    the steps stop at its last token (29), and its tokens are the reference's (a check after every step)."""
    tok = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    engine = LocalEngine(model, eos_token_ids=[], pad_token_id=tok.pad_token_id)  # rows end at their budgets
    engine.decoder.max_slots = lambda length: 2
    engine.decoder.check_every = 4
    steps, decode = [], engine.runner.decode
    engine.runner.decode = lambda batch, *a: steps.append(batch) or decode(batch, *a)
    prompts = [tok(t)["input_ids"] for t in ("hello", "one two", "x")]
    u = torch.rand(3, 30, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    limits = [3, 30, 3]
    outs = engine.decode(prompts, sp(30, 1.0, 1.0), u, limits=limits)
    assert [len(o.token_ids) for o in outs] == limits
    assert steps.count(1) > 0 and len(steps) == 29  # it ran alone, in slot 0, to its 30th token
    engine.decoder.check_every = 1
    assert [o.token_ids for o in engine.decode(prompts, sp(30, 1.0, 1.0), u, limits=limits)] == \
        [o.token_ids for o in outs]


def test_without_graphs_a_decode_step_runs_at_its_live_rows_count(tiny_model):
    """On the CPU (no CUDA graphs to replay) a step computes only the rows still decoding: as rows
    finish, the batch shrinks one by one, not to the next bucket up (with buckets 3 live rows ran as 4)."""
    engine, tok = make_engine(tiny_model)
    steps = []
    decode = engine.runner.decode
    engine.runner.decode = lambda batch, *a: steps.append(batch) or decode(batch, *a)
    prompts = [tok(t)["input_ids"] for t in ("hello", "abc", "one two", "x", "seven")]
    u = torch.rand(5, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    outs = engine.decode(prompts, sp(9, 1.0, 1.0), u, limits=[2, 3, 5, 9, 9])
    made = [len(o.token_ids) for o in outs]
    assert steps == [sum(m > j for m in made) for j in range(1, max(made))], (steps, made)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("block", [64, 32])
def test_the_gpus_decode_attention_kernel_attends_to_each_slot_up_to_its_position(block):
    """The fast engine's decode attention on a GPU (miles.rollout.local.decode_attention; here in Triton's interpreter
    where there is no GPU): each slot's query heads attend to its own cached columns [0, position], as SDPA over
    that slot alone does; a group of 3 query heads a KV head (a tile of 16 rows), positions at block edges; at the
    kernel's block of columns and at the benchmark sweep's other blocks."""
    from miles.rollout.local.decode_attention import decode_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    kv_heads, group, dim, length = 2, 3, 16, 200
    keys, values = (torch.randn(7, kv_heads, length, dim, generator=g).to(device) for _ in range(2))  # 7 slots
    q = torch.randn(5, kv_heads * group, dim, generator=g).to(device)  # slots 0..4 decode
    positions = torch.tensor([0, 63, 64, 130, 199], device=device)
    got = decode_attention(q, keys, values, positions, 0.25, block=block)
    for j, p in enumerate(positions.tolist()):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[j].view(kv_heads, group, dim), keys[j, :, :p + 1], values[j, :, :p + 1], scale=0.25)
        torch.testing.assert_close(got[j], want.reshape(-1, dim), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_gpus_fused_decode_kernels_compute_what_the_layer_functions_do():
    """decode_fused's kernels (here in Triton's interpreter, fp32, where there is no GPU; bf16 on one): RMSNorm as HF's
    RMSNorm, SiLU(gate) * up, RoPE of the queries and keys (the keys and values written at each row's slot and
    position, nothing else in the cache touched) as the layer functions compute them, in fp32 rounded once."""
    from miles.rollout.local import decode_fused
    from miles.rollout.local.runner import _rms_norm, _rotate_half

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter truncates to bf16
    # fp32 in the interpreter: equal to fp32 rounding; bf16 on a GPU: a sum's order may move a value by one bf16 step
    close = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 96, generator=g), torch.rand(96, generator=g) + 0.5
    x, w, residual = x.to(device, dtype), w.to(device, dtype), torch.randn(5, 96, generator=g).to(device, dtype)
    torch.testing.assert_close(decode_fused.rms_norm(x, w, 1e-6), _rms_norm(x, w, 1e-6), **close)
    summed = x + residual
    torch.testing.assert_close(decode_fused.rms_norm(x, w, 1e-6, residual), _rms_norm(summed, w, 1e-6), **close)
    torch.testing.assert_close(x, summed, rtol=0, atol=0)  # the residual stream, added in place as torch adds
    gate_up = torch.randn(5, 2 * 1500, generator=g).to(device, dtype)  # two blocks of columns, the second partial
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(decode_fused.silu_and_mul(gate_up), (F.silu(gate) * up).to(dtype), **close)

    heads, kv_heads, dim, length, slots = 6, 2, 16, 40, 7
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=g).to(device, dtype)
    angles = torch.rand(length, 1, dim // 2, generator=g) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(device, dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(device, dtype)
    positions = torch.tensor([0, 3, 39, 7, 20], device=device)
    keys, values = (torch.randn(slots, kv_heads, length, dim, generator=g).to(device, dtype) for _ in range(2))
    want_keys, want_values = keys.clone(), values.clone()
    q = decode_fused.rope_and_cache(qkv, cos, sin, positions, keys, values, heads)
    wq, wk, wv = qkv.float().view(5, heads + 2 * kv_heads, dim).split([heads, kv_heads, kv_heads], dim=1)
    c, s = cos[positions].float(), sin[positions].float()
    rows = torch.arange(5, device=device)
    want_keys[rows, :, positions] = (wk * c + _rotate_half(wk) * s).to(dtype)
    want_values[rows, :, positions] = wv.to(dtype)
    torch.testing.assert_close(q, (wq * c + _rotate_half(wq) * s).to(dtype), **close)
    torch.testing.assert_close(keys, want_keys, **close)
    torch.testing.assert_close(values, want_values, rtol=0, atol=0)

    # A prefill's packed rows: row j at slots[j] (two rows share a slot), the rows' keys and values returned too,
    # each KV head repeated for its query heads as repeat_interleave repeats it
    slots = torch.tensor([4, 1, 4, 6, 0], device=device)
    keys, values = (torch.randn(7, kv_heads, length, dim, generator=g).to(device, dtype) for _ in range(2))
    want_keys, want_values = keys.clone(), values.clone()
    q, k, v = decode_fused.rope_and_cache(qkv, cos, sin, positions, keys, values, heads, slots=slots, repeat=3)
    rotated = wk * c + _rotate_half(wk) * s
    want_keys[slots, :, positions], want_values[slots, :, positions] = rotated.to(dtype), wv.to(dtype)
    torch.testing.assert_close(q, (wq * c + _rotate_half(wq) * s).to(dtype), **close)
    torch.testing.assert_close(keys, want_keys, **close)
    torch.testing.assert_close(values, want_values, rtol=0, atol=0)
    torch.testing.assert_close(k, rotated.repeat_interleave(3, dim=1).to(dtype), **close)
    torch.testing.assert_close(v, wv.repeat_interleave(3, dim=1).to(dtype), rtol=0, atol=0)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("folded", [True, False])
def test_a_prefill_in_the_fused_kernels_computes_what_the_layer_functions_do(tiny_qwen, monkeypatch, folded):
    """The fast engine's prefill through decode_fused (a GPU's default; forced here, in Triton's interpreter): prompts
    packed into one row, each into its own slot, give the layer functions' logits and cache, within fp32 noise; with
    the norms folded into the projections (`_folded_layer`, the default) and in kernels of their own."""
    from miles.rollout.local import decode_fused

    device = "cuda" if torch.cuda.is_available() else "cpu"
    close = dict(rtol=1e-5, atol=1e-5) if device == "cpu" else dict(rtol=1e-4, atol=1e-4)
    tok = load_tokenizer(tiny_qwen)
    model = load_causal_lm(tiny_qwen, device=device, attention_backend="sdpa")
    runner = LocalEngine(model, eos_token_ids=eos_token_ids(model, tok), pad_token_id=tok.pad_token_id).runner
    prompts = [tok(t)["input_ids"] for t in ("hello there", "a longer prompt than the others", "x")]
    runner.reserve(4, 64)
    monkeypatch.setattr(runner, "_fused_kernels", lambda: None)  # the layer functions
    want = runner.prefill([2, 0, 3], prompts, keep=[1, 3, 1])
    want_cache = runner.cache.data.clone()
    runner.cache.data.zero_()
    calls, fused = [], decode_fused.rope_and_cache
    monkeypatch.setattr(decode_fused, "rope_and_cache",
                        lambda *a, **k: calls.append((a[-1], k.get("norm") is not None)) or fused(*a, **k))
    monkeypatch.setattr(runner, "_fused_kernels", lambda: decode_fused)
    monkeypatch.setattr(runner, "fold_norms", folded)
    got = runner.prefill([2, 0, 3], prompts, keep=[1, 3, 1])
    assert calls and all(c == (runner.group, folded) for c in calls)  # the prefill's form of the kernel ran
    torch.testing.assert_close(got, want, **close)
    torch.testing.assert_close(runner.cache.data, want_cache, **close)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("bias", [True, False])
def test_with_a_norm_folded_the_kernels_take_the_projection_of_the_unnormalised_rows(bias):
    """The kernels after a projection whose RMSNorm weight is folded into its weight (runner.py's `_folded_layer`;
    here in Triton's interpreter, fp32; bf16 on a GPU): given x's projection and `norm` (x, eps), rope_and_attend,
    rope_and_cache (a prefill's packed rows, keys and values repeated) and silu_and_mul compute what they compute from
    the projection of the normalised rows with the bias: their outputs and the cache within fp32 noise (bf16's)."""
    from miles.rollout.local import decode_fused
    from miles.rollout.local.decode_attention import rope_and_attend
    from miles.rollout.local.runner import _rms_norm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    close = dict(rtol=1e-5, atol=1e-5) if device == "cpu" else dict(rtol=3e-2, atol=3e-2)  # rounded apart in bf16
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, length, hidden, eps = 6, 2, 16, 200, 40, 1e-6

    def tensor(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, dtype)

    x = tensor(torch.randn(5, hidden, generator=g) * 3)
    norm = tensor(torch.rand(hidden, generator=g) + 0.5)
    w = tensor(torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=g) / 6)
    b = tensor(torch.randn((heads + 2 * kv_heads) * dim, generator=g)) if bias else None
    want_qkv, folded_qkv = F.linear(_rms_norm(x, norm, eps), w, b), x @ (w * norm).t()
    angles = torch.rand(length, 1, dim // 2, generator=g) * 6
    cos, sin = tensor(torch.cat([angles.cos()] * 2, -1)), tensor(torch.cat([angles.sin()] * 2, -1))
    positions = torch.tensor([0, 31, 32, 130, 199], device=device)
    keys, values = (tensor(torch.randn(7, kv_heads, length, dim, generator=g)) for _ in range(2))

    want_keys, want_values, got_keys, got_values = keys.clone(), values.clone(), keys.clone(), values.clone()
    want = rope_and_attend(want_qkv, cos, sin, positions, want_keys, want_values, heads, 0.25, block=32)
    got = rope_and_attend(folded_qkv, cos, sin, positions, got_keys, got_values, heads, 0.25, norm=(x, eps), bias=b,
                          block=32)
    for a, e in ((got, want), (got_keys, want_keys), (got_values, want_values)):
        torch.testing.assert_close(a, e, **close)

    slots = torch.tensor([4, 1, 4, 6, 0], device=device)
    want_keys, want_values, got_keys, got_values = keys.clone(), values.clone(), keys.clone(), values.clone()
    want = decode_fused.rope_and_cache(want_qkv, cos, sin, positions, want_keys, want_values, heads, slots=slots,
                                       repeat=3)
    got = decode_fused.rope_and_cache(folded_qkv, cos, sin, positions, got_keys, got_values, heads, slots=slots,
                                      repeat=3, norm=(x, eps), bias=b)
    for a, e in (*zip(got, want), (got_keys, want_keys), (got_values, want_values)):
        torch.testing.assert_close(a, e, **close)

    gate_up = tensor(torch.randn(2 * 1500, hidden, generator=g) / 6)
    torch.testing.assert_close(decode_fused.silu_and_mul(x @ (gate_up * norm).t(), norm=(x, eps)),
                               decode_fused.silu_and_mul(F.linear(_rms_norm(x, norm, eps), gate_up)), **close)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_gpus_rope_and_attend_kernel_is_rope_and_cache_then_decode_attention():
    """A decode step's RoPE, cache write and attention in one kernel (decode_attention.rope_and_attend; here in Triton's
    interpreter where there is no GPU): the cache rope_and_cache writes, bit for bit, and the output of
    decode_attention over its queries; positions 0 (only the new column), at block edges and past them."""
    from miles.rollout.local import decode_fused
    from miles.rollout.local.decode_attention import decode_attention, rope_and_attend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    close = dict(rtol=1e-4, atol=1e-5) if device == "cpu" else dict(rtol=2e-2, atol=1e-2)  # bf16 on a GPU
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, length = 6, 2, 16, 200
    positions = torch.tensor([0, 31, 32, 130, 199], device=device)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=g).to(device, dtype)
    angles = torch.rand(length, 1, dim // 2, generator=g) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(device, dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(device, dtype)
    keys, values = (torch.randn(7, kv_heads, length, dim, generator=g).to(device, dtype) for _ in range(2))
    want_keys, want_values = keys.clone(), values.clone()
    q = decode_fused.rope_and_cache(qkv, cos, sin, positions, want_keys, want_values, heads)
    want = decode_attention(q, want_keys, want_values, positions, 0.25, block=32)
    got = rope_and_attend(qkv, cos, sin, positions, keys, values, heads, 0.25, block=32)
    torch.testing.assert_close(got, want, **close)
    torch.testing.assert_close(keys, want_keys, rtol=0, atol=0 if device == "cpu" else 2 ** -7)
    torch.testing.assert_close(values, want_values, rtol=0, atol=0)


COMPILE_FOR_AN_H100 = """
import json, sys
import importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

for module, name, signature, constants in json.loads(sys.argv[1]):
    kernel = getattr(importlib.import_module(module), name)
    signature.update({c: "constexpr" for c in constants})
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32))
    except RuntimeError as e:  # no CUDA toolchain in this Triton
        print("no toolchain:", e)
        sys.exit(3)
    assert compiled.asm["cubin"], name
"""


def compile_for_an_h100(kernels: list[tuple[str, str, dict, dict]]) -> None:
    """Compiles each (module, kernel, {argument: Triton type}, {constexpr: value}) for an H100 (sm_90) without one, in a
    process without Triton's interpreter (the tests' conftest turns it on, and it runs what the GPU's compiler refuses:
    a loop variable whose type changes); skips where this Triton has no CUDA toolchain."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_AN_H100, json.dumps(kernels)], env=env,
                          capture_output=True, text=True)
    if done.returncode == 3:
        pytest.skip(done.stdout)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_decode_attention_kernels_compile_for_an_h100(dtype):
    """Both decode attention kernels, at the engine's shapes; rope_and_attend as it is and with the input norm folded
    (its row scale read, with the q/k/v bias and without: runner.py's `_folded_layer`)."""
    ptr, types = f"*{dtype}", {"positions": "*i64", "scale": "fp32", "group": "i32", "N": "i32", "eps": "fp32"}
    names = {
        "_decode_attention": ["q", "keys", "values", "positions", "out", "s_qb", "s_qh", "s_ks", "s_kh", "s_kl", "s_ob",
                              "s_oh", "scale", "group"],
        "_rope_and_attend": ["qkv", "cos", "sin", "positions", "keys", "values", "out", "normed", "bias", "s_row",
                             "s_pos", "s_ks", "s_kh", "s_kl", "s_ob", "s_oh", "s_n", "scale", "group", "N", "eps"],
    }
    kernels = []
    for name, args in names.items():
        signature = {n: types.get(n, "i64" if n.startswith("s_") else ptr) for n in args}
        constants = dict(D=64, G=16, KEYS=64, IEEE=dtype == "fp32")
        if name == "_decode_attention":
            kernels.append(("miles.rollout.local.decode_attention", name, signature, constants))
            continue
        for norm, bias in ((False, True), (True, True), (True, False)):
            folded = dict(constants, HEADS=14, KV_HEADS=2, NORM=norm, HIDDEN=1024, **({} if bias else {"bias": None}))
            kernels.append(("miles.rollout.local.decode_attention", name, signature, folded))
    compile_for_an_h100(kernels)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_fused_decode_kernels_compile_for_an_h100():
    """decode_fused's norm (with and without the residual add, fast and EXACT sum), RoPE-and-cache (a decode step's
    rows, and a prefill's packed ones with its keys and values repeated for attention without GQA; each as it is and
    with a folded norm's row scale, with the q/k/v bias and without) and SiLU-and-multiply (with a folded norm's row
    scale and without), bf16 at the engine's shapes."""
    norm = ["x", "residual", "weight", "out", "N", "s_x", "s_r", "s_o", "eps"]
    rope = ["qkv", "cos", "sin", "positions", "slots", "q", "keys", "values", "k_out", "v_out", "normed", "bias",
            "s_row", "s_pos", "s_ks", "s_kh", "s_kl", "s_qn", "s_qh", "s_on", "s_n", "N", "eps"]
    types = {"N": "i32", "F": "i32", "eps": "fp32", "positions": "*i64", "slots": "*i64", "cos": "*fp32",
             "sin": "*fp32", "q": "*fp32", "k_out": "*fp32"}

    def signature(args):
        return {n: types.get(n, "i64" if n.startswith("s_") else "*bf16") for n in args}

    module = "miles.rollout.local.decode_fused"
    kernels = [(module, "_rms_norm", signature(norm), dict(ADD=add, BLOCK=1024, EXACT_SUM=exact))
               for add in (True, False) for exact in (True, False)]
    kernels += [(module, "_rope_and_cache", signature(rope),
                 dict(HEADS=14, KV_HEADS=2, QB=16, KB=2, D=64, SLOTS=packed, REPEAT=7 if packed else 0, NORM=norm,
                      HIDDEN=1024, **({} if bias else {"bias": None})))
                for packed in (True, False) for norm, bias in ((False, True), (True, True), (True, False))]
    kernels += [(module, "_silu_and_mul", signature(["x", "out", "F", "s_x", "s_o", "normed", "N", "s_n", "eps"]),
                 dict(BLOCK=1024, NORM=norm, HIDDEN=1024)) for norm in (True, False)]
    compile_for_an_h100(kernels)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_device_draws_kernels_compile_for_an_h100():
    """The device draw's two kernels over bf16 logits and the trainer's log-probs over fp32 ones, dividing by the
    temperature and not (temperature 1), at a 151,936-token vocabulary's block count."""
    types = {"V": "i32", "temperature": "fp32", "units": "fp32", "unit": "fp32", "blocks": "i32", "s_row": "i64",
             "logits": "*bf16", "maxes": "*fp32", "masses": "*i64", "uniforms": "*fp64", "tokens": "*i64",
             "log_probs": "*fp32", "x": "*fp32", "targets": "*i64", "log_z": "*fp32"}
    names = {
        "block_masses": (["logits", "s_row", "maxes", "masses", "V", "temperature", "units"], {"CHUNK": 4096}),
        "draw": (["logits", "s_row", "maxes", "masses", "uniforms", "tokens", "log_probs", "V", "temperature", "units",
                  "unit", "blocks"], {"CHUNK": 4096, "BLOCKS": 64}),
        "token_log_probs": (["x", "s_row", "targets", "log_probs", "log_z", "V", "temperature", "units", "unit"],
                            {"CHUNK": 4096, "BLOCKS": 64}),
    }
    compile_for_an_h100([("miles.utils.invariant_kernels", name, {n: types[n] for n in args},
                          {**constants, "DIVIDE": divide})
                         for name, (args, constants) in names.items() for divide in (True, False)])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("attention", ["rope_and_cache", "rope_and_attend", "folded"])
def test_a_decode_step_in_the_fused_kernels_makes_the_tokens_of_the_layer_functions(tiny_qwen, monkeypatch, attention):
    """The fast engine's decode steps through decode_fused (a GPU's default, in fp32 there; forced here, in Triton's
    interpreter, where there is none), on a model with q/k/v biases: the tokens of the layer functions' steps (the
    runner's `fused_decode` off), log-probs within fp32 noise; with the RoPE in its own kernel before SDPA, in the
    decode attention's kernel (rope_and_attend) with the norms' kernels, and with the norms folded into the
    projections (`_folded_layer`, a GPU's default: rope_and_attend and silu_and_mul scale the rows)."""
    from miles.rollout.local import decode_attention, decode_fused

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = load_tokenizer(tiny_qwen)
    model = load_causal_lm(tiny_qwen, device=device, attention_backend="sdpa")
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(model, tok), pad_token_id=tok.pad_token_id)
    prompts = [tok(t)["input_ids"] for t in ("hello", "a longer prompt", "x")]
    u = torch.rand(3, 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    monkeypatch.setattr(engine.runner, "fused_decode", False)
    want = engine.decode(prompts, sp(12, 1.0, 1.0), u)
    monkeypatch.setattr(engine.runner, "fused_decode", True)
    monkeypatch.setattr(engine.runner, "fold_norms", attention == "folded")
    calls, fused = [], decode_fused.silu_and_mul
    monkeypatch.setattr(decode_fused, "silu_and_mul", lambda *a, **k: calls.append(k.get("norm")) or fused(*a, **k))
    norms, norm = [], decode_fused.rms_norm
    monkeypatch.setattr(decode_fused, "rms_norm", lambda *a, **k: norms.append(1) or norm(*a, **k))
    if device == "cpu":
        monkeypatch.setattr(engine.runner, "_fused_kernels", lambda: decode_fused)
    attended, kernel = [], decode_attention.rope_and_attend
    if attention != "rope_and_cache":
        monkeypatch.setattr(engine.runner, "_decode_kernel", lambda: decode_attention)
        monkeypatch.setattr(decode_attention, "rope_and_attend",
                            lambda *a, **k: attended.append(k.get("norm")) or kernel(*a, **k))
    else:
        monkeypatch.setattr(engine.runner, "triton_decode", False)
    engine.runner.release()  # graphs captured without the kernels go
    got = engine.decode(prompts, sp(12, 1.0, 1.0), u)
    layers, folded = model.config.num_hidden_layers, attention == "folded"
    steps = len(calls) // layers - 1  # a layer's SiLU-and-multiply in the prefill, then in each step
    assert steps > 0 and bool(attended) == (attention != "rope_and_cache")
    assert all((c is not None) == folded for c in calls) and all((a is not None) == folded for a in attended)
    # the prefill's and each step's two norms a layer and final norm, or the final norm alone
    assert len(norms) == (steps + 1) * (1 if folded else 2 * layers + 1)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_folded_decode_reads_an_update_of_the_weights_and_norms_and_drops_its_copies_on_release(
        tiny_qwen, monkeypatch):
    """The decode steps with the norms folded into the projections (a GPU's default; forced here, in Triton's
    interpreter) run on copies of the q/k/v and gate/up weights with the norms' weights in them: an update of the
    norms alone reaches them, so the next log-probs are the trainer's of the new weights (within 1e-4); a
    release of the engine's memory drops the copies with the cache."""
    from miles.rollout.local import decode_attention, decode_fused

    device = "cuda" if torch.cuda.is_available() else "cpu"  # fp32 on a GPU, in its graphs
    tok = load_tokenizer(tiny_qwen)
    model = load_causal_lm(tiny_qwen, device=device, attention_backend="sdpa")
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(model, tok), pad_token_id=tok.pad_token_id)
    runner = engine.runner
    monkeypatch.setattr(runner, "_fused_kernels", lambda: decode_fused)
    monkeypatch.setattr(runner, "_decode_kernel", lambda: decode_attention)
    folds, fold = [], runner._folded_layer
    monkeypatch.setattr(runner, "_folded_layer", lambda *a: folds.append(1) or fold(*a))
    prompts = [tok(p)["input_ids"] for p in ["1+1=", "what is seven plus two?", "x"]]
    engine.generate(prompts, sp(4, 1.0, 1.0), [0, 1, 2])
    assert folds and all(w.folds for w in runner._weights)
    new = load_causal_lm(tiny_qwen, device=device, attention_backend="sdpa")
    with torch.no_grad():  # the norms alone: the folded copies must follow a change of either factor
        norms = [(n, p.mul_(1.5 + 0.1 * torch.randn_like(p))) for n, p in new.named_parameters() if "norm" in n]
    engine.update_weights(norms, weight_version=1)
    outs = engine.generate(prompts, sp(16, 1.0, 1.0), [3, 4, 5])
    samples = [Sample(group_index=i, index=i, prompt="", tokens=p + o.token_ids, response_length=len(o.token_ids),
                      loss_mask=[1] * len(o.token_ids), rollout_log_probs=o.log_probs)
               for i, (p, o) in enumerate(zip(prompts, outs))]
    batch = TrainBatch.from_samples(samples, tok.pad_token_id, device)
    with torch.no_grad():
        logp, _ = response_log_probs(new, batch, 1.0)
    assert batch.mask.sum() > 15
    assert ((logp - batch.rollout_log_probs).abs() * batch.mask).max().item() < 1e-4
    engine.release_memory()
    assert runner.cache is None and runner._weights and not any(w.folds for w in runner._weights)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_under_the_mode_the_decode_keeps_to_the_layer_functions_where_rows_are_wider_than_the_exact_mean(
        tiny_qwen, monkeypatch):
    """Under --true-on-policy-mode the fused norm sums each row exactly, as the trainer's invariant row mean does. A
    row wider than that mean takes (invariant.ROW_MEAN_MAX) the trainer sums with torch, which the kernel does not
    repeat, so there the GPU's decode steps through the layer functions (the run would stop at step 1 otherwise);
    outside the mode, and at widths the mean takes, the fused kernels still run."""
    from miles.rollout.local import decode_fused
    from miles.utils import invariant

    tok = load_tokenizer(tiny_qwen)
    model = load_causal_lm(tiny_qwen, device="cpu", attention_backend="sdpa")
    runner = LocalEngine(model, eos_token_ids=eos_token_ids(model, tok), pad_token_id=tok.pad_token_id).runner
    runner.reserve(1, 16)  # the layers' weights
    monkeypatch.setattr(runner, "device", torch.device("cuda"))  # where _fused_kernels picks the kernels
    monkeypatch.setattr(runner, "fused_decode", True)
    hidden = model.config.hidden_size
    monkeypatch.setattr(invariant, "enabled", lambda: True)
    monkeypatch.setattr(invariant, "ROW_MEAN_MAX", hidden)
    assert runner._fused_kernels() is decode_fused
    monkeypatch.setattr(invariant, "ROW_MEAN_MAX", hidden - 1)
    assert runner._fused_kernels() is None
    monkeypatch.setattr(invariant, "enabled", lambda: False)
    assert runner._fused_kernels() is decode_fused


def test_sampling_at_a_large_vocabulary_follows_the_reported_distribution():
    """At Qwen's 151,936 tokens with a long tail: the distribution the inverse CDF samples (each
    token's CDF interval) equals exp(reported log-probs) to ~1e-12 in total variation, and every
    token with positive mass can be drawn. A float32 CDF is ~1e-4 off and makes thousands of tail
    tokens undrawable."""
    from miles.rollout.sampling import sampling_cdf

    vocab = 151_936
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen) * 3
    logits[:, :8] += 12  # a few likely tokens and a long tail, as a trained LM has
    log_probs = torch.log_softmax(logits, dim=-1)
    target = log_probs.double().exp()
    target = target / target.sum(-1, keepdim=True)
    cdf = sampling_cdf(log_probs, 1.0)
    sampled = torch.diff(cdf, dim=-1, prepend=torch.zeros(4, 1, dtype=torch.float64)) / cdf[:, -1:]
    tv = 0.5 * (sampled - target).abs().sum(-1)
    assert tv.max().item() < 1e-9
    assert not ((sampled <= 0) & (target > 1e-12)).any()  # no tail token has a zero-width interval
    # The bug this replaces: a float32 cumsum of the same probabilities.
    cdf32 = log_probs.exp().cumsum(-1)
    sampled32 = torch.diff(cdf32, dim=-1, prepend=torch.zeros(4, 1)).double() / cdf32[:, -1:].double()
    assert (0.5 * (sampled32 - target).abs().sum(-1)).max().item() > 1e-5
    assert ((sampled32 <= 0) & (target > 1e-12)).sum().item() > 1000


def test_top_k_and_top_p_cut_the_distribution_where_they_say():
    from miles.rollout.sampling import sampling_cdf

    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]], dtype=torch.float64)  # likeliest first: tokens 1, 3, 2, 0
    def kept(top_p, top_k=None):
        mass = torch.diff(sampling_cdf(probs.log(), top_p, top_k), dim=-1, prepend=torch.zeros(1, 1))
        return (mass[0] > 0).nonzero().flatten().tolist()
    assert kept(1.0) == [0, 1, 2, 3]
    assert kept(1.0, top_k=2) == [1, 3] and kept(1.0, top_k=1) == [1]
    assert kept(0.5) == [1, 3]  # 0.4 < 0.5: the next token is needed to reach it
    assert kept(0.35) == [1] and kept(0.75) == [1, 2, 3]  # (at exactly 0.4 the next one stays, as in SGLang)
    assert kept(0.75, top_k=2) == [1, 3]  # inside both cuts


def test_a_samples_random_stream_depends_on_its_seed_rollout_and_index_only():
    # Pinned: a captured run's samples must draw the same numbers on any machine and any later miles version.
    from miles.rollout.sampling import sample_seed

    assert sample_seed(42, 3, 0) == 3567722126139448721 and sample_seed(42, 3, 1) == 5961009303843704054
    assert len({sample_seed(s, r, i) for s in (1, 2) for r in (1, 2) for i in (0, 1)}) == 8


@pytest.mark.parametrize("vocab", [151_936, 1000, 129, 7])
def test_the_blocked_search_draws_what_a_full_cdf_search_draws(vocab):
    """The two-level inverse CDF (block masses, then the block's own CDF) picks, for every uniform,
    the token a float64 cumsum over the whole vocabulary picks (vocabularies a multiple of the block
    and not), including uniforms at the very ends."""
    from miles.rollout.sampling import _blocked_inverse_cdf

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=gen) * 3
    logits[:, : min(8, vocab)] += 12
    log_probs = logits - logits.logsumexp(-1, keepdim=True)
    full = log_probs.exp().double().cumsum(-1)
    u = torch.cat([torch.rand(4000, generator=gen, dtype=torch.float64), torch.tensor([0.0, 1 - 2**-53] * 2)])
    rows = torch.arange(len(u)) % 4
    got = _blocked_inverse_cdf(log_probs[rows], u)
    want = torch.searchsorted(full[rows], (u * full[rows, -1])[:, None], right=True).squeeze(-1).clamp(max=vocab - 1)
    assert torch.equal(got, want)
    assert got.max().item() < vocab


def test_large_vocabulary_draws_land_in_the_tail_at_the_tail_rate():

    vocab = 151_936
    logits = torch.zeros(1, vocab)
    logits[0, 0] = 12.0  # token 0 takes ~52% of the mass; 151,935 tail tokens share the rest
    log_probs = torch.log_softmax(logits, dim=-1)
    tail_mass = 1 - log_probs[0, 0].double().exp().item()
    n = 512
    u = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tokens, _ = sample_tokens(logits.expand(n, -1), sp(1, 1.0, 1.0), u)
    tail = (tokens > 0).double().mean().item()
    assert abs(tail - tail_mass) < 4 * math.sqrt(tail_mass * (1 - tail_mass) / n)
    assert tokens.max().item() > vocab - 2000  # the far end of the tail is reachable


def eager_decode(model, prompts, sampling, uniforms, eos, pad):
    """The reference the KV-cache loop must match: no cache, the whole sequence re-run every token."""
    outputs, device = [], next(model.parameters()).device
    for prompt, u in zip(prompts, uniforms):
        seq, logps = list(prompt), []
        for t in range(uniforms.shape[1]):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq], device=device)).logits[:, -1]
            tok, logp = sample_tokens(logits, sampling, u[t:t + 1])
            seq.append(int(tok))
            logps.append(float(logp))
            if int(tok) in eos:
                break
        outputs.append((seq[len(prompt):], logps))
    return outputs


DECODE_PATHS = {"fast": dict(decoder="fast"), "fast, 3 slots": dict(decoder="fast"),
                "hf dynamic": dict(decoder="hf", cache="dynamic"), "hf static": dict(decoder="hf", cache="static")}


@pytest.mark.parametrize("model_kind", ["llama", "qwen2"])
@pytest.mark.parametrize("path", list(DECODE_PATHS))
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_kv_cache_decode_matches_the_eager_reference(tiny_model, tiny_qwen, path, model_kind, temperature, top_p):
    """Both decode paths (fast: packed prefill, slot KV cache, continuous batching; with 3 slots for
    16 requests, so rows wait, take freed slots and move down; hf: left-padded batch through the
    model's own dynamic or static cache) give the tokens of decoding each prompt alone without a
    cache, log-probs within fp32 noise, each row stopping on its own."""
    plain, tok = make_engine(tiny_model if model_kind == "llama" else tiny_qwen)
    engine = LocalEngine(plain.model, eos_token_ids=plain.eos_token_ids, pad_token_id=tok.pad_token_id,
                         **DECODE_PATHS[path])
    assert (engine.runner is not None) == path.startswith("fast")
    if path == "fast, 3 slots":
        engine.decoder.max_slots = lambda length: 3
    prompts = [tok(t)["input_ids"] for t in ("hello", "a much longer prompt", "x", "what is seven plus two?")] * 4
    sampling = sp(40, temperature, top_p)
    u = torch.rand(len(prompts), 40, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = engine.decode(prompts, sampling, u)
    want = eager_decode(engine.model, prompts, sampling, u, set(engine.eos_token_ids), tok.pad_token_id)
    for out, (tokens, logps) in zip(got, want):
        assert out.token_ids == tokens
        assert out.log_probs == pytest.approx(logps, abs=1e-5)
        assert out.finish_reason == ("stop" if tokens[-1] in engine.eos_token_ids else "length")
    assert {o.finish_reason for o in got} == {"stop", "length"} or temperature == 0 or model_kind == "qwen2"
    if path == "fast, 3 slots":
        assert engine.runner.cache.slots == 3


def test_the_fast_path_decodes_qwen3s_per_head_norms_as_the_eager_reference(tiny_qwen3):
    """Qwen3 normalises each query and key head before RoPE (the layer function's q/k-norm branch): the fast path
    gives the tokens of decoding each prompt alone without a cache, log-probs within fp32 noise."""
    engine, tok = make_engine(tiny_qwen3)
    assert engine.runner is not None and engine.runner._weights == []  # the fast path, its weights fused at first use
    prompts = [tok(t)["input_ids"] for t in ("hello", "a much longer prompt", "x", "what is seven plus two?")]
    sampling = sp(24, 1.0, 1.0)
    u = torch.rand(len(prompts), 24, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = engine.decode(prompts, sampling, u)
    assert engine.runner._weights[0].q_norm is not None
    want = eager_decode(engine.model, prompts, sampling, u, set(engine.eos_token_ids), tok.pad_token_id)
    for out, (tokens, logps) in zip(got, want):
        assert out.token_ids == tokens
        assert out.log_probs == pytest.approx(logps, abs=1e-5)


def test_the_compiled_fast_path_decodes_what_the_eager_reference_decodes(tiny_qwen):
    """--enable-torch-compile: the layers through Inductor, the cache writes fused into the RoPE kernel (prefill
    and decode), give the tokens of decoding each prompt alone without a cache."""
    plain, tok = make_engine(tiny_qwen)
    engine = LocalEngine(plain.model, eos_token_ids=plain.eos_token_ids, pad_token_id=tok.pad_token_id,
                         decoder="fast", compile=True)
    prompts = [tok(t)["input_ids"] for t in ("hello", "a much longer prompt", "x")] * 2
    sampling = sp(24, 1.0, 1.0)
    u = torch.rand(len(prompts), 24, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want = eager_decode(engine.model, prompts, sampling, u, set(engine.eos_token_ids), tok.pad_token_id)
    for out, (tokens, logps) in zip(engine.decode(prompts, sampling, u), want):
        assert out.token_ids == tokens
        assert out.log_probs == pytest.approx(logps, abs=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_compiled_sampler_draws_what_the_eager_one_draws(temperature):
    """--enable-torch-compile's sampler (the plain path fused by torch.compile) draws the eager sampler's
    tokens from the same logits and uniforms, with its log-probs, on a vocabulary that is no multiple of
    the CDF's blocks; top-p goes to the eager path."""
    from miles.rollout.sampling import compiled_sample_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g) * 3
    u = torch.rand(6, generator=g, dtype=torch.float64)
    tok, logp = sample_tokens(logits, sp(1, temperature, 1.0), u)
    fused_tok, fused_logp = compiled_sample_tokens(logits, sp(1, temperature, 1.0), u)
    assert torch.equal(fused_tok, tok)
    torch.testing.assert_close(fused_logp, logp, rtol=0, atol=1e-5)
    top_p = compiled_sample_tokens(logits, sp(1, temperature, 0.5), u)
    assert all(torch.equal(a, b) for a, b in zip(top_p, sample_tokens(logits, sp(1, temperature, 0.5), u)))


def test_the_fast_path_samples_with_the_compiled_sampler_under_compile(tiny_model):
    from miles.rollout.sampling import compiled_sample_tokens

    model = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    assert LocalEngine(model, eos_token_ids=[], pad_token_id=0, compile=True).decoder.sample is compiled_sample_tokens
    assert LocalEngine(model, eos_token_ids=[], pad_token_id=0).decoder.sample is sample_tokens


def test_under_autocast_the_fast_path_computes_the_models_numbers_from_weights_cast_once(tiny_qwen):
    """fp32 weights under bf16 autocast (true on-policy mode): the runner's projections and LM head run on
    bf16 copies made once, bitwise what autocast computes from the fp32 weights; a weight written after
    (a sync) reaches its copy."""
    from miles.rollout.local.runner import ModelRunner

    model = load_causal_lm(tiny_qwen, device="cpu", attention_backend="sdpa")
    runner = ModelRunner(model, cuda_graphs=False)
    runner.reserve(2, 64)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]

    def both():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            fast = runner.prefill([0, 1], prompts)
            hf = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts])
        return fast, hf

    fast, hf = both()
    assert fast.dtype == torch.bfloat16 and torch.equal(fast, hf)
    assert len(runner._copies()) == 1 + 5 * model.config.num_hidden_layers  # the LM head; 4 projections, q/k/v bias
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
    again, hf_again = both()
    assert torch.equal(again, hf_again) and not torch.equal(again, fast)
