"""What callers get back: vLLM's RequestOutput / CompletionOutput, plus readout loops and seeds."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """vLLM's Logprob: one token's log-prob, its 1-based rank among its position's log-probs (1 = the most
    likely; None where it is not known) and its text (None from the token engines, which hold no tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a prompt."""

    index: int  # which of the n completions
    token_ids: list[int]  # generated tokens, including a final stop/eos token
    logprobs: list[float]  # processed log-prob of each token under the distribution it was drawn from
    readout_loops: list[int]  # the loop whose readout produced each token
    cumulative_logprob: float  # sum of logprobs
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"; None while running
    seed: int  # the seed the request used (drawn at admission when not given)
    weight_version: int = 0  # version of the weights when the request was admitted (per token: weight_versions)
    top_logprobs: list[dict[int, float]] | None = None  # with SamplingParams(logprobs=k > 0)
    stop_reason: int | None = None  # the stop token id when finish_reason == "stop"
    error: str | None = None  # what failed when finish_reason == "error"
    num_drafted: int = 0  # verify mode: loop-s drafts checked against loop T
    num_accepted: int = 0  # verify mode: drafts accepted (the rest were rolled back)
    weight_versions: list[int] = field(default_factory=list)  # per token: the weight version that produced it
    num_preemptions: int = 0  # times it was preempted for KV room (each inserted a loop-T readout)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The outputs of one request (n completions of one prompt)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # with SamplingParams(prompt_logprobs=k), vLLM's shape: None for position 0, then per prompt position a
    # dict token id -> Logprob: the prompt token first, then the k best (in rank order); None when not asked
    # for or not computed (a request that ended before its prefill did). DELTA streams carry it once.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # vLLM's: prompt tokens whose KV came from the prefix cache (completion 0's)
