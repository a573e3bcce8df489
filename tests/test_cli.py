"""`miles` from the outside: help, and every bad input exits 2 with one `error:` line,
no traceback, before torch is even imported."""

import json
import subprocess
import sys

import pytest

# Runs the CLI and fails (exit 7) if torch was imported on the way to the verdict.
NO_TORCH = ("import sys; from miles.cli.main import main; rc = main(sys.argv[1:]); "
            "sys.exit(7 if 'torch' in sys.modules else rc)")


def miles(*args, cwd=None):
    return subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, cwd=cwd)


def assert_usage_error(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_help_lists_working_commands_fast():
    r = miles("--help")
    assert r.returncode == 0 and "train" in r.stdout
    r = miles("train", "--help")
    assert r.returncode == 0
    for group in ("model and checkpoints", "data", "rollout", "training"):
        assert group in r.stdout
    assert "--n-samples-per-prompt" in r.stdout and "--kl-loss-type" in r.stdout


def test_python_dash_m_works():
    r = subprocess.run([sys.executable, "-m", "miles", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("miles ")


@pytest.fixture
def data_dir(tmp_path):
    (tmp_path / "good.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    (tmp_path / "bad.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": \n')
    (tmp_path / "empty.jsonl").write_text("\n")
    return tmp_path


@pytest.mark.parametrize("flags, fragments", [
    (["--prompt-data", "nope.jsonl"], ["--prompt-data", "no such file", "nope.jsonl"]),
    (["--prompt-data", "{d}/bad.jsonl", "--input-key", "question", "--label-key", "answer"], ["line 2", "invalid JSON"]),
    (["--prompt-data", "{d}/good.jsonl", "--label-key", "answer"], ["--input-key 'prompt'", "keys present: question, answer"]),
    (["--prompt-data", "{d}/good.jsonl", "--input-key", "question", "--label-key", "anwser"],
     ["--label-key 'anwser'", "any row", "answer"]),
    (["--prompt-data", "{d}/empty.jsonl", "--input-key", "question", "--label-key", "answer"], ["no rows"]),
    (["--rollout-batch-size", "0"], ["--rollout-batch-size must be > 0"]),
    (["--n-samples-per-prompt", "-1"], ["--n-samples-per-prompt"]),
    (["--rollout-top-p", "1.5"], ["--rollout-top-p"]),
    (["--global-batch-size", "12"], ["--global-batch-size 12", "32"]),
    (["--micro-batch-size", "5"], ["--micro-batch-size 5", "--global-batch-size 32"]),
    (["--use-kl-loss"], ["--kl-loss-coef"]),
    (["--n-samples-per-prompt", "1"], ["--n-samples-per-prompt >= 2", "reinforce_plus_plus"]),
    (["--hf-checkpoint", "{d}"], ["--hf-checkpoint", "no config.json"]),
    (["--load", "{d}/nowhere"], ["--load", "no such directory"]),
    (["--rm-type", "bogus"], ["--rm-type", "math"]),
    (["--custom-rm-path", "no_colon"], ["--custom-rm-path"]),
    (["--custom-rm-path", "no_such_module_xyz:fn"], ["--custom-rm-path", "no_such_module_xyz"]),
    (["--prompt-data", "{d}/good.jsonl", "--input-key", "question"], ["--label-key"]),
    (["--rollout-batch-size", "x"], ["--rollout-batch-size", "invalid int value"]),
    (["--bogus-flag"], ["--bogus-flag"]),
    (["--advantage-estimator", "ppo"], ["--advantage-estimator", "grpo"]),
])
def test_bad_input_is_one_error_line_before_torch(flags, fragments, data_dir, tmp_path):
    flags = [f.replace("{d}", str(data_dir)) for f in flags]
    result = miles("train", *flags, "--output-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert_usage_error(result, *fragments)
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_existing_run_dir_is_not_overwritten(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    assert_usage_error(miles("train", "--output-dir", str(tmp_path / "run")), "already holds a run", "--load")


def test_chat_template_missing_is_a_usage_error(tiny_model, tmp_path):
    # A model without a chat template plus --apply-chat-template: found once the tokenizer loads.
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "hi", "label": "1"}\n')
    r = subprocess.run([sys.executable, "-m", "miles", "train", "--hf-checkpoint", str(model), "--prompt-data", str(data),
                        "--label-key", "label", "--apply-chat-template", "--output-dir", str(tmp_path / "run")],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "chat template" in r.stderr
    assert "Traceback" not in r.stderr


def test_max_prompt_len_dropping_everything_is_a_usage_error(tiny_model, prompt_file, tmp_path):
    r = subprocess.run([sys.executable, "-m", "miles", "train", "--hf-checkpoint", str(tiny_model), "--prompt-data",
                        str(prompt_file), "--label-key", "label", "--rollout-max-prompt-len", "3",
                        "--output-dir", str(tmp_path / "run")], capture_output=True, text=True)
    assert r.returncode == 2 and "--rollout-max-prompt-len 3 drops every prompt" in r.stderr
    assert "Loaded checkpoint" not in r.stdout  # caught before any model loaded


def test_corrupt_weights_are_a_usage_error(tiny_model, prompt_file, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    r = subprocess.run([sys.executable, "-m", "miles", "train", "--hf-checkpoint", str(model), "--prompt-data",
                        str(prompt_file), "--label-key", "label", "--output-dir", str(tmp_path / "run")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot load a causal LM from {model}") and "--hf-checkpoint" in last
