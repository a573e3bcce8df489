"""`miles inspect-rollout`: a directory is bad input that names the dump files in it; a dump's
fields of the wrong type are an error, bad values a warning each, and the dump is still shown."""

import json
import subprocess
import sys

import pytest

from miles.bridge.rollout_dump import save_rollout
from miles.cli.main import main
from miles.debug.inspect_rollout import MAX_WARNINGS
from miles.testing.tiny import build_tokenizer
from test_replay import ACCEPTED, FIELD_CASES, NAN, at, every, good_samples, groups, header, write_dump

# Runs the CLI in a fresh interpreter and fails (exit 7) if torch was imported on the way.
NO_TORCH = ("import sys; from miles.cli.main import main; rc = main(sys.argv[1:]); "
            "sys.exit(7 if 'torch' in sys.modules else rc)")


def error_line(capsys, path) -> str:
    rc = main(["inspect-rollout", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), (rc, err)
    return err.strip()


def test_directory_names_its_dumps_in_rollout_order(tmp_path, capsys):
    for i in (10, 2, 0, 1):
        (tmp_path / f"data_{i}.pt").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not a dump")
    assert error_line(capsys, tmp_path) == (f"error: inspect-rollout: {tmp_path} is a directory; give one dump file: "
                                            "data_0.pt, data_1.pt, ..., data_10.pt (4 files)")
    (tmp_path / "data_10.pt").unlink()
    (tmp_path / "data_2.pt").unlink()
    assert error_line(capsys, tmp_path).endswith("give one dump file: data_0.pt, data_1.pt (2 files)")


def test_directory_without_dumps(tmp_path, capsys):
    assert error_line(capsys, tmp_path) == (f"error: inspect-rollout: {tmp_path} is a directory with no *.pt dump "
                                            "files; give one dump file")


def test_directory_is_refused_before_torch_is_imported(tmp_path):
    (tmp_path / "data_0.pt").write_bytes(b"")
    r = subprocess.run([sys.executable, "-c", NO_TORCH, "inspect-rollout", str(tmp_path)], capture_output=True,
                       text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: inspect-rollout: ") and "data_0.pt (1 file)" in r.stderr


# ---------------------------------------------------------------- a dump with bad fields

def inspect(capsys, path, *extra):
    rc = main(["inspect-rollout", str(path), *extra])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err.splitlines()


@pytest.mark.parametrize("name, edit, fragment, kind", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_every_field_is_checked(tmp_path, capsys, name, edit, fragment, kind):
    """A field of the wrong type is an error; a bad value is shown, with one warning line."""
    path = write_dump(tmp_path / "d_0.pt", edit)
    rc, out, err = inspect(capsys, path)
    if kind == "type":
        assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: {path}: ") and fragment in err[0], err
    elif kind == "value":
        assert rc == 0 and "samples 4 in" in out, (rc, err)
        assert len(err) == 1 and err[0].startswith(f"warning: {path}: ") and fragment in err[0], err
    else:  # the vocabulary is the model's: inspect-rollout has none to check against
        assert rc == 0 and err == []


@pytest.mark.parametrize("name, edit", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_accepted_dumps_show_without_warnings(tmp_path, capsys, name, edit):
    rc, out, err = inspect(capsys, write_dump(tmp_path / "d_0.pt", edit))
    assert rc == 0 and err == [] and "samples 4 in 2 groups" in out


def test_one_warning_per_problem_and_json_lists_them(tmp_path, capsys):
    path = write_dump(tmp_path / "d_0.pt", lambda d: (at(1, rollout_log_probs=[-0.5])(d), at(2, reward=NAN)(d)))
    rc, out, err = inspect(capsys, path)
    assert rc == 0 and err == [f"warning: {path}: sample 1: 'rollout_log_probs' has 1 value but response_length is 2",
                               f"warning: {path}: sample 2: 'reward' is nan; rewards are finite numbers (in float32)"]
    assert "reward mean nan std nan" in out
    rc, out, err = inspect(capsys, path, "--json")
    report = json.loads(out)
    assert rc == 0 and report["problems"] == [e.removeprefix("warning: ") for e in err] and len(err) == 2
    assert report["samples"][1]["logp_mean"] == -0.5


def test_warnings_stop_at_a_screenful(tmp_path, capsys):
    path = write_dump(tmp_path / "d_0.pt", every(status="pending"), samples=good_samples(n_groups=15))
    rc, out, err = inspect(capsys, path)
    assert rc == 0 and len(err) == MAX_WARNINGS + 1 and all(e.startswith("warning: ") for e in err)
    assert err[-1] == f"warning: ... and {30 - MAX_WARNINGS} more problems (--json lists them all)"
    rc, out, _ = inspect(capsys, path, "--json")
    assert rc == 0 and len(json.loads(out)["problems"]) == 30


def test_groups_of_a_dump_without_metadata_come_from_group_index(tmp_path, capsys):
    """A slime dump says nothing of n_samples_per_prompt: the first group's size tells it."""
    def slime(d):
        del d["format"], d["metadata"]
    path = write_dump(tmp_path / "d_0.pt", slime)
    rc, out, err = inspect(capsys, path)
    assert rc == 0 and err == [] and "samples 4 in 2 groups" in out
    path = write_dump(tmp_path / "d_0.pt", lambda d: (slime(d), groups(0, 0, 1, 0)(d)))
    rc, out, err = inspect(capsys, path)
    assert err == [f"warning: {path}: sample 3: 'group_index' is 0 but sample 2, in the same group of rows 2..3 "
                   "(2 samples per prompt), has 1; a group's samples must be contiguous rows"]
    path = write_dump(tmp_path / "d_0.pt", header(metadata={"n_samples_per_prompt": "2"}))
    rc, out, err = inspect(capsys, path)
    assert rc == 2 and err == [f"error: {path}: metadata 'n_samples_per_prompt' is '2' (str), not a positive int"]


def test_sample_with_bad_values_is_shown(tmp_path, capsys):
    """Token ids beyond the tokenizer and a log-prob exp() cannot take: shown, not a traceback."""
    tok_dir = tmp_path / "tok"
    build_tokenizer().save_pretrained(tok_dir)
    path = write_dump(tmp_path / "d_0.pt", at(1, tokens=[10, 11, 12, 13, 10**6], rollout_log_probs=[-0.5, 800.0]))
    rc, out, err = inspect(capsys, path, "--sample", "1", "--tokenizer", str(tok_dir))
    assert rc == 0 and err == [f"warning: {path}: sample 1: 'rollout_log_probs' holds 800.0; log-probs are finite "
                               "(in float32) and <= 0"]
    rows = out.splitlines()[-2:]
    assert rows[0].split() == ["0", "13", "-0.500", "0.607", "1", "')'"]  # id 13 is ')'
    assert rows[1].split() == ["1", "1000000", "800.000", "inf", "1", "None"]
    rc, out, err = inspect(capsys, path, "--sample", "1", "--json")
    assert rc == 0 and json.loads(out)["response_tokens"][1] == {"id": 10**6, "text": None, "logp": 800.0,
                                                                 "loss_mask": 1}


def test_a_tokenizer_that_cannot_be_used_is_one_error_line(tmp_path, capsys):
    """--tokenizer decodes --sample K's tokens: a dir without a tokenizer, or no --sample, is bad input, not a flag
    silently ignored."""
    path = write_dump(tmp_path / "d_0.pt")
    rc, _, err = inspect(capsys, path, "--sample", "1", "--tokenizer", str(tmp_path / "nowhere"))
    assert rc == 2 and err == [f"error: --tokenizer {tmp_path / 'nowhere'}: no tokenizer files (tokenizer_config.json) "
                               "there"]
    rc, _, err = inspect(capsys, path, "--tokenizer", str(tmp_path))
    assert rc == 2 and err == [f"error: --tokenizer {tmp_path} decodes the tokens of one sample: give --sample K too"]


def test_samples_that_are_not_whole_groups(tmp_path, capsys):
    path = write_dump(tmp_path / "d_0.pt", samples=good_samples(n_groups=3, n=1), n=2)
    rc, out, err = inspect(capsys, path)
    assert rc == 0 and err == [f"warning: {path}: 3 samples are not whole groups of 2 samples per prompt"]


def test_json_of_keys_json_cannot_hold(tmp_path, capsys):
    """A dump may hold tuple keys and bytes (weights_only loads them); --json shows them as plain values."""
    path = write_dump(tmp_path / "d_0.pt", lambda d: (header(metadata={"n_samples_per_prompt": 2, (1, 2): b"\0"})(d),
                                                      at(0, metadata={(3, 4): {5, 6}})(d)))
    rc, out, err = inspect(capsys, path, "--json")
    assert rc == 0 and err == [] and json.loads(out)["metadata"] == {"n_samples_per_prompt": 2, "[1, 2]": "AA=="}
    rc, out, err = inspect(capsys, path, "--sample", "0", "--json")
    assert rc == 0 and json.loads(out)["metadata"] == {"[3, 4]": [5, 6]}


def test_text_is_shown_as_it_is(tmp_path, capsys):
    """A response with rich markup in it ("[/INST]", Llama-2's) or a lone surrogate (not valid
    Unicode, which stdout cannot encode): shown, not a MarkupError or a UnicodeEncodeError."""
    samples = good_samples()
    samples[0].response, samples[1].response, samples[1].prompt = "[/INST] 2 [bold]", "bad \ud800 text", "q \udc80"
    samples[2].status = "[/x]"
    path = save_rollout(str(tmp_path / "d_{rollout_id}.pt"), 0, samples, {"n_samples_per_prompt": 2, "note": "[/x]"})
    rc, out, err = inspect(capsys, path)
    assert rc == 0 and err == [f"warning: {path}: sample 2: 'status' is '[/x]'; expected one of completed, "
                               "truncated, aborted"]
    assert "[/INST] 2 [bold]" in out and "bad \\ud800 text" in out and "status [/x] 1, completed 3" in out
    assert "metadata: n_samples_per_prompt=2, note=[/x]" in out and "[0.000, 1.000]" in out
    rc, out, err = inspect(capsys, path, "--sample", "1")
    assert rc == 0 and "prompt (3 tokens): q \\udc80" in out and "response (2 tokens): bad \\ud800 text" in out
