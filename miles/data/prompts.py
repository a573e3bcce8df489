"""Prompt data: loading `--prompt-data`, rendering prompts, and walking the data across epochs.

Everything here runs before torch is imported, so bad flags and bad files fail in a second
with one `error:` line (see `miles.errors.UsageError`) instead of after a model has loaded.
Hence no torch/transformers imports at module level; pyarrow is imported only for parquet.

The loader is deliberately strict about the one mistake that does not crash anything: a
mistyped `--label-key` gives every prompt a None label, every reward is 0, and the run
"trains" on nothing. A label key absent from every row is therefore an error; absent from
some rows only is reported to the caller through `PromptData.missing_labels`.

Every row is checked as it is loaded, each bad one a UsageError naming the file and the line (or
row, or item): prompts must be non-empty text or chat messages, at most MAX_PROMPT_CHARS long (so a
pasted document fails here, not in the tokenizer), and valid Unicode (no lone surrogates, which a
JSON "\\ud800" escape produces and tokenizers crash on); with `scalar_labels` (the built-in rewards,
which compare one answer) a label must not be a list or a dict. A .jsonl file is read line by
line, so a file with one huge line is never held twice.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import random
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.errors import UsageError

# The demo task shipped inside the package (see tasks/README.md), so a first run needs no data.
BUNDLED_TASK = Path(__file__).resolve().parent / "tasks" / "arithmetic.jsonl"
BUNDLED_EVAL = Path(__file__).resolve().parent / "tasks" / "arithmetic_eval.jsonl"  # held out from BUNDLED_TASK
BUNDLED_EVAL_NAME = "arith_held_out"
BUNDLED_INPUT_KEY = "prompt"
BUNDLED_LABEL_KEY = "label"

_SUPPORTED = (".jsonl", ".json", ".parquet")

# A prompt longer than this is a broken row (a document pasted into the field, a bad join), not a
# prompt: a million characters is ~250k tokens at ~4 characters a token, far beyond the contexts RL
# post-training runs with. Caught by its length alone, before the tokenizer spends minutes on it.
MAX_PROMPT_CHARS = 1_000_000

_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON "\ud800" escapes decode to these; they are not text
_SHORT = reprlib.Repr()  # bounded repr for error lines: long or deeply nested values are cut
_SHORT.maxstring = _SHORT.maxother = 80


@dataclass
class PromptRecord:
    prompt: str | list[dict]  # plain text, or OpenAI-style messages [{"role", "content"}]
    label: Any | None  # None when the row has no label (or no --label-key was given)
    metadata: dict = field(default_factory=dict)  # the row's other keys, passed through untouched


@dataclass
class PromptData:
    records: list[PromptRecord]
    path: str
    missing_labels: int  # rows without the label key (0 when label_key is None)
    keys: list[str]  # every key seen in any row, in first-seen order

    def __len__(self) -> int:
        return len(self.records)


def _keys_text(keys) -> str:
    return ", ".join(k if k.isprintable() else repr(k) for k in keys) if keys else "(none)"


def _did_you_mean(key: str, keys) -> str:
    close = difflib.get_close_matches(key, list(keys), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _read_rows(path: Path) -> list[tuple[str, Any]]:
    """Return (location, row) pairs; location is how an error message points at the row."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path)
    if suffix == ".json":
        return _read_json(path)
    return _read_jsonl(path)


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq  # lazy: only parquet users pay for the import
    except ImportError as e:  # pragma: no cover - pyarrow is a dependency
        raise UsageError(f"--prompt-data {path}: reading parquet needs pyarrow ({e}); pip install pyarrow") from e
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise UsageError(f"--prompt-data {path}: {_parquet_problem(pq, path, e)}") from e
    try:
        names = table.column_names
    except UnicodeDecodeError as e:  # a corrupt footer: pyarrow reads the file, but not the names
        raise UsageError(f"--prompt-data {path}: a column name is not UTF-8 ({_reason(e)}); the file is corrupt") from e
    columns = {name: _column_values(column, name, path) for name, column in zip(names, table.columns)}
    rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
    return [(f"{path} row {i}", r) for i, r in enumerate(rows, 1)]


def _parquet_problem(pq, path: Path, e: Exception) -> str:
    """Why pyarrow could not read the file: a column name used twice (pandas and pyarrow can write
    that, but not read it back), or a corrupt file."""
    try:
        names = pq.read_schema(path).names
    except Exception:
        names = []
    twice = [n for n in dict.fromkeys(names) if names.count(n) > 1]
    if twice:
        return f"column {twice[0]!r} appears {names.count(twice[0])} times; give each column its own name"
    return f"not a readable parquet file ({_reason(e)})"


def _column_values(column, name: str, path: Path) -> list:
    """A parquet column as Python values. Timestamps, times and durations that Python's datetime
    cannot hold (nanoseconds, as pandas writes them; years past 9999) come as pyarrow's strings."""
    import pyarrow as pa

    try:
        return column.to_pylist()
    except Exception as e:  # pyarrow raises ValueError, OverflowError, ArrowException, ...
        reason = _reason(e)
    if pa.types.is_temporal(column.type):
        try:
            return column.cast(pa.string()).to_pylist()
        except Exception as e:
            reason = _reason(e)
    raise UsageError(f"--prompt-data {path}: column {name!r} ({column.type}) cannot be read into Python ({reason})")


def _read_json(path: Path) -> list[tuple[str, Any]]:
    text = _read_text(path)
    try:
        data = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as e:
        hint = ""
        first = text.strip().splitlines()[0] if text.strip() else ""
        try:  # a common slip: JSON Lines saved with a .json name
            json.loads(first)
            hint = "; it looks like one object per line, so rename it to .jsonl"
        except (ValueError, RecursionError):
            pass
        raise UsageError(f"{path} line {e.lineno}: invalid JSON ({e.msg}){hint}") from e
    except (ValueError, RecursionError) as e:
        raise UsageError(f"{path}: invalid JSON ({_json_reason(e)})") from e
    if not isinstance(data, list):
        raise UsageError(
            f"--prompt-data {path}: a .json file must hold a list of objects, got {type(data).__name__}; "
            "use a list, or .jsonl with one object per line"
        )
    return [(f"{path} item {i}", r) for i, r in enumerate(data, 1)]


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    """Line by line: a file of one 50 MB line holds that line and its parsed row, not the file twice."""
    rows = []
    try:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.isspace():  # blank lines (often a trailing newline or two) are harmless
                    continue
                try:
                    rows.append((f"{path} line {n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise UsageError(f"{path} line {n}: invalid JSON ({e.msg} at column {e.colno})") from e
                except (ValueError, RecursionError) as e:
                    raise UsageError(f"{path} line {n}: invalid JSON ({_json_reason(e)})") from e
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from e
    return rows


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from e


def _not_utf8(path: Path, e: UnicodeDecodeError) -> UsageError:
    return UsageError(f"--prompt-data {path}: not UTF-8 text ({e}); save the file as UTF-8")


def _json_reason(e: Exception) -> str:
    """What json.loads raised besides a syntax error: too deep a nesting, or too long an integer."""
    return "nested too deeply" if isinstance(e, RecursionError) else _reason(e).split(";")[0]


def _reason(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _check_prompt(value: Any, where: str, input_key: str) -> None:
    """Text or chat messages, not empty, at most MAX_PROMPT_CHARS, valid Unicode."""
    _check_prompt_type(value, where, input_key)
    texts = [value] if isinstance(value, str) else [m["content"] for m in value]
    size = sum(map(len, texts))
    if size > MAX_PROMPT_CHARS:
        raise UsageError(f"{where}: --input-key '{input_key}' is {size:,} characters long, more than "
                         f"MAX_PROMPT_CHARS ({MAX_PROMPT_CHARS:,}), far beyond any model's context; shorten or "
                         "drop the row")
    if all(not t or t.isspace() for t in texts):
        raise UsageError(f"{where}: --input-key '{input_key}' is empty{' (every message)' if len(texts) > 1 else ''}; "
                         "give every row a prompt, or drop the row")
    strings = [value] if isinstance(value, str) else [v for m in value for v in m.values() if isinstance(v, str)]
    _check_unicode(strings, where, f"--input-key '{input_key}'")


def _check_prompt_type(value: Any, where: str, input_key: str) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list) and value:
        for m in value:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise UsageError(
                    f"{where}: --input-key '{input_key}' is a list, but not of chat messages "
                    f"{{\"role\": str, \"content\": str}} (bad item: {_SHORT.repr(m)}); use text or such messages"
                )
        return
    raise UsageError(
        f"{where}: --input-key '{input_key}' must be a string or a non-empty list of "
        f"{{\"role\", \"content\"}} messages, got {type(value).__name__} ({_SHORT.repr(value)})"
    )


def _check_label(label: Any, where: str, label_key: str, scalar_labels: bool) -> None:
    if scalar_labels and isinstance(label, (list, tuple, dict, set)):
        raise UsageError(
            f"{where}: --label-key '{label_key}' is a {type(label).__name__} ({_SHORT.repr(label)}), but the "
            "built-in --rm-type rewards compare one answer: give a string or a number, or score such labels "
            "with --custom-rm-path")
    _check_unicode(_strings_in(label), where, f"--label-key '{label_key}'")


def _strings_in(value: Any) -> list[str]:
    """Every string in a JSON-like value, keys included; a walk with a stack, not recursion."""
    found, stack = [], [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            found.append(v)
        elif isinstance(v, dict):
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, (list, tuple, set)):
            stack += v
    return found


def _check_unicode(strings: list[str], where: str, what: str) -> None:
    for text in strings:
        bad = _SURROGATE.search(text)
        if bad:
            raise UsageError(
                f"{where}: {what} holds a lone surrogate (U+{ord(bad.group()):04X}, at character {bad.start()}), "
                "which is not valid Unicode (a broken \\u escape?) and would crash the tokenizer; fix or drop the row")


def load_prompt_data(path: str, input_key: str, label_key: str | None, *, scalar_labels: bool = False) -> PromptData:
    """Load and validate `--prompt-data` (.jsonl, .json list, or .parquet).

    `scalar_labels`: refuse list and dict labels (the built-in rewards compare one answer); without
    it (a --custom-rm-path) labels pass through untouched.
    """
    p = Path(path)
    if not p.exists():
        raise UsageError(f"--prompt-data: no such file: {path}")
    if not p.is_file():
        raise UsageError(f"--prompt-data: not a file: {path}; give a .jsonl, .json or .parquet file")
    if p.suffix.lower() not in _SUPPORTED:
        raise UsageError(
            f"--prompt-data {path}: unsupported extension '{p.suffix or '(none)'}'; use .jsonl, .json or .parquet"
        )

    rows = _read_rows(p)
    if not rows:
        raise UsageError(f"--prompt-data {path}: no rows (the file is empty); give a file with at least one prompt")

    keys: dict[str, None] = {}  # ordered set
    records = [_record(where, row, input_key, label_key, scalar_labels, keys) for where, row in rows]
    missing = sum(r.label is None for r in records) if label_key is not None else 0
    if label_key is not None and missing == len(records):
        # Every reward would be computed against None: fail now, not after hours of flat reward.
        raise UsageError(
            f"--label-key '{label_key}' not found in any row of {path}; keys present: {_keys_text(keys)}"
            f"{_did_you_mean(label_key, keys)}"
        )
    return PromptData(records=records, path=str(path), missing_labels=missing, keys=list(keys))


def _record(where: str, row: Any, input_key: str, label_key: str | None, scalar_labels: bool,
            keys: dict[str, None]) -> PromptRecord:
    """One checked row; adds its keys to `keys`."""
    if not isinstance(row, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(row).__name__}")
    keys.update(dict.fromkeys(row))
    if input_key not in row:
        raise UsageError(
            f"--input-key '{input_key}' not found in {where}; keys present: {_keys_text(row)}"
            f"{_did_you_mean(input_key, row)}"
        )
    _check_prompt(row[input_key], where, input_key)
    label = None
    if label_key is not None:
        label = row.get(label_key)  # parquet gives null (None) where a column has no value
        _check_label(label, where, label_key, scalar_labels)
    meta = {k: v for k, v in row.items() if k != input_key and k != label_key}
    return PromptRecord(prompt=row[input_key], label=label, metadata=meta)


def render_prompt(prompt: str | list[dict], tokenizer: Any, apply_chat_template: bool) -> str:
    """Turn a record's prompt into the text the model sees."""
    if apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError(
                "--apply-chat-template: the model's tokenizer has no chat template; "
                "drop --apply-chat-template or use an instruct/chat model"
            )
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if isinstance(prompt, str):
        return prompt
    raise UsageError("prompt data holds chat messages (a list), not text; pass --apply-chat-template to render them")


class PromptDataset:
    """Endless walk over the records, epoch after epoch, as a pure function of the rollout id.

    Rollout i takes records [i * n, (i + 1) * n) of the endless sequence epoch 0, epoch 1, ...,
    where the order of an epoch is a pure function of (seed, epoch). So no position needs to be
    carried from one rollout to the next: a resumed run, or a worker that makes rollout i + 1
    ahead of time, draws exactly the prompts an uninterrupted run would have drawn.
    """

    def __init__(self, records: list[PromptRecord], *, shuffle: bool, seed: int):
        if not records:
            raise ValueError("PromptDataset needs at least one record")
        self.records = list(records)
        self.shuffle = shuffle
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.records)

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.records)))
            if self.shuffle:
                # String seeds hash deterministically (unlike tuples), and differ per epoch.
                random.Random(f"miles-prompts:{self.seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # rollouts go forward: keep only the latest epoch's order
        return self._orders[epoch]

    def batch_for(self, rollout_id: int, n: int) -> list[PromptRecord]:
        if n <= 0 or rollout_id < 0:
            raise ValueError(f"batch_for needs rollout_id >= 0 and n > 0, got {rollout_id}, {n}")
        batch = []
        for position in range(rollout_id * n, (rollout_id + 1) * n):
            epoch, offset = divmod(position, len(self.records))
            batch.append(self.records[self._epoch_order(epoch)[offset]])
        return batch

    def fingerprint(self) -> dict:
        """What a checkpoint records of the data, so a resume can tell it was given other prompts."""
        h = hashlib.sha256()
        for r in self.records:
            h.update(json.dumps([r.prompt, r.label], sort_keys=True, default=str).encode())
        return {"rows": len(self.records), "sha256": h.hexdigest()[:16], "shuffle": self.shuffle, "seed": self.seed}

    def check_fingerprint(self, saved: dict) -> None:
        """A UsageError when the checkpoint was trained on other prompt data (or another order)."""
        now = self.fingerprint()
        if saved != now:
            raise UsageError(
                f"the checkpoint was trained on other prompt data ({_describe(saved)}; now {_describe(now)}): "
                "rollout i of a resumed run would not be rollout i of the run; resume with the --prompt-data, "
                "--rollout-shuffle and --seed the run started with")


def _describe(fp: dict) -> str:
    return (f"{fp.get('rows')} rows, digest {fp.get('sha256')}, shuffle {'on' if fp.get('shuffle') else 'off'}, "
            f"seed {fp.get('seed')}")
