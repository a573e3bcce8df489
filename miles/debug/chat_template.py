"""`miles verify-chat-template --model PATH`: is this chat template safe for multi-turn RL?

    miles verify-chat-template --model Qwen/Qwen2.5-0.5B-Instruct-dir
    miles verify-chat-template --model DIR --template my_template.jinja   # try a fixed template

Multi-turn rollouts are built by appending: the engine renders the prompt, generates a reply,
appends the next message and keeps the token ids it already has. Training then treats the whole
sequence as one concatenation of turns. That is only correct if rendering never rewrites what was
rendered before, if the generation prompt is exactly what the template would put before a reply,
and if the token that closes an assistant turn is one the engine stops on. Each of these fails
silently in training (wrong log-probs, responses that never stop), so we check them up front.

Templates without an assistant header (Mistral's `[INST] ... [/INST]`, Llama-2) have a generation
prompt that adds nothing; they pass when the finished turn is the prompt, then at most whitespace,
then the reply. Templates that reject a system message (Gemma) get a SKIP line for it and run the
other conversations.

Output: one `PASS|FAIL|SKIP  <case>: <detail>` line per case, then `Verdict: PASS` (exit 0) or
`Verdict: FAIL` (exit 3). `verify(tokenizer, eos_ids)` runs the same checks without the CLI.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from miles.errors import UsageError

TOOL_NAME = "get_weather"
TOOLS = [{"type": "function", "function": {
    "name": TOOL_NAME, "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

# Assistant replies avoid leading/trailing whitespace: many templates strip content, and the
# end-of-turn case looks for the reply's text in the render.
CONVERSATIONS: dict[str, list[dict]] = {
    "with system": [
        {"role": "system", "content": "You are a careful math tutor."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "And times 4?"},
        {"role": "assistant", "content": "5 * 4 = 20."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."},
    ],
    "no system": [
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "7 is prime."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "11."},
    ],
    "tool calls": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "How warm is it in Paris?"},
        # OpenAI format. Content is "" rather than None: templates that ignore tool_calls often
        # concatenate content as a string and would crash on None instead of telling us anything.
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": TOOL_NAME, "content": '{"temp_c": 18}'},
        {"role": "assistant", "content": "It is 18 C in Paris."},
    ],
}


@dataclass
class CaseResult:
    name: str
    status: str  # "PASS", "FAIL" or "SKIP"
    detail: str


def register(commands) -> None:
    p = commands.add_parser("verify-chat-template", help="check a chat template is safe for multi-turn RL",
                            description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, metavar="PATH", help="model or tokenizer dir")
    p.add_argument("--template", metavar="FILE", help="use this Jinja chat template instead of the tokenizer's")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    model = Path(args.model)
    if not any((model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise UsageError(f"--model {model}: no tokenizer files (tokenizer.json / tokenizer_config.json) there")
    # AutoTokenizer directly rather than miles.utils.models.load_tokenizer: that module imports
    # torch, and checking a template needs no model.
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {model}: cannot load its tokenizer: {e}") from e
    if args.template:
        try:
            tokenizer.chat_template = Path(args.template).read_text()
        except OSError as e:
            raise UsageError(f"--template {args.template}: {e.strerror}") from e
    results = verify(tokenizer, generation_config_eos(model))
    for r in results:
        print(f"{r.status}  {r.name}: {r.detail}")
    failed = any(r.status == "FAIL" for r in results)
    print(f"Verdict: {'FAIL' if failed else 'PASS'}")
    return 3 if failed else 0


def generation_config_eos(model_dir: Path) -> list[int]:
    """eos_token_id of generation_config.json (an int or a list): what the engine also stops on."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)]


def verify(tokenizer, eos_ids) -> list[CaseResult]:
    """Runs every case on `tokenizer`'s chat template; `eos_ids` are the ids the engine stops on
    besides the tokenizer's own eos token."""
    if not tokenizer.chat_template:
        return [CaseResult("template", "FAIL", "no chat template (a pretrained/base model? use its instruct "
                                               "version, or pass --template FILE)")]
    results = [CaseResult("template", "PASS", "present")]

    def render(name, msgs, gen=False):
        # Every prefix of the tool conversation gets the same tool definitions, as a rollout would.
        tools = TOOLS if name == "tool calls" else None
        return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    specials = tokenizer.all_special_tokens
    convs = dict(CONVERSATIONS)
    rejection = _system_rejection(render)
    if rejection:
        # Gemma-style templates raise on a system message: that is their contract, not a fault.
        results.append(CaseResult("system message", "SKIP", f"template rejects a system message ({rejection}); "
                                  "'with system' not checked, 'tool calls' runs without its system message"))
        del convs["with system"]
        convs["tool calls"] = [m for m in convs["tool calls"] if m["role"] != "system"]
    results.append(_tool_support(render, convs["tool calls"]))
    if results[-1].status != "PASS":
        del convs["tool calls"]

    renders = {name: _render_prefixes(name, msgs, render) for name, msgs in convs.items()}
    results += _prefix_stability(tokenizer, renders, encode)
    results.append(_generation_prompt(convs, render, specials))
    results.append(_end_of_turn(tokenizer, eos_ids, render, encode, convs))
    results.append(_round_trip(renders, encode, decode))
    return results


def _system_rejection(render) -> str | None:
    """The error a template raises on a system message, or None if it accepts one (or raises on the
    same conversation without it too, which is then no matter of the system role)."""
    msgs = CONVERSATIONS["with system"]
    try:
        render("with system", msgs[:2])
        return None
    except Exception as e:  # noqa: BLE001 - Jinja raises anything (TemplateError, TypeError...)
        error = f"{type(e).__name__}: {e}"
    try:
        render("no system", msgs[1:2])
    except Exception:  # noqa: BLE001
        return None
    return error


def _render_prefixes(name, msgs, render) -> list[tuple[int, str | Exception]]:
    """(k, render(msgs[:k])) from the first prompt (the system messages and the first message after
    them: a rollout never renders a system message alone) to the whole conversation. A template that
    raises is a failure of the case that needs that render."""
    first = next(i for i, m in enumerate(msgs) if m["role"] != "system") + 1
    out = []
    for k in range(first, len(msgs) + 1):
        try:
            out.append((k, render(name, msgs[:k])))
        except Exception as e:  # noqa: BLE001
            out.append((k, e))
    return out


def _prefix_stability(tokenizer, renders, encode) -> list[CaseResult]:
    # Appending a message must only append text (and token ids) to what was rendered before.
    specials = tokenizer.all_special_tokens
    text_fail = tok_fail = None
    steps = tok_steps = 0
    for name, texts in renders.items():
        for (k, a), (_, b) in zip(texts, texts[1:]):
            where = f"'{name}' k={k}"
            if isinstance(a, Exception) or isinstance(b, Exception):
                err = a if isinstance(a, Exception) else b
                text_fail = text_fail or f"{where}: rendering raised {type(err).__name__}: {err}"
                continue
            steps += 1
            if not b.startswith(a):
                text_fail = text_fail or (f"{where}: render(messages[:{k}]) is not a prefix of "
                                          f"render(messages[:{k + 1}]); {_diff(a, b, specials)}"
                                          f"{_eos_hint(tokenizer, a, b)}")
                continue
            tok_steps += 1
            ta, tb = encode(a), encode(b)
            if tb[:len(ta)] != ta:
                i = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
                tok_fail = tok_fail or (f"{where}: token ids diverge at token {i}: "
                                        f"{tokenizer.convert_ids_to_tokens(ta[i:i + 4])} vs "
                                        f"{tokenizer.convert_ids_to_tokens(tb[i:i + 4])} (the text boundary "
                                        f"merges into a different token)")
    scope = f"{len(renders)} conversation{'s' * (len(renders) != 1)} ({', '.join(renders)}), {steps} steps"
    text = CaseResult("prefix stability (text)", "FAIL" if text_fail else "PASS", text_fail or scope)
    if tok_fail:
        tokens = CaseResult("prefix stability (tokens)", "FAIL", tok_fail)
    elif text_fail and not tok_steps:
        tokens = CaseResult("prefix stability (tokens)", "SKIP", "no text-stable step to compare")
    else:
        tokens = CaseResult("prefix stability (tokens)", "PASS",
                            f"{tok_steps} text-stable steps" if text_fail else scope)
    return [text, tokens]


def _eos_hint(tokenizer, a: str, b: str) -> str:
    # Phi-3 style: a finished conversation ends with eos_token, which the next message replaces.
    eos = tokenizer.eos_token
    if eos and a.endswith(eos) and b.startswith(a[:-len(eos)]):
        return (f" (it ends with eos_token {eos!r}, which the template writes after the last message when "
                "add_generation_prompt=False)")
    return ""


def _tool_support(render, msgs) -> CaseResult:
    # A template that ignores tool_calls renders the assistant turn as empty text: training on
    # such rollouts would teach the model nothing about calling tools, so those checks are moot.
    k = next(i for i, m in enumerate(msgs) if m.get("tool_calls"))
    try:
        before, after = render("tool calls", msgs[:k]), render("tool calls", msgs[:k + 1])
    except Exception as e:  # noqa: BLE001
        return CaseResult("tool calls", "SKIP", f"template raises on tool_calls: {type(e).__name__}: {e}")
    if after.count(TOOL_NAME) <= before.count(TOOL_NAME):
        return CaseResult("tool calls", "SKIP", "template does not render an assistant's tool_calls "
                                                "(no tool support); not checked")
    return CaseResult("tool calls", "PASS", "template renders tool_calls; tool conversation included below")


def _generation_prompt(convs, render, specials) -> CaseResult:
    # The engine renders the prompt with add_generation_prompt=True and the model continues from
    # there; training renders the finished turn. The two must agree up to the reply's first token.
    added = separator = None
    for name, msgs in convs.items():
        for k, m in enumerate(msgs):
            if m["role"] != "assistant" or k == 0:
                continue
            where = f"'{name}' k={k}"
            try:
                with_gen, without = render(name, msgs[:k], True), render(name, msgs[:k])
                full = render(name, msgs[:k + 1])
            except Exception as e:  # noqa: BLE001
                return CaseResult("generation prompt", "FAIL", f"{where}: rendering raised {type(e).__name__}: {e}")
            if with_gen == without:
                fail, sep = _headerless_turn(where, k, with_gen, full, m["content"], specials)
                if fail:
                    return CaseResult("generation prompt", "FAIL", fail)
                separator = sep if separator is None else separator
            elif not full.startswith(with_gen):
                return CaseResult("generation prompt", "FAIL", _not_prefix_of_turn(where, k, with_gen, full, specials))
            else:
                added = added or _added_text(with_gen, without, specials)
    return CaseResult("generation prompt", "PASS", _generation_prompt_detail(added, separator))


def _headerless_turn(where, k, prompt, full, reply, specials) -> tuple[str | None, str | None]:
    """add_generation_prompt=True adds nothing: the template has no assistant header (Mistral's
    `[INST] ... [/INST]`, Llama-2). That is correct when the finished turn is the prompt, then at most
    whitespace, then the reply. Returns (failure detail or None, the whitespace before the reply)."""
    if not full.startswith(prompt):
        return _not_prefix_of_turn(where, k, prompt, full, specials), None
    rest = full[len(prompt):]
    pos = rest.find(reply)
    if pos < 0:
        return (f"{where}: add_generation_prompt=True adds nothing, and the finished turn does not continue the "
                f"prompt with the reply: it continues with {rest[:40]!r}"), None
    if rest[:pos].strip():
        return ("add_generation_prompt=True adds nothing: the engine would generate without the assistant header "
                f"{rest[:pos]!r} that the finished turn puts before the reply"), None
    return None, rest[:pos]


def _not_prefix_of_turn(where, k, prompt, full, specials) -> str:
    return (f"{where}: render(messages[:{k}], add_generation_prompt=True) is not a prefix of the finished turn; "
            f"{_diff(prompt, full, specials)}")


def _added_text(with_gen, without, specials) -> str:
    """What add_generation_prompt=True adds, quoted. Phi-3 style templates also drop something (the
    eos_token that ends a finished conversation): then both sides from where they differ."""
    if with_gen.startswith(without):
        return repr(with_gen[len(without):])
    i = _first_difference(with_gen, without, specials)
    return f"{with_gen[i:]!r} in place of the trailing {without[i:]!r}"


def _generation_prompt_detail(added, separator) -> str:
    if separator is None:
        return f"adds {added}; a prefix of every finished assistant turn"
    then = f"then {separator!r}, " if separator else ""
    headerless = (f"the template has no assistant header; the finished assistant turn is the rendered prompt, "
                  f"{then}then the reply")
    if added is None:
        return f"adds nothing: {headerless}"
    return f"adds {added}, a prefix of the finished assistant turn, or nothing where {headerless}"


def _end_of_turn(tokenizer, eos_ids, render, encode, convs) -> CaseResult:
    # What the template writes right after an assistant's content is what the model learns to
    # emit to end its turn. If the engine does not stop on that token, generation runs on to the
    # length limit (the classic Qwen `<|im_end|>` vs `<|endoftext|>` mismatch).
    eos = sorted({i for i in [tokenizer.eos_token_id, *eos_ids] if i is not None})
    eos_desc = "{" + ", ".join(f"{tokenizer.convert_ids_to_tokens(i)!r} ({i})" for i in eos) + "}"
    name = "with system" if "with system" in convs else "no system"
    msgs = convs[name]
    reply = msgs[-1]["content"]
    try:
        text = render(name, msgs)
    except Exception as e:  # noqa: BLE001
        return CaseResult("end of turn", "FAIL", f"rendering raised {type(e).__name__}: {e}")
    pos = text.rfind(reply)
    if pos < 0:
        return CaseResult("end of turn", "SKIP", "the assistant's content does not appear verbatim in the render")
    ids = encode(text[pos + len(reply):])
    # Whitespace before the stop token (Llama-2's ' </s>') is fine: the model emits it, then stops.
    lead = 0
    while lead < len(ids) and ids[lead] not in eos and not tokenizer.decode([ids[lead]]).strip():
        lead += 1
    if lead == len(ids):
        return CaseResult("end of turn", "FAIL", f"nothing but whitespace follows an assistant message; no "
                                                 f"end-of-turn token (EOS set {eos_desc})")
    tok = f"{tokenizer.convert_ids_to_tokens(ids[lead])!r} ({ids[lead]})"
    if ids[lead] not in eos:
        return CaseResult("end of turn", "FAIL", f"end-of-turn token {tok} is not in the EOS set {eos_desc}: "
                                                 "responses would never stop (add it to generation_config.json's "
                                                 "eos_token_id)")
    return CaseResult("end of turn", "PASS", f"end-of-turn token {tok} is in the EOS set {eos_desc}")


def _round_trip(renders, encode, decode) -> CaseResult:
    # The trainer may re-tokenize rendered text: it must come back as the same text.
    checked = 0
    for name, texts in renders.items():
        full = texts[-1][1]
        if not isinstance(full, str):
            continue
        checked += 1
        if (back := decode(encode(full))) != full:
            hint = ""
            if "".join(back.split()) == "".join(full.split()):
                hint = " (only whitespace differs: an added token absorbs the whitespace beside it, rstrip/lstrip)"
            return CaseResult("round trip", "FAIL",
                              f"'{name}': decode(encode(text)) differs; {_diff(full, back)}{hint}")
    if not checked:
        return CaseResult("round trip", "SKIP", "no conversation rendered")
    return CaseResult("round trip", "PASS", "decode(encode(render)) == render for every conversation")


def _diff(a: str, b: str, specials=()) -> str:
    """Where two strings first differ, with ~40 characters of each side from there; a difference
    inside one of the `specials` tokens is shown from that token's start."""
    i = _first_difference(a, b, specials)
    return f"first difference at char {i}: {a[i:i + 40]!r} vs {b[i:i + 40]!r}"


def _first_difference(a: str, b: str, specials=()) -> int:
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    for tok in specials:
        for text in (a, b):
            start = text.rfind(tok, 0, i + len(tok) - 1)  # the last one starting before i
            if start >= 0 and i < start + len(tok):
                i = start
    return i
