"""A vLLM OpenAI-compatible server (started with VLLM_SERVER_DEV_MODE=1 for its RL endpoints).

Generation is one `POST /v1/completions` per sample: a token-id `prompt`, the sample's `seed`,
`logprobs: 0` (the sampled token's log-prob) and `return_token_ids`. One request per sample because
vLLM's `seed` is per request: a batched request would give a GRPO group's identical prompts one
seed, hence identical responses. Log-probs are the sampling distribution's only when the server
runs with `--logprobs-mode processed_logprobs` (miles starts it so; `raw_logprobs`, vLLM's default,
ignores the temperature and the step-1 alignment check says so).

Weights: `/pause?mode=wait` -> `/collective_rpc reload_weights {weights_path}` ->
`/reset_prefix_cache` -> `/resume`. vLLM's `/weight_checker` digests are not comparable on CPU
(fused tensors such as qkv_proj hash as empty), so `weights_checksum` is None and a weight check
is behavioural: `prompt_log_probs` of a fixed sequence, compared with the trainer's.

MoE (`routed_top_k` set): each choice's `routed_experts` (base64 of a `.npy`, (tokens - 1, layers, k))
is decoded into the output. vLLM sends them only when started with `--enable-return-routed-experts`
(miles passes it, with VLLM_USE_V2_MODEL_RUNNER=1, when it starts vLLM on a GPU for an MoE model);
vLLM's CPU backend cannot (that runner needs Triton), so there an MoE rollout comes without routes.

Memory: `/sleep?level=1` (weights offloaded to CPU memory, KV cache discarded; the engine pauses)
and `/wake_up`, on a server started with `--enable-sleep-mode` (miles passes it when it starts
vLLM on a GPU). Without it (vLLM's CPU backend has no sleep mode: its worker ignores `/sleep`, and
`--enable-sleep-mode` refuses to start) a release frees nothing, so it is a logged no-op, as is
the resume; whether the server has one is read once from its `/server_info`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx

from miles.config import SamplingParams
from miles.rollout.engine import GenerationOutput
from miles.rollout.remote.http import EngineError, ServerClient
from miles.rollout.remote.protocol import Garbage, checked_output, decode_routes

FLAG = "--vllm-url"

logger = logging.getLogger("miles")


class VLLMServer:
    flag = FLAG
    health_path = "/health"

    def __init__(self, client: ServerClient, *, eos_token_ids: list[int], vocab_size: int,
                 routed_top_k: int | None = None):
        """`routed_top_k`: an MoE model's experts per token (read each choice's `routed_experts`: a
        server started with --enable-return-routed-experts sends them), None for a dense one."""
        self.client, self.eos_token_ids, self.vocab_size = client, eos_token_ids, vocab_size
        self.routed_top_k = routed_top_k
        self.weight_version: int | None = None  # vLLM does not track one: the last step loaded
        self._sleep_mode: bool | None = None  # started with --enable-sleep-mode; asked on first use

    def body(self, prompt: list[int], sampling: SamplingParams, seed: int) -> dict[str, Any]:
        # Every sampling field explicit: vLLM fills unset ones from the model's generation_config.json.
        return {"prompt": prompt, "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "seed": seed,
                "logprobs": 0, "return_token_ids": True, "stop_token_ids": self.eos_token_ids,
                "skip_special_tokens": False, "n": 1}

    async def generate(self, session: httpx.AsyncClient, prompts: list[list[int]], sampling: SamplingParams,
                       seeds: list[int]) -> list[GenerationOutput]:
        import asyncio

        answers = await asyncio.gather(*(self.client.call(session, "POST", "/v1/completions",
                                                          self.body(p, sampling, s)) for p, s in zip(prompts, seeds)))
        try:
            return [self._output(a, sampling, len(p)) for a, p in zip(answers, prompts)]
        except Garbage as e:
            raise self.client.fail(f"POST /v1/completions answered garbage: {e}") from None

    def _output(self, answer: Any, sampling: SamplingParams, prompt_len: int) -> GenerationOutput:
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise Garbage("no single choice in the completion")
        choice = choices[0]
        logprobs = choice.get("logprobs")
        if not isinstance(logprobs, dict) or "token_ids" not in choice:
            raise Garbage("no token_ids / logprobs (the server must honour return_token_ids and logprobs)")
        if choice.get("finish_reason") == "abort":
            raise Garbage("the server aborted the request")
        out = checked_output(choice["token_ids"], logprobs.get("token_logprobs"), choice.get("finish_reason"),
                             max_new_tokens=sampling.max_new_tokens, vocab_size=self.vocab_size,
                             weight_version=self.weight_version)
        if self.routed_top_k is not None and choice.get("routed_experts") is not None:
            out.routed_experts = decode_routes(choice["routed_experts"], tokens=prompt_len + len(out.token_ids) - 1,
                                               top_k=self.routed_top_k, npy=True)
        return out

    def load_weights(self, path: str, weight_version: int) -> None:
        c = self.client
        if not any(Path(path).glob("*.safetensors")):  # vLLM 0.32's engine dies at the next request after a bad reload
            raise c.fail(f"{path} holds no *.safetensors to reload_weights from")
        c.request("POST", "/pause", params={"mode": "wait"})
        try:
            c.request("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
            c.request("POST", "/reset_prefix_cache")
        finally:
            c.request("POST", "/resume")
        self.weight_version = weight_version

    def release_memory(self) -> None:
        if self.sleep_mode():
            self.client.request("POST", "/sleep", params={"level": 1})

    def resume_memory(self) -> None:
        if self.sleep_mode():
            self.client.request("POST", "/wake_up")

    def sleep_mode(self) -> bool:
        """Whether /sleep frees memory here; False is logged once (release and resume are no-ops)."""
        if self._sleep_mode is None:
            try:
                config = self.client.request("GET", "/server_info", params={"config_format": "json"})["vllm_config"]
                self._sleep_mode = bool(config["model_config"]["enable_sleep_mode"])
                device = config["device_config"]["device"]
            except EngineError as e:
                if e.status != 404:  # 404: no VLLM_SERVER_DEV_MODE, so no /sleep either
                    raise
                self._sleep_mode, device = False, "unknown (no /server_info: VLLM_SERVER_DEV_MODE unset)"
            except (KeyError, TypeError):
                raise self.client.fail("GET /server_info answered no vllm_config.model_config.enable_sleep_mode") \
                    from None
            if not self._sleep_mode:
                logger.info("vLLM %s has no sleep mode (device %s, started without --enable-sleep-mode; vLLM's CPU "
                            "backend cannot sleep): releasing and resuming its memory are no-ops", self.client.url,
                            device)
        return self._sleep_mode

    def weights_checksum(self) -> dict[str, dict] | None:
        return None

    def prompt_log_probs(self, tokens: list[int]) -> list[float]:
        """log p(tokens[i] | tokens[:i]) for i >= 1, from `prompt_logprobs` (never temperature-scaled)."""
        answer = self.client.request("POST", "/v1/completions",
                                     {"prompt": tokens, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0})
        try:
            entries = answer["choices"][0]["prompt_logprobs"]
            return [float(entries[i][str(t)]["logprob"]) for i, t in enumerate(tokens) if i > 0]
        except (KeyError, IndexError, TypeError, ValueError):
            raise self.client.fail(f"POST /v1/completions (scoring) gave no prompt_logprobs for {len(tokens)} tokens") \
                from None
