import asyncio
import functools
import json
import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from miles.bridge.types import Sample
from miles.errors import UsageError
from miles.rollout import math_verify_pool, rewards
from miles.rollout.rewards import (
    REWARD_FUNCTIONS,
    RM_TYPES,
    extract_answer,
    get_reward_fn,
    has_answer,
    load_custom_reward,
    register_reward,
)

GSM8K_LABEL = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Altogether she sold 48+24 = <<48+24=72>>72.\n#### 72"
)
HARD = [json.loads(line) for line in (Path(__file__).parent / "fixtures" / "math_hard.jsonl").open()]
# Cases the careful grading gets right and `math` does not; each must stay a miss (strict xfail)
# until the reward improves, and none may be a false positive.
KNOWN_MISSES = {("So she has 7 apples left after giving away 5.", "#### 7")}  # no "=" or "is" says which


def sample(response, label, index=0):
    return Sample(group_index=0, index=index, prompt="p", tokens=[], response=response, label=label)


def reward(rm_type, response, label):
    return REWARD_FUNCTIONS[rm_type](sample(response, label))


def math(response, label):
    return reward("math", response, label)


@functools.cache
def hard_result(i):
    return math(HARD[i]["response"], HARD[i]["label"])


@pytest.fixture
def miles_warnings():
    """The warning records of the `miles` logger (which may not propagate to the root)."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("miles")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


# ------------------------------------------------------------------------------- the hard set


def test_hard_set_shape():
    assert len(HARD) >= 100
    assert sum(c["expected"] == 0 for c in HARD) >= len(HARD) / 3  # false-positive traps
    assert all(set(c) == {"response", "label", "expected", "why"} for c in HARD)


@pytest.mark.parametrize(
    "i",
    [
        pytest.param(i, marks=pytest.mark.xfail(strict=True, reason="known miss"))
        if (c["response"], c["label"]) in KNOWN_MISSES else i
        for i, c in enumerate(HARD)
    ],
    ids=[f"{i:03d} {c['why']}" for i, c in enumerate(HARD)],
)
def test_math_hard_case(i):
    assert hard_result(i) == HARD[i]["expected"], HARD[i]["why"]


def test_math_hard_set_agreement():
    results = [(hard_result(i), c["expected"]) for i, c in enumerate(HARD)]
    false_positives = [HARD[i]["why"] for i, (got, want) in enumerate(results) if got == 1 and want == 0]
    assert false_positives == []
    assert sum(got == want for got, want in results) / len(HARD) >= 0.95


# ------------------------------------------------------------------------------- extract_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{72}", "72"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("reasoning\n#### 1,234", "1,234"),
        (GSM8K_LABEL, "72"),
        ("The answer is 72.", "72."),
        ("**Answer:** 72", "72"),
        ("She has 12 - 5 = 7 apples left.", "She has 12 - 5 = 7 apples left."),
        ("#### Step 1: Add\n48 + 24 = 72\n#### Step 2: Check", "48 + 24 = 72"),
        ("so \\boxed{7", None),  # truncated inside the box: no answer, whatever came before
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected
    assert has_answer(text) is (expected is not None)


def test_boxed_preferred_over_other_markers():
    assert extract_answer("#### 3\nThe answer is 4. \\boxed{5} and then 6") == "5"


# -------------------------------------------------------------------------------- math reward


@pytest.mark.parametrize(
    "response",
    ["The answer is 72.", "\\boxed{72}", "$72", "72.0", "72.", "Answer: 72", "#### 72", "... so 72"],
)
def test_math_gsm8k_label_correct(response):
    assert math(response, GSM8K_LABEL) == 1.0


@pytest.mark.parametrize("response", ["The answer is 71.", "\\boxed{720}", "7.2", "-72", "\\boxed{A}"])
def test_math_wrong_answer(response):
    assert math(response, GSM8K_LABEL) == 0.0


def test_math_reads_past_gsm8k_calculator_annotations():
    # A model imitating GSM8K writes <<10-4=6>>: the number the sentence states is the one after it, not the
    # annotation's result (here they differ).
    response = "She has 10-4 = <<10-4=6>>5 apples left."
    assert math(response, 5) == 1.0
    assert math(response, 6) == 0.0


def test_math_label_types():
    assert math("72", 72) == 1.0
    assert math("72", 72.0) == 1.0
    assert math("0.1", 0.1) == 1.0
    assert math("73", 72) == 0.0


def test_math_no_answer_or_no_label():
    assert math("I don't know", GSM8K_LABEL) == 0.0
    assert math("", GSM8K_LABEL) == 0.0
    assert math("72", None) == 0.0


@pytest.mark.parametrize("rm_type", ["math", "math_verify"])
def test_numbers_compare_exactly(rm_type):
    # float(x) == float(y) would call these equal.
    assert reward(rm_type, "\\boxed{10000000000000001}", "10000000000000000") == 0.0
    assert reward(rm_type, "\\boxed{10000000000000001}", "10000000000000001") == 1.0


GSM8K_STYLE = [
    ("The answer is 72.", GSM8K_LABEL),
    ("The answer is 71.", GSM8K_LABEL),
    ("\\boxed{72}", GSM8K_LABEL),
    ("\\boxed{720}", GSM8K_LABEL),
    ("48 + 24 = 72\n#### 72", GSM8K_LABEL),
    ("48 + 24 = 73\n#### 73", GSM8K_LABEL),
    ("Answer: 72", "#### 72"),
    ("She paid $1,234.50 in all.", "#### 1234.5"),
    ("The answer is 1,234.", "#### 1234"),
    ("The answer is -3.", "#### -3"),
    ("The answer is 3.", "#### -3"),
    ("The answer is 0.5", "#### 0.50"),
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5"),
    ("The answer is 25%.", "#### 25"),
    ("So she has 7 apples.", "7"),
    ("So she has 8 apples.", "7"),
]


@pytest.mark.parametrize("response, label", GSM8K_STYLE)
def test_fast_path_equals_math_verify(response, label):
    assert math(response, label) == reward("math_verify", response, label)


def test_fast_path_does_not_call_math_verify(monkeypatch):
    def no_math_verify(*args):
        raise AssertionError("math-verify called on a plain number")

    monkeypatch.setattr(rewards, "_verify", no_math_verify)
    assert [math(r, label) for r, label in GSM8K_STYLE] == [1, 0, 1, 0, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0]


def test_math_symbolic_label_goes_to_math_verify(monkeypatch):
    calls = []
    monkeypatch.setattr(rewards, "_verify", lambda gold, pred, s: calls.append((gold, pred)) or True)
    assert math("so \\boxed{\\sqrt{8}}", "2\\sqrt{2}") == 1.0
    assert calls == [("2\\sqrt{2}", "so \\boxed{\\sqrt{8}}")]


# ------------------------------------------------------------------------- the other rm-types


def test_math_verify_reward():
    mv = functools.partial(reward, "math_verify")
    assert mv("so \\boxed{\\sqrt{8}}", "2\\sqrt{2}") == 1.0
    assert mv("The final answer is $\\frac{\\sqrt{3}}{2}$.", "\\frac{\\sqrt{3}}{2}") == 1.0
    assert mv("\\boxed{(1,2)}", "(1,2)") == 1.0 and mv("\\boxed{2}", "(1,2)") == 0.0
    assert mv("The answer is 72.", GSM8K_LABEL) == 1.0
    assert mv("The answer is B.", "\\text{(B)}") == 1.0 and mv("The answer is (C).", "B") == 0.0
    assert mv("\\boxed{6.02e23}", "6.02 \\times 10^{23}") == 1.0
    assert mv("\\boxed{6.02e22}", "6.02 \\times 10^{23}") == 0.0
    assert mv("\\boxed{72}", None) == 0.0


def test_math_verify_reward_has_no_fast_path(monkeypatch):
    monkeypatch.setattr(rewards, "_final_answer", None)  # the fast path's answer finder
    monkeypatch.setattr(rewards, "_plain_number", None)  # the fast path's number reader
    assert reward("math_verify", "#### 72", GSM8K_LABEL) == 1.0


def test_deepscaler():
    ds = functools.partial(reward, "deepscaler")
    assert ds("so the answer is \\boxed{72}", GSM8K_LABEL) == 1.0
    assert ds("so the answer is \\boxed{71}", GSM8K_LABEL) == 0.0
    assert ds("The answer is 72.", GSM8K_LABEL) == 0.0  # right, but not boxed
    assert ds("\\boxed{71} first, then \\boxed{72}", "72") == 1.0  # the last box counts
    assert ds("<think>\\boxed{72}</think> The answer is 72.", "72") == 0.0  # a box in the thinking
    assert ds("<think>maybe \\boxed{71}</think> \\boxed{72}", "72") == 1.0
    assert ds("\\boxed{\\sqrt{8}}", "2\\sqrt{2}") == 1.0 and ds("\\boxed{2}", "2\\sqrt{2}") == 0.0
    assert ds("\\boxed{72", "72") == 0.0  # truncated box
    assert ds("\\boxed{72}", None) == 0.0


def test_dapo():
    dapo = functools.partial(reward, "dapo")
    assert dapo("work...\nAnswer: 72", "72") == 1.0
    assert dapo("work...\nAnswer: 71", "72") == -1.0
    assert dapo("The answer is 72 but I never say it DAPO's way", "72") == -1.0  # no "Answer:"
    assert dapo("\\boxed{72}", 72) == -1.0
    assert dapo("Answer: 71\nwait, no.\nAnswer: $72$", 72) == 1.0  # the last "Answer:" counts
    assert dapo("answer: 72 apples", GSM8K_LABEL) == 1.0
    assert dapo("Answer: $\\frac{\\sqrt{3}}{2}$", "\\frac{\\sqrt{3}}{2}") == 1.0
    assert dapo("Answer: 72", None) == 0.0  # no label: no signal either way


def test_exact():
    exact = REWARD_FUNCTIONS["exact"]
    assert exact(sample("  Paris\n", "Paris")) == 1.0
    assert exact(sample("paris", "Paris")) == 0.0
    assert exact(sample("72", 72)) == 1.0
    assert exact(sample("None", None)) == 0.0


# --------------------------------------------------------------------------------- the timeout

POWER_TOWER = "\\boxed{9^{9^{9^{9}}}}"
NESTED = "\\boxed{" + functools.reduce(lambda s, _: f"\\frac{{{s}}}{{x+1}}", range(4200), "x") + "}"  # 50k chars


@pytest.fixture
def short_timeout(monkeypatch):
    """A 0.5 s deadline; calling the fixture's value puts the default back for the checks after."""
    default = math_verify_pool.VERIFY_TIMEOUT_S
    monkeypatch.setattr(math_verify_pool, "VERIFY_TIMEOUT_S", 0.5)
    return lambda: monkeypatch.setattr(math_verify_pool, "VERIFY_TIMEOUT_S", default)


@pytest.mark.timeout(60)
def test_timeout_in_main_thread(short_timeout, miles_warnings):
    assert math(POWER_TOWER, "5") == 0.0
    assert [r.getMessage().count("\n") for r in miles_warnings] == [0]  # one warning, one line
    assert "math-verify gave no verdict within 0.5 s on sample 0" in miles_warnings[0].getMessage()
    short_timeout()
    assert math("\\boxed{\\sqrt{8}}", "2\\sqrt{2}") == 1.0  # the stuck worker was replaced


@pytest.mark.timeout(60)
def test_timeout_in_worker_thread(short_timeout, miles_warnings):
    assert len(NESTED) > 50_000
    results = []
    # daemon: should the guard break, the test fails instead of holding the interpreter open
    thread = threading.Thread(target=lambda: results.append(reward("math_verify", NESTED, "5")), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and results == [0.0]
    assert len(miles_warnings) == 1
    short_timeout()
    thread = threading.Thread(target=lambda: results.append(math("\\boxed{\\sqrt{8}}", "2\\sqrt{2}")), daemon=True)
    thread.start()
    thread.join(30)
    assert results == [0.0, 1.0]


def test_import_is_light():
    code = "import sys, miles.rollout.rewards; print(sorted({'math_verify', 'sympy', 'torch'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


# ------------------------------------------------------------------------------ registry / lookup


def test_rm_types_are_the_registry():
    assert set(RM_TYPES) == set(REWARD_FUNCTIONS)
    assert {"math", "math_verify", "deepscaler", "dapo", "exact"} <= set(RM_TYPES)


def test_get_reward_fn_builtin():
    for name in RM_TYPES:
        assert get_reward_fn(name, None) is REWARD_FUNCTIONS[name]


@pytest.mark.parametrize("rm_type", ["nope", None])
def test_get_reward_fn_unknown_type(rm_type):
    with pytest.raises(UsageError, match="--rm-type") as info:
        get_reward_fn(rm_type, None)
    assert all(name in str(info.value) for name in RM_TYPES)


def test_register_reward_duplicate_name():
    with pytest.raises(ValueError, match="math"):
        register_reward("math")(lambda s: 0.0)


def test_register_reward_adds_type():
    @register_reward("_test_len")
    def length(s):
        return float(len(s.response))

    try:
        assert get_reward_fn("_test_len", None)(sample("abc", None)) == 3.0
    finally:
        del REWARD_FUNCTIONS["_test_len"]


# --------------------------------------------------------------------------------- custom reward


@pytest.fixture
def rm_module(tmp_path, monkeypatch):
    (tmp_path / "my_rm_mod.py").write_text(
        textwrap.dedent(
            """
            import asyncio

            def sync_rm(sample):
                return 1 if sample.response == sample.label else 0

            async def async_rm(sample):
                await asyncio.sleep(0)
                return len(sample.response)

            def bad_return(sample):
                return None

            NOT_A_FUNCTION = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rm_mod"


def test_custom_sync(rm_module):
    fn = load_custom_reward(f"{rm_module}:sync_rm")
    result = fn(sample("a", "a"))
    assert result == 1.0 and isinstance(result, float)
    assert fn(sample("a", "b")) == 0.0


def test_custom_async(rm_module):
    fn = load_custom_reward(f"{rm_module}:async_rm")
    result = fn(sample("abcd", None))
    assert result == 4.0 and isinstance(result, float)


def test_custom_async_inside_running_loop(rm_module):
    fn = load_custom_reward(f"{rm_module}:async_rm")

    async def caller():
        return fn(sample("abc", None))

    assert asyncio.run(caller()) == 3.0


def test_custom_wins_over_rm_type(rm_module):
    fn = get_reward_fn("math", f"{rm_module}:sync_rm")
    assert fn(sample("x", "x")) == 1.0


def test_custom_imported_from_cwd(tmp_path, monkeypatch):
    (tmp_path / "cwd_rm_mod.py").write_text("def rm(sample):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    # Simulate a console-script launch, where neither cwd nor "" is on sys.path.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_custom_reward("cwd_rm_mod:rm")(sample("x", None)) == 0.5


@pytest.mark.parametrize("path", ["no_colon", "mod:", ":fn"])
def test_custom_bad_format(path):
    expected = "--custom-rm-path must look like module.path:function"
    with pytest.raises(UsageError, match=expected) as info:
        load_custom_reward(path)
    assert repr(path) in str(info.value)


def test_custom_module_not_importable():
    with pytest.raises(UsageError, match="--custom-rm-path") as info:
        load_custom_reward("definitely_missing_rm_mod:fn")
    assert "definitely_missing_rm_mod" in str(info.value)
    assert "No module named" in str(info.value)


def test_custom_missing_attribute(rm_module):
    with pytest.raises(UsageError, match="--custom-rm-path") as info:
        load_custom_reward(f"{rm_module}:nope")
    assert "'nope'" in str(info.value)


def test_custom_not_callable(rm_module):
    with pytest.raises(UsageError, match="--custom-rm-path .*not callable"):
        load_custom_reward(f"{rm_module}:NOT_A_FUNCTION")


def test_custom_non_numeric_return(rm_module):
    fn = load_custom_reward(f"{rm_module}:bad_return")
    with pytest.raises(UsageError, match="--custom-rm-path .*must return a number"):
        fn(sample("x", None))


def test_custom_reward_that_raises_is_one_usage_error_naming_its_line(tmp_path, monkeypatch):
    (tmp_path / "broken_rm.py").write_text("def rm(sample):\n    return 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_custom_reward("broken_rm:rm")
    with pytest.raises(UsageError) as err:
        fn(Sample(group_index=0, index=3, prompt="p", tokens=[], response="r", label="1"))
    message = str(err.value)
    assert "--custom-rm-path broken_rm:rm raised ZeroDivisionError" in message
    assert "broken_rm.py:2" in message and "sample 3" in message and "\n" not in message
