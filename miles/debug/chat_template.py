"""`miles verify-chat-template --model PATH`: is this chat template safe for multi-turn RL?

    miles verify-chat-template --model Qwen/Qwen2.5-0.5B-Instruct-dir
    miles verify-chat-template --model DIR --template my_template.jinja   # try a fixed template

Multi-turn rollouts are built by appending: the engine renders the prompt, generates a reply,
appends the next message and keeps the token ids it already has. Training then treats the whole
sequence as one concatenation of turns. That is only correct if rendering never rewrites what was
rendered before, if the generation prompt is exactly what the template would put before a reply,
and if the token that closes an assistant turn is one the engine stops on. Each of these fails
silently in training (wrong log-probs, responses that never stop), so we check them up front.

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

    def render(msgs, gen=False):
        # Every prefix of the tool conversation gets the same tool definitions, as a rollout would.
        tools = TOOLS if msgs[0] is CONVERSATIONS["tool calls"][0] else None
        return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    convs = {k: v for k, v in CONVERSATIONS.items() if k != "tool calls"}
    results.append(_tool_support(render))
    if results[-1].status == "PASS":
        convs["tool calls"] = CONVERSATIONS["tool calls"]

    # Render every prefix once; a template that raises is a failure of the case that needs it.
    renders: dict[str, list] = {}
    for name, msgs in convs.items():
        renders[name] = []
        for k in range(1, len(msgs) + 1):
            try:
                renders[name].append(render(msgs[:k]))
            except Exception as e:  # noqa: BLE001 - Jinja raises anything (TemplateError, TypeError...)
                renders[name].append(e)

    text_fail = tok_fail = None
    steps = tok_steps = 0
    for name, texts in renders.items():
        for k in range(1, len(texts)):
            a, b = texts[k - 1], texts[k]
            where = f"'{name}' k={k}"
            if isinstance(a, Exception) or isinstance(b, Exception):
                err = a if isinstance(a, Exception) else b
                text_fail = text_fail or f"{where}: rendering raised {type(err).__name__}: {err}"
                continue
            steps += 1
            if not b.startswith(a):
                text_fail = text_fail or (f"{where}: render(messages[:{k}]) is not a prefix of "
                                          f"render(messages[:{k + 1}]); {_diff(a, b)}")
                continue
            tok_steps += 1
            ta, tb = encode(a), encode(b)
            if tb[:len(ta)] != ta:
                i = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
                tok_fail = tok_fail or (f"{where}: token ids diverge at token {i}: "
                                        f"{tokenizer.convert_ids_to_tokens(ta[i:i + 4])} vs "
                                        f"{tokenizer.convert_ids_to_tokens(tb[i:i + 4])} (the text boundary "
                                        f"merges into a different token)")
    scope = f"{len(convs)} conversations ({', '.join(convs)}), {steps} steps"
    results.append(CaseResult("prefix stability (text)", "FAIL" if text_fail else "PASS", text_fail or scope))
    results.append(CaseResult("prefix stability (tokens)", "FAIL" if tok_fail else "PASS",
                              tok_fail or (f"{tok_steps} text-stable steps" if text_fail else scope)))
    results.append(_generation_prompt(convs, render))
    results.append(_end_of_turn(tokenizer, eos_ids, render, encode))

    bad = None
    for name, texts in renders.items():
        full = texts[-1]
        if isinstance(full, str):
            back = tokenizer.decode(encode(full), skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if back != full:
                bad = bad or f"'{name}': decode(encode(text)) differs; {_diff(full, back)}"
    results.append(CaseResult("round trip", "FAIL" if bad else "PASS",
                              bad or "decode(encode(render)) == render for every conversation"))
    return results


def _tool_support(render) -> CaseResult:
    # A template that ignores tool_calls renders the assistant turn as empty text: training on
    # such rollouts would teach the model nothing about calling tools, so those checks are moot.
    msgs = CONVERSATIONS["tool calls"]
    try:
        before, after = render(msgs[:2]), render(msgs[:3])
    except Exception as e:  # noqa: BLE001
        return CaseResult("tool calls", "SKIP", f"template raises on tool_calls: {type(e).__name__}: {e}")
    if after.count(TOOL_NAME) <= before.count(TOOL_NAME):
        return CaseResult("tool calls", "SKIP", "template does not render an assistant's tool_calls "
                                                "(no tool support); not checked")
    return CaseResult("tool calls", "PASS", "template renders tool_calls; tool conversation included below")


def _generation_prompt(convs, render) -> CaseResult:
    # The engine renders the prompt with add_generation_prompt=True and the model continues from
    # there; training renders the finished turn. The two must agree up to the reply's first token.
    added = None
    for name, msgs in convs.items():
        for k, m in enumerate(msgs):
            if m["role"] != "assistant" or k == 0:
                continue
            try:
                with_gen, without, full = render(msgs[:k], True), render(msgs[:k]), render(msgs[:k + 1])
            except Exception as e:  # noqa: BLE001
                return CaseResult("generation prompt", "FAIL", f"'{name}' k={k}: rendering raised {e}")
            if with_gen == without:
                return CaseResult("generation prompt", "FAIL", "add_generation_prompt=True adds nothing: the engine "
                                                               "would generate without the assistant header")
            if not full.startswith(with_gen):
                return CaseResult("generation prompt", "FAIL", f"'{name}' k={k}: render(messages[:{k}], "
                                  f"add_generation_prompt=True) is not a prefix of the finished turn; "
                                  f"{_diff(with_gen, full)}")
            added = added or with_gen[len(without):]
    return CaseResult("generation prompt", "PASS", f"adds {added!r}; a prefix of every finished assistant turn")


def _end_of_turn(tokenizer, eos_ids, render, encode) -> CaseResult:
    # What the template writes right after an assistant's content is what the model learns to
    # emit to end its turn. If the engine does not stop on that token, generation runs on to the
    # length limit (the classic Qwen `<|im_end|>` vs `<|endoftext|>` mismatch).
    eos = sorted({i for i in [tokenizer.eos_token_id, *eos_ids] if i is not None})
    eos_desc = "{" + ", ".join(f"{tokenizer.convert_ids_to_tokens(i)!r} ({i})" for i in eos) + "}"
    msgs = CONVERSATIONS["with system"]
    reply = msgs[-1]["content"]
    try:
        text = render(msgs)
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


def _diff(a: str, b: str) -> str:
    """Where two strings first differ, with ~40 characters of each side from there."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at char {i}: {a[i:i + 40]!r} vs {b[i:i + 40]!r}"
