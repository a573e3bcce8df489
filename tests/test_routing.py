"""MoE routes (miles.bridge.routing): recorded per layer, replayed with the router's own weights for the
given ids (gradients still reach it), bad routes rejected; for every HF MoE family miles has an adapter for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.bridge.routing import (
    FAMILIES,
    RoutingError,
    mismatch_frac,
    record_routes,
    replay_routes,
    routers,
    shape,
    validate_routes,
)
from miles.testing.tiny import MOE_FAMILIES, build_moe_model


def tokens(batch: int = 2, length: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 90, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_family_records_one_route_per_layer_and_token(family):
    model = build_moe_model(family)
    assert set(MOE_FAMILIES) == set(FAMILIES)
    layers, experts, k = shape(model)
    assert (layers, experts, k) == (2, 8, 2) and len(routers(model)) == 2
    ids = tokens()
    with torch.no_grad(), record_routes(model) as calls:
        model(ids)
        model(ids[:1])
    assert len(calls) == 2 and [r.shape for r in calls[0]] == [(14, 2), (14, 2)] and calls[1][0].shape == (7, 2)
    validate_routes(calls[0], layers, experts, k, tokens=14)
    with torch.no_grad(), record_routes(model) as again:
        model(ids)
    assert all(torch.equal(a, b) for a, b in zip(calls[0], again[0]))
    assert len(calls) == 2  # the first context's hooks are gone: they recorded nothing more


def test_a_dense_model_has_no_routers(tiny_model):
    from miles.utils.models import load_causal_lm

    assert routers(load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")) == []


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_its_own_routes_changes_nothing_and_other_routes_are_followed(family):
    model = build_moe_model(family)
    ids = tokens()
    with torch.no_grad(), record_routes(model) as calls:
        plain = model(ids).logits
    with torch.no_grad(), replay_routes(model, calls[0]):
        same = model(ids).logits
    assert torch.allclose(plain, same, atol=1e-6)
    other = [torch.stack([(r[:, 0] + 1) % 8, (r[:, 0] + 2) % 8], dim=1).to(torch.int32) for r in calls[0]]
    with torch.no_grad(), replay_routes(model, other), record_routes(model) as seen:
        moved = model(ids).logits
    assert all(torch.equal(s.sort(1).values, o.sort(1).values) for s, o in zip(seen[0], other))  # routed as told
    assert not torch.allclose(plain, moved, atol=1e-4)
    assert mismatch_frac(calls[0], seen[0]) == pytest.approx(mismatch_frac(calls[0], other)) and \
        mismatch_frac(calls[0], other) > 0.5
    assert mismatch_frac(seen[0], other) == 0.0


def test_the_router_still_gets_gradients_under_replay():
    model = build_moe_model("qwen3_moe").train()
    ids = tokens()
    with torch.no_grad(), record_routes(model) as calls:
        model(ids)
    with replay_routes(model, calls[0]):
        model(ids, labels=ids).loss.backward()
    grads = [r.weight.grad for r in routers(model)]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_bad_routes_are_rejected_with_the_layer_and_what_is_wrong():
    model = build_moe_model("mixtral")
    layers, experts, k = shape(model)
    good = [torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)] * layers
    validate_routes(good, layers, experts, k, tokens=2)
    with pytest.raises(RoutingError, match="routes for 1 MoE layer"):
        validate_routes(good[:1], layers, experts, k)
    with pytest.raises(RoutingError, match="layer 1: expert id 8 out of range"):
        validate_routes([good[0], torch.tensor([[0, 8], [1, 2]])], layers, experts, k)
    with pytest.raises(RoutingError, match="layer 0: token 1 has the same expert twice"):
        validate_routes([torch.tensor([[0, 1], [3, 3]]), good[1]], layers, experts, k)
    with pytest.raises(RoutingError, match=r"layer 0: routes of shape \(2, 3\)"):
        validate_routes([torch.zeros(2, 3, dtype=torch.int32), good[1]], layers, experts, k)
    with pytest.raises(RoutingError, match="routes for 2 tokens, this forward has 14"), torch.no_grad(), \
            replay_routes(model, good):
        model(tokens())


def test_rows_of_minus_one_keep_the_routers_own_choice():
    model = build_moe_model("qwen2_moe")
    ids = tokens()
    with torch.no_grad(), record_routes(model) as calls:
        plain = model(ids).logits
    other = [torch.stack([(r[:, 0] + 3) % 8, (r[:, 0] + 5) % 8], dim=1).to(torch.int32) for r in calls[0]]
    own_last = [o.clone() for o in other]
    for o in own_last:
        o[-1] = -1  # the batch's last token: its own route
    with torch.no_grad(), replay_routes(model, own_last), record_routes(model) as seen:
        model(ids)
    for s, o, r in zip(seen[0], other, calls[0]):
        assert torch.equal(s[:-1].sort(1).values, o[:-1].sort(1).values)
        assert torch.equal(s[-1].sort().values, r[-1].sort().values)
    with pytest.raises(RoutingError, match="expert id -1 out of range"):
        validate_routes([torch.tensor([[0, -1]]), torch.tensor([[0, 1]])], 2, 8, 2)
    assert plain.shape[0] == 2


def test_the_local_engine_records_the_routes_of_every_token_it_fed(tmp_path):
    """An MoE model decodes through the HF path; each output carries (prompt + response - 1, layers, k)
    routes equal to those of one full forward over the same tokens (fp32), and they survive a dump."""
    from miles.bridge.rollout_dump import read_dump, samples_from_dump, save_rollout
    from miles.bridge.types import Sample
    from miles.config import SamplingParams
    from miles.rollout.local import LocalEngine

    model = build_moe_model("mixtral")
    engine = LocalEngine(model, eos_token_ids=[], pad_token_id=1)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1.0), seeds=[1, 2])
    samples = []
    for i, (p, out) in enumerate(zip(prompts, outs)):
        routes = out.routed_experts
        assert routes.shape == (len(p) + len(out.token_ids) - 1, 2, 2) and routes.dtype.name == "int16"
        fed = torch.tensor([(p + out.token_ids)[:-1]])
        with torch.no_grad(), record_routes(model) as calls:
            model(fed)
        full = torch.stack(calls[0], dim=1)  # (tokens, layers, k)
        assert mismatch_frac([torch.from_numpy(routes[:, j].astype("int64")) for j in range(2)],
                             [full[:, j].long() for j in range(2)]) == 0.0
        samples.append(Sample(group_index=0, index=i, prompt="", tokens=p + out.token_ids,
                              response_length=len(out.token_ids), loss_mask=[1] * len(out.token_ids),
                              rollout_log_probs=out.log_probs, rollout_routed_experts=routes))
    path = save_rollout(str(tmp_path / "{rollout_id}.pt"), 0, samples, {})
    raw = torch.load(path, weights_only=True)
    assert raw["samples"][0]["rollout_routed_experts"].dtype == torch.int16
    back = samples_from_dump(read_dump(path), path, 2)
    assert all(np.array_equal(a.rollout_routed_experts, b.rollout_routed_experts) for a, b in zip(samples, back))
    assert back[0].rollout_routed_experts.dtype == np.int16
