"""End-to-end `miles train` runs on a tiny random model: files, metrics, learning, resume."""

import json
import math
import os
import subprocess
import sys
import time
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


def test_a_run_with_the_trainer_compiled(tiny_args):
    """--trainer-torch-compile end to end (Inductor on the CPU): the compiled trainer scores the engine's
    tokens as the eager engine does, and trains."""
    out = run(tiny_args, "--trainer-torch-compile")
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in rows)
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in rows)
    assert json.loads((out / "config.json").read_text())["trainer_torch_compile"] is True


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
    assert state["step"] == 2 and state["data"]["rows"] == 16 and len(state["data"]["sha256"]) == 16


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
    log = (resumed_dir / "train.log").read_text()
    assert "Resuming after step 2" in log and "Done: 1 step; metrics in" in log
    assert main(tiny_args + ["--load", str(first / "checkpoints"), "--output-dir", str(tmp_path / "nothing")]) == 2
    # Weights, optimizer state and data position all carried over: step 3 is the same step 3.
    for key in ("rollout/reward_mean", "train/loss", "train/grad_norm", "rollout/log_probs"):
        assert resumed[0][key] == pytest.approx(full[2][key], rel=1e-5, abs=1e-7), key


@pytest.fixture
def varied_args(tiny_args, tmp_path):
    """Raw prompts on which the tiny model stops at EOS in some responses and not in others, so
    response lengths differ (and the two loss aggregations give different numbers)."""
    data = tmp_path / "varied.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"a much longer prompt {i}", "label": "1"}) + "\n" for i in range(4)))
    argv = list(tiny_args)
    argv[argv.index("--prompt-data") + 1] = str(data)
    return argv + ["--no-apply-chat-template", "--num-rollout", "1", "--rollout-max-response-len", "40"]


def test_resume_with_other_prompt_data_is_a_usage_error(tiny_args, tmp_path):
    first = run(tiny_args, "--num-rollout", "1", "--output-dir", str(tmp_path / "first"))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"prompt": "What is 9 + 9?", "label": "18"}) + "\n")
    argv = list(tiny_args)
    argv[argv.index("--prompt-data") + 1] = str(other)
    r = subprocess.run([sys.executable, "-m", "miles", *argv, "--load", str(first), "--output-dir",
                        str(tmp_path / "resumed")], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert (last.startswith("error: the checkpoint was trained on other prompt data (16 rows")
            and "--prompt-data" in last)


@pytest.mark.parametrize("per_token", [False, True])
def test_gradient_accumulation_is_invariant(varied_args, tmp_path, per_token):
    flags = ["--calculate-per-token-loss"] if per_token else []
    one = metrics(run(varied_args, *flags, "--micro-batch-size", "16", "--output-dir", str(tmp_path / "a")))
    many = metrics(run(varied_args, *flags, "--micro-batch-size", "2", "--output-dir", str(tmp_path / "b")))
    for key in ("train/loss", "train/grad_norm", "train/entropy"):
        assert one[0][key] == pytest.approx(many[0][key], rel=1e-4, abs=1e-6), key


def test_per_token_loss_weights_tokens_not_samples(varied_args, tmp_path):
    """Same rollout, two aggregations: the entropy (a plain mean) is the per-token mean over all
    trained tokens in one and the mean of per-sample means in the other; they differ when lengths do."""
    dump = ["--save-debug-rollout-data", str(tmp_path / "d" / "data_{rollout_id}.pt")]
    sample_mean = metrics(run(varied_args, *dump, "--output-dir", str(tmp_path / "a")))[0]
    token_mean = metrics(run(varied_args, "--calculate-per-token-loss", "--output-dir", str(tmp_path / "b")))[0]
    samples = torch.load(tmp_path / "d" / "data_0.pt", weights_only=True)["samples"]
    lengths = [s["response_length"] for s in samples]
    assert len(set(lengths)) > 1  # the comparison needs responses of different lengths
    assert sample_mean["rollout/reward_mean"] == token_mean["rollout/reward_mean"]  # the same rollout
    assert token_mean["train/entropy"] != pytest.approx(sample_mean["train/entropy"], rel=1e-3)
    assert token_mean["train/grad_norm"] != pytest.approx(sample_mean["train/grad_norm"], rel=1e-3)


def test_several_optimizer_steps_per_rollout(tiny_args):
    rows = metrics(run(tiny_args, "--num-rollout", "1", "--num-steps-per-rollout", "2"))
    # The second minibatch is scored by a policy that already took a step: off-policy by then.
    assert rows[0]["train/ppo_kl"] != 0.0


@pytest.mark.parametrize("estimator", ["gspo", "reinforce_plus_plus"])
def test_other_estimators_train(tiny_args, estimator):
    rows = metrics(run(tiny_args, "--advantage-estimator", estimator, "--kl-coef", "0.05", "--eps-clip", "0.1"))
    assert all(r["train/grad_norm"] > 0 for r in rows)


def test_gspo_clips_whole_sequences(tiny_args, tmp_path):
    """GSPO and GRPO differ only in the ratio: off-policy (the second optimizer step of a rollout) a
    tight clip range clips whole samples under GSPO, single tokens under GRPO."""
    flags = ["--num-rollout", "1", "--num-steps-per-rollout", "2", "--eps-clip", "0.001", "--lr", "1e-2"]
    grpo = metrics(run(tiny_args, *flags, "--output-dir", str(tmp_path / "grpo")))[0]
    gspo = metrics(run(tiny_args, *flags, "--advantage-estimator", "gspo", "--output-dir", str(tmp_path / "gspo")))[0]
    assert grpo["rollout/advantages"] == gspo["rollout/advantages"]  # same advantages: the ratio alone differs
    assert gspo["train/pg_clipfrac"] != pytest.approx(grpo["train/pg_clipfrac"], abs=1e-3)
    assert gspo["train/grad_norm"] != pytest.approx(grpo["train/grad_norm"], rel=1e-3)


def test_tis_metrics(tiny_args):
    rows = metrics(run(tiny_args, "--use-tis", "--tis-clip", "1.5"))
    assert all(r["train/tis_mean"] == pytest.approx(1.0, abs=1e-4) for r in rows)  # fp32: engine == trainer
    assert all(r["train/tis_clipfrac"] == 0.0 for r in rows)


def first_step_metrics(tiny_model, samples, ref=None, zero_head=False, **cfg):
    """Trainer.train's metrics for one optimizer step of the tiny model on `samples`."""
    from test_seams import train_cfg

    from miles.train.trainer import Trainer
    from miles.utils.models import load_causal_lm

    model = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    if zero_head:
        with torch.no_grad():
            model.get_output_embeddings().weight.zero_()
    trainer = Trainer(train_cfg(**cfg), model, ref, temperature=1.0, group_size=3, pad_token_id=1, precision="fp32")
    return trainer.train(samples).metrics


@pytest.fixture(scope="module")
def rollout(tiny_model, prompt_file):
    from test_seams import live

    return live(tiny_model, prompt_file).generate(0).samples


def test_tis_weights_scale_the_gradient_up_to_the_clip(tiny_model, rollout):
    import dataclasses

    base = first_step_metrics(tiny_model, rollout)
    # The engine gave each token 1/1.25 of the trainer's probability: every weight pi_train / pi_engine is 1.25.
    shifted = [dataclasses.replace(s, rollout_log_probs=[x - math.log(1.25) for x in s.rollout_log_probs])
               for s in rollout]
    for clip, weight in ((2.0, 1.25), (1.1, 1.1)):
        tis = first_step_metrics(tiny_model, shifted, use_tis=True, tis_clip=clip)
        assert tis["train/tis_mean"] == pytest.approx(weight, rel=1e-4)
        assert tis["train/tis_clipfrac"] == (1.0 if weight == clip else 0.0)
        assert tis["train/grad_norm"] == pytest.approx(weight * base["train/grad_norm"], rel=1e-4)


def test_the_kl_loss_enters_the_loss_times_its_coefficient(tiny_model, rollout):
    from miles.utils.models import load_causal_lm

    ref = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    with torch.no_grad():
        ref.get_output_embeddings().weight.mul_(1.5)  # a reference the policy is not
    m = first_step_metrics(tiny_model, rollout, ref=ref, use_kl_loss=True, kl_loss_coef=0.3)
    assert abs(m["train/kl_loss"]) > 1e-3
    assert m["train/loss"] == pytest.approx(m["train/pg_loss"] + 0.3 * m["train/kl_loss"], rel=1e-5, abs=1e-7)


def test_the_entropy_metric_of_a_uniform_policy_is_log_vocab(tiny_model, rollout):
    m = first_step_metrics(tiny_model, rollout, zero_head=True)  # every logit 0
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    assert m["train/entropy"] == pytest.approx(math.log(vocab), rel=1e-5)


def test_tensorboard_sink(tiny_args):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = run(tiny_args, "--use-tensorboard")
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    rows = metrics(out)
    for key in ("train/loss", "rollout/reward_mean", "train/grad_norm"):
        scalars = events.Scalars(key)
        assert [e.step for e in scalars] == [1, 2]
        assert [e.value for e in scalars] == pytest.approx([r[key] for r in rows], rel=1e-6), key


def wandb_history(run_dir: Path) -> list[dict]:
    """The rows logged to an offline W&B run, read back from its .wandb transaction log: a 7-byte
    file header, then LevelDB-log records (7-byte header: crc, length, type) in 32 KiB blocks, each
    a protobuf `Record`."""
    (log,) = (run_dir / "wandb").glob("offline-run-*/*.wandb")
    for _ in range(100):  # W&B's service process finishes writing the log after wandb.finish() returns
        rows, done = _wandb_records(log.read_bytes())
        if done:
            return rows
        time.sleep(0.1)
    raise AssertionError(f"{log} never got its exit record")


def _wandb_records(data: bytes) -> tuple[list[dict], bool]:
    import struct

    from wandb.proto import wandb_internal_pb2

    pos, block, records, part = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block padding
            pos += left
            continue
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            records.append(part)
            part = b""
    rows, done = [], False
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        done = done or kind == "exit"
    return rows, done


def test_wandb_offline_sink(tiny_args, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = run(tiny_args, "--use-wandb")
    logged, rows = wandb_history(out), metrics(out)
    assert [r["_step"] for r in logged] == [1, 2]
    for key in ("train/loss", "rollout/reward_mean"):
        assert [r[key] for r in logged] == pytest.approx([r[key] for r in rows], rel=1e-9), key


def test_wandb_without_credentials_logs_offline(tiny_args, tmp_path):
    pytest.importorskip("wandb")
    # A fresh process (W&B keeps its settings per process) with no key and no stored login (~/.netrc).
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    env.update(HOME=str(tmp_path / "home"), WANDB_SILENT="true")
    r = subprocess.run([sys.executable, "-m", "miles", *tiny_args, "--use-wandb", "--num-rollout", "1"],
                       capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "run"
    log = (out / "train.log").read_text()
    assert "--use-wandb: No API key configured" in log and "logging offline to" in log and "wandb sync" in log
    assert [r["_step"] for r in wandb_history(out)] == [1]


def test_reinforce_plus_plus_with_one_sample_per_prompt(tiny_args):
    rows = metrics(run(tiny_args, "--advantage-estimator", "reinforce_plus_plus", "--n-samples-per-prompt", "1",
                       "--rollout-batch-size", "8"))
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in rows)


def test_without_a_terminal_long_phases_log_plain_progress_lines(tiny_args, monkeypatch):
    from miles.utils import progress

    monkeypatch.setattr(progress, "PLAIN_INTERVAL_S", 0.0)  # every update is "N seconds later"
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    log = (run(tiny_args, "--num-rollout", "1") / "train.log").read_text()
    assert "INFO rollout 0 generating: 12/12 tokens, " in log
    assert "INFO training: 4/4 micro-batches, " in log


def test_a_closed_stdout_pipe_does_not_stop_or_clutter_the_run(tiny_args):
    """`miles train ... | head -1`: the run goes on, train.log gets every line, stderr stays clean."""
    proc = subprocess.Popen([sys.executable, "-m", "miles", *tiny_args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 0 and err == ""
    out = Path(tiny_args[tiny_args.index("--output-dir") + 1])
    assert "Done: 2 steps" in (out / "train.log").read_text()
