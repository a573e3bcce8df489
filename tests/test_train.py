"""End-to-end `miles train` runs on a tiny random model: files, metrics, learning, resume."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles.cli.main import main

SPEC_KEYS = ["rollout/reward_mean", "rollout/response_len_mean", "rollout/log_probs", "rollout/rollout_log_probs",
             "train/loss", "train/ppo_kl", "train/pg_clipfrac", "train/grad_norm", "train/entropy",
             "train/train_rollout_logprob_abs_diff", "forward_logp_max_diff", "perf/rollout_tok_s",
             "perf/train_tok_s", "perf/step_time_s"]


def run(args, *extra) -> Path:
    args = list(args) + list(extra)
    assert main(args) == 0
    last = len(args) - 1 - args[::-1].index("--output-dir")  # later flags override earlier ones
    return Path(args[last + 1])


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_step_run(tiny_args, tiny_model):
    out = run(tiny_args)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for key in SPEC_KEYS:
        assert all(key in r for r in rows), key
    # fp32 engine and trainer on the same weights agree to 1e-4 on every response token.
    assert all(r["forward_logp_max_diff"] < 1e-4 for r in rows)
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in rows)

    log = (out / "train.log").read_text()
    assert log.count(f"Loaded checkpoint from {tiny_model}") == 2  # policy and engine (no KL: no ref)
    assert "weight_sync step=1 tensors=21 bytes=" in log and "weight_sync step=2 " in log
    assert "step 2/2 | reward" in log

    config = json.loads((out / "config.json").read_text())
    assert config["rollout_batch_size"] == 4 and config["global_batch_size"] == 16 and config["precision"] == "fp32"

    # Every trainable tensor changed, and the checkpoint is a plain HF model dir.
    before = load_file(tiny_model / "model.safetensors")
    after = load_file(out / "checkpoints" / "step_2" / "model.safetensors")
    assert before.keys() == after.keys()
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert unchanged == []
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_2")
    AutoTokenizer.from_pretrained(out / "checkpoints" / "step_2")
    state = torch.load(out / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 2 and state["data"] == {"epoch": 0, "offset": 8}


def test_kl_is_exactly_zero_at_step_one(tiny_args, tiny_model):
    rows = metrics(run(tiny_args, "--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "low_var_kl"))
    assert rows[0]["rollout/log_probs"] == rows[0]["rollout/ref_log_probs"]
    assert rows[0]["train/kl_loss"] == 0.0
    assert rows[1]["train/kl_loss"] > 0  # the policy moved away from the reference after step 1


def test_resume_continues_the_step_count_and_the_run(tiny_args, tmp_path):
    full = metrics(run(tiny_args, "--num-rollout", "3", "--output-dir", str(tmp_path / "full")))
    first = run(tiny_args, "--save-interval", "1", "--output-dir", str(tmp_path / "first"))
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step_1", "step_2"]
    resumed_dir = run(tiny_args, "--num-rollout", "3", "--load", str(first / "checkpoints"),
                      "--output-dir", str(tmp_path / "resumed"))
    resumed = metrics(resumed_dir)
    assert [r["step"] for r in resumed] == [3]
    assert "Resuming after step 2" in (resumed_dir / "train.log").read_text()
    assert main(tiny_args + ["--load", str(first / "checkpoints"), "--output-dir", str(tmp_path / "nothing")]) == 2
    # Weights, optimizer state and data position all carried over: step 3 is the same step 3.
    for key in ("rollout/reward_mean", "train/loss", "train/grad_norm", "rollout/log_probs"):
        assert resumed[0][key] == pytest.approx(full[2][key], rel=1e-5, abs=1e-7), key


def test_gradient_accumulation_is_invariant(tiny_args, tmp_path):
    one = metrics(run(tiny_args, "--num-rollout", "1", "--micro-batch-size", "16", "--output-dir", str(tmp_path / "a")))
    many = metrics(run(tiny_args, "--num-rollout", "1", "--micro-batch-size", "2", "--output-dir", str(tmp_path / "b")))
    for key in ("train/loss", "train/grad_norm", "train/entropy"):
        assert one[0][key] == pytest.approx(many[0][key], rel=1e-4, abs=1e-6), key


def test_several_optimizer_steps_per_rollout(tiny_args):
    rows = metrics(run(tiny_args, "--num-rollout", "1", "--num-steps-per-rollout", "2"))
    # The second minibatch is scored by a policy that already took a step: off-policy by then.
    assert rows[0]["train/ppo_kl"] != 0.0


@pytest.mark.parametrize("estimator", ["gspo", "reinforce_plus_plus"])
def test_other_estimators_train(tiny_args, estimator):
    rows = metrics(run(tiny_args, "--advantage-estimator", estimator, "--kl-coef", "0.05", "--eps-clip", "0.1"))
    assert all(r["train/grad_norm"] > 0 for r in rows)


def test_tis_metrics(tiny_args):
    rows = metrics(run(tiny_args, "--use-tis", "--tis-clip", "1.5"))
    assert all(r["train/tis_mean"] == pytest.approx(1.0, abs=1e-4) for r in rows)  # fp32: engine == trainer
    assert all(r["train/tis_clipfrac"] == 0.0 for r in rows)


def test_tensorboard_sink(tiny_args):
    pytest.importorskip("tensorboard")
    out = run(tiny_args, "--use-tensorboard", "--num-rollout", "1")
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_wandb_offline_sink(tiny_args, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = run(tiny_args, "--use-wandb", "--num-rollout", "1")
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_reinforce_plus_plus_with_one_sample_per_prompt(tiny_args):
    rows = metrics(run(tiny_args, "--advantage-estimator", "reinforce_plus_plus", "--n-samples-per-prompt", "1",
                       "--rollout-batch-size", "8"))
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in rows)
