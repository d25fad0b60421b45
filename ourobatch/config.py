"""EngineConfig: everything an engine is built from, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from scheduler import config as rules  # the rules EngineConfig shares with SchedulerConfig
from scheduler.params import LOGPROBS_MODES, MAX_SEED, SamplingParams

DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
HEAD_DTYPES = ("auto", "float32")
DEVICE_RE = re.compile(r"cpu|cuda(?::\d+)?")  # whether the machine has that device is checked at build
#: The allowed values of EngineConfig's str fields, checked on construction (and the CLIs' choices).
CHOICES: dict[str, tuple[str, ...]] = {**rules.CHOICES, "dtype": DTYPES, "attention_backend": ATTENTION_BACKENDS,
                                       "logprobs_mode": LOGPROBS_MODES, "head_dtype": HEAD_DTYPES}
OWNER = "EngineConfig"  # the name in front of every message


def _positive_int(name: str, value: object, low: int = 1) -> None:
    rules.check_int(OWNER, name, value, low)


def _check_startup_fields(warmup: object, compile_cache_dir: object) -> None:
    if not isinstance(warmup, bool):
        raise TypeError(f"EngineConfig.warmup must be True or False, got {warmup!r}")
    if compile_cache_dir is None:
        return
    if not isinstance(compile_cache_dir, (str, Path)):
        raise TypeError(f"EngineConfig.compile_cache_dir must be a folder path (str) or None, got "
                        f"{compile_cache_dir!r}")
    if not str(compile_cache_dir).strip():
        raise ValueError("EngineConfig.compile_cache_dir must be a folder path or None, got an empty string")
    if Path(compile_cache_dir).expanduser().is_file():
        raise ValueError(f"EngineConfig.compile_cache_dir must be a folder, but {str(compile_cache_dir)!r} is a file")


@dataclass(frozen=True)
class EngineConfig:
    """How to build an engine. See docs/recipe.md for choosing mode, deep_interval and shallow_loops.

    The defaults serve the checkpoint's own policy: full-depth decoding (``deep_interval=1``). Deferred
    and eager decoding (``deep_interval=B > 1``) are explicit opt-ins that trade quality for speed: every
    token between two boundaries is read from the shallow loop s instead of loop T (on the shipped
    pointer-chase model, ``shallow_loops=2`` loses nearly every answer and ``shallow_loops=3`` about 1-2
    points; docs/quality.md). ``mode="verify"`` with B > 1 keeps full depth's output distribution."""

    model: str | Path  # a folder with config.json and model.safetensors (Hugging Face Ouro format)
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"  # "auto" = bfloat16 on CUDA, float32 on CPU; or float32 / float64 / bfloat16 / float16
    mode: str = "deferred"  # "deferred" | "eager" | "verify" (see docs/semantics.md); matters when B > 1
    deep_interval: int = 1  # B: deep loops run every B decoded tokens. 1 (the default) = ordinary full-depth
    #                         decoding, the checkpoint's own policy. B > 1 is an opt-in: deferred/eager read
    #                         the tokens between boundaries from loop s (faster, lossy: measure it,
    #                         docs/quality.md); verify keeps full depth's output law. At most max_model_len
    shallow_loops: int = 2  # s: loops run for every decoded token (1 .. total_ut_steps - 1)
    max_num_seqs: int = 256  # requests decoding at once
    max_model_len: int = 4096  # prompt + max_tokens of one request, at most
    block_size: int = 16  # positions per KV block
    num_kv_blocks: int | None = None  # None: CPU: max_num_seqs * max_model_len capped by kv_cache_memory_gb;
    #                                   CUDA: what gpu_memory_utilization leaves free after the weights
    kv_cache_memory_gb: float = 1.0  # CPU: cap on the automatic KV pool size
    max_num_batched_tokens: int = 8192  # tokens per step: one per decoding request + prompt tokens prefilled;
    #                                     decoding goes first, prefills fill the rest in chunks; >= block_size
    max_prefill_tokens_while_decoding: int | None = None  # while any request decodes, at most this many prompt
    #                                     tokens per step (None: no cap but the budget above); >= block_size
    gpu_memory_utilization: float = 0.9  # CUDA: share of the GPU's memory the engine may hold (weights + KV)
    attention_backend: str = "auto"  # "auto" (Triton on CUDA when the shapes allow), "triton" or "torch"
    cuda_graphs: bool | None = None  # None: on for CUDA with the Triton backend
    kv_allocation: str = "lazy"  # "lazy": KV blocks as positions are written, preempt (recompute) when the
    #                              pool runs dry; "reserve": prompt + max_tokens reserved at admission
    enable_prefix_caching: bool = True  # reuse computed prompt blocks across requests (n samples always share)
    kv_watermark: float = 0.01  # lazy: share of the KV pool kept free when admitting
    seed: int = 0  # engine seed: unseeded request i (in add order) gets a seed derived from (seed, i)
    logprobs_mode: str = "processed"  # reported log-probs: "processed" (the distribution the token was drawn
    #                                   from) or "raw" (log_softmax of the logits before temperature and
    #                                   filters: what a trainer's forward computes). Draws never change
    head_dtype: str = "auto"  # lm_head matmul: "auto" (the model dtype) or "float32" (fp32 logits from an
    #                           fp32 copy of the weight, as RL trainers run their head)
    async_scheduling: bool | None = None  # plan step k+1 while step k runs (vLLM's async scheduling); None: on
    #                                       for CUDA in deferred and eager mode, off on CPU and in verify mode
    warmup: bool = True  # CUDA: compile every kernel specialization, capture graphs and run dummy requests
    #                      before ready, so the first requests compile nothing (ourobatch/warmup.py); CPU: nothing
    compile_cache_dir: str | Path | None = None  # the folder for Triton's (and Inductor's) on-disk compile
    #                                              caches, so a second process starts warm; None: their defaults.
    #                                              An exported TRITON_CACHE_DIR wins (ourobatch/compile_cache.py)

    def __post_init__(self) -> None:
        for name, allowed in CHOICES.items():  # mode, kv_allocation, dtype, attention_backend, logprobs_mode, ...
            rules.check_choice(OWNER, name, getattr(self, name), allowed)
        rules.check_enable_prefix_caching(OWNER, self.enable_prefix_caching)
        rules.check_kv_watermark(OWNER, self.kv_watermark)
        if not isinstance(self.model, (str, Path)):
            raise TypeError(f"EngineConfig.model must be a path to a checkpoint folder, got {self.model!r}")
        if not isinstance(self.device, str):
            raise TypeError(f"EngineConfig.device must be a str like 'cpu' or 'cuda', got {self.device!r}")
        if not DEVICE_RE.fullmatch(self.device):
            raise ValueError(f"EngineConfig.device must be 'cpu', 'cuda' or 'cuda:N' (N = 0, 1, ...), got "
                             f"{self.device!r}")
        rules.check_deep_interval(OWNER, self.deep_interval)
        rules.check_shallow_loops(OWNER, self.shallow_loops)  # <= total_ut_steps - 1: checked at build
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_model_len", self.max_model_len, 2)
        if self.deep_interval > self.max_model_len:
            raise ValueError(f"EngineConfig.deep_interval must satisfy 1 <= deep_interval <= max_model_len "
                             f"({self.max_model_len}), got {self.deep_interval}")
        rules.check_block_size(OWNER, self.block_size)
        rules.check_max_num_batched_tokens(OWNER, self.max_num_batched_tokens, self.block_size)
        rules.check_max_prefill_tokens_while_decoding(OWNER, self.max_prefill_tokens_while_decoding, self.block_size)
        if self.num_kv_blocks is not None:
            rules.check_num_kv_blocks(OWNER, self.num_kv_blocks)
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        if self.cuda_graphs not in (None, True, False):
            raise TypeError(f"EngineConfig.cuda_graphs must be None, True or False, got {self.cuda_graphs!r}")
        if self.async_scheduling not in (None, True, False):
            raise TypeError(f"EngineConfig.async_scheduling must be None, True or False, got "
                            f"{self.async_scheduling!r}")
        if self.async_scheduling and self.mode == "verify":
            raise ValueError("EngineConfig.async_scheduling=True cannot be used with mode='verify': its next step "
                             "depends on how many drafts the step before accepts; use async_scheduling=None or "
                             "False, or mode 'deferred' or 'eager'")
        _positive_int("seed", self.seed, 0)
        if self.seed > MAX_SEED:
            raise ValueError(f"EngineConfig.seed must satisfy 0 <= seed <= {MAX_SEED}, got {self.seed}")
        if not isinstance(self.kv_cache_memory_gb, (int, float)) or self.kv_cache_memory_gb <= 0:
            raise ValueError(f"EngineConfig.kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        _check_startup_fields(self.warmup, self.compile_cache_dir)


def resolve_config(config: "EngineConfig | None", kwargs: dict[str, Any]) -> "EngineConfig":
    """The engines' constructor argument: an EngineConfig, or its fields as keyword arguments."""
    if config is None:
        return EngineConfig(**kwargs)
    if kwargs:
        raise TypeError(f"pass either an EngineConfig or keyword arguments, not both: got the keyword arguments "
                        f"{sorted(kwargs)} (EngineConfig fields, or unknown here)")
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
    return config


def batch_arguments(prompts: Sequence[Sequence[int]], params: Any,
                    request_ids: Sequence[str] | None) -> list[tuple[Sequence[int], SamplingParams, str | None]]:
    """generate_batch's arguments, checked: one (prompt, params, request_id) per prompt.

    `params` is one SamplingParams (or dict, or None) for every prompt, or a list with one per prompt."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of token-id lists")
    if isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        per_prompt = [SamplingParams.coerce(p) for p in params]
    else:
        per_prompt = [SamplingParams.coerce(params)] * len(prompts)
    if request_ids is not None and len(request_ids) != len(prompts):
        raise ValueError(f"got {len(request_ids)} request_ids for {len(prompts)} prompts")
    ids = list(request_ids) if request_ids is not None else [None] * len(prompts)
    return list(zip(prompts, per_prompt, ids))
