"""The trainer's fast paths compute what the plain path computes (fp32, on CPU):

- chunked log-probs from hidden states (no full-vocabulary logits) = log_softmax of `model(...).logits`;
- packed micro-batches (--qkv-format thd) = padded ones (bshd), values and gradients;
- --gradient-checkpointing: the same loss and gradients, and less memory held for backward;
- a model whose output transform the chunked path does not know is refused at construction.
"""

from __future__ import annotations

import pytest
import torch

from miles.bridge.types import Sample
from miles.train.batch import TrainBatch, response_log_probs
from miles.train.logprobs import check_output_head
from miles.train.trainer import enable_activation_checkpointing
from miles.utils.models import load_causal_lm


def samples(lengths, seed=0):
    """(prompt, response) lengths -> samples of random tokens; a 0-length response included on purpose."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(lengths):
        tokens = torch.randint(3, 90, (p + r,), generator=g).tolist()
        out.append(Sample(group_index=i, index=i, prompt="", tokens=tokens, response_length=r, loss_mask=[1] * r))
    return out


LENGTHS = [(5, 7), (3, 12), (9, 1), (4, 0), (6, 6), (2, 9)]


def reference_log_probs(model, batch: TrainBatch, temperature: float):
    """The former path: full fp32 logits of every position of the padded batch."""
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=position_ids).logits[:, :-1].float()
    scaled = logits / temperature
    token = scaled.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1) - scaled.logsumexp(-1)
    valid = torch.arange(batch.mask.shape[1]) < batch.response_lengths[:, None]
    probs = scaled.log_softmax(-1).exp()
    entropy = -(probs * scaled.log_softmax(-1)).sum(-1)
    index = batch.response_positions[..., None].expand(-1, -1, logits.shape[-1])
    return (token.gather(1, batch.response_positions) * valid, entropy.gather(1, batch.response_positions) * valid,
            logits.gather(1, index) * valid[..., None])


@pytest.fixture(scope="module", params=["tiny_model", "tiny_qwen"])
def model(request):
    return load_causal_lm(request.getfixturevalue(request.param), device="cpu", attention_backend="sdpa")


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("chunk_size", [-1, 4])
def test_chunked_log_probs_equal_the_full_logits_path(model, packed, chunk_size):
    batch = TrainBatch.from_samples(samples(LENGTHS), 0, "cpu")
    want_lp, want_ent, want_logits = reference_log_probs(model, batch, 0.7)
    with torch.no_grad():
        lp, ent = response_log_probs(model, batch, 0.7, packed=packed, chunk_size=chunk_size, with_entropy=True)
        lp2, logits = response_log_probs(model, batch, 0.7, packed=packed, chunk_size=chunk_size, with_logits=True)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=0)
    assert torch.equal(lp, lp2)  # the verifier's scoring (with_logits) computes the training path's numbers
    assert lp[3].abs().sum() == 0 and lp.abs().sum() > 0  # the empty response scores nothing


def close_to_scale(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> bool:
    return (got - want).abs().max().item() <= tol * want.abs().max().item() + 1e-7


def grads_of(model, batch, **layout):
    model.zero_grad(set_to_none=True)
    lp, ent = response_log_probs(model, batch, 0.7, with_entropy=True, **layout)
    weights = torch.linspace(-1, 1, lp.numel()).reshape(lp.shape)  # an arbitrary loss on every position
    (lp * weights * batch.mask).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk_size", [-1, 5])
def test_packed_equals_padded_values_and_gradients(model, chunk_size):
    batch = TrainBatch.from_samples(samples(LENGTHS, seed=1), 0, "cpu")
    padded_lp, padded = grads_of(model, batch, packed=False, chunk_size=-1)
    packed_lp, packed = grads_of(model, batch, packed=True, chunk_size=chunk_size)
    torch.testing.assert_close(packed_lp, padded_lp, atol=1e-5, rtol=0)
    assert padded.keys() == packed.keys() and len(padded) == len(list(model.parameters()))
    for name in padded:  # fp32 sums of many terms: within 1e-5 of the gradient's scale
        assert close_to_scale(packed[name], padded[name]), name


def test_chunked_gradients_equal_the_full_logits_gradients(model):
    """Backward through the recomputed chunks = backward through the full logits."""
    batch = TrainBatch.from_samples(samples(LENGTHS, seed=5), 0, "cpu")
    weights = torch.linspace(-1, 1, batch.mask.numel()).reshape(batch.mask.shape)
    model.zero_grad(set_to_none=True)
    (reference_log_probs(model, batch, 0.7)[0] * weights).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    lp, _ = response_log_probs(model, batch, 0.7, packed=True, chunk_size=5)
    (lp * weights).sum().backward()
    for name, p in model.named_parameters():
        assert close_to_scale(p.grad, want[name]), name


def test_packed_attention_keeps_the_sequences_apart(model):
    """A sequence's log-probs do not depend on what it is packed with."""
    alone = TrainBatch.from_samples(samples([(5, 7)], seed=2), 0, "cpu")
    together = TrainBatch.from_samples(samples([(5, 7)], seed=2) + samples([(30, 20)], seed=3), 0, "cpu")
    with torch.no_grad():
        one = response_log_probs(model, alone, 1.0, packed=True)[0][0, :7]
        two = response_log_probs(model, together, 1.0, packed=True)[0][0, :7]
    torch.testing.assert_close(two, one, atol=1e-5, rtol=0)


def test_padded_kernel_equals_the_per_sequence_kernel():
    """Packed sequences scattered to a padded grid under one causal SDPA (what CUDA runs where torch's
    varlen kernel cannot) = one SDPA per sequence: outputs and the gradients of q, k and v."""
    from miles.utils import varlen

    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 1, 7, 2]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), h, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (4, 2, 2))
    weights = torch.randn(sum(lengths), 4, 8, generator=g, dtype=torch.float64)
    results = []
    for out in (varlen.per_sequence_attention(q, k, v, cu, 0.3), varlen.padded_causal_attention(q, k, v, cu, 9, 0.3)):
        results.append((out, *torch.autograd.grad((out * weights).sum(), (q, k, v))))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_gradient_checkpointing_same_grads_less_memory_held(tiny_model):
    from torch.autograd.graph import saved_tensors_hooks

    batch = TrainBatch.from_samples(samples(LENGTHS * 4, seed=4), 0, "cpu")
    results = {}
    for checkpointing in (False, True):
        model = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa").train()
        if checkpointing:
            enable_activation_checkpointing(model)
        saved = []  # bytes autograd keeps for backward: what activation checkpointing lowers

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            lp, grads = grads_of(model, batch)
        results[checkpointing] = (lp, grads, sum(saved))
    (lp0, g0, held0), (lp1, g1, held1) = results[False], results[True]
    torch.testing.assert_close(lp1, lp0, atol=1e-6, rtol=0)
    for name in g0:
        assert close_to_scale(g1[name], g0[name]), name
    assert held1 < 0.7 * held0, (held1, held0)


def test_an_unknown_logit_transform_is_refused(tiny_model, monkeypatch):
    model = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    check_output_head(model)  # a plain Llama passes
    original = type(model).forward

    def scaled(self, *args, **kwargs):  # a model that rescales its logits where the config does not say so
        out = original(self, *args, **kwargs)
        out.logits = out.logits * 3.0
        return out

    monkeypatch.setattr(type(model), "forward", scaled)
    with pytest.raises(ValueError, match="logit transform"):
        check_output_head(model)


@pytest.mark.parametrize("arch", ["gemma2", "cohere", "granite"])
def test_known_logit_transforms_are_applied(arch, tmp_path):
    """Gemma 2 softcapping, Cohere logit_scale and Granite logits_scaling, on tiny random models."""
    import transformers

    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    config = {"gemma2": lambda: transformers.Gemma2Config(**common, final_logit_softcapping=2.0),
              "cohere": lambda: transformers.CohereConfig(**common, logit_scale=0.25),
              "granite": lambda: transformers.GraniteConfig(**common, logits_scaling=4.0)}[arch]()
    config._attn_implementation = "eager"  # Gemma 2 has no sdpa
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)  # logits large enough for the transform to matter
    check_output_head(model)
    batch = TrainBatch.from_samples(samples([(4, 6), (3, 3)]), 0, "cpu")
    with torch.no_grad():
        lp, _ = response_log_probs(model, batch, 1.0, packed=False)
    torch.testing.assert_close(lp, reference_log_probs(model, batch, 1.0)[0], atol=1e-5, rtol=0)


def test_compiled_layers_and_chunks_compute_the_eager_log_probs_and_gradients(tiny_model):
    """--trainer-torch-compile: the decoder layers and log-prob chunks run as compiled graphs (Inductor
    on the CPU here) and give the eager path's log-probs and gradients within fp32 noise."""
    from torch._dynamo.utils import counters

    from miles.train import logprobs
    from miles.train.compile import compile_layers

    batch = TrainBatch.from_samples(samples(LENGTHS, seed=6), 0, "cpu")
    eager = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    want_lp, want = grads_of(eager, batch, packed=True, chunk_size=5)
    model = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    torch._dynamo.reset()
    counters.clear()
    logprobs._compiled_chunk.cache_clear()
    assert compile_layers(model) == model.config.num_hidden_layers
    lp, got = grads_of(model, batch, packed=True, chunk_size=5, compiled=True)
    assert counters["stats"]["unique_graphs"] >= 2  # a decoder layer's graph and a chunk's
    assert logprobs._compiled_chunk.cache_info().currsize == 1  # the chunks ran through the compiled function
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    assert got.keys() == want.keys()
    for name in want:
        assert close_to_scale(got[name], want[name], tol=1e-4), name
