"""Hostile input, generated with Hypothesis: prompt files, rollout dumps, chat templates, trainer states.

Each reader either accepts its input or refuses it with a UsageError of one line (what the CLI
prints as one `error:` line, exit 2); any other exception is a bug. Inputs are arbitrary bytes, and
structures built near the valid ones, where the checks are. No model is loaded; each test runs
FUZZ's examples in a few seconds; MILES_FUZZ_EXAMPLES=5000 runs more.
"""

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from miles.bridge.rollout_dump import (FORMAT, check_fits, read_dump, samples_from_dump, samples_per_prompt,
                                       save_rollout, validate_samples)
from miles.cli.main import main
from miles.data.prompts import PromptData, load_prompt_data
from miles.debug.chat_template import CaseResult, verify
from miles.errors import UsageError
from miles.testing.tiny import build_tokenizer
from miles.train.batch import TrainBatch
from miles.train.checkpoint import TRAINER_STATE, load_trainer_state
from test_replay import VOCAB, good_samples

# Garbage bytes that happen to start like a pickle make torch warn about the protocol: expected here.
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")

# No example database: every run explores afresh (Hypothesis keeps only a self-ignored cache, .hypothesis/).
FUZZ = settings(max_examples=int(os.environ.get("MILES_FUZZ_EXAMPLES", 80)), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def refused_cleanly(call):
    """call() returns, or raises a one-line UsageError (returned); anything else propagates."""
    try:
        return call()
    except UsageError as e:
        assert "\n" not in str(e), str(e)
        return e


# ---------------------------------------------------------------- prompt files

# Strings with any code point, lone surrogates included (json.dumps writes them as \ud800 escapes).
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3), max_leaves=12)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]) | JSON_VALUES,
                                           "content": ANY_TEXT | st.just("  ") | JSON_VALUES}), max_size=3)
KEYS = st.sampled_from(["prompt", "label", "messages"]) | ANY_TEXT


@st.composite
def rows(draw) -> dict:
    """Mostly the shape of a prompt row (text or messages, a label, extras), sometimes anything."""
    text = st.one_of(*[st.text(max_size=12)] * 4, ANY_TEXT)
    row = {"prompt": draw(st.one_of(*[text] * 3, MESSAGES, JSON_VALUES)), "label": draw(text | JSON_VALUES)}
    row |= draw(st.dictionaries(KEYS, text | MESSAGES | JSON_VALUES, max_size=2))
    return row


LOAD_ARGS = st.tuples(st.sampled_from(["prompt", "messages"]), st.sampled_from([None, "label"]), st.booleans())


def load(path: Path, args) -> None:
    input_key, label_key, scalar_labels = args
    result = refused_cleanly(lambda: load_prompt_data(str(path), input_key, label_key, scalar_labels=scalar_labels))
    assert isinstance(result, (PromptData, UsageError))
    event(_outcome(result))
    if isinstance(result, PromptData):
        assert len(result) > 0 and all(isinstance(r.prompt, (str, list)) for r in result.records)


@FUZZ
@given(data=st.binary(max_size=3000), suffix=st.sampled_from([".jsonl", ".json", ".parquet"]), args=LOAD_ARGS)
def test_prompt_file_of_arbitrary_bytes(workdir, data, suffix, args):
    path = workdir / f"bytes{suffix}"
    path.write_bytes(data)
    load(path, args)


@st.composite
def json_lines(draw) -> str:
    """Mostly a row; else any JSON value, any text, a lone surrogate's escape, too deep a nesting."""
    if draw(st.integers(0, 9)):
        return json.dumps(draw(rows()))
    return draw(st.one_of(JSON_VALUES.map(json.dumps), ANY_TEXT, st.just('{"prompt": "\\ud800"}'),
                          st.just("[" * 5000)))


@FUZZ
@given(lines=st.lists(json_lines(), max_size=4),
       ascii_only=st.booleans(), as_list=st.booleans(), args=LOAD_ARGS)
def test_prompt_file_of_arbitrary_json_lines(workdir, lines, ascii_only, as_list, args):
    if not ascii_only:  # the same rows with raw (non-escaped) characters; a lone one is then not UTF-8
        lines = [json.dumps(json.loads(line), ensure_ascii=False) if _is_json(line) else line for line in lines]
    text = ("[" + ",".join(lines) + "]") if as_list else "\n".join(lines)
    path = workdir / ("rows.json" if as_list else "rows.jsonl")
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    load(path, args)


def _outcome(result) -> str:
    """For --hypothesis-show-statistics: how often inputs pass, and which check refuses the rest."""
    if not isinstance(result, UsageError):
        return "accepted"
    words = str(result).split(": ", 1)[-1].split()
    return "refused: " + " ".join(words[:4])


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


_MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
PARQUET_COLUMNS = {  # arrow type -> values of it (None is a null)
    pa.string(): st.text(max_size=10),
    pa.int64(): st.integers(-(2**63), 2**63 - 1),
    pa.float64(): st.floats(),
    pa.bool_(): st.booleans(),
    pa.timestamp("us"): st.datetimes(),
    pa.timestamp("ns", tz="UTC"): st.integers(-(2**62), 2**62),
    pa.timestamp("s"): st.integers(-(2**40), 2**40),  # beyond datetime's years 1..9999
    pa.date32(): st.dates(),
    pa.time64("ns"): st.integers(0, 86_400 * 10**9 - 1),
    pa.duration("ns"): st.integers(-(2**62), 2**62),
    pa.decimal128(20, 4): st.decimals(min_value=-(10**15), max_value=10**15, places=4, allow_nan=False),
    pa.binary(): st.binary(max_size=8),
    pa.list_(pa.string()): st.lists(st.text(max_size=5), max_size=3),
    pa.list_(_MESSAGE_TYPE): st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", ""]),
                                                            "content": st.text(max_size=8)}), max_size=3),
    _MESSAGE_TYPE: st.fixed_dictionaries({"role": st.text(max_size=4), "content": st.text(max_size=4)}),
    pa.map_(pa.string(), pa.int64()): st.lists(st.tuples(st.text(max_size=3), st.integers(-9, 9)), max_size=2),
    pa.null(): st.none(),
}


@st.composite
def parquet_tables(draw):
    """Mostly a text (or messages) prompt column and a label column among others of any type."""
    n_rows = draw(st.integers(0, 4))
    columns = [("prompt", draw(st.sampled_from([pa.string()] * 4 + [pa.list_(_MESSAGE_TYPE)] + list(PARQUET_COLUMNS)))),
               ("label", draw(st.sampled_from(list(PARQUET_COLUMNS))))]
    columns = [c for c in columns if draw(st.integers(0, 4))]  # now and then without one
    columns += draw(st.lists(st.tuples(st.sampled_from(["prompt", "label", "messages"]) | st.text(max_size=5),
                                       st.sampled_from(list(PARQUET_COLUMNS))), max_size=3))
    if draw(st.integers(0, 4)):  # mostly one column per name (pyarrow cannot read a name used twice)
        first: dict = {}
        for name, arrow_type in columns:
            first.setdefault(name, arrow_type)
        columns = list(first.items())
    arrays = []
    for _, arrow_type in columns:
        value = PARQUET_COLUMNS[arrow_type]
        value = st.none() | value if draw(st.booleans()) else value  # half the columns with nulls
        values = draw(st.lists(value, min_size=n_rows, max_size=n_rows))
        arrays.append(pa.array(values, arrow_type))
    return pa.Table.from_arrays(arrays, names=[name for name, _ in columns]) if columns else pa.table({})


@FUZZ
@given(table=parquet_tables(), args=LOAD_ARGS)
def test_prompt_file_of_arbitrary_parquet(workdir, table, args):
    path = workdir / "table.parquet"
    pq.write_table(table, path)
    load(path, args)


@FUZZ
@given(table=parquet_tables(), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), min_size=1,
                                              max_size=6), args=LOAD_ARGS)
def test_prompt_parquet_with_flipped_bits(workdir, table, flips, args):
    path = workdir / "flipped.parquet"
    pq.write_table(table, path)
    path.write_bytes(flip(path.read_bytes(), flips))
    load(path, args)


def flip(data: bytes, flips) -> bytes:
    out = bytearray(data)
    for position, bit in flips:
        out[position % len(out)] ^= 1 << bit
    return bytes(out)


# ---------------------------------------------------------------- rollout dumps

TENSORS = (st.lists(st.integers(-5, 200), max_size=6).map(lambda v: torch.tensor(v, dtype=torch.long))
           | st.lists(st.floats(width=32), max_size=6).map(lambda v: torch.tensor(v, dtype=torch.float32))
           | st.lists(st.booleans(), max_size=4).map(lambda v: torch.tensor(v, dtype=torch.bool))
           | st.sampled_from([torch.zeros(2, 2), torch.tensor(3), torch.tensor(-0.5)]))
LEAVES = (st.none() | st.booleans() | st.integers() | st.integers(-(2**80), 2**80) | st.sampled_from([10**400])
          | st.floats() | ANY_TEXT | st.binary(max_size=6) | TENSORS)
ANY = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
                   | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=3), max_leaves=10)
# Text that means something to rich (inspect-rollout's table): closing tags, styles, Llama-2's [/INST].
MARKUP = st.lists(st.sampled_from(["[/INST]", "[bold]", "[/]", "[nan, nan]", "[link=x]", "\\[", "ok"]),
                  max_size=3).map(" ".join)
TEXTS = st.sampled_from(["ab", "lone \ud800 surrogate"]) | MARKUP | ANY_TEXT
REWARDS = st.sampled_from([0.0, 1.0, 3.5e38, -1e39]) | st.floats()
FIELDS = {  # near misses for each field, then anything at all
    "tokens": st.lists(st.integers(-3, 120), max_size=7),
    "response_length": st.integers(-1, 8),
    "loss_mask": st.lists(st.integers(-1, 2) | st.booleans() | st.floats(), max_size=4),
    "rollout_log_probs": st.none() | st.lists(st.floats(max_value=0.01) | st.integers(-3, 0), max_size=4),
    "reward": st.floats() | st.dictionaries(st.text(max_size=3), st.floats() | ANY_TEXT, max_size=2),
    "status": st.sampled_from(["completed", "truncated", "aborted", "pending", "", "[/x]"]),
    "group_index": st.none() | st.integers(-1, 3),
    "index": st.none() | st.integers(-1, 5),
    "prompt": ANY_TEXT | MESSAGES | MARKUP,
    "response": ANY_TEXT | MARKUP,
    "label": ANY,
    "metadata": st.dictionaries(st.text(max_size=4) | MARKUP, ANY | MARKUP, max_size=3),
    "weight_version": st.integers(-1, 3),
    "weight_versions": st.lists(ANY, max_size=2),
}
BASE_SAMPLE = good_samples()[0].to_dict()


@st.composite
def near_miss(draw, sample: dict) -> dict:
    """`sample` with a few fields dropped, set to a near miss, or set to anything."""
    sample = dict(sample)
    for key in draw(st.sets(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=3)):
        how = draw(st.sampled_from(["near", "near", "any", "drop"]))
        if how == "drop":
            sample.pop(key, None)
        else:
            sample[key] = draw(FIELDS[key] if how == "near" else ANY)
    return sample


@st.composite
def dumps(draw):
    """Mostly a valid dump (groups of n) with a sample or two and a header field or two amiss."""
    if draw(st.integers(0, 9)) == 0:
        return draw(ANY)
    n, n_groups = draw(st.integers(1, 3)), draw(st.integers(0, 3))
    # Any text and any float in otherwise valid samples too: inspect-rollout shows those, replay trains on them.
    samples = [dict(BASE_SAMPLE, group_index=i // n, index=i, response=draw(TEXTS),
                    reward=draw(REWARDS) if draw(st.integers(0, 3)) == 0 else 0.5) for i in range(n * n_groups)]
    for i in draw(st.sets(st.integers(0, len(samples) - 1), max_size=2)) if samples else ():
        samples[i] = draw(near_miss(samples[i]))
    payload = {"format": FORMAT, "rollout_id": 0, "samples": samples, "metadata": {"n_samples_per_prompt": n}}
    near = {"format": st.just("miles.rollout/2"), "rollout_id": st.integers(-1, 3), "samples": ANY,
            "metadata": st.fixed_dictionaries({"n_samples_per_prompt": st.integers(-1, 4)},
                                              optional={"note": MARKUP | ANY_TEXT})}
    for key in near:
        how = draw(st.sampled_from(["keep"] * 6 + ["near", "any", "drop"]))
        if how == "drop":
            del payload[key]
        elif how != "keep":
            payload[key] = draw(near[key] if how == "near" else ANY)
    return payload


def check_dump(path: Path) -> None:
    """The checks a replay makes; what they pass must batch for the trainer with its engine
    log-probs kept; inspect-rollout shows the file or refuses it with one error line."""
    def replay_checks():
        payload = read_dump(path)
        n = samples_per_prompt(payload, path)
        samples = samples_from_dump(payload, path, n)
        validate_samples(samples, path, n, vocab_size=VOCAB)
        check_fits(samples, path, vocab_size=VOCAB, expected=len(samples), n_samples_per_prompt=n,
                   needs_log_probs=False)
        return samples

    samples = refused_cleanly(replay_checks)
    event(_outcome(samples))
    if not isinstance(samples, UsageError):
        batch = TrainBatch.from_samples(samples, pad_token_id=0, device="cpu")
        assert batch.has_rollout_log_probs == bool(samples[0].rollout_log_probs)
        assert torch.isfinite(batch.rollout_log_probs).all() and torch.isfinite(batch.rewards).all()
    for extra in ([], ["--json"], ["--sample", "0"], ["--sample", "0", "--json"]):
        out, err = utf8_stream(), utf8_stream()  # strict, as a real stdout: a lone surrogate cannot be written
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["inspect-rollout", str(path), *extra])
        lines = text_of(err).splitlines()
        assert rc in (0, 2) and all(line.startswith(("warning: ", "error: ")) for line in lines), text_of(err)
        if rc == 2:
            assert lines[-1].startswith("error: ") and sum(line.startswith("error: ") for line in lines) == 1
        elif "--json" in extra:
            json.loads(text_of(out))


def utf8_stream() -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)


def text_of(stream: io.TextIOWrapper) -> str:
    return stream.buffer.getvalue().decode("utf-8")


@FUZZ
@given(payload=dumps())
def test_arbitrary_rollout_dumps(workdir, payload):
    path = workdir / "dump.pt"
    torch.save(payload, path)
    check_dump(path)


@pytest.fixture(scope="module")
def real_dump(workdir) -> bytes:
    path = save_rollout(str(workdir / "real.pt"), 0, good_samples(), {"n_samples_per_prompt": 2, "seed": 1})
    return path.read_bytes()


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), max_size=6),
       cut=st.none() | st.integers(0, 10**6))
def test_rollout_dump_with_flipped_bits_or_cut_short(workdir, real_dump, flips, cut):
    data = flip(real_dump, flips) if flips else real_dump
    path = workdir / "flipped.pt"
    path.write_bytes(data if cut is None else data[: cut % len(data)])
    check_dump(path)


@FUZZ
@given(data=st.binary(max_size=2000))
def test_rollout_dump_of_garbage_bytes(workdir, data):
    path = workdir / "garbage.pt"
    path.write_bytes(data)
    check_dump(path)


# ---------------------------------------------------------------- chat templates

TEMPLATE_PIECES = st.sampled_from([
    "{% for message in messages %}", "{% endfor %}", "{% if add_generation_prompt %}", "{% endif %}", "{% else %}",
    "{% if message['role'] == 'system' %}", "{% elif message.role == 'user' %}", "{% if loop.first %}",
    "{% if loop.last %}", "{{ message['content'] }}", "{{ message.content }}", "{{ message['role'] }}",
    "{{ message.tool_calls }}", "{{ message.tool_calls[0].function.name }}", "{{ messages[0]['content'] }}",
    "{{ messages[-1].content | trim }}", "{{ tools | tojson }}", "{{ eos_token }}", "{{ bos_token }}",
    "{{ raise_exception('no system messages') }}", "<|im_start|>", "<|im_end|>", "\n", " ", "{%- ", " -%}", "{{- ",
    " -}}", "{{", "}}", "{%", "%}", "{#", "#}", "{% set n = messages | length %}", "{{ n }}", "{{ undefined.attr }}",
    "{{ 1 / 0 }}", "{{ message.content.split('x') }}", "{% generation %}", "{% endgeneration %}",
    "{% macro again() %}{{ again() }}{% endmacro %}", "{{ again() }}", "{{ message.content[1000] }}",
    "{% if tools %}", "{{ message }}", "{{ messages[0]['content'] + 1 }}",
]) | st.text(max_size=8)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@FUZZ
@given(template=st.lists(TEMPLATE_PIECES, max_size=12).map("".join).filter(lambda t: t.count("{% for") <= 2))
def test_chat_template_verifier_never_raises(tokenizer, template):
    # At most two nested loops: a dozen nested `for message in messages` renders messages**12 copies, a
    # template that is real Jinja but no chat template; the verifier does not bound rendering time.
    tokenizer.chat_template = template
    results = verify(tokenizer, [])
    assert results and all(isinstance(r, CaseResult) and r.status in ("PASS", "FAIL", "SKIP") for r in results)


# ---------------------------------------------------------------- trainer_state.pt

STATES = ANY | st.fixed_dictionaries({"step": st.integers(-1, 5) | ANY, "optimizer": ANY},
                                     optional={"rng": ANY, "data": ANY})


def check_trainer_state(step_dir: Path) -> None:
    result = refused_cleanly(lambda: load_trainer_state(step_dir))
    assert isinstance(result, (dict, UsageError)), type(result)


@FUZZ
@given(state=STATES)
def test_arbitrary_trainer_states(workdir, state):
    (workdir / "step_1").mkdir(exist_ok=True)
    torch.save(state, workdir / "step_1" / TRAINER_STATE)
    check_trainer_state(workdir / "step_1")


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), max_size=6),
       cut=st.none() | st.integers(0, 10**6), garbage=st.none() | st.binary(max_size=500))
def test_trainer_state_corrupted(workdir, flips, cut, garbage):
    step_dir = workdir / "step_2"
    step_dir.mkdir(exist_ok=True)
    state = {"step": 2, "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 1e-3}]}}
    torch.save(state, step_dir / TRAINER_STATE)
    data = (step_dir / TRAINER_STATE).read_bytes() if garbage is None else garbage
    data = flip(data, flips) if flips and data else data
    (step_dir / TRAINER_STATE).write_bytes(data if cut is None or not data else data[: cut % len(data)])
    check_trainer_state(step_dir)


def test_trainer_state_missing(workdir):
    (workdir / "step_3").mkdir(exist_ok=True)
    assert isinstance(refused_cleanly(lambda: load_trainer_state(workdir / "step_3")), UsageError)


def test_fuzz_helpers_are_strict():
    """refused_cleanly lets through anything but a one-line UsageError (else the tests above prove nothing)."""
    with pytest.raises(ValueError):
        refused_cleanly(lambda: int("x"))
    with pytest.raises(AssertionError):
        refused_cleanly(lambda: (_ for _ in ()).throw(UsageError("two\nlines")))
    assert refused_cleanly(lambda: 3) == 3
