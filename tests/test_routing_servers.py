"""MoE routes through inference servers: `miles serve` answers SGLang's `return_routed_experts` (base64
int32 (tokens, layers, k) in `meta_info.routed_experts`), miles' SGLang client asks for them and decodes
them, a vLLM answer's `.npy` routes decode too, and a run through servers replays them (R3)."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
import torch
from test_serve import ServeProcess
from test_train import metrics, run

from miles.bridge import routing
from miles.rollout.remote.protocol import Garbage, decode_routes
from miles.testing.tiny import build_moe_model_dir, train_args


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return build_moe_model_dir(tmp_path_factory.mktemp("serve-moe"), "mixtral")


@pytest.fixture(scope="module")
def moe_server(moe_model, tmp_path_factory):
    s = ServeProcess("--hf-checkpoint", str(moe_model), log=tmp_path_factory.mktemp("serve") / "moe.log")
    yield s
    s.stop()


def full_forward_routes(model_dir, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), layers, k) the routes of one fp32 forward over `tokens`."""
    from miles.utils.models import load_causal_lm

    model = load_causal_lm(model_dir, device="cpu", attention_backend="sdpa")
    with torch.no_grad(), routing.record_routes(model) as calls:
        model(torch.tensor([tokens]))
    return torch.stack(calls[0], dim=1).long()


def test_miles_serve_returns_the_routes_of_every_token_it_fed(moe_server, moe_model):
    """A batch of two prompts of different lengths (left-padded together in one prefill, then decoded
    side by side): each answer's routes cover prompt + output - 1 tokens and equal those of one full
    forward over the same tokens."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    body = {"input_ids": prompts, "return_routed_experts": True, "return_logprob": True,
            "sampling_params": [{"max_new_tokens": 7, "temperature": 1.0, "sampling_seed": s, "ignore_eos": True}
                                for s in (1, 2)]}
    answer = httpx.post(f"{moe_server.url}/generate", json=body, timeout=60).json()
    for prompt, item in zip(prompts, answer):
        fed = prompt + item["output_ids"][:-1]
        routes = np.frombuffer(base64.b64decode(item["meta_info"]["routed_experts"]), dtype=np.int32)
        routes = torch.from_numpy(routes.reshape(len(fed), 2, 2).astype(np.int64))
        full = full_forward_routes(moe_model, fed)
        assert routing.mismatch_counts([routes[:, i] for i in range(2)], [full[:, i] for i in range(2)]) == \
            (0, 2 * len(fed))
    plain = httpx.post(f"{moe_server.url}/generate", json={**body, "return_routed_experts": False}, timeout=60).json()
    assert "routed_experts" not in plain[0]["meta_info"]


def test_miles_serve_refuses_routes_for_a_dense_model(tiny_model, tmp_path):
    s = ServeProcess("--hf-checkpoint", str(tiny_model), log=tmp_path / "dense.log")
    try:
        r = httpx.post(f"{s.url}/generate", json={"input_ids": [5, 6], "return_routed_experts": True}, timeout=30)
    finally:
        s.stop()
    assert r.status_code == 400 and "return_routed_experts: the model has no MoE layers" in r.text


def test_a_run_through_miles_serve_replays_the_servers_routes(moe_model, prompt_file, reward_module, tmp_path):
    """--rollout-backend sglang (miles serve started by miles) on an MoE model: the samples carry the
    server's routes, the trainer compares and replays them (fp32: every route agrees)."""
    args = train_args(moe_model, prompt_file, tmp_path / "run", reward_module)
    out = run(args, "--num-rollout", "1", "--rollout-backend", "sglang", "--use-rollout-routing-replay",
              "--sglang-log-dir", str(tmp_path / "servers"))
    log = (out / "train.log").read_text()
    assert "MoE model: the servers are asked for each token's routed experts (top-2)" in log
    assert metrics(out)[0]["train/routing_mismatch_frac"] == 0.0
    assert "| MoE routing              | PASS | routing_mismatch_frac 0" in log


def test_the_sglang_client_decodes_routes_and_refuses_garbage():
    routes = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2) % 8
    text = base64.b64encode(routes.tobytes()).decode()
    assert np.array_equal(decode_routes(text, tokens=5, top_k=2), routes)
    with pytest.raises(Garbage, match="not tokens"):
        decode_routes(text, tokens=4, top_k=2)
    with pytest.raises(Garbage, match="does not decode"):
        decode_routes("%%%", tokens=5, top_k=2)


def test_a_vllm_answer_s_npy_routes_decode():
    """vLLM's completions choice: `routed_experts` is base64 of a `.npy` of (tokens - 1, layers, k)
    (uint8 for few experts). Checked on a built answer: vLLM's CPU backend cannot return routes (its
    --enable-return-routed-experts needs the V2 model runner, which needs Triton)."""
    from miles.config import SamplingParams
    from miles.rollout.remote.http import ServerClient
    from miles.rollout.remote.vllm import VLLMServer

    routes = (np.arange(6 * 2 * 2).reshape(6, 2, 2) % 8).astype(np.uint8)
    buf = io.BytesIO()
    np.save(buf, routes)
    answer = {"choices": [{"token_ids": [7, 8, 9], "logprobs": {"token_logprobs": [-0.1, -0.2, -0.3]},
                           "finish_reason": "length", "routed_experts": base64.b64encode(buf.getvalue()).decode()}]}
    server = VLLMServer(ServerClient("http://x", flag="--vllm-url", timeout=1, retries=0), eos_token_ids=[],
                        vocab_size=100, routed_top_k=2)
    out = server._output(answer, SamplingParams(max_new_tokens=3, temperature=1.0, top_p=1.0), prompt_len=4)
    assert out.routed_experts.dtype == np.int16 and np.array_equal(out.routed_experts, routes)
    dense = VLLMServer(ServerClient("http://x", flag="--vllm-url", timeout=1, retries=0), eos_token_ids=[],
                       vocab_size=100)
    assert dense._output(answer, SamplingParams(max_new_tokens=3, temperature=1.0, top_p=1.0), 4).routed_experts is None
    json.dumps(answer)  # the built answer is plain JSON, as a server's


def test_vllm_on_a_gpu_is_started_with_routed_experts_for_an_moe_model():
    from miles.rollout.remote.launcher import server_command

    common = {"precision": "bf16", "seed": 0, "max_model_len": 128, "python": "/usr/bin/python3", "weight_version": 0}
    gpu, env = server_command("vllm", "/m", 1, device="cuda", moe=True, **common)
    assert "--enable-return-routed-experts" in gpu and env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    cpu, env = server_command("vllm", "/m", 1, device="cpu", moe=True, **common)
    assert "--enable-return-routed-experts" not in cpu and "VLLM_USE_V2_MODEL_RUNNER" not in env


def test_miles_serve_loads_an_moe_checkpoint_saved_per_expert_and_refuses_a_broken_one(tmp_path):
    """save_pretrained writes a Mixtral's fused in-memory experts back per expert: /update_weights_from_disk
    converts that layout through from_pretrained; a checkpoint missing one expert's tensor is refused."""
    from safetensors.torch import load_file, save_file

    from miles.serve.weights import ParameterSpecs, WeightLoadError, load_checked
    from miles.testing.tiny import build_moe_model

    model = build_moe_model("mixtral")
    model.save_pretrained(tmp_path)
    assert any(".experts.0.w1." in k for k in load_file(str(tmp_path / "model.safetensors")))  # the saved layout
    specs = ParameterSpecs.of(model)
    tensors = load_checked(str(tmp_path), specs)
    assert tensors.keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(tensors[n], p) for n, p in model.named_parameters())
    state = load_file(str(tmp_path / "model.safetensors"))
    attention = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.q_proj.weight"}
    save_file(attention, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="lacks model.layers.1.self_attn.q_proj.weight"):
        load_checked(str(tmp_path), specs)  # from_pretrained would have filled it with a fresh init
    del state[next(k for k in state if ".experts.3.w1." in k)]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="does not load as MixtralForCausalLM") as e:
        load_checked(str(tmp_path), specs)
    assert "\n" not in str(e.value)
