"""`miles` from the outside: help, and every bad input exits 2 with one `error:` line,
no traceback, before torch is even imported."""

import json
import os
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
    (["--prompt-data", "{d}/bad.jsonl", "--input-key", "question", "--label-key", "answer"],
     ["line 2", "invalid JSON"]),
    (["--prompt-data", "{d}/good.jsonl", "--label-key", "answer"],
     ["--input-key 'prompt'", "keys present: question, answer"]),
    (["--prompt-data", "{d}/good.jsonl", "--input-key", "question", "--label-key", "anwser"],
     ["--label-key 'anwser'", "any row", "answer"]),
    (["--prompt-data", "{d}/empty.jsonl", "--input-key", "question", "--label-key", "answer"], ["no rows"]),
    (["--rollout-batch-size", "0"], ["--rollout-batch-size must be > 0"]),
    (["--n-samples-per-prompt", "-1"], ["--n-samples-per-prompt"]),
    (["--rollout-top-p", "1.5"], ["--rollout-top-p"]),
    (["--global-batch-size", "12"], ["--global-batch-size 12", "32"]),
    (["--micro-batch-size", "5"], ["--micro-batch-size 5", "the global batch (32: every sample"]),
    (["--num-steps-per-rollout", "3"], ["derived from 32 samples // --num-steps-per-rollout 3"]),
    (["--use-kl-loss"], ["--kl-loss-coef"]),
    (["--n-samples-per-prompt", "1"], ["--n-samples-per-prompt >= 2", "reinforce_plus_plus"]),
    (["--hf-checkpoint", "{d}"], ["--hf-checkpoint", "no config.json"]),
    (["--load", "{d}/nowhere"], ["--load", "no such directory"]),
    (["--rm-type", "bogus"], ["--rm-type", "math"]),
    (["--custom-rm-path", "no_colon"], ["--custom-rm-path"]),
    (["--custom-rm-path", "no_such_module_xyz:fn"], ["--custom-rm-path", "no_such_module_xyz"]),
    (["--seed", "-1"], ["--seed must be in [0, 2**32 - 1] (got -1)"]),
    (["--prompt-data", "{d}/good.jsonl", "--input-key", "question"], ["--label-key"]),
    (["--rollout-batch-size", "x"], ["--rollout-batch-size", "invalid int value"]),
    (["--bogus-flag"], ["--bogus-flag"]),
    (["--advantage-estimator", "ppo"], ["--advantage-estimator", "grpo"]),
    (["--trainer-torch-compile", "--true-on-policy-mode"], ["--trainer-torch-compile", "--true-on-policy-mode"]),
])
def test_bad_input_is_one_error_line_before_torch(flags, fragments, data_dir, tmp_path):
    flags = [f.replace("{d}", str(data_dir)) for f in flags]
    result = miles("train", *flags, "--output-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert_usage_error(result, *fragments)
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_a_reward_module_that_fails_to_import_is_one_error_line(tmp_path):
    """The user's module: a syntax error names its file and line; an exception at its top level its type."""
    (tmp_path / "broken_syntax.py").write_text("def f(:\n")
    (tmp_path / "raises_on_import.py").write_text("x = 1 / 0\n")
    run = ["--output-dir", str(tmp_path / "run")]
    assert_usage_error(miles("train", "--custom-rm-path", "broken_syntax:f", *run, cwd=tmp_path),
                       f"--custom-rm-path broken_syntax:f: {tmp_path / 'broken_syntax.py'}:1: invalid syntax")
    assert_usage_error(miles("train", "--custom-rm-path", "raises_on_import:f", *run, cwd=tmp_path),
                       "importing 'raises_on_import' raised ZeroDivisionError: division by zero")
    assert not (tmp_path / "run").exists()


def test_existing_run_dir_is_not_overwritten(tmp_path):
    (tmp_path / "run" / "checkpoints" / "step_2").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_2" / "trainer_state.pt").write_bytes(b"")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert_usage_error(miles("train", "--output-dir", str(tmp_path / "run")), "already holds a run",
                       "checkpoints up to step_2", f"--load {tmp_path / 'run'}")


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
    r = subprocess.run([sys.executable, "-m", "miles", "train", "--hf-checkpoint", str(model),
                        "--prompt-data", str(data), "--label-key", "label", "--apply-chat-template",
                        "--output-dir", str(tmp_path / "run")],
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


def test_every_choice_list_is_its_registry():
    from miles.cli import train_args
    from miles.rollout.rewards import REWARD_FUNCTIONS, RM_TYPES
    from miles.train.advantages import ADVANTAGE_ESTIMATORS
    from miles.train.losses import KL_ESTIMATORS
    from miles.utils.models import ATTENTION_IMPLEMENTATIONS

    assert set(train_args.ADVANTAGE_ESTIMATORS) == set(ADVANTAGE_ESTIMATORS)
    assert set(train_args.KL_TYPES) == set(KL_ESTIMATORS)
    assert set(train_args.ATTENTION_BACKENDS) == set(ATTENTION_IMPLEMENTATIONS)
    assert set(RM_TYPES) == set(REWARD_FUNCTIONS)
    # And the parser offers exactly those.
    from miles.cli.main import build_parser

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    choices = {a.dest: set(a.choices) for a in train._actions if a.choices}
    assert choices["advantage_estimator"] == set(ADVANTAGE_ESTIMATORS)
    assert choices["kl_loss_type"] == set(KL_ESTIMATORS)
    assert choices["attention_backend"] == set(ATTENTION_IMPLEMENTATIONS)
    assert choices["rm_type"] == set(REWARD_FUNCTIONS)


def test_relative_paths_are_stored_absolute(tiny_args, tmp_path, capsys):
    """Relative --save-debug-rollout-data / --output-dir given in one directory; `miles report`
    run from another still finds the dumps through config.json."""
    from miles.cli.main import main

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    argv = list(tiny_args)
    argv[argv.index("--output-dir") + 1] = "run"
    cwd = os.getcwd()
    try:
        os.chdir(work)
        assert main(argv + ["--num-rollout", "1", "--save-debug-rollout-data", "dumps/data_{rollout_id}.pt"]) == 0
        config = json.loads((work / "run" / "config.json").read_text())
        assert config["save_debug_rollout_data"] == str(work / "dumps" / "data_{rollout_id}.pt")
        assert config["output_dir"] == str(work / "run")
        os.chdir(elsewhere)
        capsys.readouterr()
        assert main(["report", str(work / "run")]) == 0
        assert "logprob_scatter" in capsys.readouterr().out + (work / "run" / "report.html").read_text()
    finally:
        os.chdir(cwd)


def test_resuming_into_the_same_dir_keeps_the_first_command_line(tiny_args, tmp_path):
    from miles.cli.main import main

    import shlex

    out = tmp_path / "run"
    first, second = tiny_args + ["--save-interval", "1"], tiny_args + ["--num-rollout", "3", "--load", str(out)]
    assert main(first) == 0
    assert main(second) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["command_line"] == "miles " + shlex.join(first)
    assert [i["command_line"] for i in config["invocations"]] == ["miles " + shlex.join(a) for a in (first, second)]
    assert config["num_rollout"] == 3  # the flags are this invocation's
    rows = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3]
