"""Tests for miles.data.prompts: loading/validating --prompt-data, rendering, and the dataset walk."""

import datetime
import json
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from miles.data.prompts import (
    BUNDLED_INPUT_KEY,
    BUNDLED_LABEL_KEY,
    BUNDLED_EVAL,
    BUNDLED_TASK,
    MAX_PROMPT_CHARS,
    PromptData,
    PromptDataset,
    PromptRecord,
    load_prompt_data,
    render_prompt,
)
from miles.errors import UsageError

GSM8K = Path("/work/shared/data/gsm8k/train.jsonl")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load_err(path, input_key="prompt", label_key=None, **kwargs) -> str:
    with pytest.raises(UsageError) as ei:
        load_prompt_data(str(path), input_key, label_key, **kwargs)
    msg = str(ei.value)
    assert "\n" not in msg  # one `error:` line for the user
    return msg


# ---------------------------------------------------------------- loading


def test_jsonl_basic(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": 1, "id": 7}, {"prompt": "b", "label": 2, "id": 8}])
    data = load_prompt_data(p, "prompt", "label")
    assert isinstance(data, PromptData)
    assert len(data) == 2 and data.path == p and data.missing_labels == 0
    assert data.keys == ["prompt", "label", "id"]
    assert data.records[0] == PromptRecord(prompt="a", label=1, metadata={"id": 7})


def test_jsonl_blank_lines_skipped(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('\n{"prompt": "a"}\n\n   \n{"prompt": "b"}\n\n')
    data = load_prompt_data(str(p), "prompt", None)
    assert [r.prompt for r in data.records] == ["a", "b"]
    assert all(r.label is None for r in data.records) and data.missing_labels == 0


def test_no_label_key_keeps_label_in_metadata(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": "x"}])
    rec = load_prompt_data(p, "prompt", None).records[0]
    assert rec.label is None and rec.metadata == {"label": "x"}


def test_json_list(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([{"q": "a", "y": "1"}, {"q": "b", "y": "2"}]))
    data = load_prompt_data(str(p), "q", "y")
    assert [(r.prompt, r.label) for r in data.records] == [("a", "1"), ("b", "2")]


def test_json_not_a_list(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps({"q": "a"}))
    msg = load_err(p, "q")
    assert "--prompt-data" in msg and str(p) in msg and "list" in msg


def test_json_that_is_really_jsonl(tmp_path):
    p = tmp_path / "d.json"
    p.write_text('{"q": "a"}\n{"q": "b"}\n')
    msg = load_err(p, "q")
    assert f"{p} line 2: invalid JSON" in msg and ".jsonl" in msg


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "d.parquet"
    table = pa.table(
        {
            "question": ["1+1?", "2+2?", "3+3?"],
            "answer": ["2", None, "6"],
            "src": ["x", "y", "z"],
        }
    )
    pq.write_table(table, p)
    data = load_prompt_data(str(p), "question", "answer")
    assert [r.prompt for r in data.records] == ["1+1?", "2+2?", "3+3?"]
    assert [r.label for r in data.records] == ["2", None, "6"]
    assert data.missing_labels == 1
    assert data.records[0].metadata == {"src": "x"}
    assert data.keys == ["question", "answer", "src"]


def test_parquet_messages(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "d.parquet"
    msgs = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]]
    pq.write_table(pa.table({"messages": msgs, "label": ["x"]}), p)
    data = load_prompt_data(str(p), "messages", "label")
    assert data.records[0].prompt == msgs[0]


def test_parquet_missing_input_key(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["a"], "answer": ["b"]}), p)
    msg = load_err(p, "prompt")
    assert msg == f"--input-key 'prompt' not found in {p} row 1; keys present: question, answer"


def test_corrupt_parquet(tmp_path):
    p = tmp_path / "d.parquet"
    p.write_bytes(b"this is not parquet")
    msg = load_err(p)
    assert "--prompt-data" in msg and str(p) in msg and "parquet" in msg


def test_parquet_with_a_column_name_twice(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["prompt", "prompt"]), p)
    assert load_err(p) == f"--prompt-data {p}: column 'prompt' appears 2 times; give each column its own name"


def test_parquet_with_a_column_name_not_utf8(tmp_path):
    """Found by tests/test_fuzz.py: one flipped bit in the footer, and pyarrow reads a table whose
    column_names raises UnicodeDecodeError."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "zzzzzz": ["b"]}), p, store_schema=False)
    p.write_bytes(p.read_bytes().replace(b"zzzzzz", b"\xc0zzzzz"))
    assert load_err(p).startswith(f"--prompt-data {p}: a column name is not UTF-8 (")


def test_messages_input(tmp_path):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    p = write_jsonl(tmp_path / "d.jsonl", [{"messages": msgs, "label": "1"}])
    assert load_prompt_data(p, "messages", "label").records[0].prompt == msgs


def test_missing_labels_counted(tmp_path):
    rows = [{"prompt": "a", "label": "1"}, {"prompt": "b"}, {"prompt": "c", "label": None}, {"prompt": "d", "label": 0}]
    data = load_prompt_data(write_jsonl(tmp_path / "d.jsonl", rows), "prompt", "label")
    assert data.missing_labels == 2
    assert [r.label for r in data.records] == ["1", None, None, 0]


# ---------------------------------------------------------------- load errors


def test_missing_file(tmp_path):
    p = tmp_path / "nope.jsonl"
    assert load_err(p) == f"--prompt-data: no such file: {p}"


def test_directory(tmp_path):
    msg = load_err(tmp_path)
    assert "--prompt-data" in msg and "not a file" in msg


def test_unsupported_extension(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("prompt,label\na,1\n")
    msg = load_err(p)
    assert "--prompt-data" in msg and "'.csv'" in msg and ".jsonl" in msg and ".parquet" in msg


def test_invalid_json_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"prompt": "b",}\n')
    msg = load_err(p)
    assert msg.startswith(f"{p} line 3: invalid JSON (")


def test_non_object_row(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a"}\n["prompt", "b"]\n')
    msg = load_err(p)
    assert msg.startswith(f"{p} line 2:") and "object" in msg and "list" in msg


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_jsonl(tmp_path, content):
    p = tmp_path / "d.jsonl"
    p.write_text(content)
    msg = load_err(p)
    assert "--prompt-data" in msg and str(p) in msg and "no rows" in msg


def test_empty_json_list(tmp_path):
    p = tmp_path / "d.json"
    p.write_text("[]")
    assert "no rows" in load_err(p)


def test_not_utf8(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"prompt": "\xff\xfe"}\n')
    msg = load_err(p)
    assert "--prompt-data" in msg and "UTF-8" in msg


def test_input_key_missing_names_line_flag_and_keys(tmp_path):
    p = tmp_path / "d.jsonl"
    write_jsonl(p, [{"question": "q", "answer": "a"}])
    assert load_err(p, "prompt") == f"--input-key 'prompt' not found in {p} line 1; keys present: question, answer"


def test_input_key_missing_later_row_and_suggestion(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"question": "q"}\n\n{"questoin": "q"}\n')
    msg = load_err(p, "question")
    assert f"not found in {p} line 3" in msg and "keys present: questoin" in msg and "did you mean" in msg


def test_input_key_missing_json_item(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([{"q": "a"}, {"x": "b"}]))
    msg = load_err(p, "q")
    assert f"not found in {p} item 2" in msg and "keys present: x" in msg


@pytest.mark.parametrize(
    "value, kind",
    [
        (5, "int"),
        (None, "NoneType"),
        ({"role": "user", "content": "x"}, "dict"),
        ([], "list"),
    ],
)
def test_input_value_bad_type(tmp_path, value, kind):
    p = tmp_path / "d.jsonl"
    write_jsonl(p, [{"prompt": "ok"}, {"prompt": value}])
    msg = load_err(p)
    assert msg.startswith(f"{p} line 2:") and "--input-key 'prompt'" in msg and kind in msg


@pytest.mark.parametrize("bad", [["just", "strings"], [{"role": "user"}], [{"content": "x"}],
                                 [{"role": "user", "content": 3}]])
def test_input_value_bad_messages(tmp_path, bad):
    p = tmp_path / "d.jsonl"
    write_jsonl(p, [{"prompt": bad}])
    msg = load_err(p)
    assert msg.startswith(f"{p} line 1:") and "--input-key 'prompt'" in msg and "role" in msg and "content" in msg


def test_label_key_absent_everywhere(tmp_path):
    p = tmp_path / "d.jsonl"
    write_jsonl(p, [{"question": "q1", "answer": "1"}, {"question": "q2", "answer": "2", "extra": 0}])
    msg = load_err(p, "question", "anwser")
    assert msg.startswith(f"--label-key 'anwser' not found in any row of {p}; keys present: question, answer, extra")
    assert "did you mean 'answer'" in msg


def test_label_key_null_everywhere(tmp_path):
    p = tmp_path / "d.jsonl"
    write_jsonl(p, [{"prompt": "q1", "label": None}, {"prompt": "q2", "label": None}])
    assert "--label-key 'label'" in load_err(p, "prompt", "label")


# ---------------------------------------------------------------- hostile rows


@pytest.mark.parametrize("prompt", ["", "   ", " \n\t ", [{"role": "user", "content": ""}],
                                    [{"role": "system", "content": " "}, {"role": "user", "content": "\n"}]])
def test_empty_prompt(tmp_path, prompt):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"prompt": prompt}])
    msg = load_err(p)
    assert msg.startswith(f"{p} line 2: --input-key 'prompt' is empty") and "drop the row" in msg


def test_prompt_with_one_non_empty_message(tmp_path):
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": msgs}])
    assert load_prompt_data(p, "prompt", None).records[0].prompt == msgs


def test_prompt_of_max_length_is_accepted(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * MAX_PROMPT_CHARS}])
    assert len(load_prompt_data(p, "prompt", None).records[0].prompt) == MAX_PROMPT_CHARS


@pytest.mark.parametrize("chat", [False, True])
def test_huge_prompt_names_its_line_and_length(tmp_path, chat):
    half = MAX_PROMPT_CHARS // 2 + 1  # two messages of half the limit each: over it together
    prompt = [{"role": "user", "content": "x" * half}] * 2 if chat else "x" * (2 * half)
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"prompt": "ok"}, {"prompt": prompt}])
    assert load_err(p) == (f"{p} line 3: --input-key 'prompt' is {2 * half:,} characters long, more than "
                           f"MAX_PROMPT_CHARS ({MAX_PROMPT_CHARS:,}), far beyond any model's context; shorten or "
                           "drop the row")


def test_one_50mb_line_is_not_held_twice(tmp_path):
    """The file is read line by line: at its peak the loader holds the one huge line and its parsed
    row (2x), where reading the whole text and splitting it held three copies."""
    p = tmp_path / "d.jsonl"
    with p.open("w") as f:
        f.write('{"prompt": "short"}\n')
        f.write('{"prompt": "' + "y" * 50_000_000 + '"}\n')
    size = p.stat().st_size
    tracemalloc.start()
    try:
        msg = load_err(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert msg.startswith(f"{p} line 2: --input-key 'prompt' is 50,000,000 characters long")
    assert peak < 2.5 * size, peak / size


@pytest.mark.parametrize("escaped, where", [
    ('{"prompt": "2 + 2 = \\ud800?"}', "--input-key 'prompt' holds a lone surrogate (U+D800, at character 8)"),
    ('{"prompt": [{"role": "user", "content": "\\udfff"}]}', "--input-key 'prompt' holds a lone surrogate (U+DFFF"),
    ('{"prompt": "hi", "label": "\\udc80"}', "--label-key 'label' holds a lone surrogate (U+DC80"),
    ('{"prompt": "hi", "label": {"answers": ["4", "\\ud83d"]}}', "--label-key 'label' holds a lone surrogate"),
])
def test_lone_surrogate(tmp_path, escaped, where):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "ok", "label": "1"}\n' + escaped + "\n")
    msg = load_err(p, "prompt", "label")
    assert msg.startswith(f"{p} line 2: {where}") and "crash the tokenizer" in msg


def test_surrogate_pair_is_one_character(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "smile \\ud83d\\ude00", "label": "\\ud83d\\ude00"}\n')  # an emoji, escaped
    rec = load_prompt_data(str(p), "prompt", "label").records[0]
    assert rec.prompt == "smile \U0001F600" and rec.label == "\U0001F600"


@pytest.mark.parametrize("label", [["4", "four"], {"answer": "4"}])
def test_structured_label_with_a_built_in_reward(tmp_path, label):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": "1"}, {"prompt": "b", "label": label}])
    msg = load_err(p, "prompt", "label", scalar_labels=True)
    assert msg.startswith(f"{p} line 2: --label-key 'label' is a {type(label).__name__} (")
    assert "built-in --rm-type rewards compare one answer" in msg and "--custom-rm-path" in msg


@pytest.mark.parametrize("label", [["4", "four"], {"answer": "4", "alts": [4, 4.0]}])
def test_structured_label_with_a_custom_reward_passes_through(tmp_path, label):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "b", "label": label}])
    got = load_prompt_data(p, "prompt", "label").records[0].label
    assert got == label and type(got) is type(label)  # a list stays a list, not its str()


def test_scalar_labels_accepts_scalars(tmp_path):
    rows = [{"prompt": "a", "label": "1"}, {"prompt": "b", "label": 2}, {"prompt": "c", "label": 2.5},
            {"prompt": "d", "label": True}, {"prompt": "e"}]
    data = load_prompt_data(write_jsonl(tmp_path / "d.jsonl", rows), "prompt", "label", scalar_labels=True)
    assert [r.label for r in data.records] == ["1", 2, 2.5, True, None]


def test_parquet_list_label_with_a_built_in_reward(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "label": [["1"], ["2", "two"]]}), p)
    assert load_err(p, "prompt", "label", scalar_labels=True).startswith(f"{p} row 1: --label-key 'label' is a list")
    assert load_prompt_data(str(p), "prompt", "label").records[1].label == ["2", "two"]


def test_parquet_nanosecond_timestamps(tmp_path):
    """pandas writes nanosecond timestamps, which Python's datetime cannot hold: they come as strings."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "at": pa.array([1], pa.timestamp("ns")),
                             "day": pa.array([datetime.datetime(2024, 1, 2)], pa.timestamp("ns"))}), p)
    assert load_prompt_data(str(p), "prompt", None).records[0].metadata == {
        "at": "1970-01-01 00:00:00.000000001", "day": datetime.datetime(2024, 1, 2)}


@pytest.mark.parametrize("line, reason", [
    ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "invalid JSON (nested too deeply)"),
    ('{"prompt": "a", "n": ' + "9" * 5000 + "}", "invalid JSON (Exceeds the limit (4300 digits)"),
])
def test_json_python_cannot_hold(tmp_path, line, reason):
    p = tmp_path / "d.jsonl"
    p.write_text(line + "\n")
    assert load_err(p).startswith(f"{p} line 1: {reason}")
    q = tmp_path / "d.json"
    q.write_text("[" + line + "]")
    assert load_err(q).startswith(f"{q}: {reason}")


def test_line_separator_inside_a_string_is_not_a_line_break(tmp_path):
    """JSON strings may hold U+2028 unescaped; str.splitlines() used to cut the line there."""
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "a\u2028b", "label": "c\x1cd"}, ensure_ascii=False) + "\n", encoding="utf-8")
    rec = load_prompt_data(str(p), "prompt", "label").records[0]
    assert rec.prompt == "a\u2028b" and rec.label == "c\x1cd"


def test_error_lines_stay_one_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt\\n": "x"}\n{"prompt": ["bad\\nitem"]}\n')
    assert "\n" not in load_err(p)  # a key with a newline is shown as its repr
    p.write_text('{"prompt": ["bad\\nitem"]}\n')
    assert "\n" not in load_err(p)


# ---------------------------------------------------------------- render_prompt


class FakeTokenizer:
    def __init__(self, chat_template="{{ fake }}"):
        self.chat_template = chat_template
        self.calls = []

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        self.calls.append((messages, tokenize, add_generation_prompt))
        body = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return body + ("<assistant>" if add_generation_prompt else "")


def test_render_string_with_template():
    tok = FakeTokenizer()
    assert render_prompt("2+2?", tok, True) == "<user>2+2?</user><assistant>"
    assert tok.calls == [([{"role": "user", "content": "2+2?"}], False, True)]


def test_render_messages_with_template():
    tok = FakeTokenizer()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert render_prompt(msgs, tok, True) == "<system>s</system><user>u</user><assistant>"
    assert tok.calls[0][0] == msgs


@pytest.mark.parametrize("template", [None, ""])
def test_render_no_chat_template(template):
    with pytest.raises(UsageError) as ei:
        render_prompt("hi", FakeTokenizer(template), True)
    msg = str(ei.value)
    assert "no chat template" in msg and "--apply-chat-template" in msg and "instruct" in msg


def test_render_string_without_template():
    tok = FakeTokenizer()
    assert render_prompt("raw text", tok, False) == "raw text"
    assert tok.calls == []


def test_render_messages_without_flag():
    with pytest.raises(UsageError) as ei:
        render_prompt([{"role": "user", "content": "u"}], FakeTokenizer(), False)
    assert "pass --apply-chat-template" in str(ei.value)


# ---------------------------------------------------------------- PromptDataset


def recs(n):
    return [PromptRecord(prompt=f"p{i}", label=i, metadata={}) for i in range(n)]


def labels(batch):
    return [r.label for r in batch]


def test_dataset_in_order_and_wraps():
    ds = PromptDataset(recs(5), shuffle=False, seed=0)
    assert labels(ds.batch_for(0, 2)) == [0, 1]
    assert labels(ds.batch_for(1, 2)) == [2, 3]
    assert labels(ds.batch_for(2, 2)) == [4, 0]  # wraps into epoch 1
    assert labels(ds.batch_for(1, 3)) == [3, 4, 0]
    assert labels(ds.batch_for(3, 3)) == [4, 0, 1]  # positions 9..11: epoch 1 offset 4, epoch 2 offsets 0, 1


def test_dataset_batch_larger_than_data():
    ds = PromptDataset(recs(3), shuffle=False, seed=0)
    assert labels(ds.batch_for(0, 7)) == [0, 1, 2, 0, 1, 2, 0]
    assert labels(ds.batch_for(1, 7)) == [1, 2, 0, 1, 2, 0, 1]


def test_dataset_shuffle_is_permutation_per_epoch_and_deterministic():
    n = 20
    a = PromptDataset(recs(n), shuffle=True, seed=3)
    b = PromptDataset(recs(n), shuffle=True, seed=3)
    ea1, ea2 = labels(a.batch_for(0, n)), labels(a.batch_for(1, n))
    assert sorted(ea1) == list(range(n)) and sorted(ea2) == list(range(n))
    assert ea1 != list(range(n))  # actually shuffled
    assert ea1 != ea2  # reshuffled each epoch
    assert labels(b.batch_for(0, n)) + labels(b.batch_for(1, n)) == ea1 + ea2  # same seed, same order
    c = PromptDataset(recs(n), shuffle=True, seed=4)
    assert labels(c.batch_for(0, n)) != ea1  # different seed, different order


@pytest.mark.parametrize("shuffle", [False, True])
def test_dataset_batches_are_a_pure_function_of_the_rollout_id(shuffle):
    """In order, out of order, ahead of time or after a resume (a fresh dataset): rollout i is rollout i."""
    data = recs(11)
    in_order = [labels(PromptDataset(data, shuffle=shuffle, seed=42).batch_for(i, 4)) for i in range(10)]
    one = PromptDataset(data, shuffle=shuffle, seed=42)
    walked = [labels(one.batch_for(i, 4)) for i in range(10)]
    other = PromptDataset(data, shuffle=shuffle, seed=42)
    backwards = [labels(other.batch_for(i, 4)) for i in reversed(range(10))][::-1]
    assert walked == in_order == backwards
    # Every record is handed out once per epoch: 40 positions over 11 records.
    flat = sum(walked, [])
    for epoch in range(3):
        assert sorted(flat[epoch * 11:(epoch + 1) * 11]) == list(range(11))


def test_dataset_fingerprint_names_changed_data():
    ds = PromptDataset(recs(3), shuffle=False, seed=0)
    saved = json.loads(json.dumps(ds.fingerprint()))  # survives a checkpoint round trip
    PromptDataset(recs(3), shuffle=False, seed=0).check_fingerprint(saved)
    for changed in (PromptDataset(recs(4), shuffle=False, seed=0), PromptDataset(recs(3), shuffle=True, seed=0),
                    PromptDataset(recs(3)[:2] + [PromptRecord(prompt="other", label=2)], shuffle=False, seed=0)):
        with pytest.raises(UsageError, match="--prompt-data"):
            changed.check_fingerprint(saved)


def test_dataset_bad_args():
    ds = PromptDataset(recs(3), shuffle=False, seed=0)
    with pytest.raises(ValueError):
        ds.batch_for(0, 0)
    with pytest.raises(ValueError):
        PromptDataset([], shuffle=False, seed=0)


# ---------------------------------------------------------------- bundled task and real data


def test_bundled_task():
    assert BUNDLED_TASK.is_file()
    data = load_prompt_data(str(BUNDLED_TASK), BUNDLED_INPUT_KEY, BUNDLED_LABEL_KEY)
    assert len(data.records) == 241 and data.missing_labels == 0
    sums = []
    for r in data.records:
        m = re.fullmatch(r"What is (\d+) \+ (\d+)\? Answer with just the number\.", r.prompt)
        assert m, r.prompt
        a, b = int(m[1]), int(m[2])
        assert r.label == str(a + b)
        sums.append((a, b))
    assert len(set(sums)) == 241
    single = [(a, b) for a, b in sums if a < 10 and b < 10]
    assert sorted(single) == [(a, b) for a in range(1, 10) for b in range(1, 10)]
    hard = [(a, b) for a, b in sums if not (a < 10 and b < 10)]
    assert len(hard) == 160 and all(10 <= max(a, b) <= 99 and 1 <= min(a, b) <= 9 for a, b in hard)


def test_bundled_task_is_reproducible(tmp_path):
    script = Path(__file__).resolve().parent.parent / "scripts" / "make_arithmetic_task.py"
    out, held = tmp_path / "a.jsonl", tmp_path / "eval.jsonl"
    subprocess.run([sys.executable, str(script), "--out", str(out), "--eval-out", str(held)], check=True,
                   capture_output=True)
    assert out.read_bytes() == BUNDLED_TASK.read_bytes() and held.read_bytes() == BUNDLED_EVAL.read_bytes()
    operands = lambda path: {tuple(sorted(map(int, re.findall(r"\d+", json.loads(x)["prompt"])[:2])))  # noqa: E731
                             for x in path.read_text().splitlines()}
    assert len(operands(held)) == 32 and not operands(held) & operands(out)  # held out: no training problem


def test_module_does_not_import_torch():
    code = "import sys, miles.data.prompts; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


@pytest.mark.skipif(not GSM8K.is_file(), reason="shared gsm8k data not present")
def test_gsm8k_train():
    data = load_prompt_data(str(GSM8K), "question", "answer")
    assert len(data.records) == 7473 and data.missing_labels == 0
    assert "####" in data.records[0].label
