"""A calculator tool for the arithmetic task:
`--custom-generate-function-path miles.rollout.examples.calculator:generate`.

The policy answers; when its answer holds `<calc>EXPRESSION</calc>` (numbers, + - * / and
parentheses), the tool appends `<result>VALUE</result>` (masked: the policy did not write it) and the
policy gets one more turn to give the final answer. At most `MAX_CALLS` tool calls per sample; the
whole response stays within the rollout's --rollout-max-response-len.
"""

from __future__ import annotations

import ast
import operator
import re

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
MAX_CALLS = 2
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or `error` (no names, calls or other syntax are evaluated)."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return "error"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


async def generate(client, sample, sampling):
    prompt_len, budget = len(sample.tokens), sampling.max_new_tokens
    tokens, mask, log_probs = list(sample.tokens), [], []
    for call in range(MAX_CALLS + 1):
        room = budget - len(mask)
        if room <= 0:
            break
        out = await client.generate(tokens, max_new_tokens=room)
        tokens += out.token_ids
        mask += [1] * len(out.token_ids)
        log_probs += out.log_probs
        found = CALL.search(client.tokenizer.decode(out.token_ids, skip_special_tokens=True))
        if found is None or call == MAX_CALLS:
            break
        tool = client.tokenizer.encode(f"<result>{calculate(found.group(1))}</result>", add_special_tokens=False)
        tool = tool[:max(budget - len(mask), 0)]
        tokens += tool
        mask += [0] * len(tool)
        log_probs += [0.0] * len(tool)
    sample.tokens, sample.response_length = tokens, len(tokens) - prompt_len
    sample.loss_mask, sample.rollout_log_probs = mask, log_probs
    return sample
