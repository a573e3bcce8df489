"""The CUDA paths (skipped without a GPU): the fast decode path (CUDA graphs, varlen prefill) against
the eager reference and the trainer, the HF path's device-side stop state and stop checks every 16
steps, static cache included, and a bf16 run end to end."""

import pytest
import torch

from miles.rollout.local import LocalEngine
from miles.utils.models import eos_token_ids, load_causal_lm, load_tokenizer
from test_determinism import DET, hashes
from test_engine import eager_decode, sp
from test_train import metrics, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


PROMPTS = ("hello", "a much longer prompt", "x", "what is seven plus two?")


@pytest.mark.parametrize("slots", [None, 3])
def test_fast_path_on_cuda_matches_the_eager_reference(tiny_model, slots, monkeypatch):
    """fp32 on the GPU, CUDA graphs on (and 3 slots for 16 requests: rows wait, take freed slots
    and move down), the RoPE and decode attention in the Triton kernel, tokens drawn by the device draw, the host's
    checks reading the done flags copied before each group's last step: the tokens of decoding each prompt alone
    without a cache, log-probs within fp32 noise."""
    from miles.rollout.local import batching, decode_attention
    from miles.utils import invariant

    kernel, calls = decode_attention.rope_and_attend, []
    monkeypatch.setattr(decode_attention, "rope_and_attend", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    done, lagged = batching._Call._done, []
    monkeypatch.setattr(batching._Call, "_done", lambda self: lagged.append(self.seen_at is not None) or done(self))
    draw, draws = invariant.sample, []
    monkeypatch.setattr(invariant, "sample", lambda *a: draws.append(1) or draw(*a))
    tok = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model, device="cuda", attention_backend="sdpa")
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(model, tok), pad_token_id=tok.pad_token_id)
    if slots:
        engine.decoder.max_slots = lambda length: slots
    prompts = [tok(t)["input_ids"] for t in PROMPTS] * 4
    sampling = sp(40, 1.0, 1.0)
    u = torch.rand(len(prompts), 40, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = engine.decode(prompts, sampling, u)
    assert engine.runner.cuda_graphs and engine.runner._graphs  # the steps ran as graph replays
    assert calls  # of the Triton kernel (captured in the graphs)
    assert draws  # the sampler's device draw
    assert sum(lagged) >= len(lagged) / 2  # most checks read the copy, not the drained queue
    want = eager_decode(model, prompts, sampling, u, set(engine.eos_token_ids), tok.pad_token_id)
    for out, (tokens, logps) in zip(got, want):
        assert out.token_ids == tokens
        assert out.log_probs == pytest.approx(logps, abs=1e-4)
    assert {o.finish_reason for o in got} == {"stop", "length"}


def test_cuda_graph_replay_equals_the_eager_fast_path_in_bf16(tiny_model):
    """Same kernels, same shapes: a graph replay computes bit for bit what the eager step does."""
    tok = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model, device="cuda", attention_backend="sdpa", dtype=torch.bfloat16)
    prompts = [tok(t)["input_ids"] for t in PROMPTS] * 8
    u = torch.rand(len(prompts), 48, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    runs = []
    for graphs in (True, False):
        engine = LocalEngine(model, eos_token_ids=eos_token_ids(model, tok), pad_token_id=tok.pad_token_id,
                             cuda_graphs=graphs)
        runs.append(engine.decode(prompts, sp(48, 1.0, 1.0), u))
        assert bool(engine.runner._graphs) == graphs
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert [o.log_probs for o in runs[0]] == [o.log_probs for o in runs[1]]


def test_fast_bf16_log_probs_are_within_bf16_noise_of_the_trainer(tiny_model):
    """The engine's bf16 log-probs of its own tokens against the trainer's (fp32 weights under bf16
    autocast, the padded full forward) on the same tokens: bf16 rounding, not a different model."""
    from miles.bridge.types import Sample
    from miles.train.batch import TrainBatch, response_log_probs

    tok = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model, device="cuda", attention_backend="sdpa", dtype=torch.bfloat16)
    trainer_model = load_causal_lm(tiny_model, device="cuda", attention_backend="sdpa")
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(model, tok), pad_token_id=tok.pad_token_id)
    prompts = [tok(t)["input_ids"] for t in PROMPTS] * 4
    outs = engine.generate(prompts, sp(32, 1.0, 1.0), list(range(len(prompts))))
    samples = [Sample(group_index=0, index=i, prompt="", tokens=p + o.token_ids, response_length=len(o.token_ids),
                      loss_mask=[1] * len(o.token_ids)) for i, (p, o) in enumerate(zip(prompts, outs))]
    batch = TrainBatch.from_samples(samples, tok.pad_token_id, "cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        trainer, _ = response_log_probs(trainer_model, batch, 1.0)
    diffs = [abs(a - b) for i, o in enumerate(outs) for a, b in zip(o.log_probs, trainer[i].tolist())]
    assert max(diffs) < 0.25 and sum(diffs) / len(diffs) < 0.02


def test_packed_trainer_attention_runs_the_fused_kernel_under_autocast(tiny_model, monkeypatch):
    """fp32 weights under bf16 autocast (the trainer's setting): packed (thd) attention gets fp32
    queries from the rotary embedding and must still take torch's bf16 varlen kernel (the one padded
    SDPA where this torch has none), never one SDPA per sequence; its log-probs stay within bf16 noise
    of the padded (bshd) path."""
    from miles.bridge.types import Sample
    from miles.train.batch import TrainBatch, response_log_probs
    from miles.utils import varlen

    ran = []  # the kernels packed attention called
    for name in ("per_sequence_attention", "padded_causal_attention"):
        original = getattr(varlen, name)
        monkeypatch.setattr(varlen, name, lambda *a, _f=original, _n=name, **kw: (ran.append(_n), _f(*a, **kw))[1])
    kernel, _ = varlen._varlen_attn(), varlen._varlen_params()  # the signature is read (and cached) unwrapped
    if kernel is not None:
        spy = lambda *a, **kw: (ran.append("varlen_attn"), kernel(*a, **kw))[1]
        monkeypatch.setattr(varlen, "_varlen_attn", lambda: spy)
    model = load_causal_lm(tiny_model, device="cuda", attention_backend="sdpa")
    g = torch.Generator().manual_seed(0)
    samples = [Sample(group_index=0, index=i, prompt="", tokens=torch.randint(3, 90, (n,), generator=g).tolist(),
                      response_length=n // 2, loss_mask=[1] * (n // 2)) for i, n in enumerate((40, 17, 33, 8))]
    batch = TrainBatch.from_samples(samples, 0, "cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        packed, _ = response_log_probs(model, batch, 1.0, packed=True)
        padded, _ = response_log_probs(model, batch, 1.0, packed=False)
    assert set(ran) == {"varlen_attn" if kernel is not None else "padded_causal_attention"}
    assert (packed - padded).abs().max() < 0.1


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cuda_decode_matches_the_eager_reference(tiny_model, cache):
    tok = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model, device="cuda", attention_backend="sdpa")
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(model, tok), pad_token_id=tok.pad_token_id,
                         decoder="hf", cache=cache)
    assert engine.decoder.stop_check_every == 16
    prompts = [tok(t)["input_ids"] for t in ("hello", "a much longer prompt", "x", "what is seven plus two?")] * 4
    sampling = sp(40, 1.0, 1.0)
    u = torch.rand(len(prompts), 40, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = engine.decode(prompts, sampling, u)
    want = eager_decode(model, prompts, sampling, u, set(engine.eos_token_ids), tok.pad_token_id)
    same = sum(out.token_ids == tokens for out, (tokens, _) in zip(got, want))
    assert same == len(prompts)
    assert {o.finish_reason for o in got} == {"stop", "length"}


@pytest.mark.parametrize("extra", [[], ["--trainer-torch-compile"]])
def test_bf16_run_on_cuda(tiny_args, extra):
    rows = metrics(run(tiny_args, "--device", "cuda", "--check-weight-update-equal", *extra))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["forward_logp_max_diff"] < 0.5 for r in rows)  # bf16 engine vs bf16-autocast trainer


def test_under_the_mode_packed_attention_is_varlen_only_where_its_backward_is_deterministic(deterministic_algorithms):
    """--deterministic-mode (warn only): packed attention runs the padded grid, since varlen_attn's flash
    backward accumulates dQ with atomics there; inside strict_backward (the trainer's passes) and in the
    engine's forward, lifted out of the mode, it runs varlen_attn."""
    from miles.utils import varlen
    from miles.utils.forward_kernels import engine_forward, strict_backward

    q = torch.zeros(8, 4, 64, dtype=torch.bfloat16, device="cuda")
    fused = "varlen_attn" if varlen._varlen_attn() else "padded_sdpa"
    assert varlen.kernel_for(q, None) == "padded_sdpa"
    with strict_backward():
        assert varlen.kernel_for(q, None) == fused
    with engine_forward():
        assert varlen.kernel_for(q, None) == fused


def test_under_the_mode_compiled_packed_attention_has_no_graph_break(deterministic_algorithms):
    """--deterministic-mode with --trainer-torch-compile: the kernel choice inside strict_backward
    compiles into one graph (a graph break there made the compiled trainer 1.48x slower)."""
    from miles.utils import varlen
    from miles.utils.forward_kernels import strict_backward

    lengths = [30, 50]
    cu = torch.tensor([0, 30, 80], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(80, h, 64, device="cuda", dtype=torch.bfloat16) for h in (14, 2, 2))
    torch._dynamo.reset()
    attend = torch.compile(lambda q, k, v: varlen.packed_causal_attention(q, k, v, cu, max(lengths), None),
                           fullgraph=True)
    with strict_backward():
        assert attend(q, k, v).shape == (80, 14, 64)


@pytest.mark.parametrize("precision, compiled", [("fp32", []), ("bf16", []),
                                               ("bf16", ["--trainer-torch-compile", "--enable-torch-compile"])])
def test_a_deterministic_run_on_cuda_repeats_bitwise(tiny_args, tmp_path, precision, compiled):
    """Two --deterministic-mode runs on the GPU hash the same at every step, the engine lifted out of the
    mode's kernels and the trainer in them; with both compiles, each run compiling afresh (Dynamo reset,
    no Inductor cache) with Inductor in its deterministic setting."""
    import torch._inductor.config as inductor_config

    runs = []
    with inductor_config.patch(force_disable_caches=True):
        for name in ("a", "b"):
            torch._dynamo.reset()
            runs.append(run(tiny_args, "--device", "cuda", "--precision", precision, *DET, *compiled,
                            "--output-dir", str(tmp_path / name)))
    assert [r["step"] for r in hashes(runs[0])] == [1, 2]
    assert hashes(runs[0]) == hashes(runs[1])


def test_under_the_mode_the_trainers_attention_backward_is_flash_and_repeats_bitwise(deterministic_algorithms):
    """--deterministic-mode, bf16: inside strict_backward the trainer's packed attention runs varlen_attn,
    FlashAttention forward and backward, strict, so dQ is not accumulated with atomics: two backwards
    give bitwise equal gradients. Outside it the padded grid runs the mode's math kernel."""
    from miles.utils import varlen
    from miles.utils.forward_kernels import strict_backward

    torch.backends.cuda.enable_flash_sdp(False)  # as the mode's math-kernel part leaves them
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        lengths = [700, 1024, 300, 900]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(sum(lengths), h, 64, generator=g, device="cuda", dtype=torch.bfloat16)
                   for h in (14, 2, 2))

        def grads():
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = varlen.packed_causal_attention(*leaves, cu, max(lengths), None)
                out.float().square().sum().backward()
            return [t.grad for t in leaves], {e.key for e in prof.key_averages()}

        with strict_backward():
            runs = [grads() for _ in range(4)]
        flash_backward = {"aten::_flash_attention_backward", "aten::_scaled_dot_product_flash_attention_backward"}
        assert flash_backward & runs[0][1]
        assert all(torch.equal(a, b) for other, _ in runs[1:] for a, b in zip(runs[0][0], other))
        _, outside = grads()
        assert not flash_backward & outside
        assert "aten::_scaled_dot_product_attention_math" in outside
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_mem_efficient_sdp(True)
        torch.backends.cuda.enable_cudnn_sdp(True)
