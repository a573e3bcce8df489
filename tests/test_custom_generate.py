"""Custom generation (--custom-generate-function-path): a two-turn rollout with a tool's output between
the turns trains only on the policy's tokens; its dumps replay bitwise; bad returns are refused."""

from __future__ import annotations

import pytest
import torch
from test_train import metrics, run

from miles.cli.main import main
from miles.rollout.examples.calculator import calculate

TWO_TURNS = "miles.testing.generate:two_turns"


def dumped(path):
    return torch.load(path, weights_only=True)["samples"]


def test_a_two_turn_rollout_masks_the_tool_output(tiny_args, tmp_path):
    """The dumps hold both turns and the tool's tokens between them, loss_mask 0 exactly there."""
    from miles.testing.generate import TOOL_TEXT
    from miles.testing.tiny import build_tokenizer

    tool = build_tokenizer().encode(TOOL_TEXT, add_special_tokens=False)
    out = run(tiny_args, "--custom-generate-function-path", TWO_TURNS, "--num-rollout", "1",
              "--save-debug-rollout-data", str(tmp_path / "d" / "{rollout_id}.pt"))
    samples = dumped(tmp_path / "d" / "0.pt")
    assert len(samples) == 16
    for s in samples:
        response = s["tokens"][len(s["tokens"]) - s["response_length"]:]
        mask = s["loss_mask"]
        start = mask.index(0)
        assert response[start:start + len(tool)] == tool and mask.count(0) == len(tool)
        assert all(m == 1 for m in mask[:start] + mask[start + len(tool):])
    assert "train/loss" in metrics(out)[0]


def test_the_masked_tokens_do_not_train_or_count_in_the_mismatch(tiny_args, tmp_path):
    """Nonsense log-probs where the mask is 0 (-50 instead of 0) change nothing: the same loss, grad norm,
    trainer/engine gap and weights, bitwise. --use-tis puts the engine's log-probs into the loss, so a
    masked token that trained would move it."""
    from safetensors.torch import load_file

    a = run(tiny_args, "--custom-generate-function-path", TWO_TURNS, "--save-interval", "2", "--use-tis",
            "--output-dir", str(tmp_path / "a"))
    b = run(tiny_args, "--custom-generate-function-path", "miles.testing.generate:two_turns_other_masked_log_probs",
            "--save-interval", "2", "--use-tis", "--output-dir", str(tmp_path / "b"))
    keys = ("train/loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff", "forward_logp_max_diff")
    assert [[r[k] for k in keys] for r in metrics(a)] == [[r[k] for k in keys] for r in metrics(b)]
    wa, wb = (load_file(d / "checkpoints" / "step_2" / "model.safetensors") for d in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    log = (a / "train.log").read_text()
    assert "Alignment check | trainer vs engine        | PASS" in log  # the tool tokens' 0.0 is not compared


def test_a_custom_rollout_replays_bitwise(tiny_args, tmp_path):
    live = run(tiny_args, "--custom-generate-function-path", TWO_TURNS, "--save-debug-rollout-data",
               str(tmp_path / "d" / "{rollout_id}.pt"), "--output-dir", str(tmp_path / "live"))
    replay = run(tiny_args, "--load-debug-rollout-data", str(tmp_path / "d" / "{rollout_id}.pt"),
                 "--output-dir", str(tmp_path / "replay"))
    keys = ("train/loss", "train/grad_norm", "train/entropy", "rollout/log_probs")
    assert [[r[k] for k in keys] for r in metrics(live)] == [[r[k] for k in keys] for r in metrics(replay)]


@pytest.mark.parametrize("path, message", [
    ("miles.testing.generate:wrong_mask", "loss_mask must hold response_length"),
    ("miles.testing.rewards:digit_share", "must be an async function"),
    ("miles.testing.generate:nosuch", "has no 'nosuch'"),
])
def test_a_bad_custom_generate_function_is_one_error_line(tiny_args, capsys, path, message):
    assert main(tiny_args + ["--custom-generate-function-path", path, "--num-rollout", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"--custom-generate-function-path {path}" in err and message in err, err


def test_the_calculator_example_evaluates_arithmetic_only():
    assert calculate("12 + 7*2") == "26" and calculate("7/2") == "3.5" and calculate("-(3)") == "-3"
    assert calculate("__import__('os').system('x')") == "error" and calculate("1/0") == "error"


def test_the_calculator_example_masks_its_tool_turn():
    """A stand-in engine writes a <calc> call, then the answer: the tool's <result> tokens are masked."""
    import asyncio

    from miles.bridge.types import Sample
    from miles.config import SamplingParams
    from miles.rollout.custom_generate import EngineClient
    from miles.rollout.engine import GenerationOutput
    from miles.rollout.examples.calculator import generate
    from miles.testing.tiny import build_tokenizer

    tok = build_tokenizer()
    turns = iter(["<calc>19+23</calc>", "42"])

    class Engine:
        def generate(self, prompts, sampling, seeds, progress=None):
            ids = tok.encode(next(turns), add_special_tokens=False)
            return [GenerationOutput(ids, [-0.1] * len(ids), "stop")]

    prompt = tok.encode("What is 19 + 23?", add_special_tokens=False)
    sample = Sample(group_index=0, index=0, prompt="", tokens=list(prompt))
    client = EngineClient(Engine(), SamplingParams(max_new_tokens=64, temperature=1.0, top_p=1.0), 1, tok, None)
    done = asyncio.run(generate(client, sample, client.sampling))
    text = tok.decode(done.tokens[len(prompt):])
    assert text == "<calc>19+23</calc><result>42</result>42"
    masked = tok.decode([t for t, m in zip(done.tokens[len(prompt):], done.loss_mask) if m == 0])
    assert masked == "<result>42</result>" and len(done.rollout_log_probs) == done.response_length


def test_inspect_rollout_shows_the_masked_spans(tiny_args, tiny_model, tmp_path, capsys):
    """The table counts each sample's masked tokens; one sample's view lists its turns, the masked
    span's text, and `masked` instead of a masked token's placeholder log-prob (-50 here)."""
    run(tiny_args, "--custom-generate-function-path", "miles.testing.generate:two_turns_other_masked_log_probs",
        "--num-rollout", "1", "--save-debug-rollout-data", str(tmp_path / "d" / "{rollout_id}.pt"))
    dump = str(tmp_path / "d" / "0.pt")
    capsys.readouterr()
    assert main(["inspect-rollout", dump]) == 0
    table = capsys.readouterr().out
    assert "masked" in table.splitlines()[2] and "-50" not in table
    assert main(["inspect-rollout", dump, "--sample", "1", "--tokenizer", str(tiny_model)]) == 0
    view = capsys.readouterr().out
    assert "| masked " in view and "'<result>42</result>'" in view and "| policy " in view
    assert "masked    n/a    0  '<'" in view and "-50" not in view


def test_the_local_engine_gets_each_turn_of_every_sample_as_one_batch():
    """Six samples, two turns each: two engine calls of six sequences (the sampling setup is the same),
    each sample's calls with its own seeds."""
    from miles.bridge.types import Sample
    from miles.config import SamplingParams
    from miles.rollout.custom_generate import Batcher, run_custom
    from miles.rollout.engine import GenerationOutput
    from miles.testing.generate import two_turns
    from miles.testing.tiny import build_tokenizer

    seeds_seen = []

    class Engine:
        def generate(self, prompts, sampling, seeds, progress=None):
            seeds_seen.extend(seeds)
            return [GenerationOutput([7, 8], [-0.1, -0.2], "length") for _ in prompts]

    engine = Engine()
    batcher = Batcher(engine)
    samples = [Sample(group_index=0, index=i, prompt="", tokens=[5, 6 + i]) for i in range(6)]
    done = run_custom(two_turns, "miles.testing.generate:two_turns", engine, build_tokenizer(), samples,
                      list(range(100, 106)), SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0),
                      batched=True, batcher=batcher)
    assert batcher.calls == [6, 6] and len(set(seeds_seen)) == 12
    assert all(s.loss_mask.count(0) > 0 and s.tokens[:2] == [5, 6 + s.index] for s in done)
