"""The demo model (SmolLM2-135M-Instruct) end to end on CPU. Slow: about a minute each."""

import json
from pathlib import Path

import pytest

from miles.cli.main import main

pytestmark = pytest.mark.slow
GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"


def test_demo_recipe(tmp_path):
    """`miles train` with only the step count shortened: demo model, bundled task, chat template, and
    the held-out problems evaluated before the step and after it."""
    out = tmp_path / "run"
    assert main(["train", "--num-rollout", "1", "--output-dir", str(out)]) == 0
    before, row = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert before["step"] == 0 and set(before) == {"step", "eval/arith_held_out", "eval/arith_held_out/response_len"}
    assert row["step"] == 1 and 0 <= row["eval/arith_held_out"] <= 1
    assert 0 <= row["rollout/reward_mean"] <= 1
    assert row["forward_logp_max_diff"] < 1e-4  # fp32 engine vs trainer on a real model
    log = (out / "train.log").read_text()
    assert "Loaded checkpoint from" in log and "weight_sync step=1 tensors=272" in log
    # A clean demo run passes every alignment check.
    checks = [line for line in log.splitlines() if "Alignment check |" in line]
    assert len(checks) == 6 and all("| PASS |" in line for line in checks), "\n".join(checks)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_1")
    assert model.config.model_type == "llama"


@pytest.mark.skipif(not GSM8K.is_file(), reason="needs ../shared/data/gsm8k beside the checkout")
def test_gsm8k_example_runs_two_steps(tmp_path):
    out = tmp_path / "gsm8k"
    assert main(["train", "--prompt-data", str(GSM8K), "--input-key", "question", "--label-key", "answer",
                 "--rm-type", "math", "--apply-chat-template", "--num-rollout", "2", "--rollout-batch-size", "4",
                 "--n-samples-per-prompt", "2", "--rollout-max-response-len", "48", "--output-dir", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    config = json.loads((out / "config.json").read_text())
    assert config["input_key"] == "question" and config["label_key"] == "answer" and config["apply_chat_template"]
