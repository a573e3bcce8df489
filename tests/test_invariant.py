"""Batch-invariant kernels (miles.utils.invariant, --true-on-policy-mode on a GPU): one row's result never
depends on the rows computed with it, and the kernels compute what torch computes, within rounding.

On a machine without a GPU the kernels run in Triton's interpreter (numpy), which checks their logic;
the GPU tests check the same on the device, where the property is at stake, and a true on-policy run
in bf16 that re-draws nothing."""

import contextlib
import importlib.util
import json

import pytest
import torch

from miles.utils import invariant
from miles.utils.varlen import per_sequence_attention

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


@pytest.fixture(params=["interpreter", "cuda"])
def device(request):
    """Where the kernels run: Triton's interpreter on the CPU (only where there is no GPU: conftest.py
    turns it on), or the GPU."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton")
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        request.applymarker(pytest.mark.gpu)
    elif torch.cuda.is_available():
        pytest.skip("the GPU runs the kernels themselves")
    return "cpu" if request.param == "interpreter" else "cuda"


def dtype_for(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def compute(device):
    """The trainer's context in bf16 on the GPU (autocast), plain fp32 in the interpreter."""
    return torch.autocast("cuda", torch.bfloat16) if device == "cuda" else contextlib.nullcontext()


def exact_addmm(bias, a, w):
    """bias + a @ w.T summed in fp64: the kernel's bf16 result is this rounded once. (cuBLAS's own bf16 addmm is no
    reference at a long K: it may add split-K partials in bf16, off by a whole bf16 step of the result.)"""
    return torch.addmm(bias.double(), a.double(), w.double().t()).float()


def test_a_matmul_row_is_the_same_alone_and_in_any_batch(device):
    g = torch.Generator().manual_seed(0)
    dtype = dtype_for(device)
    a = torch.randn(300, 96, generator=g).to(device, dtype)
    w = torch.randn(200, 96, generator=g).to(device, dtype)  # a linear layer's (out, in) weight
    bias = torch.randn(200, generator=g).to(device, dtype)
    full = invariant.addmm(bias, a, w.t())
    torch.testing.assert_close(full.float(), exact_addmm(bias, a, w), rtol=1e-2, atol=1e-2)
    for rows in (slice(0, 1), slice(5, 12), slice(170, 300)):
        assert torch.equal(invariant.addmm(bias, a[rows], w.t()), full[rows])
    # A fused projection's column block (the engine's q/k/v in one matmul) equals the block alone.
    assert torch.equal(invariant.addmm(bias[50:120], a, w[50:120].t()), full[:, 50:120])
    assert torch.equal(invariant.mm(a[3:4], w.t()), invariant.mm(a, w.t())[3:4])


def test_a_matmul_in_k_slices_is_the_same_alone_and_in_any_batch(device):
    # A long reduction runs in slices of K added in order (on the GPU: bf16 with K 4096..16384, the MLP's down
    # projection); the interpreter runs fp32, whose tiles never slice K, so it is given sliced tiles.
    k = 4160 if device == "cuda" else 200
    tiles = invariant.tiles_for(k, torch.bfloat16) if device == "cuda" else invariant.Tiles(32, 32, 32, 4, 1, 3)
    assert tiles.splits > 1
    g = torch.Generator().manual_seed(3)
    dtype = dtype_for(device)
    a = torch.randn(150, k, generator=g).to(device, dtype)
    w = torch.randn(90, k, generator=g).to(device, dtype)
    bias = torch.randn(90, generator=g).to(device, dtype)
    full = invariant._matmul(a, w.t(), bias, tiles)
    torch.testing.assert_close(full.float(), exact_addmm(bias, a, w), rtol=1e-2, atol=1e-2)
    for rows in (slice(0, 1), slice(64, 150)):
        assert torch.equal(invariant._matmul(a[rows], w.t(), bias, tiles), full[rows])
    assert torch.equal(invariant._matmul(a, w[20:50].t(), bias[20:50], tiles), full[:, 20:50])
    if device == "cuda":
        assert torch.equal(invariant.addmm(bias, a, w.t()), full)  # what the aten override runs


def test_a_row_mean_is_the_same_alone_and_in_any_batch(device):
    x = torch.randn(64, 896, generator=torch.Generator().manual_seed(1)).to(device)
    full = invariant.mean_dim(x, [-1], True)
    torch.testing.assert_close(full, x.mean(-1, keepdim=True))
    assert torch.equal(invariant.mean_dim(x[7:9], [-1], True), full[7:9])
    torch.testing.assert_close(invariant.mean_dim(x.t(), [0]), x.t().mean(0))  # other layouts: torch's sum


def test_a_row_mean_sums_exactly_in_any_order(device):
    """The invariant row mean (--true-on-policy-mode's RMSNorm, in the trainer and in the decode's fused norm) sums a
    row exactly: its columns in any order give the same bits, within an fp32 rounding of the fp64 mean, over values
    spanning 40 binary orders of magnitude; a row with an inf or a nan gives inf or nan. (Triton's interpreter on
    the CPU; the kernel itself on a GPU.)"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 896, generator=g) * torch.exp2(torch.randint(-20, 20, (16, 896), generator=g).float())
    x[3, 5], x[4, 9] = float("inf"), float("nan")
    x = x.to(device)
    mean = invariant.mean_dim(x, [-1])
    for _ in range(3):
        shuffled = x[:, torch.randperm(896, generator=g).to(device)]
        assert torch.equal(invariant.mean_dim(shuffled, [-1]).nan_to_num(), mean.nan_to_num())
    want = x.double().mean(-1)
    finite = torch.ones(16, dtype=torch.bool, device=device)
    finite[3:5] = False
    torch.testing.assert_close(mean[finite], want[finite].float(), rtol=2 ** -23, atol=0)
    assert mean[3] == float("inf") and mean[4].isnan()


def test_the_fused_norm_sums_as_the_row_mean_does(device):
    """decode_fused's RMSNorm (in Triton's interpreter on the CPU) computes what torch's ops compute with the
    invariant row mean, bit for bit in fp32, alone and after its residual add: the two kernels share the exact sum."""
    from miles.rollout.local import decode_fused

    g = torch.Generator().manual_seed(1)
    x, weight, residual = (t.to(device) for t in (torch.randn(8, 896, generator=g) * 3,
                                                  torch.rand(896, generator=g) + 0.5, torch.randn(8, 896, generator=g)))
    for r in (None, residual):
        h = x + r if r is not None else x
        want = weight * (h * torch.rsqrt(invariant.mean_dim(h * h, [-1], True) + 1e-6))
        got = decode_fused.rms_norm(x.clone(), weight, 1e-6, r, exact=True)
        assert torch.equal(got, want), (got - want).abs().max()


def packed(device, lengths, heads=4, kv_heads=2, dim=16, seed=2):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, dim, generator=g).to(device) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


def test_packed_attention_is_causal_attention_within_each_sequence(device):
    q, k, v, cu = packed(device, [5, 70, 3, 130])
    with compute(device):
        out = invariant.packed_attention(q, k, v, cu, 0.25)
        want = per_sequence_attention(q, k, v, cu, 0.25, 0.0)
    tolerance = dict(rtol=2e-2, atol=2e-2) if device == "cuda" else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, want, **tolerance)


def test_a_decode_step_over_the_slot_cache_equals_the_packed_forward_bitwise(device):
    """The engine's decode of one token per slot computes exactly the trainer's packed attention at that
    position, whatever else is packed with it."""
    lengths = [5, 70, 3]
    q, k, v, cu = packed(device, lengths)
    with compute(device):
        out = invariant.packed_attention(q, k, v, cu, 0.25)
    keys = torch.zeros(3, 2, 80, 16, device=device)
    values = torch.zeros_like(keys)
    starts = cu.tolist()
    for slot, (lo, n) in enumerate(zip(starts, lengths)):
        keys[slot, :, :n], values[slot, :, :n] = k[lo:lo + n].transpose(0, 1), v[lo:lo + n].transpose(0, 1)
    for at in ([4, 69, 2], [0, 30, 1]):  # each slot's position
        rows = torch.tensor([lo + p for lo, p in zip(starts, at)], device=device)
        positions = torch.tensor(at, device=device)
        with compute(device):
            step = invariant.slot_attention(q[rows], keys, values, positions, 0.25)
            # the runner makes the tiles once a step and hands them to every layer
            tiles = invariant.slot_tiles(q.shape[1], keys, positions)
            assert torch.equal(invariant.slot_attention(q[rows], keys, values, positions, 0.25, tiles), step)
        assert torch.equal(step, out[rows])
    alone = torch.tensor([0, 70], dtype=torch.int32, device=device)  # the second sequence packed alone
    with compute(device):
        assert torch.equal(invariant.packed_attention(q[5:75], k[5:75], v[5:75], alone, 0.25), out[5:75])


def test_packed_attention_backward_is_the_attention_gradient(device):
    q, k, v, cu = packed(device, [6, 90])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with compute(device):
        loss = invariant.packed_attention(*leaves, cu, 0.25).float().square().sum()
    loss.backward()
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    with compute(device):
        loss = per_sequence_attention(*reference, cu, 0.25, 0.0).float().square().sum()
    loss.backward()
    tolerance = dict(rtol=5e-2, atol=5e-2) if device == "cuda" else dict(rtol=1e-4, atol=1e-5)
    for got, want in zip(leaves, reference):
        assert got.grad.dtype == want.grad.dtype == torch.float32
        torch.testing.assert_close(got.grad, want.grad, **tolerance)


def test_the_draw_is_the_plain_samplers_and_a_row_draws_alone_as_in_a_batch(device):
    from miles.rollout.sampling import _torch_sample

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(16, 9000, generator=g) * 4).to(device)
    u = torch.rand(16, generator=g, dtype=torch.float64).to(device)
    tokens, log_probs = invariant.sample(logits, u, 0.7)
    want_tokens, want_log_probs = _torch_sample(logits, u, 0.7)
    assert (tokens == want_tokens).float().mean() >= 15 / 16  # the same inverse CDF, other summation order
    torch.testing.assert_close(log_probs, torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None])[:, 0])
    # Uniforms on the CDF boundaries (the float64 mass up to a token, as torch sums it): where two summation
    # orders part, the draw lands on either side; a row drawn alone must land where it did in the batch.
    cdf = torch.softmax(logits.double() / 0.7, -1).cumsum(-1)
    boundary = cdf.gather(-1, torch.randint(0, 9000, (16, 1), generator=g).to(device))[:, 0]
    tokens, log_probs = invariant.sample(logits, boundary, 0.7)
    for rows in [slice(i, i + 1) for i in range(16)] + [slice(9, 16)]:
        alone = invariant.sample(logits[rows], boundary[rows], 0.7)
        assert torch.equal(alone[0], tokens[rows]) and torch.equal(alone[1], log_probs[rows])
    edge = torch.tensor([[0.0, 0.0, 0.0, 0.0]], device=device)  # equal halves: u just under 1/2 takes token 1
    assert invariant.sample(edge, torch.tensor([0.4999], dtype=torch.float64, device=device), 1.0)[0].item() == 1


def test_the_trainers_log_probs_are_the_draws_bitwise(device):
    # The engine draws from its logits in bf16 on the GPU, the trainer scores the same logits in fp32: Triton
    # lays the two loads out differently (8 bf16 a thread, 4 fp32), so a float sum would add in other orders.
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(12, 9000, generator=g) * 4).to(device, dtype_for(device))
    u = torch.rand(12, generator=g, dtype=torch.float64).to(device)
    for temperature in (1.0, 0.7, 0.3):
        tokens, log_probs = invariant.sample(logits, u, temperature)
        got, log_z = invariant.token_log_probs(logits.float(), tokens, temperature)  # the trainer's chunked log-probs
        assert torch.equal(got, log_probs)
        x = logits.float() / temperature
        torch.testing.assert_close(log_z, x.logsumexp(-1))
        torch.testing.assert_close(got, x.log_softmax(-1).gather(-1, tokens[:, None])[:, 0])
    x = torch.randn(3, 500, generator=g).to(device).requires_grad_()
    targets = torch.tensor([4, 0, 499], device=device)
    invariant.token_log_probs(x, targets, 0.7)[0].square().sum().backward()
    reference = x.detach().clone().requires_grad_()
    (reference / 0.7).log_softmax(-1).gather(-1, targets[:, None]).square().sum().backward()
    torch.testing.assert_close(x.grad, reference.grad)


def test_the_log_sum_exp_does_not_depend_on_the_order_within_a_block(device):
    # Each block's mass is an integer sum (fixed point) against the block's own max, so no order of additions within a
    # block, however a kernel lays the row out, can move it: a row's entries shuffled within each block of CHUNK give
    # the same log-sum-exp, bit for bit.
    # Rows shifted to a log-sum-exp near 0.7, whose float32 spacing (6e-8) shows a change in the sum's last bit.
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(32, 9000, generator=g) * 3
    logits = (logits - logits.logsumexp(-1, keepdim=True) + 0.7).to(device)
    targets = torch.zeros(32, dtype=torch.long, device=device)
    log_z = invariant.token_log_probs(logits, targets)[1]
    for _ in range(3):
        order = torch.cat([start + torch.randperm(min(invariant.CHUNK, 9000 - start), generator=g)
                           for start in range(0, 9000, invariant.CHUNK)])
        assert torch.equal(invariant.token_log_probs(logits[:, order.to(device)], targets)[1], log_z)
    # The largest sum a vocabulary of 2^18 - 1 tokens can make (every term 1, at the unit of its size) fits int64.
    flat = torch.zeros(2, (1 << 18) - 1, device=device)
    _, log_z = invariant.token_log_probs(flat, targets[:2])
    torch.testing.assert_close(log_z, flat.logsumexp(-1))
    ends = torch.tensor([0.0, 1 - 2 ** -40], dtype=torch.float64, device=device)
    tokens, log_probs = invariant.sample(flat, ends, 1.0)
    assert tokens.tolist() == [0, flat.shape[1] - 1] and torch.equal(log_probs, -log_z)


def test_the_draw_brings_each_block_to_the_rows_max(device):
    # The blocks' masses are summed against each block's own max, then scaled to the row's: a row whose likely tokens
    # lie in three blocks, the max in the second, and a block of -inf logits between them, drawn at 2,000 evenly spaced
    # uniforms (the inverse CDF's quantiles), lands on each token as often as its probability says (within 1 / 2,000).
    n = 2000
    logits = torch.full((n, 13000), -30.0)
    logits[:, 8192:12288] = float("-inf")
    likely = torch.tensor([5, 4000, 4100, 5000, 12999])  # blocks 0, 0, 1, 1, 3 of 4,096
    logits[:, likely] = torch.tensor([1.0, 0.5, 2.0, -0.5, 1.5])
    u = ((torch.arange(n, dtype=torch.float64) + 0.5) / n).to(device)
    tokens, log_probs = invariant.sample(logits.to(device), u, 0.7)
    want = torch.softmax(logits[0].double() / 0.7, -1)
    for token in likely.tolist():
        assert abs((tokens == token).double().mean().item() - want[token].item()) <= 1.5 / n, token
    assert set(tokens.tolist()) == set(likely.tolist())
    torch.testing.assert_close(log_probs.cpu(), want.log().float()[tokens.cpu()])


@needs_triton
def test_enable_routes_only_cuda_ops_and_disable_puts_torchs_back():
    a = torch.randn(4, 8)
    before = a @ a.t()
    invariant.enable()
    try:
        assert invariant.enabled()
        assert torch.equal(a @ a.t(), before)  # CPU ops never reach the kernels
    finally:
        invariant.disable()
    assert not invariant.enabled()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_true_on_policy_run_redraws_nothing(tiny_args):
    """--true-on-policy-check rescore: the engine decodes what the trainer computes, so every rollout passes the
    check's scoring pass in its first round, and the log-probs it reports are the trainer's."""
    from test_train import metrics, run

    try:
        rows = metrics(run(tiny_args, "--true-on-policy-mode", "--true-on-policy-check", "rescore", "--device",
                           "cuda", "--precision", "bf16", "--num-rollout", "3", "--rollout-max-response-len", "48"))
    finally:
        invariant.disable()
    assert len(rows) == 3
    for r in rows:
        assert r["rollout/true_on_policy_redrawn"] == 0
        assert r["train/recompute_logp_max_diff"] == 0.0  # the training forward against the old log-probs
        # step 1 (the alignment check): the trainer's scoring; later steps: the training forward on the engine's
        assert r["forward_logp_max_diff"] == 0.0 and r["train/train_rollout_logprob_abs_diff"] == 0.0
    assert [r["train/rollout_logprobs_used"] for r in rows] == [0.0, 1.0, 1.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_engine_log_probs_are_the_trainers_without_the_check(tiny_args):
    """--true-on-policy-check stop, the default on a GPU: no scoring pass, the engine reports the log-probs of its own
    draw; the loop stops a run where they are not the trainer's bit for bit. With the kernels doing their job, no
    step stops."""
    from test_train import metrics, run

    try:
        out = run(tiny_args, "--true-on-policy-mode", "--device", "cuda", "--precision", "bf16", "--num-rollout", "3",
                  "--rollout-max-response-len", "48", "--rollout-temperature", "0.8")
        rows = metrics(out)
    finally:
        invariant.disable()
    assert len(rows) == 3
    assert json.loads((out / "config.json").read_text())["true_on_policy_check"] == "stop"  # auto's choice
    assert not any("rollout/true_on_policy_redrawn" in r for r in rows)  # no rollout went through the scoring pass
    # step 1's trainer scoring (the alignment check), then each step's training forward, against the engine's
    assert all(r["forward_logp_max_diff"] == 0.0 == r["train/recompute_logp_max_diff"] for r in rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_padded_layout_is_refused_on_a_gpu(tiny_args, capsys):
    from miles.cli.main import main

    assert main(tiny_args + ["--true-on-policy-mode", "--device", "cuda", "--qkv-format", "bshd"]) == 2
    assert "drop --qkv-format bshd" in capsys.readouterr().err
    assert not invariant.enabled()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_under_the_mode_the_fused_decode_step_computes_the_layer_functions_bits(tiny_qwen, monkeypatch):
    """--true-on-policy-mode's decode (fp32 weights under bf16 autocast, the batch-invariant kernels) through
    decode_fused's norms and RoPE: the tokens and log-probs of the layer functions' steps, bit for bit (the engine's
    log-probs must stay the trainer's)."""
    import functools

    from miles.rollout.local import LocalEngine, decode_fused
    from miles.train.trainer import mixed_precision
    from miles.utils.models import eos_token_ids, load_causal_lm, load_tokenizer
    from test_engine import sp

    tok = load_tokenizer(tiny_qwen)
    model = load_causal_lm(tiny_qwen, dtype=torch.float32, device="cuda", attention_backend="sdpa")
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(model, tok), pad_token_id=tok.pad_token_id,
                         autocast=functools.partial(mixed_precision, "bf16", "cuda", cache=False))
    prompts = [tok(t)["input_ids"] for t in ("hello", "a longer prompt", "x", "what is seven plus two?")] * 3
    u = torch.rand(len(prompts), 40, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    calls, rope = [], decode_fused.rope_and_cache
    monkeypatch.setattr(decode_fused, "rope_and_cache", lambda *a: calls.append(1) or rope(*a))
    invariant.enable()
    try:
        with engine.autocast():  # as LocalEngine.generate decodes
            monkeypatch.setattr(engine.runner, "fused_decode", False)
            want = engine.decode(prompts, sp(40, 1.0, 1.0), u)
            assert not calls
            monkeypatch.setattr(engine.runner, "fused_decode", True)
            engine.runner.release()  # graphs captured without the kernels go
            got = engine.decode(prompts, sp(40, 1.0, 1.0), u)
    finally:
        invariant.disable()
    assert calls and engine.runner._graphs
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.log_probs for o in got] == [o.log_probs for o in want]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("piece", ["norm", "norm_after_add", "rope"])
def test_under_the_mode_the_fused_norm_and_rope_are_the_layer_functions_bits(piece):
    """decode_fused's RMSNorm (alone and after its residual add) and RoPE with the cache writes, at the Qwen2.5-0.5B
    widths, on fp32 rows and bf16 projections as the mode has them: the bits of the layer functions' torch ops with
    the batch-invariant mean, compared in fp32 (a bf16 result would hide a sum's order: the mode casts it after)."""
    from miles.rollout.local import decode_fused
    from miles.rollout.local.runner import _rms_norm, _rotate_half

    g = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, heads, kv_heads, d = 64, 896, 14, 2, 64
    invariant.enable()
    try:
        if piece.startswith("norm"):
            x = torch.randn(n, hidden, device="cuda", generator=g) * 3
            weight = torch.rand(hidden, device="cuda", generator=g) + 0.5
            residual = torch.randn(n, hidden, device="cuda", generator=g).bfloat16() if piece != "norm" else None
            want_x = x + residual if residual is not None else x.clone()
            want = _rms_norm(want_x, weight, 1e-6)
            got = decode_fused.rms_norm(x, weight, 1e-6, residual, exact=True)
            assert torch.equal(x, want_x)  # the residual stream, added in place
        else:
            qkv = torch.randn(n, (heads + 2 * kv_heads) * d, device="cuda", generator=g).bfloat16()
            angles = torch.rand(512, 1, d, device="cuda", generator=g) * 6
            cos, sin = angles.cos(), angles.sin()
            positions = torch.randint(0, 512, (n,), device="cuda", generator=g)
            keys, values = (torch.zeros(n, kv_heads, 512, d, device="cuda") for _ in range(2))
            q, k, v = qkv.view(n, heads + 2 * kv_heads, d).split([heads, kv_heads, kv_heads], dim=1)
            c, s = cos[positions], sin[positions]
            want = q * c + _rotate_half(q) * s
            want_k = k * c + _rotate_half(k) * s
            got = decode_fused.rope_and_cache(qkv, cos, sin, positions, keys, values, heads, exact=True)
            assert torch.equal(keys[torch.arange(n), :, positions], want_k)
            assert torch.equal(values[torch.arange(n), :, positions], v.float())
    finally:
        invariant.disable()
    assert got.dtype == want.dtype and torch.equal(got, want), (got.float() - want.float()).abs().max()
