"""`miles verify-chat-template` and `verify()`: each case passes on a good ChatML template and
fails, with a useful detail, on the template bugs that break multi-turn RL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CHATML, build_tokenizer

from miles.cli.main import main
from miles.debug.chat_template import verify
from miles.utils.models import cache_dir

NO_GEN_PROMPT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# A different system prompt once the conversation grows: turn 1 was rendered with another one.
SYSTEM_CHANGES = (
    "{% for m in messages %}{% if m['role'] == 'system' and messages|length > 2 %}"
    "<|im_start|>system\nLong conversation mode.<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Like reasoning templates that drop earlier assistant turns' content: only the last one is kept.
DROPS_OLD_TURNS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WITH_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for tc in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def model_dir(path: Path, template: str | None = CHATML, eos: str = "<|im_end|>", tok=None) -> Path:
    """A tokenizer-only model dir whose generation_config.json stops on `eos`."""
    tok = tok or build_tokenizer()
    tok.chat_template = template
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.convert_tokens_to_ids(eos)}))
    return path


def by_name(results) -> dict:
    return {r.name: r for r in results}


def im_end_ids(tok) -> list[int]:
    return [tok.convert_tokens_to_ids("<|im_end|>")]


def test_chatml_passes(tmp_path, capsys):
    assert main(["verify-chat-template", "--model", str(model_dir(tmp_path))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "Verdict: PASS"
    assert not [line for line in lines if line.startswith("FAIL")]
    for case in ("template", "prefix stability (text)", "prefix stability (tokens)", "generation prompt",
                 "end of turn", "round trip"):
        assert any(line.startswith(f"PASS  {case}: ") for line in lines), case
    assert "SKIP  tool calls: " in "\n".join(lines)  # plain ChatML ignores tool_calls
    assert "'<|im_end|>'" in next(line for line in lines if "end of turn" in line)


def test_no_template_fails_and_stops(tmp_path, capsys):
    assert main(["verify-chat-template", "--model", str(model_dir(tmp_path, template=None))]) == 3
    out = capsys.readouterr().out.splitlines()
    assert out == ["FAIL  template: no chat template (a pretrained/base model? use its instruct version, or pass "
                   "--template FILE)", "Verdict: FAIL"]


@pytest.mark.parametrize("template", [SYSTEM_CHANGES, DROPS_OLD_TURNS], ids=["system-changes", "drops-old-turns"])
def test_not_prefix_stable(template):
    tok = build_tokenizer()
    tok.chat_template = template
    results = by_name(verify(tok, im_end_ids(tok)))
    text = results["prefix stability (text)"]
    assert text.status == "FAIL"
    assert "k=" in text.detail and "is not a prefix of" in text.detail and "first difference at char" in text.detail


def test_prefix_failure_reported_by_cli(tmp_path, capsys):
    assert main(["verify-chat-template", "--model", str(model_dir(tmp_path, SYSTEM_CHANGES))]) == 3
    out = capsys.readouterr().out
    assert "FAIL  prefix stability (text): 'with system' k=2: render(messages[:2]) is not a prefix" in out
    assert "'Long conversation mode.<|im_end|>" in out  # the diff shows both sides
    assert out.rstrip().endswith("Verdict: FAIL")


def test_token_prefix_fails_when_boundary_merges():
    # Text-stable, but '.' at the end of turn k merges with the '\n' that opens turn k+1.
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<|im_end|>", *chars, ".\n"])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[(".", "\n")], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>")
    # (Jinja trims a newline right after a block tag, hence the newline as an expression.)
    tok.chat_template = ("{% for m in messages %}{{ '\\n' }}{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '\\n' }}assistant: {% endif %}")
    results = by_name(verify(tok, []))
    assert results["prefix stability (text)"].status == "PASS"
    tokens = results["prefix stability (tokens)"]
    assert tokens.status == "FAIL" and "'.\\n'" in tokens.detail, tokens.detail


def test_end_of_turn_not_in_eos_set(tmp_path, capsys):
    # The Qwen mismatch: turns end with <|im_end|>, but the engine only stops on <|endoftext|>.
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|endoftext|>"]})
    tok.eos_token = "<|endoftext|>"
    path = model_dir(tmp_path, eos="<|endoftext|>", tok=tok)
    assert main(["verify-chat-template", "--model", str(path)]) == 3
    line = next(x for x in capsys.readouterr().out.splitlines() if "end of turn" in x)
    eot, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert line == (f"FAIL  end of turn: end-of-turn token '<|im_end|>' ({eot}) is not in the EOS set "
                    f"{{'<|endoftext|>' ({eos})}}: responses would never stop (add it to generation_config.json's "
                    "eos_token_id)")


def test_eos_list_in_generation_config(tmp_path, capsys):
    # Qwen-instruct style: eos_token_id is a list holding both tokens; that is fine.
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|endoftext|>"]})
    tok.eos_token = "<|endoftext|>"
    path = model_dir(tmp_path, tok=tok)
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]}))
    assert main(["verify-chat-template", "--model", str(path)]) == 0
    assert "PASS  end of turn: end-of-turn token '<|im_end|>'" in capsys.readouterr().out


def test_no_generation_prompt():
    tok = build_tokenizer()
    tok.chat_template = NO_GEN_PROMPT
    gen = by_name(verify(tok, im_end_ids(tok)))["generation prompt"]
    assert gen.status == "FAIL"
    assert gen.detail == ("add_generation_prompt=True adds nothing: the engine would generate without the "
                          "assistant header")


def test_no_end_of_turn_token():
    tok = build_tokenizer()
    tok.chat_template = CHATML.replace("<|im_end|>", "")
    eot = by_name(verify(tok, im_end_ids(tok)))["end of turn"]
    assert eot.status == "FAIL" and "nothing but whitespace follows" in eot.detail


def test_round_trip_fails_on_unknown_chars():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127) if chr(i) != "?"] + ["\n"]  # '?' becomes <unk>
    vocab = {t: i for i, t in enumerate(["<unk>", "<|im_start|>", "<|im_end|>", *chars])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    rt = by_name(verify(tok, []))["round trip"]
    assert rt.status == "FAIL" and "'<unk>" in rt.detail, rt.detail


def test_tool_calls_checked_when_supported():
    tok = build_tokenizer()
    tok.chat_template = WITH_TOOLS
    results = by_name(verify(tok, im_end_ids(tok)))
    assert results["tool calls"].status == "PASS"
    assert "tool calls" in results["prefix stability (text)"].detail
    assert all(r.status == "PASS" for r in results.values())


def test_template_override(tmp_path, capsys):
    path = model_dir(tmp_path / "model", template=None)
    good = tmp_path / "chatml.jinja"
    good.write_text(CHATML)
    assert main(["verify-chat-template", "--model", str(path), "--template", str(good)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("Verdict: PASS")
    bad = tmp_path / "nogen.jinja"
    bad.write_text(NO_GEN_PROMPT)
    assert main(["verify-chat-template", "--model", str(path), "--template", str(bad)]) == 3
    assert "FAIL  generation prompt: " in capsys.readouterr().out


def test_usage_errors(tmp_path, capsys):
    assert main(["verify-chat-template", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model ") and "no tokenizer files" in err
    path = model_dir(tmp_path / "model")
    assert main(["verify-chat-template", "--model", str(path), "--template", str(tmp_path / "x.jinja")]) == 2
    assert capsys.readouterr().err.startswith("error: --template ")
    assert main(["verify-chat-template"]) == 2  # --model is required


def test_demo_model(capsys):
    """SmolLM2-135M-Instruct: ChatML that injects a default system prompt only when messages[0]
    is not a system message, which is prefix-stable (it depends on the first message alone)."""
    path = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if not (path / "tokenizer_config.json").is_file():
        pytest.skip(f"demo model not converted at {path}")
    assert main(["verify-chat-template", "--model", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "Verdict: PASS"
    assert [line.split(":")[0] for line in lines[:-1]] == [
        "PASS  template", "SKIP  tool calls", "PASS  prefix stability (text)", "PASS  prefix stability (tokens)",
        "PASS  generation prompt", "PASS  end of turn", "PASS  round trip"]
    assert "'<|im_end|>' (2) is in the EOS set {'<|im_end|>' (2)}" in lines[5]
