"""The doctor's knowledge base of real failures (kb/), the facts it reads from pasted reports, and
retrieval: known cases named with their URLs, leave-one-out accuracy held, no culprit for distractors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from miles.cli.main import main
from miles.debug.doctor.facts import read_facts
from miles.debug.doctor.knowledge import cases, culprits, distractors, pending_cases

ISSUE = """### Bug Description

After resuming from a checkpoint the rollout logprobs diff is very high and pass@1 drops for a few steps.
Training Qwen3-30B-A3B (MoE) with colocated sglang engines.

### Steps to Reproduce

```bash
python train.py --hf-checkpoint /ckpt/Qwen3-30B-A3B --ref-load /ckpt/ref_torch_dist \\
   --load /ckpt/run --colocate --sglang-mem-fraction-static 0.7 --pipeline-model-parallel-size 2 --fp8-format e4m3
```

### Logs

```shell
[2026-03-09 10:01:02] rollout/log_probs: -0.41 train/train_rollout_logprob_abs_diff: 0.83
[2026-03-09 10:01:05] grad_norm: 12.5
RuntimeError: CUDA error: an illegal memory access was encountered
```

### Environment
- slime version: c259823
- PyTorch version: 2.9.1
- SGLang version: 0.5.2
"""

FREEZE = "accelerate==1.10.0\nflash-attn==2.8.3\nray==2.49.1\nsglang==0.5.2\ntorch==2.8.0\ntransformers==4.56.1\n"


def doctor_json(capsys, *paths) -> dict:
    capsys.readouterr()
    main(["doctor", *map(str, paths), "--json"])
    return json.loads(capsys.readouterr().out)


def test_the_knowledge_base_is_real_shaped_and_covers_every_culprit():
    known = cases()
    assert len(known) >= 150
    assert len(distractors()) >= 40
    per = Counter(c.culprit for c in known)
    assert set(per) == set(culprits()), f"culprits without a case: {set(culprits()) - set(per)}"
    for c in known:
        assert c.url.startswith("https://github.com/") and c.evidence and c.evidence_url.startswith("https://")
        assert c.report and c.culprit_detail and c.fix
    assert len({c.framework for c in known}) >= 8


def test_the_pending_cases_are_checked_and_kept_out_of_the_base():
    """kb/pending/ holds checked real cases outside the base (kb/README.md says why): same keys and checks as a
    case, no URL or id of the base, and not matched against."""
    pending = pending_cases()
    assert pending and all(c.culprit in culprits() and c.evidence_url.startswith("https://") for c in pending)
    base = {c.url for c in (*cases(), *distractors())} | {c.id for c in (*cases(), *distractors())}
    assert not base & ({c.url for c in pending} | {c.id for c in pending})
    from miles.debug.doctor.retrieval import default_index

    assert not {c.id for c in pending} & {c.id for c in default_index().cases}


def test_facts_of_a_pasted_issue_and_a_pip_freeze():
    f = read_facts(ISSUE)
    assert f.frameworks[:2] == ["slime", "sglang"]  # the RL framework first, its engine after
    assert f.versions == {"slime": "commit c259823", "torch": "2.9.1", "sglang": "0.5.2"}
    assert {"load", "ref_load", "colocate", "mem_fraction", "pp_size", "resume"} <= set(f.flags)
    assert f.moe and f.fp8 and f.models[0] == "Qwen3-30B-A3B"
    assert "RuntimeError" in f.errors and "illegal memory access" in f.errors
    assert f.metrics["train/train_rollout_logprob_abs_diff"] == "0.83" and f.metrics["grad_norm"] == "12.5"
    freeze = read_facts(FREEZE + "vllm==0.10.2\npeft==0.17.0\n")
    assert freeze.pip_freeze and freeze.versions["torch"] == "2.8.0" and freeze.versions["flash-attn"] == "2.8.3"
    assert not read_facts(FREEZE.splitlines()[0]).pip_freeze
    prose = read_facts("Using verl 0.4 with vllm 0.8.5. Also torch 2.5.1+cu121, sglang 0.4.6.post1.")
    assert prose.versions == {"verl": "0.4", "vllm": "0.8.5", "torch": "2.5.1+cu121", "sglang": "0.4.6.post1"}
    kernels = read_facts("after upgrading Liger-Kernel 0.6.3 (flashinfer-python==0.2.5, xformers 0.0.29.post3)")
    assert kernels.versions == {"liger-kernel": "0.6.3", "flashinfer": "0.2.5", "xformers": "0.0.29.post3"}


def test_a_pasted_issue_gets_the_culprit_its_evidence_and_known_cases(capsys, tmp_path):
    report = tmp_path / "issue.md"
    report.write_text(ISSUE)
    out = doctor_json(capsys, report)
    first = out["findings"][0]
    assert first["culprit_id"] == "oom_disguised"  # the rule on the CUDA line, with known cases beside it
    assert any("illegal memory access" in e["text"] for e in first["evidence"])
    seen = first["seen_before"]
    assert seen and all(s["url"].startswith("https://github.com/") for s in seen)
    ids = {c.url: c.culprit for c in cases()}
    assert all(ids[s["url"]] == "oom_disguised" for s in seen)
    assert out["facts"]["moe"] and out["facts"]["versions"]["torch"] == "2.9.1"


def test_a_nan_reward_finding_points_to_known_reports_of_nan_rewards(capsys):
    """The non-finite-rewards rule on verl's metrics line: the known cases beside it include reports whose rewards
    were NaN (a reward function's None turned NaN), not only other reward bugs that share verl's words."""
    out = doctor_json(capsys, Path(__file__).parent / "fixtures" / "doctor" / "verl_nan_reward.log")
    first = out["findings"][0]
    assert first["id"] == "reward_nonfinite"
    titles = [s["title"] for s in first["seen_before"]]
    assert any("NaN" in t for t in titles), titles


def test_a_known_case_reworded_is_found_by_retrieval(capsys, tmp_path):
    """A case's report, reworded by a user, with no rule's signature: the retrieval names its culprit."""
    case = next(c for c in cases() if c.culprit == "moe_routing" and "routed" in c.report.lower())
    words = case.report.split()
    report = tmp_path / "report.txt"
    report.write_text("Hi, seeing this on our cluster: " + " ".join(words[: max(12, len(words) * 2 // 3)]))
    out = doctor_json(capsys, report)
    named = [f["culprit_id"] for f in out["findings"]]
    assert "moe_routing" in named[:3], named
    kb = next(f for f in out["findings"] if f["culprit_id"] == "moe_routing")
    assert kb["seen_before"], kb


def test_nothing_known_says_what_was_read_and_what_is_missing(capsys, tmp_path):
    plain = tmp_path / "note.txt"
    plain.write_text("We started a run with verl on 8 GPUs yesterday and are wondering about the throughput.\n")
    capsys.readouterr()
    assert main(["doctor", str(plain)]) == 0
    text = capsys.readouterr().out
    assert "no known symptom found" in text
    assert "What the doctor could read: framework: verl" in text
    assert "Missing, to name a culprit: versions" in text and "an error line or stack trace" in text
    assert "Closest known failures" not in text  # nothing said to be wrong: no pointers either


def test_trouble_below_the_bar_lists_the_closest_known_failures_without_naming_a_culprit(capsys, tmp_path):
    """A report that says something is wrong but that the known-failure check does not take: no finding (exit 0),
    and the closest known cases of the ranking's first culprit as pointers, in the text and the JSON."""
    note = tmp_path / "note.md"
    note.write_text("### Training is slower than expected with verl 0.4\n\nI run GRPO with verl on Qwen2.5-7B, "
                    "8xH100, rollout vllm 0.8.5. The throughput seems lower than the blog post says.\n"
                    "Is there a recommended config for gpu_memory_utilization?\n")
    capsys.readouterr()
    assert main(["doctor", str(note)]) == 0
    text = capsys.readouterr().out
    assert "no known symptom found" in text and "Closest known failures, not close enough to name a culprit" in text
    out = doctor_json(capsys, note)
    assert not out["findings"]
    near = out["closest_known"]
    urls = {c.url: c.culprit for c in cases()}
    assert near["cases"] and all(urls[c["url"]] == near["culprit_id"] for c in near["cases"])
    assert all(c["url"] in text for c in near["cases"])


def test_a_persons_sentences_are_read_as_a_symptom_and_a_programs_output_is_not(capsys, tmp_path):
    """Prose with a symptom word is matched even with dashes, quotes and flags in it; a clean program's
    output (no error, no sentence saying something is wrong) names no culprit."""
    from miles.debug.doctor.readers import collect
    from miles.debug.doctor.retrieval import query_lines

    report = tmp_path / "report.md"
    report.write_text("Qwen3-MoE multi-turn SFT: 'Token mismatch detected!' - extra think tags\n"
                      "with VLLM_ROCM_USE_AITER_MOE=1 and CUDA graphs on, responses are all gibberish after RL\n")
    lines, symptomatic = query_lines(collect([str(report)]))
    assert symptomatic and len(lines) == 2
    log = tmp_path / "eval.txt"
    log.write_text("Starting evaluation of /models/Qwen2.5-7B-Instruct on gsm8k (1319 problems)\n"
                   "Loading tokenizer...\nResults written to results/gsm8k.json\n")
    assert not query_lines(collect([str(log)]))[1]
    assert doctor_json(capsys, log)["findings"] == []


def test_the_classifier_reads_an_identifier_as_its_parts_too():
    """`num_iterations` in a traceback shares `iterations` with a report's prose; `GRPOTrainer` gives `trainer`."""
    from miles.debug.doctor.retrieval import words

    got = words("AttributeError: 'XGRPOTrainer' object has no attribute 'num_iterations'; GRPOTrainer, camelCase")
    assert {"num_iterations", "num", "iterations", "xgrpotrainer", "xgrpo", "trainer", "grpo", "camel"} <= set(got)
    assert "error" not in got and "attributeerror" in got  # a stop word stays out, the whole identifier stays in


def test_the_classifier_learns_a_culprit_from_its_cases_causes_too():
    """A known case's established cause (culprit_detail) is a document of its culprit: a report that shares words
    only with another case's cause is ranked to that cause's culprit."""
    import dataclasses

    from miles.debug.doctor.retrieval import CaseIndex

    base, noise = cases()[0], distractors()[0]
    blank = dict(title="", symptom="the training run went wrong", report="", signature=(), fix="", evidence="")
    known = [dataclasses.replace(base, id="a", culprit="fp8_overflow", culprit_detail="the quorbel flange wobbled",
                                 **blank),
             dataclasses.replace(base, id="b", culprit="reward_bug", culprit_detail="a zentrix spindle snapped",
                                 **blank),
             dataclasses.replace(noise, id="n")]
    index = CaseIndex(known, profiles=False)
    assert index.match("after an hour the quorbel flange wobbles").ranked_culprits()[0] == "fp8_overflow"
    assert index.match("our zentrix spindle keeps snapping").ranked_culprits()[0] == "reward_bug"


def test_the_classifier_matches_a_words_inflections_and_fragments():
    """The classifier also reads 2-4 character n-grams within words: a report whose words are other forms of a
    known cause's words (no word in common) is ranked to that cause's culprit."""
    import dataclasses

    from miles.debug.doctor.retrieval import CaseIndex

    base, noise = cases()[0], distractors()[0]
    blank = dict(title="", report="", signature=(), fix="", evidence="")
    a, b = "quorbelizing flanges wobbled", "zentrixes spindled snappily"  # each in two documents: its report, its cause
    known = [dataclasses.replace(base, id="a", culprit="fp8_overflow", symptom=a, culprit_detail=a, **blank),
             dataclasses.replace(base, id="b", culprit="reward_bug", symptom=b, culprit_detail=b, **blank),
             dataclasses.replace(noise, id="n")]
    index = CaseIndex(known, profiles=False)
    assert index.match("a quorbelized flange").ranked_culprits()[0] == "fp8_overflow"
    assert index.match("one zentrix spindle").ranked_culprits()[0] == "reward_bug"


def test_the_same_base_gives_the_same_classifiers_whatever_the_random_state():
    """liblinear's solver visits the documents in a random order; the doctor seeds it, so a base gives the same
    weights in every process (numpy's global state, which an unseeded solver draws from, differs between them)."""
    import numpy as np

    from miles.debug.doctor.retrieval import CaseIndex

    base = [*cases()[:80], *distractors()[:40]]
    np.random.seed(1)
    one = CaseIndex(base)
    np.random.seed(2)
    two = CaseIndex(base)
    assert np.array_equal(one.classifier.coef_, two.classifier.coef_)
    assert np.array_equal(one.detector.coef_, two.detector.coef_)


@pytest.fixture(scope="module")
def evaluation():
    import tempfile

    from miles.debug.doctor.evaluate import leave_one_out

    base = [*cases(), *distractors()]
    with tempfile.TemporaryDirectory() as t:
        return leave_one_out(cases(), base, Path(t)), leave_one_out(distractors(), base, Path(t))


def test_the_known_failure_check_reads_a_known_report_as_the_doctor_reads_it_pasted(tmp_path):
    """The check is trained on each case and distractor in the form a pasted file gives the matcher (lines
    reordered: errors first; facts added), built in memory by `as_pasted`."""
    from miles.debug.doctor.readers import collect
    from miles.debug.doctor.retrieval import as_pasted, query_lines, query_of

    for case in [*cases()[:3], *distractors()[:2]]:
        path = tmp_path / "report.md"
        path.write_text(case.text)
        text = "\n".join(t for _, t in query_lines(collect([str(path)]))[0])
        assert as_pasted(case.text) == query_of(text, read_facts(text)) != case.text


def test_leave_one_out_accuracy_and_false_alarms_hold(evaluation):
    """The README's numbers, each case matched against the base without it, must not fall: top-1 70.7% (248/351)
    and top-3 76.9% (270/351) (the issue's target, 80% top-1, is not met), false alarms 4.8% (6/126) on 126
    distractors, 26 of them near misses (target <= 5%). The classifiers are seeded, so the figures are exact for a
    given scikit-learn; the floors leave 3 cases for another release's solver (losing the api_mismatch rule costs 5)."""
    outcomes, alarms = evaluation
    top1 = sum(o.top1 for o in outcomes) / len(outcomes)
    top3 = sum(o.top3 for o in outcomes) / len(outcomes)
    false = sum(bool(o.named) for o in alarms) / len(alarms)
    assert top1 >= 245 / 351 and top3 >= 267 / 351, f"leave-one-out top-1 {top1:.1%}, top-3 {top3:.1%}"
    assert false <= 0.05, f"false alarms on distractors {false:.1%}"


def test_every_planted_fault_of_the_fixtures_is_named_first():
    from miles.debug.doctor.evaluate import planted_faults

    results = planted_faults(Path(__file__).parent / "fixtures" / "doctor")
    wrong = [(f, want, named[:2]) for f, want, named in results if (named[:1] != [want] if want else named)]
    assert len(results) >= 19 and not wrong, wrong  # 17 planted faults and 2 clean runs
