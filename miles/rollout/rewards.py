"""Reward functions: turn a finished `Sample` into a float, with no torch and no side effects.

`--rm-type NAME` picks a function from `REWARD_FUNCTIONS` (its names are `RM_TYPES`);
`--custom-rm-path module.path:function` loads a user function instead (plain or `async def`). To
add a built-in reward, write a function `(sample) -> float` in this file and decorate it with
`@register_reward("name")`; it then becomes a valid `--rm-type`.

Built-in rewards. A label (`sample.label`) may be a GSM8K solution (its answer follows the
last `####`), a MATH solution (its answer is its last `\\boxed{}`) or the answer itself: "72",
"1,234", "0.5", "2\\sqrt{2}", "(1,2)", "[-2,3)", "x^2+1", "\\text{(C)}". A missing label scores 0.

- `math`: 1.0 right, 0.0 wrong. A plain-number label (`#### 72`, "-3", "1{,}234", "\\frac{1}{2}",
  "6.02e23", "25\\%") takes the fast path: the response's final answer is the last `\\boxed{}`, else
  a `#### N` line, else what follows the last "answer is" / "Answer:", else the final sentence
  with a number in it; the number it states is compared with the label as an exact rational.
  A boxed or LaTeX answer that is not a plain number ("2^{10}") goes to math-verify; a sentence
  that states several numbers and no result scores 0. Any other label goes to math-verify, which
  finds the answer anywhere in the response and checks mathematical equivalence.
- `math_verify`: 1.0 / 0.0. math-verify alone on the whole response, any answer format (box,
  "final answer is", LaTeX, a plain expression, a letter choice); no fast path.
- `deepscaler`: 1.0 / 0.0. DeepScaleR's convention: the answer is the last `\\boxed{}` of the
  response (of the part after `</think>` when there is one); no box scores 0.
- `dapo`: 1.0 right, -1.0 otherwise, as DAPO: the answer is the rest of the line after the last
  "Answer:"; a response without one scores -1. Values are compared as in `math`, not as strings.
- `exact`: 1.0 / 0.0. The response, stripped, equals the label, stripped.

math-verify runs in worker processes (`miles.rollout.math_verify_pool`) with a deadline per
answer: a pathological answer (`\\boxed{9^{9^{9^{9}}}}`) scores 0 with one warning instead of
hanging the run, whichever thread calls the reward. It is imported only there, so importing this
module stays cheap.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import re
import traceback
from collections.abc import Callable
from fractions import Fraction
from typing import NamedTuple

from miles.bridge.types import Sample
from miles.errors import UsageError
from miles.rollout import math_verify_pool

logger = logging.getLogger("miles")

RewardFn = Callable[[Sample], float]
REWARD_FUNCTIONS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def decorator(fn: RewardFn) -> RewardFn:
        # A second registration under one name would silently change what `--rm-type` means.
        if name in REWARD_FUNCTIONS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARD_FUNCTIONS[name] = fn
        return fn

    return decorator


# ------------------------------------------------------------------------------- reading numbers

# 1,234.5 and 1 000 000 before 1234 so separators bind; exponents are capped at 3 digits so that
# "1e999999999" cannot make Fraction build a billion-digit integer.
_N = r"(?:\d{1,3}(?:,\d{3})+|\d{1,3}(?: \d{3})+|\d+)(?:\.\d+)?(?:[eE][+-]?\d{1,3})?|\.\d+"
# A number or a fraction of numbers; a minus sign only counts when it does not follow a word
# character ("5-3" is 5 and 3), and a number never starts inside a word ("x2", "e23").
_NUMBER = re.compile(rf"(?<![\w.])(?P<a>-?(?:{_N}))(?:\s*/\s*(?P<b>{_N}))?(?![\w])")
_OPERATOR_NEXT = re.compile(r"\s*(?:[-+*/×÷^=]|\\times|\\cdot|\\div|x\s*\d)")
_RESULT_WORD = re.compile(r"\b(?:is|are|was|were|equals)\b", re.IGNORECASE)

# Notation that does not change a number's value, rewritten to the plain form _NUMBER reads.
_NOTATION = [
    (re.compile(r"\\[dt]?frac\{\s*(-?[\d.,]+)\s*\}\{\s*([\d.,]+)\s*\}"), r"\1/\2"),  # \frac{1}{2}
    (re.compile(r"\\[dt]?frac(\d)(\d)"), r"\1/\2"),  # \frac12
    (re.compile(r"(\d)\s*(?:\\times|\\cdot|×|\*)\s*10\s*\^\s*\{?\s*([+-]?\d{1,3})\s*\}?"), r"\1e\2"),
    (re.compile(r"\\(?:text|textbf|mbox|mathrm)\{[^{}]*\}(?:\s*\^\s*\{?\d\}?)?"), " "),  # units, cm^2
    (re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|°"), ""),  # degrees
    (re.compile(r"\{,\}"), ","),  # 1{,}234
    (re.compile(r"\\[,!;: ]"), ""),  # LaTeX spaces: 1\,000\,000
    (re.compile(r"\\%"), "%"),
    (re.compile(r"\\\$|\$|\\[()\[\]]|\\left|\\right|\*\*"), " "),  # $, math delimiters, bold
]


def _rewrite(text: str, rules: list[tuple[re.Pattern[str], str]]) -> str:
    for pattern, repl in rules:
        text = pattern.sub(repl, text)
    return text


def _plain_text(text: str) -> str:
    return _rewrite(text.replace("\u2212", "-"), _NOTATION)  # U+2212 is the minus sign of model output


def _fraction(m: re.Match[str]) -> Fraction | None:
    def value(s: str) -> Fraction:
        return Fraction(s.replace(",", "").replace(" ", ""))

    try:
        return value(m["a"]) / value(m["b"]) if m["b"] else value(m["a"])
    except (ZeroDivisionError, ValueError):  # 1/0, or past Python's 4300-digit int limit
        return None


def _plain_number(text: str) -> Fraction | None:
    """The value of text that is exactly one number ("1,234", "-\\frac{1}{3}", "25\\%"), else None."""
    m = _NUMBER.fullmatch(_plain_text(text).strip().rstrip(".%").strip())
    return _fraction(m) if m else None


def _leading_number(text: str) -> Fraction | None:
    # "7, not 8" states 7; "5 + 3 = 8" does not state 5.
    m = _NUMBER.match(text.lstrip())
    if m is None or _OPERATOR_NEXT.match(text.lstrip()[m.end() :]):
        return None
    return _fraction(m)


def _stated_number(text: str) -> Fraction | None:
    """The one number that answer text states, or None when it states none or several.

    Tried in order: a number it starts with ("72 clips"), the number after its last "=" ("5 + 3 =
    8"), the number after its last "is" ("the sum of 3 and 4, which is 7"), its only number.
    """
    text = _plain_text(text)
    for tail in (text, text.rpartition("=")[2], _RESULT_WORD.split(text)[-1]):
        if (value := _leading_number(tail)) is not None:
            return value
    numbers = list(_NUMBER.finditer(text))
    return _fraction(numbers[0]) if len(numbers) == 1 else None


# ------------------------------------------------------------------------------ finding answers


class _Answer(NamedTuple):
    text: str  # the answer as written: box content, a line or a sentence
    kind: str  # "boxed", "####", "answer" (after "answer is") or "sentence" (no marker at all)

    def for_math_verify(self) -> str:
        return f"\\boxed{{{self.text}}}" if self.kind == "boxed" else self.text

    def is_math(self) -> bool:
        """Whether math-verify may read it: a box, or LaTeX after a marker (not plain words)."""
        return self.kind == "boxed" or (self.kind != "sentence" and re.search(r"[\\^{]", self.text) is not None)


# Numbers that are not answers, blanked before the answer is looked for.
_NOT_ANSWERS = [
    (re.compile(r"<<[^<>\n]*>>"), " "),  # GSM8K calculator annotations: <<48/2=24>>
    (re.compile(r"\bstep\s*\d+", re.IGNORECASE), " "),  # "#### Step 2:" headings
    (re.compile(r"(?m)^([ \t]*#*[ \t]*)\d+[.)](?=[ \t]+[A-Za-z])"), r"\1"),  # "#### 2. Add them"
]
_GSM8K_LINE = re.compile(r"(?m)^[ \t]*####[ \t]*(.*?)[ \t]*$")
_ANSWER_IS = re.compile(r"\banswer(?:\*\*)?\s*(?:is\b|:|=)\s*:?(?:\*\*)?\s*([^\n]*)", re.IGNORECASE)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_BOXED = "\\boxed{"


def _last_boxed(text: str) -> str | None:
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 0, start + len(_BOXED) - 1
    # Walk braces by hand: a regex cannot match the nesting in \boxed{\frac{1}{2}}.
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unclosed: the response was truncated mid-answer


def _final_answer(text: str) -> _Answer | None:
    if _BOXED in text:  # a truncated box is no answer, whatever numbers precede it
        boxed = _last_boxed(text)
        return _Answer(boxed, "boxed") if boxed is not None else None
    text = _rewrite(text, _NOT_ANSWERS)
    lines = [line for line in _GSM8K_LINE.findall(text) if _plain_number(line) is not None]
    if lines:
        return _Answer(lines[-1], "####")
    if clauses := _ANSWER_IS.findall(text):
        return _Answer(clauses[-1], "answer")
    sentences = [s for s in _SENTENCE_END.split(text) if re.search(r"\d", s)]
    return _Answer(sentences[-1], "sentence") if sentences else None


def extract_answer(text: str) -> str | None:
    """The final answer of a response as written, by the `math` reward's conventions; None if none.

    The content of the last `\\boxed{}`, else the last `#### N` line, else what follows the last
    "answer is" / "Answer:", else the last sentence with a digit. A truncated box is no answer.
    """
    answer = _final_answer(text)
    return answer.text if answer else None


def has_answer(text: str) -> bool:
    """Whether the `math` reward finds a final answer in the response at all."""
    return extract_answer(text) is not None


def _gold_answer(label: object) -> str | None:
    if label is None:
        return None
    text = str(label).strip()
    if "####" in text:  # a GSM8K solution
        text = text.rpartition("####")[2]
    elif (boxed := _last_boxed(text)) is not None:  # a MATH solution
        text = boxed
    return text.strip() or None


def _matches(gold: str, answer: _Answer, sample: Sample) -> bool:
    """Whether a located answer equals the gold answer: exact rationals for numbers, else math-verify."""
    want = _plain_number(gold)
    if want is not None:
        got = _stated_number(answer.text)
        if got is not None:
            # Exact rational comparison: float == would call 0.1 + 0.2 wrong and 1e17 + 1 right.
            return got == want
        if not answer.is_math():  # words that state several numbers and no result
            return False
    return _verify(gold, answer.for_math_verify(), sample)


def _verify(gold: str, pred: str, sample: Sample) -> bool:
    return math_verify_pool.equal(gold, pred, what=f"sample {sample.index}")


# ------------------------------------------------------------------------------ built-in rewards


@register_reward("math")
def math_reward(sample: Sample) -> float:
    gold = _gold_answer(sample.label)
    if gold is None:
        return 0.0
    if _plain_number(gold) is None:  # a symbolic label: math-verify finds and compares the answer
        return float(_verify(gold, sample.response, sample))
    answer = _final_answer(sample.response)
    return float(answer is not None and _matches(gold, answer, sample))


@register_reward("math_verify")
def math_verify_reward(sample: Sample) -> float:
    gold = _gold_answer(sample.label)
    return float(gold is not None and _verify(gold, sample.response, sample))


@register_reward("deepscaler")
def deepscaler_reward(sample: Sample) -> float:
    gold = _gold_answer(sample.label)
    boxed = _last_boxed(sample.response.rpartition("</think>")[2])  # the box of the thinking does not count
    return float(gold is not None and boxed is not None and _matches(gold, _Answer(boxed, "boxed"), sample))


_DAPO_ANSWER = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)


@register_reward("dapo")
def dapo_reward(sample: Sample) -> float:
    gold = _gold_answer(sample.label)
    if gold is None:
        return 0.0
    lines = _DAPO_ANSWER.findall(sample.response)
    return 1.0 if lines and _matches(gold, _Answer(lines[-1].strip(), "answer"), sample) else -1.0


@register_reward("exact")
def exact_reward(sample: Sample) -> float:
    if sample.label is None:  # otherwise a response "None" would match a missing label
        return 0.0
    return float(sample.response.strip() == str(sample.label).strip())


RM_TYPES: tuple[str, ...] = tuple(REWARD_FUNCTIONS)  # the --rm-type names, for the CLI's --help


# ---------------------------------------------------------------------------- custom and lookup


def _run_sync(awaitable) -> object:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(awaitable)
    # Called from inside an event loop (an async rollout), where asyncio.run refuses to nest.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, awaitable).result()


def load_custom_reward(path: str) -> RewardFn:
    from miles.utils.imports import load_function

    fn = load_function(path, "--custom-rm-path")

    @functools.wraps(fn)
    def reward(sample: Sample) -> float:
        try:
            result = fn(sample)
            if inspect.isawaitable(result):
                result = _run_sync(result)
        except Exception as e:  # the user's function failed: say where, in one line
            frame = traceback.extract_tb(e.__traceback__)[-1]
            raise UsageError(f"--custom-rm-path {path} raised {type(e).__name__}: {e} (at {frame.filename}:"
                             f"{frame.lineno}) on sample {sample.index}; fix the reward function") from e
        try:
            return float(result)
        except (TypeError, ValueError) as e:
            raise UsageError(
                f"--custom-rm-path {path} returned {result!r}; "
                "a reward function must return a number"
            ) from e

    return reward


def get_reward_fn(rm_type: str | None, custom_rm_path: str | None) -> RewardFn:
    if custom_rm_path:
        return load_custom_reward(custom_rm_path)
    if rm_type not in REWARD_FUNCTIONS:
        known = ", ".join(sorted(REWARD_FUNCTIONS))
        raise UsageError(
            f"--rm-type {rm_type!r} is not a known reward; use one of {known} or --custom-rm-path"
        )
    return REWARD_FUNCTIONS[rm_type]
