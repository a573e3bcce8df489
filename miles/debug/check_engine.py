"""`miles check-weights CHECKPOINT URL`: does a running engine hold a checkpoint's weights?

Against `miles serve` (its `GET /weights_checksum`), every tensor of the checkpoint, cast to the
dtype the engine holds it in, is compared by digest: missing, extra and differing tensors are
listed. Against servers whose digests mean nothing or that have none (vLLM on CPU reports the
SHA-256 of nothing for its fused tensors; SGLang has no such endpoint), the check is behavioural:
the checkpoint (loaded here) and the server score the same probe sequence, and the largest
log-prob difference is compared with the precision's tolerance (bridge/weight_probe.py).

Exit 0 when the engine holds the checkpoint's weights, 3 when not, 2 on bad arguments, 1 when the
server cannot be reached.
"""

from __future__ import annotations

import json
from pathlib import Path

from miles.errors import UsageError

EXIT_DIFFER = 3


def check_engine(checkpoint: str, url: str, *, as_json: bool, precision: str) -> int:
    from miles.rollout.remote.http import ServerClient

    path = Path(checkpoint)
    if not path.is_dir():
        raise UsageError(f"A: {checkpoint}: against an engine URL, A must be a checkpoint dir (HF format)")
    client = ServerClient(url, flag="B", timeout=120, retries=2)
    report = _by_digest(path, client) or _by_probe(path, client, url, precision)
    print(json.dumps(report, indent=2) if as_json else _format(report))
    return 0 if report["verdict"] == "match" else EXIT_DIFFER


def _by_digest(path: Path, client) -> dict | None:
    """The digest comparison, or None when the server has no /weights_checksum."""
    from miles.rollout.remote.sglang import SGLangServer

    answer = SGLangServer(client, eos_token_ids=[], vocab_size=0).checksum_answer()
    if answer is None:
        return None
    engine = answer["tensors"]
    import torch
    from safetensors import safe_open

    from miles.debug.check_weights import resolve
    from miles.utils.digest import tensor_bytes_sha256

    mine = {}
    for f in resolve("A", str(path)):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                dtype = engine.get(name, {}).get("dtype")
                t = handle.get_tensor(name)
                mine[name] = tensor_bytes_sha256(t.to(getattr(torch, dtype)) if dtype else t)
    differ = sorted(n for n in set(mine) & set(engine) if engine[n]["sha256"] != mine[n])
    return {"a": str(path), "b": client.url, "method": "digests", "weight_version": answer.get("weight_version"),
            "tensors_a": len(mine), "tensors_b": len(engine), "only_in_a": sorted(set(mine) - set(engine)),
            "only_in_b": sorted(set(engine) - set(mine)), "values_differ": differ,
            "verdict": "match" if not differ and set(mine) == set(engine) else "differ"}


def _by_probe(path: Path, client, url: str, precision: str) -> dict:
    from miles.bridge.weight_probe import TOLERANCE, probe_tokens
    from miles.rollout.remote.sglang import SGLangServer
    from miles.rollout.remote.vllm import VLLMServer
    from miles.utils.models import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(path)
    tokens = probe_tokens(tokenizer)
    kind = VLLMServer if _is_vllm(client) else SGLangServer
    engine = kind(client, eos_token_ids=[], vocab_size=len(tokenizer)).prompt_log_probs(tokens)
    import torch

    model = load_causal_lm(path, dtype=torch.float32, device="cpu", attention_backend="sdpa")
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()
    diff = max(abs(a - b) for a, b in zip(mine, engine))
    return {"a": str(path), "b": url,
            "method": f"probe ({kind.__name__.removesuffix('Server')}: no comparable digests)",
            "probe_tokens": len(tokens), "probe_max_diff": diff, "tolerance": TOLERANCE[precision],
            "verdict": "match" if diff <= TOLERANCE[precision] else "differ"}


def _is_vllm(client) -> bool:
    from miles.rollout.remote.http import EngineError

    try:
        models = client.request("GET", "/v1/models")
    except EngineError:
        return False
    return isinstance(models, dict) and isinstance(models.get("data"), list)


def _format(r: dict) -> str:
    lines = [f"A: {r['a']}", f"B: {r['b']} (engine, {r['method']})"]
    if r["method"] == "digests":
        lines.append(f"tensors: A {r['tensors_a']}, B {r['tensors_b']}; weight_version {r['weight_version']}")
        for key, title in (("only_in_a", "only in A (missing from the engine)"), ("only_in_b", "only in B (extra)"),
                           ("values_differ", "values differ")):
            if r[key]:
                lines.append(f"{title}: {len(r[key])}: " + ", ".join(r[key][:10])
                             + (" ..." if len(r[key]) > 10 else ""))
    else:
        lines.append(f"probe: {r['probe_tokens']} tokens, max |log p difference| {r['probe_max_diff']:.2e} "
                     f"(tolerance {r['tolerance']:g})")
    lines.append(f"Verdict: {'MATCH' if r['verdict'] == 'match' else 'DIFFER'}")
    return "\n".join(lines)
