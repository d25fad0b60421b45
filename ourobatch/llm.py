"""LLM: vLLM's offline class over one engine. ``LLM(model).generate(prompts, sampling_params)``.

Drop-in for the calls RL workers make (``LLM(...)``, ``generate([{"prompt_token_ids": ids}], params)``,
``out.outputs[j].token_ids``): prompts as token-id lists, ``{"prompt_token_ids": [...]}`` dicts (vLLM's
TokensPrompt), or text with a tokenizer.json; outputs in vLLM's shapes (ourobatch.compat). It runs the
same EngineCore as SyncEngine on the calling thread, and cuts stop strings itself (the engine works in
token ids): a completion whose text completes a stop string is ended after that token.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from pathlib import Path
from typing import Any, Mapping, Sequence

from tqdm.auto import tqdm

from scheduler.errors import EngineClosedError
from ourobatch.log import get_logger
from scheduler.params import MAX_SEED, SamplingParams

from ._extras import MissingExtraError
from .chat_template import ChatTemplate, conversations, no_template_error, read_special_tokens
from .compat import (VLLM_LOGPROBS_MODE, LLMRequestOutput, to_sampling_params, to_vllm_completion,
                     to_vllm_prompt_logprobs)
from .config import EngineConfig
from .llm_control import LLMControl
from .text import StopChecker, Tokenizer, check_text_params, load_tokenizer

log = get_logger("ourobatch.llm")

# vLLM engine arguments with no counterpart here, and the values that mean "the same as ourobatch does".
# Other values raise: dropping them would change what runs. None: every value is fine (no effect here).
VLLM_ONLY_OPTIONS: dict[str, tuple[Any, ...] | None] = {
    "tensor_parallel_size": (1,), "pipeline_parallel_size": (1,), "data_parallel_size": (1,),
    "quantization": (None,), "kv_cache_dtype": ("auto",), "cpu_offload_gb": (0, 0.0), "load_format": ("auto",),
    "tokenizer_mode": ("auto",), "revision": (None,), "tokenizer_revision": (None,), "enable_lora": (False,),
    "speculative_config": (None,), "max_logprobs": None, "swap_space": None, "enable_sleep_mode": None,
    "disable_log_stats": None, "enable_chunked_prefill": None, "distributed_executor_backend": None,
    "disable_custom_all_reduce": None, "download_dir": None, "max_seq_len_to_capture": None,
    "compilation_config": None, "worker_extension_cls": None, "enable_prefix_caching": None,
}
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# vLLM's logprobs_mode spellings -> EngineConfig.logprobs_mode (LLM's default: raw, as vLLM's; Engine's processed)
LOGPROBS_MODE_ALIASES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"
    return DTYPE_ALIASES.get(name, name)


def _cut_stop_strings(core: Any, parent: Any, checkers: list[StopChecker], stops: list[Any]) -> None:
    """Record in stops[j] the stop string child j's text hit, once, and abort that child alone."""
    for j, child in enumerate(parent.children):
        if stops[j] is None:
            stops[j] = checkers[j].check(child.output_token_ids, child.finish_reason == "stop")  # eos first (vLLM)
            if stops[j] is not None and not child.is_finished:
                core.abort(child.request_id, stop_string=True)  # this completion only; siblings run on


class LLM(LLMControl):
    """vLLM's ``LLM``: ``LLM(model, dtype=..., max_model_len=..., seed=0, ...)``, then ``generate``; between
    generate calls the RL calls of ourobatch.llm_control (sleep, wake_up, reset_prefix_cache, update_weights).

    ``seed`` is the engine seed: unseeded request i gets a seed derived from (seed, i), so a script gives
    the same outputs every run; ``seed=None`` (vLLM's "random") draws one, logged and kept in
    ``config.seed``. ``enforce_eager=True`` turns CUDA graphs off. ``trust_remote_code`` has no
    effect (Ouro is built in). ``device=None`` is CUDA when available, else the CPU. Other keyword
    arguments are EngineConfig fields (``mode``, ``deep_interval``, ``shallow_loops``, ``max_num_seqs``,
    ...; the default is full-depth decoding) or vLLM engine arguments with no effect here
    (VLLM_ONLY_OPTIONS; a value that would change what runs, like ``tensor_parallel_size=2``, raises).
    Reported log-probs are raw by default, as vLLM's (``logprobs_mode="processed"`` for the distribution
    each token was drawn from, the native Engine's default).
    """

    def __init__(self, model: str | Path, *, dtype: Any = "auto", max_model_len: int | None = None,
                 seed: int | None = 0, gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
                 trust_remote_code: bool = False, skip_tokenizer_init: bool = False,
                 tokenizer: str | Path | None = None, device: str | None = None, **engine_options: Any) -> None:
        from .assembly import build_engine_core  # torch loads here

        options = dict(engine_options)
        options.setdefault("logprobs_mode", VLLM_LOGPROBS_MODE)  # vLLM's default, raw (EngineConfig's: processed)
        mode = options.get("logprobs_mode")
        if isinstance(mode, str) and mode in LOGPROBS_MODE_ALIASES:
            options["logprobs_mode"] = LOGPROBS_MODE_ALIASES[mode]
        elif mode in ("raw_logits", "processed_logits"):
            raise ValueError(f"LLM(logprobs_mode={mode!r}) is not supported: ourobatch reports log-probs "
                             f"('raw_logprobs' or 'processed_logprobs')")
        for name in list(options):
            if name in VLLM_ONLY_OPTIONS:
                allowed, value = VLLM_ONLY_OPTIONS[name], options.pop(name)
                if allowed is not None and value not in allowed:
                    raise ValueError(f"LLM({name}={value!r}) is not supported by ourobatch (allowed: "
                                     f"{', '.join(repr(a) for a in allowed)})")
        fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise TypeError(f"LLM() got unknown option(s) {unknown}; allowed: EngineConfig fields {sorted(fields)} "
                            f"and vLLM's {sorted(VLLM_ONLY_OPTIONS)}")
        if not isinstance(trust_remote_code, bool) or not isinstance(enforce_eager, bool):
            raise TypeError("LLM(trust_remote_code=..., enforce_eager=...) must be True or False")
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        if max_model_len is None:  # vLLM: the model's own limit
            max_model_len = self._checkpoint_max_len(Path(model))
        if seed is None:  # vLLM: a random seed; the outputs then differ run to run
            seed = secrets.randbelow(MAX_SEED + 1)
            log.info("random_seed", seed=seed)
        if enforce_eager:
            if options.get("cuda_graphs"):
                raise ValueError("LLM(enforce_eager=True) contradicts cuda_graphs=True")
            options["cuda_graphs"] = False
        self.config = EngineConfig(model=str(model), device=device, dtype=_dtype_name(dtype),
                                   max_model_len=max_model_len, seed=seed,
                                   gpu_memory_utilization=gpu_memory_utilization, **options)
        self.tokenizer: Tokenizer | None = None
        self._tokenizer_missing: MissingExtraError | None = None  # a tokenizer.json, but no `tokenizers`
        if not skip_tokenizer_init:
            try:
                self.tokenizer = load_tokenizer(model, tokenizer)
            except MissingExtraError as exc:
                if tokenizer is not None:
                    raise  # one that was asked for must load
                # the checkpoint's own tokenizer.json: token-id prompts run on; whatever needs text says why not
                self._tokenizer_missing = exc
                log.warning("no_tokenizer", reason=str(exc),
                            effect="text prompts, stop strings and chat are refused; completions have text ''")
        self._core = build_engine_core(self.config)
        self._next_id = 0

    @staticmethod
    def _checkpoint_max_len(model: Path) -> int:
        try:
            value = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
        except (OSError, ValueError):
            value = None  # the engine's own checks report a missing or bad config.json
        return value if isinstance(value, int) and value >= 2 else EngineConfig.__dataclass_fields__[
            "max_model_len"].default

    # ------------------------------------------------------------------ vLLM's calls

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def generate(self, prompts: Any, sampling_params: Any = None, *, use_tqdm: bool = True,
                 **unsupported: Any) -> list[LLMRequestOutput]:
        """Generate for every prompt; outputs in prompt order, each with its n completions.

        `prompts`: one prompt or a list; a prompt is a token-id list, a ``{"prompt_token_ids": [...]}``
        dict, or text (a str, or ``{"prompt": str}``) when a tokenizer is loaded. `sampling_params`: one
        for all prompts or a list with one per prompt; each an ourobatch or vLLM SamplingParams, a dict
        (vLLM or SGLang names) or None (the defaults). If one prompt is rejected, none runs."""
        if unsupported:  # lora_request, priority, ...: would change what runs
            raise TypeError(f"LLM.generate() got unsupported argument(s) {sorted(unsupported)}")
        core = self._require_core()
        batch = self._prompts(prompts)
        per_prompt = self._per_prompt_params(sampling_params, len(batch))
        parents = self._add_all(core, batch, per_prompt)
        stops = self._run_to_completion(core, parents, per_prompt, use_tqdm)
        eos = core.scheduler.config.eos_token_ids
        results = []
        for (text, _), p, parent, hits in zip(batch, per_prompt, parents, stops):
            out = parent.output()
            completions = [to_vllm_completion(c, p, self.tokenizer, eos, hit) for c, hit in zip(out.outputs, hits)]
            results.append(LLMRequestOutput(out.request_id, text, list(out.prompt_token_ids), completions,
                                            prompt_logprobs=to_vllm_prompt_logprobs(out.prompt_logprobs, p,
                                                                                    self.tokenizer),
                                            num_cached_tokens=out.num_cached_tokens))
        return results

    def _per_prompt_params(self, sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
        """One SamplingParams per prompt (one for all, or a list of one each), stop strings checked."""
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes, Mapping)):
            if len(sampling_params) != num_prompts:
                raise ValueError(f"got {len(sampling_params)} sampling_params for {num_prompts} prompts")
            per_prompt = [to_sampling_params(p) for p in sampling_params]
        else:
            per_prompt = [to_sampling_params(sampling_params)] * num_prompts
        for p in per_prompt:
            if p.stop:
                self._require_tokenizer(f"stop={list(p.stop)!r}")
            check_text_params(p, self.tokenizer)
        return per_prompt

    def _add_all(self, core: Any, batch: list[tuple[str | None, list[int]]],
                 per_prompt: list[SamplingParams]) -> list[Any]:
        """Add every prompt (stop strings are cut here, not by the engine); if one is rejected, none runs."""
        parents = []
        for i, ((_, ids), p) in enumerate(zip(batch, per_prompt)):  # all checked first: a rejected batch
            try:  # queues nothing (add_sync: a sleeping LLM raises EngineAsleepError, not step forever)
                core.check(ids, dataclasses.replace(p, stop=()), str(self._next_id + i), op="add_sync")
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from None
        try:
            for (_, ids), p in zip(batch, per_prompt):
                parents.append(core.add(ids, dataclasses.replace(p, stop=()), str(self._next_id), op="add_sync"))
                self._next_id += 1
        except BaseException:
            for parent in parents:  # all or nothing
                core.abort(parent.request_id)
            raise
        return parents

    def _run_to_completion(self, core: Any, parents: list[Any], per_prompt: list[SamplingParams],
                           use_tqdm: bool) -> list[list[Any]]:
        """Step until every parent finishes; a completion whose text hits a stop string is aborted alone.
        -> the stop string each completion hit (None: none). On any error every parent is aborted."""
        checkers = [[StopChecker(self.tokenizer, p) for _ in range(p.n)] if p.stop and self.tokenizer else None
                    for p in per_prompt]
        stops: list[list[Any]] = [[None] * p.n for p in per_prompt]
        done = [False] * len(parents)
        bar = tqdm(total=len(parents), desc="Processed prompts", unit="it", disable=not use_tqdm)
        try:
            while not all(done):
                core.step()
                for i, parent in enumerate(parents):
                    if done[i]:
                        continue
                    if checkers[i] is not None:
                        _cut_stop_strings(core, parent, checkers[i], stops[i])
                    if parent.finished:
                        done[i] = True
                        bar.update(1)
        except BaseException:
            for parent in parents:
                core.abort(parent.request_id)
            raise
        finally:
            bar.close()
        return stops

    def _prompts(self, prompts: Any) -> list[tuple[str | None, list[int]]]:
        """-> [(text or None, token ids)] for one prompt or a list of them (vLLM's parsing)."""
        if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, Sequence) and prompts
                                                   and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # one prompt
        if not isinstance(prompts, Sequence) or isinstance(prompts, bytes) or not prompts:
            raise TypeError("prompts must be a prompt or a non-empty list of prompts (token-id lists, "
                            "{'prompt_token_ids': [...]} dicts or text)")
        return [self._prompt(i, p) for i, p in enumerate(prompts)]

    def _prompt(self, i: int, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            extra = sorted(set(prompt) - {"prompt_token_ids", "prompt"})
            if extra:  # multi_modal_data, ...
                raise ValueError(f"prompts[{i}] has unsupported key(s) {extra}; allowed: prompt_token_ids, prompt")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError(f"prompts[{i}] needs 'prompt_token_ids' or 'prompt'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            tok = self._require_tokenizer(f"prompts[{i}] is text: it")
            try:
                return prompt, tok.encode(prompt)
            except ValueError as exc:  # a word outside the vocabulary
                raise ValueError(f"prompts[{i}]: {exc}") from None
        if isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            return None, list(prompt)
        raise TypeError(f"prompts[{i}] must be a token-id list, a {{'prompt_token_ids': [...]}} dict or text, got "
                        f"{type(prompt).__name__}")

    def chat(self, messages: Any, sampling_params: Any = None, *, use_tqdm: bool = True,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: Any = None,
             documents: Any = None, chat_template_kwargs: dict[str, Any] | None = None,
             **unsupported: Any) -> list[LLMRequestOutput]:
        """vLLM's ``LLM.chat``: render each conversation with the chat template, then ``generate``.

        `messages`: one conversation (a list of ``{"role", "content"}`` dicts; content a string or a list of
        text parts) or a list of conversations. `chat_template`: the template text (default: the
        tokenizer folder's, see ourobatch.chat_template). The rendered text is tokenized without the
        tokenizer's own special tokens (the template writes them) and is each output's ``prompt``."""
        if unsupported:  # lora_request, mm_processor_kwargs, ...
            raise TypeError(f"LLM.chat() got unsupported argument(s) {sorted(unsupported)}")
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r} is not supported "
                             f"(allowed: 'auto', 'string': a message's text parts are joined into one string)")
        tok = self._require_tokenizer("LLM.chat")
        template = tok.chat_template
        if chat_template is not None:
            if template is not None:
                special = template.special_tokens
            else:  # the folder's bos_token, eos_token, ...
                special = read_special_tokens(tok.path.parent) if tok.path is not None else {}
            template = ChatTemplate({"default": chat_template}, "chat_template=...", special)
        if template is None:
            raise no_template_error(tok.path.parent if tok.path else None, "pass LLM.chat(..., chat_template=TEXT)")
        convs = conversations(messages)
        prompts = []
        for i, conv in enumerate(convs):
            where = f"messages[{i}]: " if len(convs) > 1 else ""
            try:
                text = template.render(conv, add_generation_prompt=add_generation_prompt, tools=tools,
                                       continue_final_message=continue_final_message, documents=documents,
                                       chat_template_kwargs=chat_template_kwargs)
                ids = tok.encode(text, add_special_tokens=False)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{where}{exc}") from None
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _require_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is not None:
            return self.tokenizer
        if self._tokenizer_missing is not None:
            raise MissingExtraError(f"{what} needs the tokenizer: {self._tokenizer_missing}")
        raise ValueError(f"{what} needs a tokenizer, but no tokenizer is loaded (no tokenizer.json beside the "
                         f"model, or skip_tokenizer_init=True); give token ids instead")

    # ------------------------------------------------------------------ lifecycle

    def _require_core(self) -> Any:
        if self._core is None:
            raise EngineClosedError("this LLM is closed")
        return self._core

    def stats(self) -> dict[str, Any]:
        return self._require_core().stats()

    def close(self) -> None:
        """Free the weights, KV pool and CUDA graphs now."""
        core, self._core = self._core, None
        if core is not None:
            for request_id in list(core.parents):
                core.abort(request_id)
            core.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["LLM", "SamplingParams"]  # `from ourobatch.llm import LLM, SamplingParams`, as from vllm
