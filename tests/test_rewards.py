import asyncio
import sys
import textwrap

import pytest

from miles.bridge.types import Sample
from miles.errors import UsageError
from miles.rollout.rewards import (
    REWARD_FUNCTIONS,
    extract_answer,
    get_reward_fn,
    load_custom_reward,
    register_reward,
)

GSM8K_LABEL = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Altogether she sold 48+24 = <<48+24=72>>72.\n#### 72"
)


def sample(response, label):
    return Sample(group_index=0, index=0, prompt="p", tokens=[], response=response, label=label)


def math(response, label):
    return REWARD_FUNCTIONS["math"](sample(response, label))


# ------------------------------------------------------------------------------ extract_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 72.", "72"),
        ("so \\boxed{72}", "72"),
        ("$72", "72"),
        ("72.0", "72"),
        ("1,234", "1234"),
        ("reasoning\n#### 1,234", "1234"),
        (GSM8K_LABEL, "72"),
        ("It drops to -3 degrees", "-3"),
        ("5-3=2", "2"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{-\\dfrac{3}{4}}", "-0.75"),
        ("1/3 of the cake", "1/3"),
        ("Answer: $1,000.50", "1000.5"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{x = 5}", "5"),
        ("\\boxed{\\$72}", "72"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{A}", "A"),
        ("The answer is 7, not 8 as 3 people said", "7"),
        ("\u22124", "-4"),
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_boxed_preferred_over_other_markers():
    assert extract_answer("#### 3\nThe answer is 4. \\boxed{5} and then 6") == "5"


def test_unclosed_boxed_falls_back_to_last_number():
    assert extract_answer("so \\boxed{7") == "7"


# -------------------------------------------------------------------------------- math reward


@pytest.mark.parametrize(
    "response",
    [
        "The answer is 72.",
        "\\boxed{72}",
        "$72",
        "72.0",
        "72.",
        "Answer: 72",
        "#### 72",
        "... so 72",
    ],
)
def test_math_gsm8k_label_correct(response):
    assert math(response, GSM8K_LABEL) == 1.0


@pytest.mark.parametrize(
    "response", ["The answer is 71.", "\\boxed{720}", "7.2", "-72", "\\boxed{A}"]
)
def test_math_wrong_answer(response):
    assert math(response, GSM8K_LABEL) == 0.0


def test_math_commas():
    assert math("1,234", "#### 1234") == 1.0
    assert math("1234", "#### 1,234") == 1.0


def test_math_negative():
    assert math("The answer is -3.", "#### -3") == 1.0
    assert math("The answer is 3.", "#### -3") == 0.0


def test_math_fractions_and_decimals():
    assert math("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math("1/2", "#### 0.50") == 1.0
    assert math("\\boxed{\\frac{2}{6}}", "1/3") == 1.0
    assert math("\\boxed{0.33}", "1/3") == 0.0


def test_math_label_types():
    assert math("72", 72) == 1.0
    assert math("72", 72.0) == 1.0
    assert math("0.1", 0.1) == 1.0
    assert math("72", "72") == 1.0
    assert math("73", 72) == 0.0


def test_math_no_number_or_no_label():
    assert math("I don't know", GSM8K_LABEL) == 0.0
    assert math("", GSM8K_LABEL) == 0.0
    assert math("72", None) == 0.0


def test_math_exact_not_float():
    # float(x) == float(y) would call these equal.
    assert math("10000000000000001", "10000000000000000") == 0.0


# ------------------------------------------------------------------------------- exact reward


def test_exact():
    exact = REWARD_FUNCTIONS["exact"]
    assert exact(sample("  Paris\n", "Paris")) == 1.0
    assert exact(sample("paris", "Paris")) == 0.0
    assert exact(sample("72", 72)) == 1.0
    assert exact(sample("None", None)) == 0.0


# ------------------------------------------------------------------------------ registry / lookup


def test_get_reward_fn_builtin():
    assert get_reward_fn("math", None) is REWARD_FUNCTIONS["math"]
    assert get_reward_fn("exact", None) is REWARD_FUNCTIONS["exact"]


@pytest.mark.parametrize("rm_type", ["nope", None])
def test_get_reward_fn_unknown_type(rm_type):
    with pytest.raises(UsageError, match="--rm-type") as info:
        get_reward_fn(rm_type, None)
    assert "exact" in str(info.value) and "math" in str(info.value)


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
