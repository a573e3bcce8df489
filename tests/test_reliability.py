"""Nothing lost: NaN guards, one run per directory, exact resume, signals, disk full, hostile rewards.

The kill tests run `miles train` as a real process and kill it with SIGKILL / SIGTERM at chosen
points, then resume it and compare with a run that was never interrupted.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles.cli.main import main
from test_train import metrics, run

TESTS = Path(__file__).parent
DET = ["--deterministic-mode", "--debug-determinism"]


def with_reward(args, name):
    argv = list(args)
    argv[argv.index("--custom-rm-path") + 1] = f"faulty_rewards:{name}"
    return argv


def out_dir(args) -> Path:
    return Path(args[len(args) - 1 - args[::-1].index("--output-dir") + 1])


def steps_of(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def weights(step_dir: Path) -> dict:
    return load_file(step_dir / "model.safetensors")


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def start(args, runner=("miles",), **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", *runner, *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, **kw)


def wait_for(predicate, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended early: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def finish(args) -> subprocess.CompletedProcess:
    proc = start(args)
    _, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err)


# -- non-finite values never reach the weights ----------------------------------------------------

def test_a_nan_reward_skips_its_step_and_the_weights_stay(tiny_args):
    out = run(with_reward(tiny_args, "nan_once"), "--num-rollout", "3", "--save-interval", "1")
    log = (out / "train.log").read_text()
    assert "Skipped step 2: non-finite reward of sample(s) 1 (nan); parameters and optimizer unchanged" in log
    assert same_weights(out / "checkpoints" / "step_1", out / "checkpoints" / "step_2")
    assert not same_weights(out / "checkpoints" / "step_2", out / "checkpoints" / "step_3")  # training went on
    for step in (1, 2, 3):
        assert all(bool(t.isfinite().all()) for t in weights(out / "checkpoints" / f"step_{step}").values())
    s1 = torch.load(out / "checkpoints" / "step_1" / "trainer_state.pt", weights_only=True)["optimizer"]
    s2 = torch.load(out / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=True)["optimizer"]
    assert all(torch.equal(s1["state"][k]["exp_avg"], s2["state"][k]["exp_avg"]) for k in s1["state"])
    assert [r.get("train/skipped_nonfinite") for r in metrics(out)] == [None, 1.0, None]


def test_consecutive_nan_steps_stop_the_run_with_exit_3(tiny_args, tiny_model):
    argv = with_reward(tiny_args, "always_nan") + ["--num-rollout", "6", "--max-nonfinite-steps", "2"]
    assert main(argv) == 3
    out = out_dir(argv)
    log = (out / "train.log").read_text()
    assert "Stopping: 2 consecutive steps with non-finite values (--max-nonfinite-steps 2)" in log
    assert steps_of(out / "metrics.jsonl") == [1, 2]
    assert same_weights(out / "checkpoints" / "step_2", tiny_model)  # no update ever landed


def test_nan_steps_apart_do_not_add_up_to_a_stop(tiny_args):
    argv = with_reward(tiny_args, "nan_every_other_rollout") + ["--num-rollout", "5", "--max-nonfinite-steps", "2"]
    assert main(argv) == 0
    metrics_rows = metrics(out_dir(argv))
    assert [r.get("train/skipped_nonfinite") for r in metrics_rows] == [None, 1.0, None, 1.0, None]


def test_a_gradient_that_overflows_is_named_and_not_applied(tiny_args, monkeypatch):
    from miles.train import trainer as trainer_module

    original = trainer_module.Trainer._micro_step

    def poisoned(self, mb, *args):
        out = original(self, mb, *args)
        self.model.lm_head.weight.grad[0, 0] = float("inf")
        return out

    monkeypatch.setattr(trainer_module.Trainer, "_micro_step", poisoned)
    assert main(tiny_args + ["--num-rollout", "1"]) == 0
    log = (out_dir(tiny_args) / "train.log").read_text()
    assert "Skipped step 1: non-finite gradient of lm_head.weight, optimizer step 1 of 1" in log


# -- one run per directory ------------------------------------------------------------------------

def test_a_second_run_on_a_locked_dir_is_refused(tiny_args):
    from miles.utils.run_lock import RunLock

    lock = RunLock(out_dir(tiny_args), flag="--output-dir", command_line="miles train (the first run)")
    assert lock.acquire() is None
    try:
        r = finish(tiny_args)
        assert r.returncode == 2
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: --output-dir {out_dir(tiny_args)} is in use by another miles run (pid "
                               f"{os.getpid()} on ")
        assert "miles train (the first run)" in last
        assert not (out_dir(tiny_args) / "metrics.jsonl").exists()
    finally:
        lock.release()


def test_a_save_dir_shared_by_two_runs_is_refused(tiny_args, tmp_path):
    from miles.utils.run_lock import RunLock

    lock = RunLock(tmp_path / "shared", flag="--save", command_line="miles train --save shared")
    lock.acquire()
    try:
        r = finish(tiny_args + ["--save", str(tmp_path / "shared")])
        assert r.returncode == 2 and f"error: --save {tmp_path / 'shared'} is in use by another miles run" in r.stderr
    finally:
        lock.release()


def test_a_dead_runs_lock_is_taken_over(tiny_args):
    out = out_dir(tiny_args)
    out.mkdir(parents=True)
    (out / ".miles.lock").write_text(json.dumps({"pid": 999999999, "host": "gone", "command_line": "miles train"}))
    run(tiny_args, "--num-rollout", "1")
    assert "took over the lock of a run that is gone (pid 999999999 on gone" in (out / "train.log").read_text()
    assert not (out / ".miles.lock").exists()  # released at a clean exit


# -- resume: exact, and honest -------------------------------------------------------------------

@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model, prompt_file, reward_module):
    from conftest import tiny_train_args

    out = tmp_path_factory.mktemp("whole") / "run"
    args = tiny_train_args(tiny_model, prompt_file, reward_module, out) + [*DET, "--num-rollout", "6"]
    r = finish(args)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.mark.parametrize("kill_when", ["right after the step_2 checkpoint is renamed into place",
                                       "in the middle of step 4"])
def test_kill_9_then_resume_equals_the_uninterrupted_run(tiny_args, uninterrupted, kill_when):
    args = tiny_args + [*DET, "--num-rollout", "6", "--save-interval", "2"]
    out = out_dir(args)
    if kill_when.startswith("right after"):  # the process kills itself at that exact point
        proc = start(args, runner=("kill_points", "2"))
        assert proc.wait(timeout=300) == -signal.SIGKILL, proc.stderr.read()[-2000:]
        assert (out / "checkpoints" / "step_2").is_dir() and not (out / "checkpoints" / "step_3").exists()
    else:
        proc = start(args)
        wait_for(lambda: (out / "metrics.jsonl").is_file() and len(steps_of(out / "metrics.jsonl")) >= 3, proc)
        proc.kill()
        proc.wait()
    r = finish(args + ["--load", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert steps_of(out / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]  # each step once: no gap, no duplicate
    assert steps_of(out / "hashes.jsonl") == [1, 2, 3, 4, 5, 6]
    assert (out / "hashes.jsonl").read_text() == (uninterrupted / "hashes.jsonl").read_text()
    assert same_weights(out / "checkpoints" / "step_6", uninterrupted / "checkpoints" / "step_6")


def test_a_run_killed_before_its_first_checkpoint_restarts_in_place(tiny_args):
    args = tiny_args + ["--num-rollout", "3"]
    out = out_dir(args)
    proc = start(args)
    wait_for(lambda: (out / "metrics.jsonl").is_file() and steps_of(out / "metrics.jsonl"), proc)
    proc.kill()
    proc.wait()
    r = finish(args)  # the same command again
    assert r.returncode == 0, r.stderr[-2000:]
    assert steps_of(out / "metrics.jsonl") == [1, 2, 3]
    assert "stopped before its first checkpoint: restarting it in place" in (out / "train.log").read_text()
    assert steps_of(out / "metrics.jsonl.dropped")  # the killed run's rows are set aside, not lost


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_the_last_finished_step_and_resumes(tiny_args, uninterrupted, sig, code):
    args = tiny_args + [*DET, "--num-rollout", "6"]
    out = out_dir(args)
    proc = start(args)
    wait_for(lambda: (out / "metrics.jsonl").is_file() and len(steps_of(out / "metrics.jsonl")) >= 2, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert err.strip().splitlines()[-1] == f"stopped by {sig.name}"
    log = (out / "train.log").read_text()
    done = steps_of(out / "metrics.jsonl")[-1]
    assert f"Stopped by {sig.name} during step {done + 1} of 6; saved {out / 'checkpoints' / f'step_{done}'}; " \
           f"resume with --load {out}" in log
    r = finish(args + ["--load", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert steps_of(out / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    assert same_weights(out / "checkpoints" / "step_6", uninterrupted / "checkpoints" / "step_6")


def test_a_second_signal_stops_at_once_even_mid_step():
    from miles.errors import Stopped
    from miles.utils.stopping import StopSignals

    stops = StopSignals()
    with pytest.raises(Stopped) as first:
        with stops.deferred():
            stops._handle(signal.SIGTERM, None)  # held: the step lands first
            with pytest.raises(Stopped) as second:
                stops._handle(signal.SIGINT, None)
            assert second.value.immediate and second.value.exit_code == 130
    assert not first.value.immediate and first.value.exit_code == 143


def test_a_signal_during_training_lets_the_step_land_then_stops(tiny_args, monkeypatch):
    """SIGTERM while the trainer steps is held: step 1 trains, is recorded and saved, then the run stops."""
    from miles.train import trainer as trainer_module

    original = trainer_module.Trainer.train

    def interrupted(self, samples, **kw):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread inside train()
        return original(self, samples, **kw)

    monkeypatch.setattr(trainer_module.Trainer, "train", interrupted)
    args = tiny_args + ["--num-rollout", "3"]
    assert main(args) == 143
    out = out_dir(args)
    assert steps_of(out / "metrics.jsonl") == [1]
    assert (out / "checkpoints" / "step_1" / "model.safetensors").is_file()
    assert f"Stopped by SIGTERM during step 2 of 3; saved {out / 'checkpoints' / 'step_1'}" in \
        (out / "train.log").read_text()


def test_dropout_streams_continue_across_a_resume(tmp_path, prompt_file, reward_module):
    """A model with dropout: the resumed run draws the masks the uninterrupted one drew (RNG state)."""
    from conftest import tiny_train_args
    from miles.testing.tiny import build_model_dir

    model = build_model_dir(tmp_path / "dropout", "llama", seed=0)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    whole = run(tiny_train_args(model, prompt_file, reward_module, tmp_path / "whole"), *DET, "--num-rollout", "3")
    first = run(tiny_train_args(model, prompt_file, reward_module, tmp_path / "first"), *DET, "--num-rollout", "2")
    resumed = run(tiny_train_args(model, prompt_file, reward_module, tmp_path / "resumed"), *DET, "--num-rollout", "3",
                  "--load", str(first))
    assert same_weights(whole / "checkpoints" / "step_3", resumed / "checkpoints" / "step_3")


def test_changed_flags_are_listed_and_the_new_lr_applies(tiny_args, tmp_path):
    first = run(tiny_args, "--output-dir", str(tmp_path / "first"))
    resumed = run(tiny_args, "--num-rollout", "3", "--lr", "5e-4", "--load", str(first),
                  "--output-dir", str(tmp_path / "resumed"))
    log = (resumed / "train.log").read_text()
    assert "Resuming with flags that differ from the checkpoint's run" in log
    assert "--lr 0.0005 (was 0.001)" in log and "--num-rollout 3 (was 2)" in log
    state = torch.load(resumed / "checkpoints" / "step_3" / "trainer_state.pt", weights_only=True)
    assert {g["lr"] for g in state["optimizer"]["param_groups"]} == {5e-4}


def test_branching_from_an_older_step_is_refused_unless_asked(tiny_args):
    args = tiny_args + ["--num-rollout", "4", "--save-interval", "1"]
    out = run(args)
    older = ["--load", str(out / "checkpoints" / "step_2")]
    r = finish(args + older)
    assert r.returncode == 2 and "would mix two lineages" in r.stderr and "--allow-branch" in r.stderr
    again = run(args, *older, "--allow-branch")
    assert sorted(p.name for p in (again / "checkpoints").glob("step_*")) == ["step_1", "step_2", "step_3", "step_4"]
    (aside,) = (again / "checkpoints").glob("abandoned-after-step_2-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step_3", "step_4"]
    assert steps_of(again / "metrics.jsonl") == [1, 2, 3, 4]
    assert steps_of(again / "metrics.jsonl.dropped") == [3, 4]


def test_leftover_temp_dirs_are_removed_and_old_checkpoints_pruned(tiny_args):
    out = out_dir(tiny_args)
    (out / "checkpoints" / ".step_7.tmp-abc").mkdir(parents=True)
    (out / "checkpoints" / ".step_7.tmp-abc" / "model.safetensors").write_bytes(b"x" * 4096)
    run(tiny_args, "--num-rollout", "4", "--save-interval", "1", "--keep-checkpoints", "2")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_3", "step_4"]
    assert "Removed unfinished checkpoint dirs" in (out / "train.log").read_text()


def test_a_checkpoint_holding_nan_is_refused_and_the_last_one_kept(tiny_model, tmp_path):
    # The last guard before disk: whatever let a NaN into the weights, save_checkpoint writes nothing of it.
    from transformers import AutoTokenizer

    from miles.errors import CheckFailed
    from miles.train.checkpoint import find_latest_checkpoint, save_checkpoint
    from miles.utils.models import load_causal_lm

    model = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    save_checkpoint(tmp_path, 1, model, tokenizer, {"optimizer": {}})
    with torch.no_grad():
        model.get_output_embeddings().weight[0, 0] = float("nan")
    with pytest.raises(CheckFailed, match="holds NaN"):
        save_checkpoint(tmp_path, 2, model, tokenizer, {"optimizer": {}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    assert find_latest_checkpoint(tmp_path).name == "step_1"


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    import stat

    from miles.utils.io import atomic_dir, atomic_path, atomic_write_text, readable_mode

    path = tmp_path / "config.json"
    atomic_write_text(path, "old")
    assert stat.S_IMODE(path.stat().st_mode) == readable_mode()  # not mkstemp's 0600
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("the disk went away")
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "step_1") as tmp:
            (tmp / "model.safetensors").write_text("half")
            raise RuntimeError("the disk went away")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_a_torn_metrics_line_is_repaired_on_resume(tiny_args):
    out = run(tiny_args, "--save-interval", "1")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rollout/rew')  # a row cut by a full disk
    run(tiny_args, "--num-rollout", "3", "--load", str(out))
    assert steps_of(out / "metrics.jsonl") == [1, 2, 3]
    assert '{"step": 3, "rollout/rew' in (out / "metrics.jsonl.dropped").read_text()


# -- errors instead of tracebacks, also in train.log ----------------------------------------------

def test_a_full_disk_is_one_error_line_and_no_torn_row(tiny_args, monkeypatch, capsys):
    from miles.utils import jsonl

    real_write, calls = os.write, []

    def filling(fd, data):  # the second metrics row finds the disk full halfway through
        calls.append(1)
        return real_write(fd, data[: len(data) // 2]) if len(calls) == 2 else real_write(fd, data)

    monkeypatch.setattr(jsonl.os, "write", filling)
    assert main(tiny_args + ["--save-interval", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    out = out_dir(tiny_args)
    assert err[-1] == (f"error: No space left on device writing {out / 'metrics.jsonl'}; the last checkpoint on disk "
                       "is intact, resume from it once this is fixed")
    assert steps_of(out / "metrics.jsonl") == [1]  # whole rows only
    assert "ERROR error: No space left on device" in (out / "train.log").read_text()
    assert (out / "checkpoints" / "step_1" / "trainer_state.pt").is_file()


def test_a_corrupt_trainer_state_is_a_usage_error(tiny_args, tmp_path):
    first = run(tiny_args, "--output-dir", str(tmp_path / "first"))
    state = first / "checkpoints" / "step_2" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    r = finish(tiny_args + ["--num-rollout", "3", "--load", str(first), "--output-dir", str(tmp_path / "again")])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: --load {first / 'checkpoints' / 'step_2'}: {state} "
                                                        "is not a readable trainer state")


def test_an_unwritable_save_dir_is_found_before_any_model_loads(tiny_args, tmp_path):
    (tmp_path / "a_file").write_text("")
    r = finish(tiny_args + ["--save", str(tmp_path / "a_file" / "ckpts")])
    assert r.returncode == 2 and "--save" in r.stderr and "is a file, not a directory" in r.stderr
    assert not out_dir(tiny_args).exists()


def test_a_dir_that_takes_no_file_is_found_before_any_model_loads_also_for_root(tiny_args, monkeypatch, capsys):
    """/proc takes no new file whatever the permission bits say; root's os.access says yes to everything."""
    monkeypatch.setattr(os, "access", lambda *a, **kw: True)
    assert main(tiny_args + ["--output-dir", "/proc/miles-test-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --output-dir /proc/miles-test-run cannot be created: /proc takes no new file")
    assert main(["selftest", "--write-expected", "/proc/miles-selftest.json"]) == 2  # before the recipe runs
    assert capsys.readouterr().err.startswith("error: --write-expected /proc takes no new file")


def test_a_crash_lands_in_train_log_with_its_traceback(tiny_args):
    r = finish(with_reward(tiny_args, "crashes") + ["--num-rollout", "1"])
    assert r.returncode == 2  # a custom reward's exception is the user's: one error line
    log = (out_dir(tiny_args) / "train.log").read_text()
    assert "ERROR error: --custom-rm-path faulty_rewards:crashes raised RuntimeError: reward service unreachable" in log


def test_an_unexpected_exception_is_logged_as_a_crash(tiny_args, monkeypatch):
    from miles.train import trainer as trainer_module

    def broken(self, samples, **kw):
        raise ZeroDivisionError("a bug in the trainer")

    monkeypatch.setattr(trainer_module.Trainer, "train", broken)
    with pytest.raises(ZeroDivisionError):
        main(tiny_args)
    log = (out_dir(tiny_args) / "train.log").read_text()
    assert "ERROR Crashed: ZeroDivisionError: a bug in the trainer\nTraceback (most recent call last):" in log
    assert 'in broken\n    raise ZeroDivisionError("a bug in the trainer")' in log


# -- rewards that misbehave --------------------------------------------------------------------------

@pytest.mark.parametrize("name, words", [
    ("hangs", "did not return within --reward-timeout 1 s on sample 0: it hangs or is too slow"),
    ("exits", "called sys.exit(3) on sample 0; a reward function must return a number, not exit the process"),
    ("interrupts", "raised KeyboardInterrupt itself on sample 0"),
])
def test_a_reward_that_hangs_or_exits_is_named(tiny_args, name, words):
    r = finish(with_reward(tiny_args, name) + ["--reward-timeout", "1", "--num-rollout", "1"])
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --custom-rm-path faulty_rewards:{name} ") and words in last


def test_a_reward_gets_a_copy_of_the_sample(tiny_args, tmp_path):
    dumps = ["--save-debug-rollout-data", str(tmp_path / "d" / "data_{rollout_id}.pt"), "--num-rollout", "1"]
    honest = metrics(run(tiny_args, *dumps, "--output-dir", str(tmp_path / "a")))[0]
    vandal = metrics(run(with_reward(tiny_args, "vandal"), "--num-rollout", "1",
                         "--output-dir", str(tmp_path / "b")))[0]
    assert vandal["rollout/reward_mean"] == honest["rollout/reward_mean"]
    assert vandal["train/grad_norm"] == honest["train/grad_norm"]  # trained on the real tokens and mask


def test_a_prompt_longer_than_the_model_is_refused_or_dropped(tiny_args, tmp_path):
    data = tmp_path / "long.jsonl"
    # tiny model: 512 positions
    rows = [{"prompt": "What is 1 + 1?", "label": "2"}, {"prompt": "x" * 600, "label": "1"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = list(tiny_args)
    argv[argv.index("--prompt-data") + 1] = str(data)
    argv[argv.index("--rollout-batch-size") + 1] = "1"
    r = finish(argv)
    assert r.returncode == 2
    assert "row 2: its prompt is 6" in r.stderr and "--rollout-max-prompt-len 500" in r.stderr
    run(argv, "--rollout-max-prompt-len", "500", "--num-rollout", "1")
