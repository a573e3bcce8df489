"""Rollout dumps: the `Sample`s of one rollout on disk (`--save-debug-rollout-data`), and reading them back.

One file per rollout id, written atomically, readable with `torch.load(path, weights_only=True)`:

    {"format": "miles.rollout/1", "rollout_id": int, "samples": [sample dict, ...], "metadata": {...}}

Writing converts whatever a data row brought along (a parquet timestamp or decimal column, numpy
values, bytes, sets) to plain types first (`plain`), so every dump loads with `weights_only=True`.

Reading trusts nothing: `read_dump` checks the file and its header, `samples_from_dump` the type of
every field of every sample, and `validate_samples` their values and their consistency (lengths,
log-probs, rewards, statuses, GRPO groups). Each bad field is one line naming the file, the sample
and the field. A replay (`miles.rollout.replay.ReplaySource`, through `check_fits`) refuses a dump
with any such problem; `miles inspect-rollout` shows it and prints the problems as warnings.

Dumps written by Miles or slime (`{"rollout_id", "samples": [Sample.to_dict()]}`, no `format`) load
too: their extra fields are ignored and the ones miles needs but they may lack (loss masks, group
indices, engine log-probs) are filled in or reported as missing.
"""

from __future__ import annotations

import base64
import datetime
import enum
import itertools
import math
import re
import reprlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.bridge.dump_paths import dump_path
from miles.bridge.types import Sample, Status
from miles.errors import UsageError
from miles.utils.io import atomic_path

FORMAT = "miles.rollout/1"
LOAD_FLAG = "--load-debug-rollout-data"
STATUSES = (Status.COMPLETED, Status.TRUNCATED, Status.ABORTED)
# Engine log-probs are log p <= 0. An fp32 log-softmax can round a near-certain token to a hair above
# 0 (~1e-7); 1e-3 also covers engines that compute in lower precision, and still refuses the
# probabilities or logits a buggy capture might store in their place.
LOG_PROB_SLACK = 1e-3
# The trainer holds rewards and log-probs as float32: a Python float beyond its range (~3.4e38) is
# finite here but inf there, and its loss NaN.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)

_SHORT = reprlib.Repr()  # bounded repr for error lines: long or deeply nested values are cut
_SHORT.maxstring = _SHORT.maxother = 60


# ---------------------------------------------------------------- writing


ROUTES = "rollout_routed_experts"  # slime's field: MoE expert ids per token, layer and k


def save_rollout(template: str, rollout_id: int, samples: list[Sample], metadata: dict[str, Any]) -> Path:
    path = dump_path(template, rollout_id)
    payload = {"format": FORMAT, "rollout_id": rollout_id, "samples": [_sample_dict(s) for s in samples],
               "metadata": plain(metadata)}
    with atomic_path(path) as tmp:  # a reader never sees a half-written dump
        torch.save(payload, tmp)
    return path


def _sample_dict(s: Sample) -> dict[str, Any]:
    d = s.to_dict()
    for key in ("prompt", "label", "metadata"):  # where a data row's own values end up
        d[key] = plain(d[key])
    if s.rollout_routed_experts is not None:  # MoE routes: an int16 tensor, compact and weights_only-loadable
        d[ROUTES] = torch.from_numpy(s.rollout_routed_experts.astype("int16"))
    return d


def plain(value: Any) -> Any:
    """`value` in types that `torch.load(weights_only=True)` reads and JSON can show, recursively.

    datetimes, dates and times (pandas Timestamps too) become ISO 8601 strings; timedeltas seconds
    (float); Decimal its exact str; numpy scalars and arrays Python numbers and lists (numpy datetimes
    ISO strings); bytes base64 strings (standard alphabet, padded); tuples lists; sets sorted lists
    (in repr order when their items do not compare); enums their value; subclasses of str, int and
    float (numpy.str_, numpy.float64) the base type; dict keys str unless plain; anything else
    str(value). Tensors stay tensors.
    """
    if value is None or type(value) in (str, int, float, bool) or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        return {_plain_key(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [plain(v) for v in value]
        try:
            return sorted(items)
        except TypeError:  # items of mixed types
            return sorted(items, key=repr)
    return _plain_scalar(value)


def _plain_scalar(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, (datetime.date, datetime.time)):  # datetime.datetime is a date
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, (np.datetime64, np.timedelta64)):
        return str(value)
    if isinstance(value, np.ndarray) and value.dtype.kind in "mM":  # tolist() would give raw integers
        return [plain(v) for v in value]
    if isinstance(value, (np.ndarray, np.generic)):
        return plain(value.tolist())
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    for base in (str, int, float):  # a subclass would be pickled as its own class
        if isinstance(value, base):
            return base(value)
    return str(value)  # Decimal (exact), UUID, Path, complex, ...


def _plain_key(key: Any) -> Any:
    key = plain(key)
    return key if key is None or type(key) in (str, int, float, bool) else str(key)


# ---------------------------------------------------------------- reading


def _load_failure(path: Path, e: Exception) -> str:
    """Why torch.load refused PATH, in one short clause."""
    with open(path, "rb") as f:
        if f.read(2) != b"PK":  # torch.save writes a zip archive
            return "not a file torch.save wrote: no zip header"
    # torch's weights-only refusal is a paragraph about torch.load's defaults; its cause is one line in it
    cause = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|$)", str(e), re.S)
    if cause:
        return f"{cause.group(1).split('. ')[0][:120]}: objects a dump never holds"
    return str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__


def read_dump(path: Path, source: str = LOAD_FLAG) -> dict[str, Any]:
    """Loads one dump file; any failure is a UsageError naming the file (and `source`, the flag
    or command that asked for it)."""
    if not path.is_file():
        raise UsageError(f"{source}: {path} does not exist; capture rollouts with --save-debug-rollout-data "
                         f"(with --debug-rollout-only to skip training)")
    try:
        payload = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # truncated zip, garbage bytes, a pickle of arbitrary objects, ...
        raise UsageError(f"{path}: not a readable rollout dump ({_load_failure(path, e)}); re-capture it with "
                         f"--save-debug-rollout-data") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("samples"), list):
        got = f"keys {_short(sorted(map(str, payload)))}" if isinstance(payload, dict) else type(payload).__name__
        raise UsageError(f"{path}: not a rollout dump (expected a dict with a 'samples' list; got {got})")
    _check_header(payload, path)
    if not payload["samples"]:
        raise UsageError(f"{path}: the dump holds no samples")
    return payload


def _check_header(payload: dict, path: Path) -> None:
    """`format` (absent in Miles/slime dumps), `metadata` and `rollout_id`."""
    fmt = payload.get("format")
    if "format" in payload and not (isinstance(fmt, str) and fmt == FORMAT):
        raise UsageError(f"{path}: 'format' is {_describe(fmt)}, not '{FORMAT}': not a rollout dump this miles "
                         f"reads; re-capture it with --save-debug-rollout-data")
    metadata = payload.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise UsageError(f"{path}: 'metadata' is {_describe(metadata)}, not a dict")
    rollout_id = payload.get("rollout_id")
    if rollout_id is not None and not _is_int(rollout_id):
        raise UsageError(f"{path}: 'rollout_id' is {_describe(rollout_id)}, not an int")


def samples_per_prompt(payload: dict[str, Any], path: Path) -> int:
    """The capture's --n-samples-per-prompt: from the dump's metadata (miles), else the size of the
    first run of equal `group_index` (slime), else 1."""
    n = (payload.get("metadata") or {}).get("n_samples_per_prompt")
    if n is not None:
        if not _is_int(n) or n < 1:
            raise UsageError(f"{path}: metadata 'n_samples_per_prompt' is {_describe(n)}, not a positive int")
        return n
    groups = [d.get("group_index") if isinstance(d, dict) else None for d in payload["samples"]]
    if not _is_int(groups[0]):
        return 1
    return sum(1 for _ in itertools.takewhile(lambda g: _is_int(g) and g == groups[0], groups))


def samples_from_dump(payload: dict[str, Any], path: Path, n_samples_per_prompt: int) -> list[Sample]:
    """The dump's samples, each field type-checked (a wrong type is a UsageError naming the file,
    the sample and the field). Values and consistency are `validate_samples`' job."""
    return [_to_sample(d, i, path, n_samples_per_prompt) for i, d in enumerate(payload["samples"])]


def _to_sample(d: Any, i: int, path: Path, n_samples_per_prompt: int) -> Sample:
    """A miles sample dict, or a Miles/slime `Sample.to_dict()`, as a miles `Sample`."""
    if not isinstance(d, dict):
        raise UsageError(f"{path}: sample {i} is {_describe(d)}, not a dict")
    f = _Fields({k: v.numpy() if k == ROUTES and isinstance(v, torch.Tensor) else _from_tensor(v)
                 for k, v in d.items()}, path, i)
    tokens = f.int_list("tokens")
    response_length = f.integer("response_length")
    if min(tokens, default=0) < 0:
        raise f.error("tokens", f"holds token id {min(tokens)}; token ids are >= 0")
    if not 0 < response_length <= len(tokens):
        raise f.error("response_length", f"is {response_length} but the sample has {len(tokens)} tokens; "
                                         f"it must be in 1..{len(tokens)}")
    loss_mask = f.numbers("loss_mask", "0/1 values", allow_bool=True)
    return Sample(
        group_index=f.integer("group_index", default=i // n_samples_per_prompt),
        index=f.integer("index", default=i),
        prompt=f.prompt(),
        tokens=tokens,
        response=f.text("response", default=""),
        response_length=response_length,
        label=f.d.get("label"),
        reward=f.reward(),
        loss_mask=[1] * response_length if loss_mask is None else loss_mask,
        rollout_log_probs=[float(x) for x in f.numbers("rollout_log_probs", "floats") or []],
        status=f.text("status", default=Status.COMPLETED),
        weight_version=_weight_version(d),
        metadata=f.mapping("metadata"),
        rollout_routed_experts=f.routes(ROUTES, len(tokens)),
    )


class _Fields:
    """Typed reads of one sample dict's fields; a wrong type is a UsageError naming the file, the
    sample and the field. None (slime's "not set") reads as the default where there is one."""

    def __init__(self, d: dict, path: Path, i: int):
        self.d, self.path, self.i = d, path, i

    def error(self, key: str, what: str) -> UsageError:
        return UsageError(f"{self.path}: sample {self.i}: '{key}' {what}")

    def _get(self, key: str, default: Any = None) -> Any:
        value = self.d.get(key)
        if value is None and default is None:
            raise self.error(key, "is missing; the sample cannot be trained on")
        return default if value is None else value

    def integer(self, key: str, default: int | None = None) -> int:
        value = self._get(key, default)
        if not _is_int(value):
            raise self.error(key, f"is {_describe(value)}, not an int")
        return value

    def text(self, key: str, default: str) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise self.error(key, f"is {_describe(value)}, not a string")
        return value

    def mapping(self, key: str) -> dict:
        value = self._get(key, {})
        if not isinstance(value, dict):
            raise self.error(key, f"is {_describe(value)}, not a dict")
        return value

    def int_list(self, key: str) -> list[int]:
        values = self._list(self._get(key), key, "ints")
        for v in values:
            if not _is_int(v):
                raise self.error(key, f"holds {_describe(v)}; expected a list of ints")
        return values

    def numbers(self, key: str, kind: str, allow_bool: bool = False) -> list | None:
        """A list of ints/floats (and bools where `allow_bool`), or None when the field is unset."""
        if self.d.get(key) is None:
            return None
        values = self._list(self.d[key], key, kind)
        for v in values:
            if not (_is_number(v) or (allow_bool and isinstance(v, bool))):
                raise self.error(key, f"holds {_describe(v)}; expected a list of {kind}")
            if not _fits_float(v):
                raise self.error(key, f"holds {_describe(v)}, too large for a float")
        return values

    def _list(self, value: Any, key: str, kind: str) -> list:
        if not isinstance(value, (list, tuple)):
            raise self.error(key, f"is {_describe(value)}, not a list of {kind}")
        return list(value)

    def routes(self, key: str, n_tokens: int):
        """An MoE sample's routes, (tokens - 1, layers, k) expert ids, as a compact numpy array; None when unset.
        slime stores them as a numpy array or nested lists; a tensor is read too."""
        import numpy as np

        value = self.d.get(key)
        if value is None:
            return None
        try:
            routes = np.asarray(value)
        except (ValueError, TypeError):
            raise self.error(key, "is not an array of expert ids") from None
        if routes.ndim != 3 or routes.shape[0] not in (n_tokens - 1, n_tokens) or not np.issubdtype(routes.dtype,
                                                                                                     np.integer):
            raise self.error(key, f"has shape {routes.shape} of {routes.dtype}; expected integer expert ids of shape "
                                  f"(tokens - 1 = {n_tokens - 1}, layers, k)")
        if routes.size and (routes.min() < -1 or routes.max() > np.iinfo(np.int16).max):
            raise self.error(key, f"holds expert id {routes.min() if routes.min() < -1 else routes.max()}")
        return routes.astype(np.int16)

    def prompt(self) -> str | list[dict]:
        value = self._get("prompt", "")
        if isinstance(value, str) or (isinstance(value, list) and all(_is_message(m) for m in value)):
            return value
        raise self.error("prompt", f"is {_describe(value)}; expected text or a list of chat messages "
                                   f"({{\"role\": str, \"content\": ...}})")

    def reward(self) -> float:
        reward = self._get("reward")
        if isinstance(reward, dict):  # slime stores a dict when the reward model returns several keys
            numbers = [v for v in reward.values() if _is_number(v)]
            if len(numbers) != 1:
                raise self.error("reward", f"is a dict with keys {_short(sorted(map(str, reward)))}; "
                                           f"miles needs one number")
            reward = numbers[0]
        if not _is_number(reward):
            raise self.error("reward", f"is {_describe(reward)}, not a number")
        if not _fits_float(reward):
            raise self.error("reward", f"is {_describe(reward)}, too large for a float")
        return float(reward)


def _weight_version(d: dict) -> int | None:
    """miles' `weight_version`; slime's `weight_versions` lists one per turn: the first made the response."""
    if _is_int(d.get("weight_version")):
        return d["weight_version"]
    versions = d.get("weight_versions")
    if isinstance(versions, list) and versions:
        try:
            return int(versions[0])
        except (TypeError, ValueError, OverflowError):
            return None
    return None


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str)


def _from_tensor(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fits_float(value: int | float) -> bool:
    try:
        float(value)
    except OverflowError:  # a Python int beyond 1e308
        return False
    return True


def _finite32(x: float) -> bool:
    return math.isfinite(x) and abs(x) <= FLOAT32_MAX


def _describe(value: Any) -> str:
    return f"{_short(value)} ({type(value).__name__})"


def _short(value: Any) -> str:
    """A bounded repr of `value`, on one line (a tensor's repr spans several)."""
    return re.sub(r"\s*\n\s*", " ", _SHORT.repr(value))


# ---------------------------------------------------------------- values and consistency


def validate_samples(samples: list[Sample], path: Path, n_samples_per_prompt: int, *,
                     vocab_size: int | None = None) -> list[str]:
    """What makes the samples unfit to train on, one line per problem naming the file, the sample and
    the field; [] when nothing does. Token ids are checked against `vocab_size` when it is given."""
    problems = [f"{path}: sample {i}: {p}" for i, s in enumerate(samples) for p in _sample_problems(s, vocab_size)]
    return problems + _log_prob_presence(samples, path) + _group_problems(samples, path, n_samples_per_prompt)


def _sample_problems(s: Sample, vocab_size: int | None) -> list[str]:
    out, r = [], s.response_length
    top = max(s.tokens)
    if vocab_size is not None and top >= vocab_size:
        out.append(f"token id {top} is outside the model's vocabulary ({vocab_size} tokens); the dump was made "
                   f"with another model: replay it with the --hf-checkpoint that captured it")
    if len(s.loss_mask) != r:
        out.append(f"'loss_mask' has {_values(len(s.loss_mask))} but response_length is {r}")
    bad = next((m for m in s.loss_mask if m not in (0, 1)), None)
    if bad is not None:
        out.append(f"'loss_mask' holds {bad!r}; its values are 0 or 1")
    lp = s.rollout_log_probs
    if lp and len(lp) != r:
        out.append(f"'rollout_log_probs' has {_values(len(lp))} but response_length is {r}")
    bad = next((x for x in lp if not (_finite32(x) and x <= LOG_PROB_SLACK)), None)
    if bad is not None:
        out.append(f"'rollout_log_probs' holds {bad!r}; log-probs are finite (in float32) and <= 0")
    if not _finite32(s.reward):
        out.append(f"'reward' is {s.reward!r}; rewards are finite numbers (in float32)")
    if s.status not in STATUSES:
        out.append(f"'status' is {_short(s.status)}; expected one of {', '.join(STATUSES)}")
    return out


def _values(n: int) -> str:
    return f"{n} value{'' if n == 1 else 's'}"


def _log_prob_presence(samples: list[Sample], path: Path) -> list[str]:
    """Engine log-probs on every sample or on none: the trainer drops them for the whole batch if
    one sample lacks them. Names the first sample of the minority."""
    having = [i for i, s in enumerate(samples) if s.rollout_log_probs]
    if not having or len(having) == len(samples):
        return []
    rule = "every sample needs them or none does (one without them drops them for the whole batch)"
    if 2 * len(having) >= len(samples):
        i = next(i for i, s in enumerate(samples) if not s.rollout_log_probs)
        return [f"{path}: sample {i}: 'rollout_log_probs' is empty but {len(having)} of {len(samples)} samples "
                f"have engine log-probs; {rule}"]
    return [f"{path}: sample {having[0]}: 'rollout_log_probs' has values but {len(samples) - len(having)} of "
            f"{len(samples)} samples have none; {rule}"]


def _group_problems(samples: list[Sample], path: Path, n: int) -> list[str]:
    """GRPO normalises rewards over rows [g*n, (g+1)*n): each such block must be one group (one
    group_index) and no group may reappear in another block. Reports the first break only."""
    if len(samples) % n:
        return [f"{path}: {len(samples)} samples are not whole groups of {n} samples per prompt"]
    seen: dict[int, int] = {}  # group_index -> its block's first row
    for start in range(0, len(samples), n):
        group = samples[start].group_index
        for i in range(start + 1, start + n):
            if samples[i].group_index != group:
                return [f"{path}: sample {i}: 'group_index' is {samples[i].group_index} but sample {start}, in the "
                        f"same group of rows {start}..{start + n - 1} ({n} samples per prompt), has {group}; "
                        f"a group's samples must be contiguous rows"]
        if group in seen:
            return [f"{path}: sample {start}: 'group_index' {group} is also the group of rows {seen[group]}.."
                    f"{seen[group] + n - 1}; a group's samples must be contiguous rows"]
        seen[group] = start
    return []


def check_fits(samples: list[Sample], path: Path, *, vocab_size: int, expected: int, n_samples_per_prompt: int,
               needs_log_probs: bool) -> None:
    """The dump must fit the batch flags (sample count, groups), the model (token ids) and be free of
    any `validate_samples` problem: a UsageError on the first, saying how many more there are."""
    if len(samples) != expected:
        raise UsageError(f"{path} holds {len(samples)} samples but --rollout-batch-size x --n-samples-per-prompt is "
                         f"{expected}; set them to the capture's values")
    problems = validate_samples(samples, path, n_samples_per_prompt, vocab_size=vocab_size)
    if problems:
        more = (f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''}; "
                f"`miles inspect-rollout {path}` lists them)") if len(problems) > 1 else ""
        raise UsageError(problems[0] + more)
    if needs_log_probs and not samples[0].rollout_log_probs:
        raise UsageError(f"{path}: samples have no engine log-probs (rollout_log_probs), which --use-tis and "
                         f"--use-rollout-logprobs need; drop the flag or re-capture with miles")
