"""`miles verify-chat-template` and `verify()`: each case passes on a good ChatML template and
fails, with a useful detail, on the template bugs that break multi-turn RL; and on the published
templates of Qwen2.5, Qwen3, Llama-3.1, Mistral, Gemma-2 and Phi-3 (tests/fixtures/chat_templates/,
each citing its source) each case reports what it really finds."""

from __future__ import annotations

import json
from dataclasses import dataclass
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
    # The assistant header exists, but only in the finished turn: the engine would prompt without it.
    tok = build_tokenizer()
    tok.chat_template = NO_GEN_PROMPT
    gen = by_name(verify(tok, im_end_ids(tok)))["generation prompt"]
    assert gen.status == "FAIL"
    assert gen.detail == ("add_generation_prompt=True adds nothing: the engine would generate without the "
                          "assistant header '<|im_start|>assistant\\n' that the finished turn puts before the reply")


def test_generation_prompt_not_a_prefix_of_the_finished_turn():
    # Like templates that force a reasoning block open in the prompt (`<think>\n` after the header) and render a
    # finished turn without it: the engine's prompt is not what the trainer's turn starts with.
    tok = build_tokenizer()
    header = "<|im_start|>assistant\n{% endif %}"
    tok.chat_template = CHATML.replace(header, header.replace("\n", "\n<think>\n"))
    assert tok.chat_template != CHATML
    gen = by_name(verify(tok, im_end_ids(tok)))["generation prompt"]
    assert gen.status == "FAIL"
    assert "add_generation_prompt=True) is not a prefix of the finished turn" in gen.detail, gen.detail


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


# --- Headerless templates (Mistral `[INST] ... [/INST]`, Llama-2): add_generation_prompt adds nothing.

# The user turn closes differently once an assistant turn follows: what the engine was given is not
# what training sees before the reply.
HEADERLESS_NOT_PREFIX = (
    "{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
    "{% if loop.last %} [/INST]{% else %}[/INST]{% endif %}"
    "{% else %} {{ m['content'] }}</s>{% endif %}{% endfor %}"
)
# Llama-2 style: no header, a ' ' before the reply and ' </s>' after it.
HEADERLESS_OK = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<s>[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }} </s>{% endif %}{% endfor %}"
)


def headerless_tokenizer(template):
    tok = special_tokenizer(["<s>", "</s>"], eos="</s>", bos="<s>")
    tok.chat_template = template
    return tok


def test_headerless_template_passes():
    results = by_name(verify(headerless_tokenizer(HEADERLESS_OK), []))
    gen = results["generation prompt"]
    assert gen.status == "PASS"
    assert gen.detail == ("adds nothing: the template has no assistant header; the finished assistant turn is the "
                          "rendered prompt, then ' ', then the reply")
    assert all(r.status != "FAIL" for r in results.values()), results


def test_headerless_generation_prompt_not_a_prefix():
    gen = by_name(verify(headerless_tokenizer(HEADERLESS_NOT_PREFIX), []))["generation prompt"]
    assert gen.status == "FAIL"
    assert gen.detail.startswith("'with system' k=2: render(messages[:2], add_generation_prompt=True) is not a "
                                 "prefix of the finished turn; first difference at char "), gen.detail
    assert "' [/INST]' vs '[/INST] 2 + 3 = 5.</s>'" in gen.detail


def test_template_that_always_raises():
    # Not a system-role matter: every case that renders fails, none is skipped as 'system message'.
    tok = build_tokenizer()
    tok.chat_template = "{{ raise_exception('broken template') }}"
    results = by_name(verify(tok, im_end_ids(tok)))
    assert "system message" not in results
    assert results["prefix stability (text)"].status == "FAIL"
    assert "rendering raised TemplateError: broken template" in results["prefix stability (text)"].detail
    assert results["generation prompt"].status == "FAIL" and results["end of turn"].status == "FAIL"
    assert results["round trip"].status == "SKIP"


# --- Published templates: tests/fixtures/chat_templates/<name>.jinja (source cited in each file).

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"


def special_tokenizer(specials, eos, bos=None, rstrip=()):
    """A character-level tokenizer like miles.testing.tiny's, with `specials` as single special
    tokens; those in `rstrip` absorb the whitespace after them, as Phi-3's added tokens do."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(["<unk>", *specials, *chars])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    added = [AddedToken(t, special=True, normalized=False, rstrip=t in rstrip) for t in specials]
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token=eos, bos_token=bos,
                                   additional_special_tokens=added)


@dataclass
class Published:
    """The tokenizer facts of a published model that its template relies on."""
    specials: list[str]  # special tokens of its tokenizer the template writes or that stop generation
    eos: str  # tokenizer_config.json eos_token
    stop: list[str]  # generation_config.json eos_token_id, as tokens
    bos: str | None = None  # tokenizer_config.json bos_token
    rstrip: tuple[str, ...] = ()  # added tokens with "rstrip": true


PUBLISHED = {
    # Qwen2.5-Instruct: eos_token <|im_end|>; generation_config eos_token_id [151645, 151643].
    "qwen2.5-instruct": Published(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>",
                                  ["<|im_end|>", "<|endoftext|>"]),
    # Qwen3-0.6B: the same, plus <think> / </think>.
    "qwen3": Published(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_end|>",
                       ["<|im_end|>", "<|endoftext|>"]),
    # Llama-3.1-8B-Instruct: eos_token <|eot_id|>; generation_config eos_token_id [128001, 128008, 128009].
    "llama-3.1-instruct": Published(
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
         "<|eot_id|>", "<|python_tag|>"], "<|eot_id|>", ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>"),
    # Mistral-7B-Instruct-v0.2: SentencePiece with only <unk> <s> </s> special ([INST] is plain text);
    # generation_config eos_token_id 2 (</s>).
    "mistral-7b-instruct-v0.2": Published(["<s>", "</s>"], "</s>", ["</s>"], bos="<s>"),
    "mistral-7b-instruct-v0.2-legacy": Published(["<s>", "</s>"], "</s>", ["</s>"], bos="<s>"),
    # gemma-2-2b-it: eos_token <eos>; generation_config eos_token_id [1, 107] (<eos>, <end_of_turn>).
    "gemma-2-it": Published(["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<eos>",
                            ["<eos>", "<end_of_turn>"], bos="<bos>"),
    # Phi-3-mini-4k-instruct (the tokenizer_config.json cited in the fixture): eos_token <|endoftext|>;
    # <|assistant|> <|system|> <|end|> <|user|> have "rstrip": true; generation_config eos_token_id
    # [32000, 32001, 32007] (<|endoftext|>, <|assistant|>, <|end|>).
    "phi-3-mini-4k-instruct": Published(
        ["<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"], "<|endoftext|>",
        ["<|endoftext|>", "<|assistant|>", "<|end|>"], bos="<s>",
        rstrip=("<|assistant|>", "<|system|>", "<|end|>", "<|user|>")),
}

TOOLS_PREFIX_PASS = [
    ("PASS", "prefix stability (text)", ["3 conversations (with system, no system, tool calls), 11 steps"]),
    ("PASS", "prefix stability (tokens)", ["3 conversations (with system, no system, tool calls), 11 steps"]),
]
NO_TOOLS = ("SKIP", "tool calls", ["does not render an assistant's tool_calls"])
SYSTEM_REJECTED = "template rejects a system message"

# What `miles verify-chat-template` prints for each published template, line by line:
# (status, case, words its detail contains), then the verdict.
EXPECTED = {
    # Qwen2.5: ChatML with a default system prompt and Hermes-style <tool_call>; safe throughout.
    "qwen2.5-instruct": ([
        ("PASS", "template", ["present"]),
        ("PASS", "tool calls", ["template renders tool_calls"]),
        *TOOLS_PREFIX_PASS,
        ("PASS", "generation prompt", ["adds '<|im_start|>assistant\\n'", "a prefix of every finished"]),
        ("PASS", "end of turn", ["'<|im_end|>'", "is in the EOS set", "'<|endoftext|>'"]),
        ("PASS", "round trip", ["decode(encode(render)) == render"]),
    ], "PASS"),
    # Qwen3: the last assistant turn after the last user query gets a '<think>\n\n</think>\n\n' block
    # that disappears once the next user message arrives (earlier turns lose their reasoning): not
    # prefix-stable, so appending rollouts train on text the template would not render.
    "qwen3": ([
        ("PASS", "template", ["present"]),
        ("PASS", "tool calls", ["template renders tool_calls"]),
        ("FAIL", "prefix stability (text)", ["'with system' k=3: render(messages[:3]) is not a prefix of "
                                             "render(messages[:4])", "'<think>\\n\\n</think>\\n\\n2 + 3 = 5."]),
        ("PASS", "prefix stability (tokens)", ["7 text-stable steps"]),
        ("PASS", "generation prompt", ["adds '<|im_start|>assistant\\n'"]),
        ("PASS", "end of turn", ["'<|im_end|>'", "is in the EOS set"]),
        ("PASS", "round trip", ["decode(encode(render)) == render"]),
    ], "FAIL"),
    # Llama-3.1: header tokens; the date line is the constant "26 Jul 2024" unless date_string is
    # passed (this template calls no strftime_now); tools go into the first user message, which
    # stays put as the conversation grows.
    "llama-3.1-instruct": ([
        ("PASS", "template", ["present"]),
        ("PASS", "tool calls", ["template renders tool_calls"]),
        *TOOLS_PREFIX_PASS,
        ("PASS", "generation prompt", ["adds '<|start_header_id|>assistant<|end_header_id|>\\n\\n'"]),
        ("PASS", "end of turn", ["'<|eot_id|>'", "is in the EOS set", "'<|eom_id|>'", "'<|end_of_text|>'"]),
        ("PASS", "round trip", ["decode(encode(render)) == render"]),
    ], "PASS"),
    # Mistral v0.2: no assistant header; the reply follows ' [/INST]' after a ' '. Correct (issue 9).
    "mistral-7b-instruct-v0.2": ([
        ("PASS", "template", ["present"]),
        NO_TOOLS,
        ("PASS", "prefix stability (text)", ["2 conversations (with system, no system), 8 steps"]),
        ("PASS", "prefix stability (tokens)", ["2 conversations (with system, no system), 8 steps"]),
        ("PASS", "generation prompt", ["adds nothing: the template has no assistant header",
                                       "the rendered prompt, then ' ', then the reply"]),
        ("PASS", "end of turn", ["'</s>'", "is in the EOS set"]),
        ("PASS", "round trip", ["decode(encode(render)) == render"]),
    ], "PASS"),
    # The older v0.2 template: no header and no separator; a system message breaks its user/assistant
    # alternation check, so it is rejected (SKIP) and the rest runs without one.
    "mistral-7b-instruct-v0.2-legacy": ([
        ("PASS", "template", ["present"]),
        ("SKIP", "system message", [SYSTEM_REJECTED, "Conversation roles must alternate"]),
        NO_TOOLS,
        ("PASS", "prefix stability (text)", ["1 conversation (no system), 3 steps"]),
        ("PASS", "prefix stability (tokens)", ["1 conversation (no system), 3 steps"]),
        ("PASS", "generation prompt", ["adds nothing: the template has no assistant header",
                                       "the rendered prompt, then the reply"]),
        ("PASS", "end of turn", ["'</s>'", "is in the EOS set"]),
        ("PASS", "round trip", ["decode(encode(render)) == render"]),
    ], "PASS"),
    # Gemma-2: raises "System role not supported" (SKIP, not FAIL); '<start_of_turn>model\n' header;
    # turns end with <end_of_turn>, which generation_config stops on.
    "gemma-2-it": ([
        ("PASS", "template", ["present"]),
        ("SKIP", "system message", [SYSTEM_REJECTED, "System role not supported"]),
        NO_TOOLS,
        ("PASS", "prefix stability (text)", ["1 conversation (no system), 3 steps"]),
        ("PASS", "prefix stability (tokens)", ["1 conversation (no system), 3 steps"]),
        ("PASS", "generation prompt", ["adds '<start_of_turn>model\\n'"]),
        ("PASS", "end of turn", ["'<end_of_turn>'", "is in the EOS set", "'<eos>'"]),
        ("PASS", "round trip", ["decode(encode(render)) == render"]),
    ], "PASS"),
    # Phi-3-mini: a finished conversation ends with eos_token '<|endoftext|>' (add_generation_prompt
    # =False), which the next message replaces: no render is a prefix of the next. Its rstrip added
    # tokens eat the '\n' after them, so text does not survive encode/decode either.
    "phi-3-mini-4k-instruct": ([
        ("PASS", "template", ["present"]),
        NO_TOOLS,
        ("FAIL", "prefix stability (text)", ["'with system' k=2: render(messages[:2]) is not a prefix",
                                             "'<|endoftext|>' vs '<|assistant|>\\n2 + 3 = 5.",
                                             "ends with eos_token '<|endoftext|>'"]),
        ("SKIP", "prefix stability (tokens)", ["no text-stable step to compare"]),
        ("PASS", "generation prompt", ["adds '<|assistant|>\\n' in place of the trailing '<|endoftext|>'"]),
        ("PASS", "end of turn", ["'<|end|>'", "is in the EOS set"]),
        ("FAIL", "round trip", ["'with system': decode(encode(text)) differs",
                                "only whitespace differs", "rstrip"]),
    ], "FAIL"),
}


def published_model_dir(path: Path, name: str) -> Path:
    """A tokenizer-only model dir with the published template, special tokens and generation_config EOS."""
    spec = PUBLISHED[name]
    tok = special_tokenizer(spec.specials, spec.eos, spec.bos, spec.rstrip)
    tok.chat_template = (FIXTURES / f"{name}.jinja").read_text()
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tok.convert_tokens_to_ids(t) for t in spec.stop]}))
    return path


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_published_template(name, tmp_path, capsys):
    expected, verdict = EXPECTED[name]
    code = main(["verify-chat-template", "--model", str(published_model_dir(tmp_path, name))])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"Verdict: {verdict}" and code == (0 if verdict == "PASS" else 3), lines
    got = [line.split(": ", 1) for line in lines[:-1]]
    assert [head for head, _ in got] == [f"{status}  {case}" for status, case, _ in expected], lines
    for (_, detail), (_, case, words) in zip(got, expected):
        for word in words:
            assert word in detail, (case, word, detail)


def test_published_templates_all_have_an_expectation():
    assert sorted(p.stem for p in FIXTURES.glob("*.jinja")) == sorted(EXPECTED) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_source_comment_renders_nothing(name):
    # The `{# source: ... #}` line (and, by trim_blocks, its newline) adds nothing to any render.
    text = (FIXTURES / f"{name}.jinja").read_text()
    head, template = text.split("\n", 1)
    assert head.startswith("{# source: ") and head.endswith(" #}") and "https://" in head
    spec = PUBLISHED[name]
    tok = special_tokenizer(spec.specials, spec.eos, spec.bos)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert (tok.apply_chat_template(msgs, chat_template=text, tokenize=False)
            == tok.apply_chat_template(msgs, chat_template=template, tokenize=False))
