"""MoE routing replay in the trainer (--use-rollout-routing-replay): the experts the trainer's forwards
use are the engine's; `train/routing_mismatch_frac`, the step-1 `MoE routing` check and `miles doctor`
report when they differ; routes are hashed; dumps replay with them bitwise; bad routes are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import metrics, run

from miles.bridge import routing
from miles.cli.main import main
from miles.debug.alignment import FAIL, PASS, WARN, check_routing
from miles.testing.tiny import build_moe_model_dir, train_args


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    return build_moe_model_dir(tmp_path_factory.mktemp("tiny-moe"), "qwen3_moe")


@pytest.fixture
def moe_args(moe_model, prompt_file, reward_module, tmp_path):
    return train_args(moe_model, prompt_file, tmp_path / "run", reward_module) + ["--num-rollout", "1"]


@pytest.fixture
def engine_routes_elsewhere(monkeypatch):
    """The engine's copy of the routers perturbed as it is built: its routes differ from the trainer's
    for many tokens (as when engine and trainer numerics or router weights part)."""
    from miles.rollout.local import engine as local_engine

    built = local_engine.LocalEngine.__init__

    def perturbed(self, model, **kw):
        with torch.no_grad():
            for r in routing.routers(model):
                r.weight.add_(0.25 * torch.randn_like(r.weight) * r.weight.std())
        built(self, model, **kw)

    monkeypatch.setattr(local_engine.LocalEngine, "__init__", perturbed)


def expert_ids_used(model):
    """Records the expert ids each layer's experts module is handed (after any replay), per forward."""
    used: list[torch.Tensor] = []
    handles = [layer.mlp.experts.register_forward_pre_hook(lambda _m, args: used.append(args[1].clone()))
               for layer in model.model.layers]
    return used, handles


@pytest.mark.parametrize("qkv_format, checkpointing", [("bshd", False), ("thd", False), ("bshd", True)])
def test_replay_makes_the_experts_the_trainer_uses_the_engines(moe_model, engine_routes_elsewhere, qkv_format,
                                                               checkpointing):
    """Trainer level, fp32: with replay the experts every policy forward (scoring and training) hands
    its MoE blocks are the engine's (mismatch 0 by construction) and the train/engine gap is smaller than without; the
    router's own top-k still differs (train/routing_mismatch_frac reports it either way)."""
    from test_seams import train_cfg

    from miles.config import SamplingParams
    from miles.rollout.local import LocalEngine
    from miles.train.batch import TrainBatch
    from miles.utils.models import load_causal_lm

    engine = LocalEngine(load_causal_lm(moe_model, device="cpu", attention_backend="sdpa"), eos_token_ids=[],
                         pad_token_id=1)
    prompts = [[5 + i, 20 + i, 30, 40 + i][: 2 + i % 3] for i in range(6)]  # of 2-4 tokens: padding in bshd
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1.0), seeds=list(range(6)))
    from miles.bridge.types import Sample

    samples = [Sample(group_index=i // 3, index=i, prompt="", tokens=p + o.token_ids, response_length=len(o.token_ids),
                      loss_mask=[1] * len(o.token_ids), rollout_log_probs=o.log_probs, reward=float(i % 2),
                      rollout_routed_experts=o.routed_experts) for i, (p, o) in enumerate(zip(prompts, outs))]
    # Padded rows (bshd) or the real tokens packed into one row (thd): the routes follow either layout.
    engine_flat = TrainBatch.from_samples(samples, 1, "cpu").flat_routes(packed=qkv_format == "thd")
    results = {}
    for replay in (False, True):
        from miles.train.trainer import Trainer

        model = load_causal_lm(moe_model, device="cpu", attention_backend="sdpa")
        trainer = Trainer(train_cfg(use_rollout_routing_replay=replay, micro_batch_size=6, qkv_format=qkv_format,
                                    gradient_checkpointing=checkpointing), model, None,
                          temperature=1.0, group_size=3, pad_token_id=1, precision="fp32")
        used, handles = expert_ids_used(model)
        result = trainer.train(samples)
        for h in handles:
            h.remove()
        # The scoring forward's two MoE layers (one micro-batch of 6), then the training forward's (and,
        # with checkpointing, the backward's recompute of each layer, last layer first).
        scoring, training, recomputed = used[:2], used[2:4], used[4:6][::-1]
        assert len(used) == (6 if checkpointing else 4)
        results[replay] = (result.metrics, routing.mismatch_counts(engine_flat, scoring),
                           routing.mismatch_counts(engine_flat, training),
                           routing.mismatch_counts(engine_flat, recomputed) if checkpointing else None)
    (off, off_used, off_trained, off_re), (on, on_used, on_trained, on_re) = results[False], results[True]
    assert off_used[0] > 0 and on_used == (0, off_used[1])  # replay: every recorded route followed
    assert off_trained[0] > 0 and on_trained == (0, off_trained[1])
    if checkpointing:
        assert off_re[0] > 0 and on_re == (0, off_re[1])
    # The router's own top-k still differs from the engine's with replay on (from layer 1 on it sees
    # the replayed layers' outputs, so the share is not the same number as without).
    assert on["train/routing_mismatch_frac"] > 0.02 and off["train/routing_mismatch_frac"] > 0.02
    assert on["train/train_rollout_logprob_abs_diff"] < off["train/train_rollout_logprob_abs_diff"]


def doctor_culprits(run_dir: Path, capsys) -> list[str]:
    capsys.readouterr()
    main(["doctor", str(run_dir), "--json"])
    return [f["culprit_id"] for f in json.loads(capsys.readouterr().out)["findings"]]


def test_without_replay_the_check_warns_and_with_it_passes(moe_args, tmp_path, engine_routes_elsewhere, capsys):
    """A real run whose engine routes elsewhere: step 1's `MoE routing` check is WARN with the R3 fix and
    the metric is logged; `miles doctor RUN` lists routing (after the mismatch attribution's verdict:
    the planted fault is in the engine's router weights). The same run with replay passes the check."""
    out = run(moe_args)
    log = (out / "train.log").read_text()
    assert "Alignment check | MoE routing              | WARN | routing_mismatch_frac" in log
    assert "fix: --use-rollout-routing-replay" in log
    assert metrics(out)[0]["train/routing_mismatch_frac"] > 0.02
    assert "moe_routing" in doctor_culprits(out, capsys)

    replayed = run(moe_args, "--use-rollout-routing-replay", "--output-dir", str(tmp_path / "r3"))
    log = (replayed / "train.log").read_text()
    assert "| MoE routing              | PASS |" in log and "replay on: the trainer follows the engine's experts" in log


def test_bf16_without_replay_shows_a_nonzero_mismatch_and_the_doctor_names_routing(moe_args, capsys):
    """No planted fault: bf16 rounding alone flips some routes between the engine's decode and the
    trainer's forward (the tiny MoE's routers start small, so near-ties are common); the doctor's top
    findings name the routing culprit (beside the tiny random model's high response NLL)."""
    out = run(moe_args, "--precision", "bf16", "--num-rollout", "3")
    assert max(r["train/routing_mismatch_frac"] for r in metrics(out)) > 0
    assert "moe_routing" in doctor_culprits(out, capsys)[:2]


def test_a_dump_replayed_train_only_with_r3_trains_bitwise_like_the_live_run(moe_args, tmp_path):
    """Routes travel in dumps: a train-only replay of a live R3 run's dumps has the same hashes, routes
    included, and the same final weights."""
    from safetensors.torch import load_file

    flags = ["--use-rollout-routing-replay", "--precision", "bf16", "--num-rollout", "2", "--debug-determinism"]
    live = run(moe_args, *flags, "--save-debug-rollout-data", str(tmp_path / "dumps" / "d_{rollout_id}.pt"),
               "--output-dir", str(tmp_path / "live"))
    replay = run(moe_args, *flags, "--load-debug-rollout-data", str(tmp_path / "dumps" / "d_{rollout_id}.pt"),
                 "--output-dir", str(tmp_path / "replay"))
    rows = lambda d: [json.loads(x) for x in (d / "hashes.jsonl").read_text().splitlines()]
    assert rows(live) == rows(replay) and "rollout_routes" in rows(live)[0]
    a, b = (load_file(d / "checkpoints" / "step_2" / "model.safetensors") for d in (live, replay))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_routes_are_hashed(moe_args, tmp_path):
    """The determinism hashes cover the routes: other routes, same tokens, another rollout_routes hash."""
    from miles.bridge.types import Sample
    from miles.debug.determinism import rollout_hashes

    routes = np.zeros((5, 2, 2), dtype=np.int16)
    routes[:, :, 1] = 1
    s = Sample(group_index=0, index=0, prompt="", tokens=[1, 2, 3, 4, 5, 6], response_length=2,
               rollout_routed_experts=routes)
    other = routes.copy()
    other[3, 1] = [2, 3]
    t = Sample(**{**s.__dict__, "rollout_routed_experts": other})
    a, b = rollout_hashes([s]), rollout_hashes([t])
    assert a["rollout_routes"] != b["rollout_routes"] and a["rollout_tokens"] == b["rollout_tokens"]
    assert "rollout_routes" not in rollout_hashes([Sample(**{**s.__dict__, "rollout_routed_experts": None})])


def test_replay_on_a_dense_model_is_a_usage_error(tiny_args, tmp_path, capsys):
    assert main(tiny_args + ["--num-rollout", "1", "--use-rollout-routing-replay"]) == 2
    err = capsys.readouterr().err
    assert "error: --use-rollout-routing-replay: the model (llama) has no MoE routers" in err
    assert "error: --use-rollout-routing-replay" in (tmp_path / "run" / "train.log").read_text()


def test_trainer_torch_compile_on_an_moe_model_is_a_usage_error(moe_args, tmp_path, capsys):
    assert main(moe_args + ["--trainer-torch-compile"]) == 2
    err = capsys.readouterr().err
    assert "error: --trainer-torch-compile: MoE routers are hooked per micro-batch" in err
    assert "error: --trainer-torch-compile" in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.parametrize("edit, fragment", [
    (lambda r: None, "has no rollout_routed_experts: the engine returned no MoE routes"),
    (lambda r: np.where(r == r.max(), 99, r).astype(np.int16), "expert id 99 out of range [0, 8)"),
    (lambda r: r[:, :1], "rollout_routed_experts of shape"),
    (lambda r: np.repeat(r[..., :1], 2, axis=-1), "has the same expert twice"),
])
def test_a_dump_with_missing_or_bad_routes_is_refused_under_replay(moe_args, tmp_path, capsys, edit, fragment):
    """Missing, out-of-range, mis-shaped or duplicate routes: one `error:` line naming the sample, exit 2."""
    run(moe_args, "--debug-rollout-only", "--save-debug-rollout-data", str(tmp_path / "d" / "d_{rollout_id}.pt"),
        "--output-dir", str(tmp_path / "capture"))
    path = tmp_path / "d" / "d_0.pt"
    dump = torch.load(path, weights_only=False)
    first = dump["samples"][0]
    routes = edit(first["rollout_routed_experts"].numpy())
    if routes is None:
        del first["rollout_routed_experts"]
    else:
        first["rollout_routed_experts"] = torch.from_numpy(np.ascontiguousarray(routes))
    torch.save(dump, path)
    capsys.readouterr()
    assert main(moe_args + ["--use-rollout-routing-replay", "--load-debug-rollout-data",
                            str(tmp_path / "d" / "d_{rollout_id}.pt"), "--output-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "error: --use-rollout-routing-replay: sample 0 (group 0, index 0)" in err
    assert fragment in err, err


def test_the_routing_check_bands():
    assert check_routing(0.0, replay=False).verdict == PASS
    assert check_routing(0.03, replay=False).verdict == WARN
    assert check_routing(0.03, replay=True).verdict == PASS
    assert check_routing(0.8, replay=True).verdict == FAIL and "weight-sync" in check_routing(0.8, True).culprit
    assert check_routing(float("nan"), replay=True).verdict == FAIL
    missing = check_routing(None, replay=False, moe_without_routes=True)
    assert missing.verdict == WARN and "--enable-return-routed-experts" in missing.fix


def test_the_doctor_reads_the_metric_unless_replay_is_on(tmp_path, capsys):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/routing_mismatch_frac": v}) + "\n"
                                                   for s, v in [(1, 0.0), (2, 0.04), (3, 0.05)]))
    capsys.readouterr()
    main(["doctor", str(run_dir), "--json"])
    ids = [f["id"] for f in json.loads(capsys.readouterr().out)["findings"]]
    assert "moe_routing_mismatch" in ids
    (run_dir / "config.json").write_text(json.dumps({"train": {"use_rollout_routing_replay": True}}))
    main(["doctor", str(run_dir), "--json"])
    ids = [f["id"] for f in json.loads(capsys.readouterr().out)["findings"]]
    assert "moe_routing_mismatch" not in ids
