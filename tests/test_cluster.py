"""Scale-out on this CPU: trainer ranks as Ray actors (FSDP2 on gloo), engines on Ray, supervision.

Every test starts a real local Ray cluster through `miles train` (a subprocess, as a user runs
it). The tiny model trains in fp32, where 1 and 2 ranks compute the same numbers up to the order
of the gradient sum.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("ray")

# 16 samples per rollout, 2 optimizer steps of 8, micro-batches of 4: each of 2 ranks takes one
# micro-batch per step, so the split is exercised in scoring, training and the metric reductions.
EQUIV = ["--num-steps-per-rollout", "2", "--micro-batch-size", "4", "--num-rollout", "2", "--debug-determinism",
         "--save-interval", "1"]
TOLERANCE = 1e-5  # fp32: per-step loss and grad norm, and final parameters, 1 rank vs 2


def miles(args: list[str], timeout: float = 400, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles", *args], capture_output=True, text=True, timeout=timeout,
                          **kwargs)


def rows(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def final_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step}" / "model.safetensors"))


def ray_processes() -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines()[1:]
            if re.search(r"raylet|gcs_server|ray::|default_worker\.py", line)}


@pytest.fixture(scope="module")
def one_rank(tiny_model, prompt_file, reward_module, tmp_path_factory) -> Path:
    from conftest import tiny_train_args

    run = tmp_path_factory.mktemp("one") / "run"
    result = miles(tiny_train_args(tiny_model, prompt_file, reward_module, run) + EQUIV)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def two_ranks(tiny_model, prompt_file, reward_module, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    from conftest import tiny_train_args

    run = tmp_path_factory.mktemp("two") / "run"
    result = miles(tiny_train_args(tiny_model, prompt_file, reward_module, run) + EQUIV
                   + ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    return run, result


def test_two_ranks_train_like_one(one_rank, two_ranks):
    run, result = two_ranks
    log = (run / "train.log").read_text()
    assert "Trainer: 2 ranks (each a CPU rank on gloo (no GPU on this host))" in log
    assert "FSDP2" in log
    assert (run / "workers" / "trainer_rank_1.log").read_text().count("process group joined") == 1
    assert "(trainer policy, on 2 ranks)" in log  # the ranks' loads, said once in the driver's log
    one, two = rows(one_rank), rows(run)
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy", "rollout/log_probs",
                    "train/train_rollout_logprob_abs_diff", "train/pg_clipfrac"):
            assert b[key] == pytest.approx(a[key], rel=TOLERANCE, abs=TOLERANCE), (a["step"], key)
    w1, w2 = final_weights(one_rank, 2), final_weights(run, 2)
    assert w1.keys() == w2.keys()
    worst = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert worst < TOLERANCE, worst
    assert any((w1[k] != final_weights(one_rank, 1)[k]).any() for k in w1)  # the run did train


def test_two_ranks_hash_whole_tensors(one_rank, two_ranks):
    """Digests are of gathered tensors: where the numbers are the same, so are the hashes (step 1's
    rollout and scoring). Gradients are summed in another order across ranks, so those may differ,
    and so may the loss: its second optimizer step follows the first's update (it differed in the
    last bits on one machine and not on another)."""
    one, two = rows(one_rank, "hashes.jsonl"), rows(two_ranks[0], "hashes.jsonl")
    for key in ("prompts", "rollout_tokens", "rollout_log_probs", "rewards", "trainer_log_probs"):
        assert one[0][key] == two[0][key], key


def test_checkpoint_resumes_at_another_rank_count(one_rank, two_ranks, tiny_model, prompt_file, reward_module,
                                                  tmp_path):
    """A 2-rank checkpoint is the 1-process format: a 1-process run resumes from it and trains step 2
    as the 1-process run did."""
    from conftest import tiny_train_args

    run = tmp_path / "resumed"
    result = miles(tiny_train_args(tiny_model, prompt_file, reward_module, run) + EQUIV
                   + ["--load", str(two_ranks[0] / "checkpoints" / "step_1")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert rows(run)[0]["step"] == 2
    assert rows(run)[0]["train/loss"] == pytest.approx(rows(one_rank)[1]["train/loss"], rel=TOLERANCE, abs=TOLERANCE)
    w1, w2 = final_weights(one_rank, 2), final_weights(run, 2)
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < TOLERANCE


RANK_1 = ("trainer_rank_1.log", r"pid (\d+) \(")  # where a worker's pid is logged
SERVER = ("engine_0.log", r"Started sglang server 1 of 1: \S+ \(pid (\d+)")


def signal_rank_1_mid_run(args: list[str], run: Path, sig: int, target=RANK_1,
                          ranks: int = 2) -> tuple[subprocess.CompletedProcess, float, int]:
    """Starts a long run of `ranks` trainer ranks, sends `sig` to the target (rank 1, or the server
    of engine 0) once the first checkpoint is saved, and waits for the run to end. Returns (its
    result, seconds from the signal to the end, the target's pid), once it has checked that no Ray
    process outlived the run."""
    before = ray_processes()
    args = args + ["--num-rollout", "200", "--save-interval", "1", "--actor-num-gpus-per-node", str(ranks)]
    process = subprocess.Popen([sys.executable, "-m", "miles", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        log = run / "train.log"
        while not (log.is_file() and "Saved checkpoint" in log.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, "the run did not reach its first save"
            time.sleep(0.5)
        pid = int(re.search(target[1], (run / "workers" / target[0]).read_text()).group(1))
        os.kill(pid, sig)
        sent = time.monotonic()
        stdout, stderr = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
    seconds = time.monotonic() - sent
    time.sleep(2)
    assert not (ray_processes() - before), "Ray processes outlived the run"
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr), seconds, pid


def test_killed_rank_is_worker_crashed(tiny_args, tmp_path):
    """SIGKILL one rank mid-run: WorkerCrashed naming it, exit 1 within a bounded time, the last
    checkpoint intact, no Ray process left."""
    run = tmp_path / "run"
    result, seconds, pid = signal_rank_1_mid_run(tiny_args + ["--distributed-timeout-minutes", "0.5"], run,
                                                 signal.SIGKILL)
    assert seconds < 90
    assert result.returncode == 1
    text = (run / "train.log").read_text()
    assert "WorkerCrashed: trainer rank 1 on node" in text and f"pid {pid}" in text
    assert "error: WorkerCrashed" in result.stderr
    steps = sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    assert steps, "no checkpoint survived"
    last = run / "checkpoints" / f"step_{steps[-1]}"
    state = torch.load(last / "trainer_state.pt", weights_only=True)
    assert state["step"] == steps[-1] and load_file(str(last / "model.safetensors"))


def test_two_ranks_with_engine_servers_on_ray(tiny_args, tmp_path):
    """Disaggregated: 2 trainer ranks (and a sharded reference model), 1 `miles serve` owned by an
    engine actor on its own bundle; weights reach it through the disk transport and are verified by
    digest each step; `miles doctor` finds nothing wrong with the run."""
    run = tmp_path / "run"
    # Temperature 0.5: the random tiny model's samples then pass the response-NLL check (no WARN).
    result = miles(tiny_args + ["--actor-num-gpus-per-node", "2", "--rollout-backend", "sglang",
                                "--rollout-num-gpus", "1", "--check-weight-update-equal",
                                "--rollout-temperature", "0.5", "--use-kl-loss", "--kl-loss-coef", "0.1",
                                "--sglang-log-dir", str(tmp_path / "servers")])
    assert result.returncode == 0, result.stderr[-3000:]
    text = (run / "train.log").read_text()
    assert "Engines: 1 sglang server(s) on Ray (on their own bundles)" in text
    assert text.count("weight_sync step=") == 2 and text.count("checksum_ok=true") == 2
    assert [r["step"] for r in rows(run)] == [1, 2]
    assert "Started sglang server" in (run / "workers" / "engine_0.log").read_text()
    assert "(reference model, on 2 ranks)" in text
    doctor = miles(["doctor", str(run), "--json"], timeout=120)
    assert json.loads(doctor.stdout)["findings"] == [] and doctor.returncode == 0, doctor.stdout[-2000:]


@pytest.mark.parametrize("flags, message", [
    (["--actor-num-gpus-per-node", "3"], "must split evenly into 3 trainer ranks"),
    (["--colocate"], "--colocate places engines on the trainer ranks' devices"),
    (["--rollout-num-gpus", "2"], "place engines on Ray"),
    (["--actor-num-gpus-per-node", "1", "--rollout-backend", "sglang", "--rollout-num-gpus-per-engine", "2"],
     "run on one device each"),
    (["--async", "--colocate", "--actor-num-gpus-per-node", "1"], "--async generates while the trainer trains"),
    (["--actor-num-gpus-per-node", "0"], "--actor-num-gpus-per-node must be > 0"),
    (["--rollout-backend", "sglang", "--sglang-mem-fraction-static", "1.5"], "must be in (0, 1]"),
    (["--rollout-backend", "sglang", "--sglang-mem-fraction-static", "nan"], "must be in (0, 1]"),
    (["--rollout-backend", "sglang", "--sglang-url", "http://127.0.0.1:1", "--sglang-mem-fraction-static", "0.5"],
     "sizes the engines miles runs"),
    (["--rollout-backend", "sglang", "--disable-cuda-graph"], "is for the local engine"),
])
def test_cluster_flag_errors(tiny_args, flags, message):
    result = miles(tiny_args + flags, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_colocate_takes_turns(tiny_args, tmp_path):
    """--colocate: per step the engine releases its memory before the trainer loads back and trains,
    takes it back for the weight sync, and the trainer offloads before the next rollout."""
    run = tmp_path / "run"
    result = miles(tiny_args + ["--colocate", "--actor-num-gpus-per-node", "1", "--rollout-backend", "sglang",
                                "--check-weight-update-equal", "--sglang-log-dir", str(tmp_path / "servers")])
    assert result.returncode == 0, result.stderr[-3000:]
    text = (run / "train.log").read_text()
    assert "Engines: 1 sglang server(s) on Ray (colocated with the trainer ranks)" in text
    events = re.findall(r"Trainer offloaded|Trainer loaded back|Memory released|Memory resumed|step \d/2 \|", text)
    turn = ["Memory released", "Trainer loaded back", "Memory resumed"]
    assert events == ["Trainer offloaded", *turn, "step 1/2 |", "Trainer offloaded", *turn, "step 2/2 |"], events
    assert text.count("checksum_ok=true") == 2
    assert all(r["perf/colocate_switch_s"] > 0 for r in rows(run))
    server_log = next((tmp_path / "servers").glob("sglang-0-*.log")).read_text()
    assert server_log.count("miles serve: memory released") == 2
    assert server_log.count("miles serve: memory resumed") == 2


def test_mem_fraction_reaches_the_servers_miles_starts(tiny_args, tmp_path):
    """--sglang-mem-fraction-static goes to each server miles starts (on a CPU: logged as not applying)."""
    result = miles(tiny_args + ["--num-rollout", "1", "--rollout-backend", "sglang", "--sglang-mem-fraction-static",
                                "0.4", "--sglang-log-dir", str(tmp_path / "servers")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mem_fraction 0.4 is for GPU servers" in (tmp_path / "run" / "train.log").read_text()


@pytest.fixture
def stand_in_ranks():
    """Two FailOrHang actors on a real local Ray cluster as "trainer rank 0/1", and the messages the
    `miles` logger gets meanwhile; the cluster and the log handler go at the end."""
    import logging

    import ray

    from miles.cluster.supervisor import SUPERVISION, Worker
    from miles.testing.workers import FailOrHang

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("miles").addHandler(handler)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(max_concurrency=2, concurrency_groups=SUPERVISION)(FailOrHang)
        yield ray, [Worker(f"trainer rank {i}", actor.remote(), {"node_ip": "10.0.0.1", "host": "h", "pid": i})
                    for i in range(2)], records
    finally:
        ray.shutdown()
        logging.getLogger("miles").removeHandler(handler)


def test_supervisor_names_the_failure_and_logs_the_stuck_workers_stack(stand_in_ranks):
    """One worker fails, another hangs: the error names the first, and the stuck one's Python stack
    (where it hangs) is logged, within the grace period rather than never."""
    from miles.cluster.supervisor import Supervisor
    from miles.errors import WorkerCrashed

    ray, workers, records = stand_in_ranks
    supervisor = Supervisor(ray, grace=2.0)
    refs = [workers[0].actor.call.remote("fail"), workers[1].actor.call.remote("hang")]
    start = time.monotonic()
    with pytest.raises(WorkerCrashed) as e:
        supervisor.wait(workers, refs, what="train")
    assert time.monotonic() - start < 30
    assert "WorkerCrashed: trainer rank 0 on node 10.0.0.1 (h), pid 0 failed during train" in str(e.value)
    assert "RuntimeError: this rank failed first" in str(e.value)
    stuck = [m for m in records if "trainer rank 1 had not finished train" in m]
    assert stuck and "in call" in stuck[0] and "time.sleep(0.1)" in stuck[0], records


def test_supervisor_bounds_a_worker_stuck_after_its_peers_returned(stand_in_ranks):
    """No worker fails, one never returns (a stopped rank in a call with no collective): past `stall`
    seconds after its peer returned it is named stuck, with its stack; an `uneven` call (rank 0
    writes alone) is not bounded that way, so a slow worker there still returns."""
    from miles.cluster.supervisor import Supervisor
    from miles.errors import WorkerCrashed

    ray, workers, records = stand_in_ranks
    supervisor = Supervisor(ray, grace=2.0, stall=2.0)
    refs = [workers[0].actor.call.remote("finish"), workers[1].actor.call.remote("hang")]
    start = time.monotonic()
    with pytest.raises(WorkerCrashed) as e:
        supervisor.wait(workers, refs, what="rng_state")
    assert time.monotonic() - start < 30
    refs = [workers[0].actor.call.remote("finish"), workers[1].actor.call.remote("slow")]
    assert supervisor.wait(workers, refs, what="save", uneven=True) == ["done", "slow"]
    assert str(e.value).startswith("WorkerCrashed: trainer rank 1 did not finish rng_state within 2 s of its peers")
    assert str(e.value).endswith("still running (stuck; stacks in the log): trainer rank 1")
    stuck = [m for m in records if "trainer rank 1 had not finished rng_state 2 s after its peers returned" in m]
    assert stuck and "time.sleep(0.1)" in stuck[0], records


@pytest.mark.timeout(90)
def test_the_heartbeat_names_a_stopped_worker_in_an_uneven_call(stand_in_ranks):
    """A call with no bound on how long one worker runs after another (rank 0 writes a checkpoint
    alone), and a worker stopped inside it after its peer returned (CI once hung here for good):
    its unanswered pings name it stuck within about `stall` seconds."""
    from miles.cluster.supervisor import Supervisor
    from miles.errors import WorkerCrashed

    ray, workers, records = stand_in_ranks
    supervisor = Supervisor(ray, grace=2.0, stall=3.0)
    pid = ray.get(workers[1].actor.pid.remote())
    refs = [workers[0].actor.call.remote("finish"), workers[1].actor.call.remote("slow")]
    time.sleep(1)
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerCrashed) as e:
            supervisor.wait(workers, refs, what="save", uneven=True)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert time.monotonic() - start < 20
    assert str(e.value).startswith("WorkerCrashed: trainer rank 1 did not finish save: no answer to a ping in 3 s")
    assert [m for m in records if "trainer rank 1 had not finished save with no answer to a ping" in m], records


def test_a_frozen_rank_is_a_timeout_not_a_freeze(tiny_args, tmp_path):
    """SIGSTOP one rank mid-run: within --distributed-timeout-minutes the run stops with an error
    naming the stuck rank, exit 1, nothing left behind. Where the stop lands decides who notices
    first: inside a collective, rank 0's collective times out (rank 0 failed, rank 1 stuck); in a
    call with no collective (the RNG state gathered for a checkpoint), rank 1 is stuck past its
    peers; anywhere, rank 1 leaves the supervisor's pings unanswered."""
    run = tmp_path / "run"
    result, seconds, _ = signal_rank_1_mid_run(tiny_args + ["--distributed-timeout-minutes", "0.1"], run,
                                               signal.SIGSTOP)
    assert seconds < 120 and result.returncode == 1
    text = (run / "train.log").read_text()
    assert ("WorkerCrashed: trainer rank 0" in text and "Timed out" in text) or \
        "WorkerCrashed: trainer rank 1 did not finish" in text  # past its peers, or no answer to a ping
    assert "trainer rank 1 had not finished" in text and "(stuck; stacks in the log): trainer rank 1" in text


def test_a_dead_engine_server_is_worker_crashed(tiny_args, tmp_path):
    """SIGKILL the server an engine actor owns: the next rollout's failed requests become
    WorkerCrashed naming engine 0 and its exited server, exit 1, nothing left behind."""
    run = tmp_path / "run"
    flags = ["--rollout-backend", "sglang", "--rollout-num-gpus", "1", "--rollout-request-retries", "1",
             "--sglang-log-dir", str(tmp_path / "servers")]
    result, seconds, _ = signal_rank_1_mid_run(tiny_args + flags, run, signal.SIGKILL, target=SERVER, ranks=1)
    assert seconds < 120 and result.returncode == 1
    text = (run / "train.log").read_text()
    assert "WorkerCrashed: engine 0 on node" in text and "its server process exited" in text
