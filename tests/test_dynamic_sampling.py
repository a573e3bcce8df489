"""Dynamic sampling (--dynamic-sampling-filter-path, --over-sampling-batch-size): a rollout keeps generating
until it has --rollout-batch-size groups that pass the filter; the built-in filter drops exactly the
groups whose rewards are all equal; a filter that starves the rollout stops the run with a clear error."""

from __future__ import annotations

import pytest
from test_train import metrics, run

from miles.cli.main import main
from miles.config import RolloutConfig, SamplingParams
from miles.data.prompts import PromptDataset, PromptRecord
from miles.errors import RunFailed
from miles.rollout.engine import GenerationOutput
from miles.rollout.source import LiveRollout
from miles.testing.tiny import build_tokenizer

FILTER = "miles.rollout.filters:check_reward_nonzero_std"


class Engine:
    """Answers every prompt with one token; remembers the prompts it was asked, round by round."""

    def __init__(self):
        self.rounds: list[list[list[int]]] = []
        self.seeds: list[int] = []

    def generate(self, prompts, sampling, seeds, progress=None):
        self.rounds.append(prompts)
        self.seeds += seeds
        return [GenerationOutput([5 + seed % 7], [-1.0], "stop") for seed in seeds]


def rollout(records, *, batch_size=2, over=None, rounds=8, reward=None, seed=0):
    cfg = RolloutConfig(batch_size=batch_size, n_samples_per_prompt=2, rm_type="math", custom_rm_path=None,
                        reward_timeout=60.0, dynamic_filter_path=FILTER, over_sampling_batch_size=over,
                        dynamic_max_rounds=rounds,
                        sampling=SamplingParams(max_new_tokens=1, temperature=1.0, top_p=1.0))
    # Group signal by label: "flat" prompts reward both responses 1, "mixed" ones 1 and 0 (by index parity).
    reward = reward or (lambda s: 1.0 if s.label == "flat" else float(s.index % 2))
    engine = Engine()
    source = LiveRollout(cfg, engine, build_tokenizer(), PromptDataset(records, shuffle=False, seed=seed), reward,
                         apply_chat_template=False, seed=seed)
    return source, engine


def records(labels: str) -> list[PromptRecord]:
    return [PromptRecord(prompt=f"p{i}", label="flat" if c == "f" else "mixed") for i, c in enumerate(labels)]


def test_the_filter_keeps_exactly_the_groups_with_differing_rewards():
    """Round of 4 prompts, 2 groups needed: f m f m -> the two mixed groups, renumbered 0 and 1, one round."""
    source, engine = rollout(records("fmfm"), over=4)
    batch = source.generate(0)
    assert [s.prompt for s in batch.samples] == ["p1", "p1", "p3", "p3"]
    assert [(s.group_index, s.index) for s in batch.samples] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert batch.stats["rollout/dynamic_sampling_rounds"] == 1
    assert batch.stats["rollout/dynamic_sampling_dropped_groups"] == 2
    assert batch.stats["rollout/dynamic_sampling_surplus_groups"] == 0
    assert len(engine.rounds) == 1 and len(engine.rounds[0]) == 8


def test_it_tops_up_from_a_second_walk_until_the_batch_is_full_and_repeats():
    """Only 1 of 6 prompts carries a signal: rounds of 2 prompts top up until 2 groups passed; the same
    rollout id gives the same samples again (a pure function of the id), and the kept groups' seeds
    are distinct."""
    data = records("ffffmf")
    source, engine = rollout(data, over=2)
    batch = source.generate(3)
    assert len(batch.samples) == 4 and all(s.label == "mixed" for s in batch.samples)
    assert batch.stats["rollout/dynamic_sampling_rounds"] == len(engine.rounds) > 1
    assert len(set(engine.seeds)) == len(engine.seeds)  # every round's samples draw their own streams
    again, _ = rollout(data, over=2)
    assert [(s.prompt, s.tokens, s.reward) for s in again.generate(3).samples] == \
        [(s.prompt, s.tokens, s.reward) for s in batch.samples]


def test_a_filter_that_starves_the_rollout_stops_with_what_to_do():
    source, _ = rollout(records("ffff"), over=2, rounds=3)
    with pytest.raises(RunFailed, match=r"dynamic sampling starved: rollout 0 kept 0 of the 2 groups it needs after "
                                         r"3 round\(s\) of 2 prompts \(6 dropped by --dynamic-sampling-filter-path "
                                         r"miles.rollout.filters:check_reward_nonzero_std: 6 x every reward 1\)"):
        source.generate(0)


def test_a_run_with_dynamic_sampling_trains_on_kept_groups_only(tiny_args, tmp_path):
    """End to end: half the tiny prompts give uniform groups under digit_share_odd_sums; every group
    the trainer gets (the dumps) has differing rewards, and the counts are in metrics.jsonl."""
    args = [a if a != "miles.testing.rewards:digit_share" else "miles.testing.rewards:digit_share_odd_sums"
            for a in tiny_args]
    out = run(args, "--dynamic-sampling-filter-path", FILTER, "--over-sampling-batch-size", "6",
              "--save-debug-rollout-data", str(tmp_path / "d" / "{rollout_id}.pt"))
    rows = metrics(out)
    assert all(r["rollout/dynamic_sampling_dropped_groups"] > 0 for r in rows)
    import torch

    for step in range(2):
        dump = torch.load(tmp_path / "d" / f"{step}.pt", weights_only=True)
        groups: dict[int, set] = {}
        for s in dump["samples"]:
            groups.setdefault(s["group_index"], set()).add(s["reward"])
        assert len(groups) == 4 and all(len(r) > 1 for r in groups.values())
    assert "dynamic sampling: rollout 0 kept 4 groups" in (out / "train.log").read_text()


@pytest.mark.parametrize("extra, message", [
    (["--over-sampling-batch-size", "8"], "--over-sampling-batch-size sizes the rounds of dynamic sampling"),
    (["--dynamic-sampling-filter-path", FILTER, "--over-sampling-batch-size", "2"], "must be at least"),
    (["--dynamic-sampling-filter-path", "nosuch.module:f"], "--dynamic-sampling-filter-path nosuch.module:f: cannot"),
    (["--dynamic-sampling-filter-path", "miles.rollout.filters"], "must look like module.path:function"),
])
def test_bad_dynamic_sampling_flags_are_one_error_line(tiny_args, capsys, extra, message):
    assert main(tiny_args + extra) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and message in err, err


def test_a_filter_that_fails_or_answers_nonsense_is_named(tmp_path, monkeypatch):
    from miles.bridge.types import Sample
    from miles.errors import UsageError
    from miles.rollout.filters import load_filter

    (tmp_path / "my_filters.py").write_text("def maybe(args, samples):\n    return 'maybe'\n\n"
                                            "def boom(args, samples):\n    raise ValueError('no rewards here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    group = [Sample(group_index=3, index=6, prompt="p", tokens=[1])]
    with pytest.raises(UsageError, match="my_filters:maybe returned 'maybe'; a filter returns a bool"):
        load_filter("my_filters:maybe", None)(group)
    with pytest.raises(UsageError, match=r"my_filters:boom raised ValueError: no rewards here \(at .*my_filters.py:5\) "
                                         r"on the group of prompt 3"):
        load_filter("my_filters:boom", None)(group)
