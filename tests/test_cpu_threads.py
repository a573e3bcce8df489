"""CPU thread settings (miles.utils.cpu_threads): the choice, the wait policy set before torch loads
libgomp (checked in libgomp's own OMP_DISPLAY_ENV report of `miles train` and `miles serve`), the log line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from miles.utils import cpu_threads
from miles.utils.cpu_threads import choose_threads, wait_policy_for
from test_serve import ServeProcess

PASSIVE_SEEN = "GOMP_SPINCOUNT = '0'"  # libgomp's OMP_DISPLAY_ENV=VERBOSE report under OMP_WAIT_POLICY=PASSIVE


@pytest.mark.parametrize("cores", [1, 2, 8])
def test_one_thread_per_core_this_process_may_use(cores):
    assert choose_threads(cores=cores) == (cores, None)


def test_the_flag_then_omp_num_threads_win():
    assert choose_threads(cores=2, override=1, omp_num_threads="3") == (1, "--cpu-threads")
    assert choose_threads(cores=2, omp_num_threads="3") == (3, "OMP_NUM_THREADS")
    for unusable in ("", "0", "two", "2,1"):  # not a thread count torch took: miles chooses
        assert choose_threads(cores=2, omp_num_threads=unusable) == (2, None)


def test_passive_unless_the_user_chose_or_torch_is_loaded():
    assert wait_policy_for({}, torch_loaded=False) == ({"OMP_WAIT_POLICY": "PASSIVE"}, "OMP_WAIT_POLICY=PASSIVE")
    assert wait_policy_for({"OMP_WAIT_POLICY": "active"}, torch_loaded=False) == ({}, "OMP_WAIT_POLICY=active")
    assert wait_policy_for({"GOMP_SPINCOUNT": "1000"}, torch_loaded=False) == ({}, "GOMP_SPINCOUNT=1000")
    changes, said = wait_policy_for({}, torch_loaded=True)
    assert changes == {} and "torch was imported first" in said


def test_set_wait_policy_sets_the_environment_it_is_given(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")  # as before `import torch` (restored after the test)
    env: dict[str, str] = {}
    assert cpu_threads.set_wait_policy(env) == "OMP_WAIT_POLICY=PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    mine = {"OMP_WAIT_POLICY": "ACTIVE"}
    cpu_threads.set_wait_policy(mine)
    assert mine == {"OMP_WAIT_POLICY": "ACTIVE"}


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_setup_sets_torch_threads_and_logs_one_line(monkeypatch, caplog, threads_restored):
    monkeypatch.setattr(cpu_threads, "affinity_cores", lambda: 2)  # the affinity mask, not the host's count
    monkeypatch.setattr(cpu_threads.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (1.9, 1.0, 1.0))
    monkeypatch.setattr(cpu_threads, "_wait_policy", "OMP_WAIT_POLICY=PASSIVE")
    monkeypatch.setattr(cpu_threads, "_chosen_by_miles", False)  # put back after the test: the setup sets it
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with caplog.at_level(logging.INFO, logger="miles"):
        setup = cpu_threads.setup_cpu_threads()
    assert cpu_threads._chosen_by_miles  # miles chose: its decode may tune
    assert torch.get_num_threads() == setup.threads == 2
    assert [r.getMessage() for r in caplog.records] == ["CPU threads: 2 of 2 cores (load 1.9), OMP_WAIT_POLICY=PASSIVE"]
    assert cpu_threads.setup_cpu_threads(1).line() == ("CPU threads: 1 of 2 cores (load 1.9, --cpu-threads), "
                                                       "OMP_WAIT_POLICY=PASSIVE")
    assert torch.get_num_threads() == 1 and not cpu_threads._chosen_by_miles  # the flag's: the decode keeps it


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    return {**env, "OMP_DISPLAY_ENV": "VERBOSE", **extra}  # libgomp prints its settings when it loads


def test_miles_train_sets_passive_before_torch_loads_and_logs_threads(tiny_args, tmp_path):
    r = subprocess.run([sys.executable, "-m", "miles", *tiny_args, "--num-rollout", "1", "--device", "cpu"],
                       capture_output=True, text=True, env=clean_env(), stdin=subprocess.DEVNULL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert PASSIVE_SEEN in r.stderr
    log = (tmp_path / "run" / "train.log").read_text()
    # The setup's line, once (on a busy machine the decode's thread tuner logs a "CPU threads:" line of its own).
    lines = [line for line in log.splitlines() if "CPU threads:" in line and " cores (load " in line]
    assert len(lines) == 1 and lines[0].endswith("OMP_WAIT_POLICY=PASSIVE"), lines
    assert f"of {len(os.sched_getaffinity(0))} cores (load " in lines[0]


def test_the_users_wait_policy_is_kept(tiny_args):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (--device cuda must fail once torch is loaded)")
    r = subprocess.run([sys.executable, "-m", "miles", *tiny_args, "--device", "cuda"], capture_output=True,
                       text=True, env=clean_env(OMP_WAIT_POLICY="ACTIVE"), stdin=subprocess.DEVNULL, timeout=300)
    assert r.returncode == 2 and "--device cuda: no CUDA device" in r.stderr
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in r.stderr and PASSIVE_SEEN not in r.stderr


def test_miles_serve_sets_passive_and_logs_the_flag(tiny_model, tmp_path, monkeypatch):
    for name, value in clean_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    server = ServeProcess("--hf-checkpoint", str(tiny_model), "--device", "cpu", log=tmp_path / "serve.log")
    server.stop()
    log = (tmp_path / "serve.log").read_text()
    assert PASSIVE_SEEN in log
    assert "CPU threads: 1 of " in log and "--cpu-threads), OMP_WAIT_POLICY=PASSIVE" in log


def test_vllm_is_started_eager_unless_the_benchmark_asks_for_its_compiled_mode():
    from miles.rollout.remote.launcher import server_command

    def command(**extra):
        return server_command("vllm", "/m", 8000, precision="fp32", seed=0, max_model_len=2048, python="python",
                              weight_version=0, device="cpu", **extra)[0]

    assert "--enforce-eager" in command() and "--enforce-eager" not in command(enforce_eager=False)


def feed(tuner, seconds_on: dict[int, float], steps: int, rows: int = 8) -> list[int]:
    """STEPS steps through TUNER, each taking seconds_on[threads]; the thread count of each."""
    counts = []
    for _ in range(steps):
        n = tuner.count()
        counts.append(n)
        tuner.record(rows, seconds_on[n])
    return counts


def test_step_threads_move_to_fewer_threads_when_their_steps_are_faster_and_log_it(caplog):
    tuner = cpu_threads.StepThreads(2)
    with caplog.at_level(logging.INFO, logger="miles"):
        counts = feed(tuner, {2: 0.36, 1: 0.24}, 40)
    first = tuner.FIRST_WINDOW
    assert counts[:first] == [2] * first  # all threads until the first probe
    assert counts[first:first + 1 + tuner.PROBE] == [1] * (1 + tuner.PROBE)  # the probe: 1 settling + PROBE steps
    assert tuner.current == 1 and counts[-1] == 1
    assert [r.getMessage() for r in caplog.records][0] == (
        "CPU threads: decode steps now on 1 of 2 threads (3 steps took 240 ms each on 1, against 360 ms on 2)")


def test_step_threads_stay_when_the_probe_is_slower_and_probe_less_and_less_often():
    tuner = cpu_threads.StepThreads(2)
    counts = feed(tuner, {2: 0.11, 1: 0.15}, 200)
    assert tuner.current == 2
    probes = [i for i in range(1, len(counts)) if counts[i] == 1 and counts[i - 1] == 2]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # the window doubles
    assert sum(c == 1 for c in counts) == len(probes) * (1 + tuner.PROBE)


def test_step_threads_go_back_when_the_machine_is_quiet_again():
    tuner = cpu_threads.StepThreads(4)
    feed(tuner, {4: 0.4, 2: 0.2, 1: 0.3}, 60)  # busy: 2 is best (4 -> 2; 1 was tried and lost)
    assert tuner.current == 2
    feed(tuner, {4: 0.1, 2: 0.2, 1: 0.3}, 400)  # quiet again
    assert tuner.current == 4


def test_step_threads_start_on_fewer_threads_where_other_tasks_run_and_go_up_when_that_is_faster(caplog):
    with caplog.at_level(logging.INFO, logger="miles"):
        tuner = cpu_threads.StepThreads(2, busy=2)
    assert tuner.current == 1
    assert caplog.records[0].getMessage() == "CPU threads: decode steps start on 1 of 2 threads (2 other tasks running)"
    counts = feed(tuner, {2: 0.11, 1: 0.15}, 40)  # quiet after all: 2 are faster
    assert counts[0] == 1 and tuner.current == 2 and counts[-1] == 2
    assert cpu_threads.StepThreads(4, busy=1).current == 3 and cpu_threads.StepThreads(2, busy=0).current == 2


def test_runnable_elsewhere_reads_the_running_tasks_less_the_reader(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("2.84 2.84 2.24 3/86 27613\n")  # 3 runnable: the reader and two others
    assert cpu_threads.runnable_elsewhere(samples=3, interval=0, path=str(loadavg)) == 2
    loadavg.write_text("0.10 0.20 0.30 1/86 27613\n")
    assert cpu_threads.runnable_elsewhere(samples=1, interval=0, path=str(loadavg)) == 0
    loadavg.write_text("garbage\n")
    assert cpu_threads.runnable_elsewhere(path=str(loadavg)) == 0
    assert cpu_threads.runnable_elsewhere(path=str(tmp_path / "absent")) == 0


def test_a_probe_across_finished_rows_is_not_judged():
    tuner = cpu_threads.StepThreads(2)
    feed(tuner, {2: 0.36, 1: 0.24}, tuner.FIRST_WINDOW, rows=32)
    feed(tuner, {2: 0.36, 1: 0.24}, 1 + tuner.PROBE, rows=16)  # half the rows: faster for that reason alone
    assert tuner.current == 2


def test_the_engine_tunes_only_where_miles_chose_the_threads(tiny_model, monkeypatch, threads_restored):
    from test_engine import make_engine

    from miles.config import SamplingParams

    engine, tok = make_engine(tiny_model)
    ran_on = []
    real_decode = engine.runner.decode

    def decode(*args, **kw):
        ran_on.append(torch.get_num_threads())
        return real_decode(*args, **kw)

    monkeypatch.setattr(engine.runner, "decode", decode)
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0, top_p=1.0)
    prompts = [tok(t)["input_ids"] for t in ("hello", "a longer prompt")]
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_threads, "_chosen_by_miles", False)  # --cpu-threads, OMP_NUM_THREADS, or no setup
    engine.generate(prompts, sampling, [1, 2])
    assert set(ran_on) == {2} and engine.decoder.step_threads is None

    monkeypatch.setattr(cpu_threads, "_chosen_by_miles", True)
    monkeypatch.setattr(cpu_threads.StepThreads, "FIRST_WINDOW", 2)
    ran_on.clear()
    engine.generate(prompts, sampling, [1, 2])
    assert 1 in ran_on and 2 in ran_on  # a probe ran on 1 thread
    monkeypatch.setattr(cpu_threads.StepThreads, "count", lambda self: 1)  # every step on 1 thread
    ran_on.clear()
    engine.generate(prompts, sampling, [1, 2])
    assert set(ran_on) == {1} and torch.get_num_threads() == 2  # the process's count again after the call

    prefilled_on, real_prefill = [], engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill", lambda *a, **kw: prefilled_on.append(torch.get_num_threads())
                        or real_prefill(*a, **kw))
    engine.decoder.step_threads.current = 1  # the steps found 1 faster: the prefill runs on 1 too
    engine.generate(prompts, sampling, [1, 2])
    assert prefilled_on == [1] and torch.get_num_threads() == 2

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert not cpu_threads.step_threads_allowed()  # a deterministic run keeps its count
    finally:
        torch.use_deterministic_algorithms(False)
