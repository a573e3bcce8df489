"""MoE routes: the experts each router chose, recorded in one forward and replayed in another (R3).

The HF MoE families miles runs (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) route through one router module
per layer whose forward returns `(router_logits, top-k weights, top-k expert ids)` over the flattened
tokens of the batch. `RouterFamily` says, per family, which module that is and how its top-k weights
are made (softmax, then renormalised over the k chosen: always for Mixtral, by `norm_topk_prob` for the
others). Both directions are forward hooks on those modules, active only inside their context:

- `record_routes(model)`: every forward appends each layer's expert ids, (tokens, k) int32.
- `replay_routes(model, routes)`: the next forward uses the given ids, layer by layer. The router's
  weights for those ids are recomputed from its own logits (softmax over all experts, gathered at
  the given ids, renormalised as the family does), so the router still gets gradients, as in Miles'
  and verl's routing replay: only the choice is fixed, not the weights.

A token whose route is -1 (all k entries) keeps the router's own choice: padding, and the last token
of a sequence, which the engine never fed back (its output trains nothing). Routes are validated
before a replay (`validate_routes`): one entry per layer, each (tokens, k) with ids in [0, num_experts)
or a whole row of -1, and no expert twice in a token's k: a wrong count or id is a clear error, not
a silent re-route.

Uses: miles' local engine records the routes of every token it feeds an MoE model (decode.py) into
`Sample.rollout_routed_experts` (kept in dumps as an int16 tensor; slime's dumps load too). The
trainer (miles/train/trainer.py) compares its own routes with them on every scoring pass
(`train/routing_mismatch_frac`) and, with `--use-rollout-routing-replay`, replays them in scoring
and training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RouterFamily:
    router_class: str  # the router module's class name in transformers
    always_renormalise: bool  # Mixtral renormalises the top-k weights whatever the config says
    experts_attr: str  # the config attribute holding the number of routed experts

    def renormalise(self, config) -> bool:
        return self.always_renormalise or bool(getattr(config, "norm_topk_prob", False))


FAMILIES = {
    "qwen2_moe": RouterFamily("Qwen2MoeTopKRouter", False, "num_experts"),
    "qwen3_moe": RouterFamily("Qwen3MoeTopKRouter", False, "num_experts"),
    "mixtral": RouterFamily("MixtralTopKRouter", True, "num_local_experts"),
    "olmoe": RouterFamily("OlmoeTopKRouter", False, "num_experts"),
}


class RoutingError(ValueError):
    """Routes that cannot be replayed: the message says which layer and what is wrong."""


def family_of(model) -> RouterFamily | None:
    """The model's MoE family, or None for a dense model (or a family miles has no adapter for)."""
    return FAMILIES.get(getattr(model.config, "model_type", ""))


def routers(model) -> list[torch.nn.Module]:
    """The model's router modules, in layer order (empty for a dense model)."""
    family = family_of(model)
    if family is None:
        return []
    return [m for m in model.modules() if type(m).__name__ == family.router_class]


def shape(model) -> tuple[int, int, int]:
    """(MoE layers, experts, k) of the model's routing."""
    family, found = family_of(model), routers(model)
    return len(found), getattr(model.config, family.experts_attr), model.config.num_experts_per_tok


@contextlib.contextmanager
def record_routes(model) -> Iterator[list[list[torch.Tensor]]]:
    """Yields a list that gets, for every forward inside the context, one (tokens, k) int32 tensor per
    layer, on the model's device."""
    found = routers(model)
    calls: list[list[torch.Tensor]] = []
    pending: list[torch.Tensor] = []

    def hook(_module, _args, output):
        pending.append(output[2].detach().to(torch.int32))  # on the model's device: no sync per layer
        if len(pending) == len(found):  # the last layer's router: one forward done
            calls.append(list(pending))
            pending.clear()

    handles = [r.register_forward_hook(hook) for r in found]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def validate_routes(routes: list[torch.Tensor], layers: int, experts: int, k: int, tokens: int | None = None) -> None:
    if len(routes) != layers:
        raise RoutingError(f"routes for {len(routes)} MoE layer(s), the model has {layers}")
    for i, r in enumerate(routes):
        if r.dim() != 2 or r.shape[1] != k or (tokens is not None and r.shape[0] != tokens):
            want = f"({tokens if tokens is not None else 'tokens'}, {k})"
            raise RoutingError(f"layer {i}: routes of shape {tuple(r.shape)}, expected {want}")
        own = (r == -1).all(dim=1)  # rows left to the router
        chosen = r[~own]
        if chosen.numel() and (int(chosen.min()) < 0 or int(chosen.max()) >= experts):
            bad = int(chosen.min()) if int(chosen.min()) < 0 else int(chosen.max())
            raise RoutingError(f"layer {i}: expert id {bad} out of range [0, {experts}) (-1 for a whole row: the "
                               "router's own choice)")
        if k > 1 and r.numel():
            s = r.sort(dim=1).values
            dup = (s[:, 1:] == s[:, :-1]).any(dim=1) & ~own
            if bool(dup.any()):
                raise RoutingError(f"layer {i}: token {int(dup.nonzero()[0])} has the same expert twice in its "
                                   f"top-{k} {r[int(dup.nonzero()[0])].tolist()}")


@contextlib.contextmanager
def replay_routes(model, routes: list[torch.Tensor]) -> Iterator[None]:
    """Inside the context every forward routes each layer's tokens to the given experts (see the module
    docstring); `routes[i]` is layer i's (tokens, k) ids for the flattened batch of that forward."""
    family, found = family_of(model), routers(model)
    layers, experts, k = shape(model)
    validate_routes(routes, layers, experts, k)
    renormalise = family.renormalise(model.config)

    def hook_for(i: int):
        def hook(module, args, output):
            logits = output[0]
            ids = routes[i].to(device=logits.device, dtype=torch.int64)
            if ids.shape[0] != logits.shape[0]:
                raise RoutingError(f"layer {i}: routes for {ids.shape[0]} tokens, this forward has {logits.shape[0]}")
            ids = torch.where((ids == -1).all(dim=1, keepdim=True), output[2].to(torch.int64), ids)
            probs = F.softmax(logits.float(), dim=-1)
            weights = probs.gather(-1, ids)
            if renormalise:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(output[1].dtype), ids
        return hook

    handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(found)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def mismatch_counts(recorded: list[torch.Tensor], own: list[torch.Tensor]) -> tuple[int, int]:
    """(token-layer routes whose set of k experts differs, routes compared) between a recorded routing
    and a model's own; rows of -1 in `recorded` (no route recorded) are not compared, and the order
    within a token's k does not count."""
    differ = total = 0
    for a, b in zip(recorded, own):
        a, b = a.to(torch.int64), b.to(device=a.device, dtype=torch.int64)
        kept = ~(a == -1).all(dim=1)
        same = (a[kept].sort(dim=1).values == b[kept].sort(dim=1).values).all(dim=1)
        differ += int((~same).sum())
        total += same.numel()
    return differ, total


def mismatch_frac(recorded: list[torch.Tensor], own: list[torch.Tensor], mask: torch.Tensor | None = None) -> float:
    """The share of token-layer routes whose set of k experts differs between two routings; `mask`
    (tokens,) bool keeps only some tokens (e.g. not padding)."""
    if mask is not None:
        recorded, own = [r[mask] for r in recorded], [o[mask] for o in own]
    differ, total = mismatch_counts(recorded, own)
    return differ / total if total else 0.0


def check_sample_routes(samples, layers: int, experts: int, k: int, *, required: bool) -> None:
    """Every sample's `rollout_routed_experts` fits the model: (len(tokens) - 1 or len(tokens), layers, k)
    ids in range (or whole rows of -1), no expert twice in a token's k. `required` (routing replay on):
    a sample without routes is an error too. Raises RoutingError naming the sample."""
    for n, s in enumerate(samples):
        where = f"sample {n} (group {s.group_index}, index {s.index})"
        r = s.rollout_routed_experts
        if r is None:
            if required:
                raise RoutingError(f"{where} has no rollout_routed_experts: the engine returned no MoE routes to "
                                   "replay")
            continue
        r = torch.as_tensor(r)
        if r.dim() != 3 or r.shape[0] not in (len(s.tokens) - 1, len(s.tokens)) or tuple(r.shape[1:]) != (layers, k):
            raise RoutingError(f"{where}: rollout_routed_experts of shape {tuple(r.shape)}, expected "
                               f"({len(s.tokens) - 1}, {layers}, {k}) for its {len(s.tokens)} tokens and this "
                               f"model's {layers} MoE layers of top-{k}")
        try:
            validate_routes([r[:, i] for i in range(layers)], layers, experts, k)
        except RoutingError as e:
            raise RoutingError(f"{where}: {e}") from None
