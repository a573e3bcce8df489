"""Reward functions: turn a finished `Sample` into a float, with no torch and no side effects.

`--rm-type NAME` picks a function from `REWARD_FUNCTIONS`; `--custom-rm-path module.path:function`
loads a user function instead (plain or `async def`). To add a built-in reward, write a function
`(sample) -> float` in this file and decorate it with `@register_reward("name")`; it then becomes
a valid `--rm-type`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction

from miles.bridge.types import Sample
from miles.errors import UsageError

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


# ---------------------------------------------------------------------------- answer extraction

_NUM = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"  # 1,234.5 before 1234 so commas bind
# Fractions come first in the alternation so "1/2" is one match, not "1" then "2". A minus sign
# only counts when it does not follow a word character: "5-3" is 5 and 3, not 5 and -3.
_VALUE = re.compile(
    rf"(?<![\w.])(?:(?P<fsign>-?)\\d?frac\{{(?P<fnum>{_NUM})\}}\{{(?P<fden>{_NUM})\}}"
    rf"|(?P<num>{_NUM})\s*/\s*(?P<den>{_NUM})(?![\d.])"
    rf"|(?P<plain>{_NUM}))"
)
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*([^\n]*)", re.IGNORECASE)
_BOXED_NOISE = re.compile(r"\\text\{[^{}]*\}|\\mbox\{[^{}]*\}|\^\{?\\circ\}?|\\[$%!,;]|[$%\s]")


def _canonical(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d == 1:  # terminating decimal: "0.5" reads better than "1/2" and is what labels use
        text = format((Decimal(value.numerator) / Decimal(value.denominator)).normalize(), "f")
        if Fraction(text) == value:  # Decimal rounds past 28 digits; keep exactness over looks
            return text
    return f"{value.numerator}/{value.denominator}"


def _value(m: re.Match[str]) -> str | None:
    def num(s: str) -> Fraction:
        return Fraction(s.replace(",", ""))

    try:
        if m["fnum"] is not None:
            v = num(m["fnum"]) / num(m["fden"])
            return _canonical(-v if m["fsign"] else v)
        if m["num"] is not None:
            return _canonical(num(m["num"]) / num(m["den"]))
        return _canonical(num(m["plain"]))
    except ZeroDivisionError:
        return None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    # Walk braces by hand: a regex cannot match the nesting in \boxed{\frac{1}{2}}.
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unclosed: the response was truncated mid-answer


def extract_answer(text: str) -> str | None:
    """The final answer in a response or label as a canonical string ("72", "-3", "0.5", "1/3").

    Looks, in order, for the last \\boxed{...}, a GSM8K "#### N", "answer is N" / "Answer: N",
    then the last number anywhere. None when there is no answer.
    """
    text = text.replace("\u2212", "-")  # unicode minus, common in model output
    boxed = _last_boxed(text)
    if boxed is not None:
        content = _BOXED_NOISE.sub("", boxed).rstrip(".").split("=")[-1]
        m = _VALUE.fullmatch(content)
        # A non-numeric box ("A", "3\sqrt{2}") stays as text: digging a number out of it would
        # reward answers that merely contain the right digit.
        return (_value(m) if m else content) or None
    for marker in (re.compile(r"####\s*([^\n]*)"), _ANSWER_IS):
        spans = marker.findall(text)
        if spans and (m := _VALUE.search(spans[-1])):
            return _value(m)
    matches = list(_VALUE.finditer(text))
    return _value(matches[-1]) if matches else None


def _as_fraction(answer: str) -> Fraction | None:
    try:
        return Fraction(answer)
    except (ValueError, ZeroDivisionError):
        return None


# ------------------------------------------------------------------------------ built-in rewards


@register_reward("math")
def math_reward(sample: Sample) -> float:
    if sample.label is None:
        return 0.0
    got, want = extract_answer(sample.response), extract_answer(str(sample.label))
    if got is None or want is None:
        return 0.0
    a, b = _as_fraction(got), _as_fraction(want)
    # Exact rational comparison: float == would call 0.1 + 0.2 wrong and 1e17 + 1 right.
    if a is not None and b is not None:
        return float(a == b)
    return float(got == want)


@register_reward("exact")
def exact_reward(sample: Sample) -> float:
    if sample.label is None:  # otherwise a response "None" would match a missing label
        return 0.0
    return float(sample.response.strip() == str(sample.label).strip())


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
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--custom-rm-path must look like module.path:function (got {path!r})")
    # `python -m` and console scripts differ on whether cwd is importable; users expect it is.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(
            f"--custom-rm-path {path}: cannot import module {module_name!r} ({e}); "
            "run from the directory that contains it or add it to PYTHONPATH"
        ) from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise UsageError(f"--custom-rm-path {path}: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise UsageError(f"--custom-rm-path {path}: {attr!r} is not callable; name a function")

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
