"""What crosses between `miles serve`'s HTTP side and its scheduler thread: one sequence to
generate (`SequenceRequest`, parsed from a `/generate` body by protocol.py) and what became of it
(`SequenceResult`, turned back into SGLang's response shape by protocol.py). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RowSampling:
    """One sequence's sampling parameters (SGLang's `sampling_params`, as miles honours them)."""

    max_new_tokens: int
    temperature: float
    """0 means greedy (SGLang rewrites temperature < 1e-6 to greedy too)."""
    top_p: float
    top_k: int | None
    """None: the whole vocabulary (SGLang's -1 and its default 2^30)."""
    seed: int
    """The sequence's random stream (`sampling_seed`, or one the server drew)."""
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    """Stop strings, matched on the decoded completion."""
    ignore_eos: bool = False
    """Skips the EOS and `stop_token_ids` checks (as SGLang)."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    """Keep the matched stop token or string in `text`."""


@dataclass(frozen=True, kw_only=True)
class SequenceRequest:
    rid: str
    input_ids: list[int]
    sampling: RowSampling
    return_logprob: bool = False
    logprob_start_len: int = -1
    """-1: output log-probs only; k >= 0: also `input_token_logprobs` from prompt position k."""
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    return_routed_experts: bool = False
    """MoE: `meta_info.routed_experts`, the experts each layer chose for every token fed."""

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.input_ids)

    @property
    def final_len(self) -> int:
        """Prompt plus the most tokens it may make: what admission reserves."""
        return len(self.input_ids) + self.sampling.max_new_tokens


@dataclass(frozen=True)
class Finish:
    kind: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or string
    message: str | None = None  # why an abort happened
    in_waiting_queue: bool = False  # aborted before it was ever scheduled


@dataclass
class SequenceResult:
    output_ids: list[int]
    output_logprobs: list[float]  # one per output id, EOS included
    finish: Finish
    weight_version: str  # the engine's weights when the sequence finished
    e2e_latency: float  # seconds from arrival to finish
    input_logprobs: list[float | None] | None = None  # per prompt position from logprob_start_len; first None
    retractions: int = 0  # times a pause (mode retract) sent it back to the queue
    # MoE, when asked: int32 bytes of (prompt + output - 1, layers, k) expert ids, SGLang's layout
    routed_experts: bytes | None = None
