"""Prompt data: loading `--prompt-data`, rendering prompts, and walking the data across epochs.

Everything here runs before torch is imported, so bad flags and bad files fail in a second
with one `error:` line (see `miles.errors.UsageError`) instead of after a model has loaded.
Hence no torch/transformers imports at module level; pyarrow is imported only for parquet.

The loader is deliberately strict about the one mistake that does not crash anything: a
mistyped `--label-key` gives every prompt a None label, every reward is 0, and the run
"trains" on nothing. A label key absent from every row is therefore an error; absent from
some rows only is reported to the caller through `PromptData.missing_labels`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.errors import UsageError

# The demo task shipped inside the package (see tasks/README.md), so a first run needs no data.
BUNDLED_TASK = Path(__file__).resolve().parent / "tasks" / "arithmetic.jsonl"
BUNDLED_INPUT_KEY = "prompt"
BUNDLED_LABEL_KEY = "label"

_SUPPORTED = (".jsonl", ".json", ".parquet")


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
    return ", ".join(keys) if keys else "(none)"


def _did_you_mean(key: str, keys) -> str:
    close = difflib.get_close_matches(key, list(keys), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _read_rows(path: Path) -> list[tuple[str, Any]]:
    """Return (location, row) pairs; location is how an error message points at the row."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # lazy: only parquet users pay for the import
        except ImportError as e:  # pragma: no cover - pyarrow is a dependency
            raise UsageError(f"--prompt-data {path}: reading parquet needs pyarrow ({e}); pip install pyarrow") from e
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise UsageError(f"--prompt-data {path}: not a readable parquet file ({e})") from e
        return [(f"{path} row {i}", r) for i, r in enumerate(rows, 1)]

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--prompt-data {path}: not UTF-8 text ({e}); save the file as UTF-8") from e

    if suffix == ".json":
        try:
            data = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as e:
            hint = ""
            first = text.strip().splitlines()[0] if text.strip() else ""
            try:  # a common slip: JSON Lines saved with a .json name
                json.loads(first)
                hint = "; it looks like one object per line, so rename it to .jsonl"
            except json.JSONDecodeError:
                pass
            raise UsageError(f"{path} line {e.lineno}: invalid JSON ({e.msg}){hint}") from e
        if not isinstance(data, list):
            raise UsageError(
                f"--prompt-data {path}: a .json file must hold a list of objects, got {type(data).__name__}; "
                "use a list, or .jsonl with one object per line"
            )
        return [(f"{path} item {i}", r) for i, r in enumerate(data, 1)]

    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue  # blank lines (often a trailing newline or two) are harmless
        try:
            rows.append((f"{path} line {n}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} line {n}: invalid JSON ({e.msg} at column {e.colno})") from e
    return rows


def _check_prompt(value: Any, where: str, input_key: str) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list) and value:
        for m in value:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise UsageError(
                    f"{where}: --input-key '{input_key}' is a list, but not of chat messages "
                    f"{{\"role\": str, \"content\": str}} (bad item: {str(m)[:80]}); use text or such messages"
                )
        return
    raise UsageError(
        f"{where}: --input-key '{input_key}' must be a string or a non-empty list of "
        f"{{\"role\", \"content\"}} messages, got {type(value).__name__} ({str(value)[:80]})"
    )


def load_prompt_data(path: str, input_key: str, label_key: str | None) -> PromptData:
    """Load and validate `--prompt-data` (.jsonl, .json list, or .parquet)."""
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
    records: list[PromptRecord] = []
    missing = 0
    for where, row in rows:
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
            missing += label is None
        meta = {k: v for k, v in row.items() if k != input_key and k != label_key}
        records.append(PromptRecord(prompt=row[input_key], label=label, metadata=meta))

    if label_key is not None and missing == len(records):
        # Every reward would be computed against None: fail now, not after hours of flat reward.
        raise UsageError(
            f"--label-key '{label_key}' not found in any row of {path}; keys present: {_keys_text(keys)}"
            f"{_did_you_mean(label_key, keys)}"
        )
    return PromptData(records=records, path=str(path), missing_labels=missing, keys=list(keys))


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
