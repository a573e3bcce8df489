"""The declared seams (Engine, RolloutSource, WeightTransport, the Trainer's calls) tested against
their in-process reference implementations, and the import arrows between the rooms."""

import ast
import inspect
from pathlib import Path

import pytest
import torch

import miles
from miles.bridge.rollout_dump import save_rollout
from miles.bridge.transports import InProcessTransport, ModelWeights, WeightTransport
from miles.bridge.types import RolloutBatch, TrainResult
from miles.config import RolloutConfig, SamplingParams, TrainConfig
from miles.data.prompts import PromptDataset, load_prompt_data
from miles.rollout.engine import Engine
from miles.rollout.replay import ReplaySource
from miles.rollout.source import LiveRollout, RolloutSource
from miles.testing.rewards import digit_share
from miles.train.trainer import Trainer
from miles.utils.models import load_causal_lm
from test_engine import make_engine

PACKAGE = Path(miles.__file__).parent


def protocol_methods(protocol) -> set[str]:
    return {name for name, _ in inspect.getmembers(protocol, inspect.isfunction) if not name.startswith("_")}


def test_local_engine_implements_every_engine_method_with_its_signature(tiny_model):
    engine, _ = make_engine(tiny_model)
    for name in protocol_methods(Engine):
        declared = inspect.signature(getattr(Engine, name))
        actual = inspect.signature(getattr(type(engine), name))
        assert list(actual.parameters) == list(declared.parameters), name


def test_engine_reference_generate_update_checksum_buffers(tiny_model):
    engine, tok = make_engine(tiny_model)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1.0)
    before = engine.weights_checksum()
    assert {c.dtype for c in before.values()} == {"float32"}
    out = engine.generate([tok("hi")["input_ids"]], sampling, [1])[0]
    assert out.weight_version == 0 and len(out.token_ids) == len(out.log_probs) > 0

    other = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    with torch.no_grad():
        other.lm_head.weight.mul_(2)
    engine.update_weights(other.named_parameters(), weight_version=5)
    after = engine.weights_checksum()
    assert [n for n in before if before[n] != after[n]] == ["lm_head.weight"]
    assert engine.generate([tok("hi")["input_ids"]], sampling, [1])[0].weight_version == 5
    assert engine.check_buffers() == []
    with torch.no_grad():
        engine.model.model.rotary_emb.inv_freq.zero_()
    assert engine.check_buffers() == ["model.rotary_emb.inv_freq zeroed (max |diff| 1)"]


def test_in_process_transport_sends_every_parameter(tiny_model):
    engine, _ = make_engine(tiny_model)
    model = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    transport: WeightTransport = InProcessTransport(engine)
    stats = transport.send(ModelWeights(model), 7)
    params = list(model.named_parameters())
    assert (stats.step, stats.tensors) == (7, len(params))
    assert stats.bytes == sum(p.numel() * 4 for _, p in params)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(engine.model.named_parameters(), params))
    assert engine.weight_version == 7


def test_weight_digests_fail_a_tensor_the_engine_changed_or_does_not_hold():
    from miles.bridge.weight_sync import SentTensor, SyncStats, TensorChecksum, verify_digests

    sent = {n: SentTensor([2], "float32", 8, d) for n, d in [("a", "1" * 64), ("b", "2" * 64), ("c", "3" * 64)]}
    stats = SyncStats(step=1, tensors=3, bytes=24, seconds=0.0)
    engine = {"a": TensorChecksum("float32", "1" * 64), "b": TensorChecksum("float32", "f" * 64)}  # no "c"
    verify_digests(stats, sent, engine, debug_level=0)
    assert stats.mismatched == ["b", "c"] and stats.checksum_ok is False and stats.failed
    verify_digests(stats, sent, {**engine, "b": TensorChecksum("float32", "2" * 64),
                                 "c": TensorChecksum("float32", "3" * 64)}, debug_level=0)
    assert stats.mismatched == [] and stats.checksum_ok is True


def rollout_cfg():
    return RolloutConfig(batch_size=2, n_samples_per_prompt=3, rm_type="math", custom_rm_path=None, reward_timeout=60,
                         sampling=SamplingParams(max_new_tokens=5, temperature=1.0, top_p=1.0))


def live(tiny_model, prompt_file):
    engine, tok = make_engine(tiny_model)
    dataset = PromptDataset(load_prompt_data(str(prompt_file), "prompt", "label").records, shuffle=True, seed=3)
    source: RolloutSource = LiveRollout(rollout_cfg(), engine, tok, dataset, digit_share, apply_chat_template=True,
                                        seed=3)
    return source


def test_live_rollout_is_a_pure_function_of_the_rollout_id(tiny_model, prompt_file):
    """Made in order, out of order, or by a fresh source (a resumed run): rollout i is the same."""
    a, b = live(tiny_model, prompt_file), live(tiny_model, prompt_file)
    in_order = [a.generate(i) for i in range(3)]
    backwards = [b.generate(i) for i in (2, 1, 0)][::-1]
    for x, y in zip(in_order, backwards):
        assert isinstance(x, RolloutBatch)
        assert [s.tokens for s in x.samples] == [s.tokens for s in y.samples]
        assert [s.reward for s in x.samples] == [s.reward for s in y.samples]
    batch = in_order[1]
    assert [s.group_index for s in batch.samples] == [0, 0, 0, 1, 1, 1]
    assert {s.weight_version for s in batch.samples} == {0}
    assert batch.stats["perf/rollout_tok_s"] > 0 and "rollout/true_on_policy_redrawn" not in batch.stats
    assert [s.prompt for s in in_order[0].samples] != [s.prompt for s in in_order[1].samples]


def test_replay_source_returns_the_captured_rollout(tiny_model, prompt_file, tmp_path):
    batch = live(tiny_model, prompt_file).generate(0)
    template = str(tmp_path / "data_{rollout_id}.pt")
    save_rollout(template, 0, batch.samples, {})
    replay: RolloutSource = ReplaySource(template, vocab_size=100, rollout_batch_size=2, n_samples_per_prompt=3,
                                         needs_log_probs=False)
    again = replay.generate(0)
    assert [s.to_dict() for s in again.samples] == [s.to_dict() for s in batch.samples]


def train_cfg(**overrides):
    cfg = dict(num_steps_per_rollout=1, global_batch_size=6, micro_batch_size=3, lr=1e-3, weight_decay=0.0,
               clip_grad=1.0, advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.2, kl_coef=0.0,
               use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", use_tis=False, tis_clip=2.0,
               calculate_per_token_loss=False)
    return TrainConfig(**{**cfg, **overrides})


def test_trainer_applies_parallelize_before_building_the_optimizer(tiny_model, prompt_file, tmp_path):
    seen = []

    def parallelize(model):  # stands in for FSDP2: replaces the module the optimizer must own
        wrapped = torch.nn.Module()
        wrapped.inner = model
        wrapped.forward = model.forward
        seen.append(wrapped)
        return wrapped

    model = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    trainer = Trainer(train_cfg(), model, None, temperature=1.0, group_size=3, pad_token_id=1, precision="fp32",
                      record_hashes=True, parallelize=parallelize)
    owned = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert owned == {id(p) for p in seen[0].parameters()}

    batch = live(tiny_model, prompt_file).generate(0)
    result = trainer.train(batch.samples)
    assert isinstance(result, TrainResult)
    assert result.metrics["train/grad_norm"] > 0 and set(result.hashes) == {
        "trainer_log_probs", "loss", "gradients", "parameters"}
    assert result.diagnostics.old_log_probs.shape == result.diagnostics.mask.shape


def module_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("room, forbidden", [
    ("rollout", ("miles.train", "miles.debug", "miles.loop", "miles.cli")),
    ("train", ("miles.rollout", "miles.debug", "miles.loop", "miles.cli")),
    ("bridge", ("miles.rollout", "miles.train", "miles.debug", "miles.loop", "miles.cli")),
    ("serve", ("miles.train", "miles.debug", "miles.loop", "miles.cli")),  # an engine server: rollout side only
])
def test_import_arrows(room, forbidden):
    """The hot path imports no tooling, and the two sides meet only in the bridge (ARCHITECTURE.md)."""
    bad = [(path.relative_to(PACKAGE).as_posix(), name) for path in (PACKAGE / room).rglob("*.py")
           for name in module_imports(path) if name.startswith(forbidden)]
    assert bad == []


def test_the_loop_asks_components_and_never_reaches_into_their_models():
    tree = ast.parse((PACKAGE / "loop.py").read_text())
    reaching = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                and node.attr in ("model", "ref_model", "optimizer") and ast.unparse(node.value).endswith(("trainer",
                                                                                                           "engine"))]
    assert reaching == []
