"""The RL control routes, in SGLang's names, methods and shapes (as slime and AReaL call them), each mapped
onto one Engine call. What each route does here, and where it differs from SGLang, is the table in
docs/server.md.

- pause: SGLang's modes map onto the engine's (``PAUSE_MODES``): "in_place" is "keep" (requests stay with
  their KV and continue on it); "retract" is "keep" now and ``resume(recompute_kv=True)`` at
  /continue_generation (the requests are re-prefilled under the weights current then, as SGLang's
  retracted requests are; the KV stays allocated while paused, which SGLang frees);
- memory: /release_memory_occupation is ``sleep(level=1)`` (weights to CPU memory, KV pool and CUDA graphs
  freed: SGLang with its weights CPU backup) and needs both the "weights" and "kv_cache" tags, since the
  engine frees them together; /resume_memory_occupation is ``wake_up()``, which brings every region back
  at once (the answer's ``resumed`` lists them);
- /get_model_info, /get_server_info (and their newer names /model_info, /server_info): the served model
  (state.ServedModel) and the engine's stats.

SGLang's /health_generate is health.py's.

Each route calls its Engine method directly: the app always serves an ``ourobatch.Engine``, which has every
one of them. Every refusal is a named error from the one table (errors.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import anyio
from fastapi import APIRouter, Request

from .errors import BadRequest
from .protocol import (
    AbortRequest,
    ContinueRequest,
    MemoryOccupationRequest,
    PauseRequest,
    SleepRequest,
    UpdateWeightsFromDiskRequest,
)

# request mode -> (Engine.pause mode, recompute the kept requests' KV at /continue_generation)
PAUSE_MODES: dict[str, tuple[str, bool]] = {
    "abort": ("abort", False), "wait": ("wait", False), "keep": ("keep", False),  # the engine's own
    "in_place": ("keep", False), "retract": ("keep", True),  # SGLang's
}
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's GPU memory regions
RELEASED_TOGETHER = ("weights", "kv_cache")  # sleep(level=1) frees both (and the CUDA graphs)

router = APIRouter()


def _memory_tags(body: MemoryOccupationRequest | None) -> list[str]:
    tags = list(MEMORY_TAGS) if body is None or body.tags is None else list(body.tags)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown or not tags:
        raise BadRequest(f"tags={tags!r}: each tag must be one of {list(MEMORY_TAGS)} (null: all of them)", "tags")
    return tags


@router.post("/abort_request")
async def abort_request(request: Request, body: AbortRequest) -> dict[str, Any]:
    engine = request.app.state.engine
    rid = body.rid or None  # SGLang's AbortReq defaults rid to "" (no request)
    if body.abort_all == (rid is not None):
        raise BadRequest("give exactly one of rid (a request id) or abort_all=true", "rid")
    if body.abort_all:
        aborted = await engine.abort_all()  # the aborted requests' partial outputs
        return {"success": True, "aborted": len(aborted)}
    return {"success": await engine.abort(rid), "aborted": None}


@router.post("/pause_generation")
async def pause_generation(request: Request, body: PauseRequest | None = None) -> dict[str, Any]:
    requested = (body or PauseRequest()).mode
    mode, recompute = PAUSE_MODES[requested]
    state = request.app.state
    await state.engine.pause(mode=mode)
    state.recompute_on_continue = state.recompute_on_continue or recompute  # a retracted request stays so
    return {"success": True, "status": "ok", "mode": requested, "engine_mode": mode,
            "message": "Generation paused successfully."}


@router.post("/continue_generation")
async def continue_generation(request: Request, body: ContinueRequest | None = None) -> dict[str, Any]:
    state = request.app.state
    recompute = state.recompute_on_continue
    # after "retract": the kept requests are re-prefilled under the current weights
    await state.engine.resume(recompute_kv=recompute)
    state.recompute_on_continue = False
    return {"success": True, "status": "ok", "recompute_kv": recompute,
            "message": "Generation continued successfully."}


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request, body: UpdateWeightsFromDiskRequest) -> dict[str, Any]:
    if body.load_format not in (None, "auto"):
        raise BadRequest(f"load_format={body.load_format!r}: only an HF safetensors folder ('auto') loads",
                         "load_format")
    if body.flush_cache is False:
        raise BadRequest("flush_cache=false is not supported: a weight change always drops the prefix cache "
                         "(its KV came from the old weights); send true or leave it out", "flush_cache")
    if body.is_async:
        raise BadRequest("is_async=true is not supported: the update returns once the weights are in; send "
                         "false or leave it out", "is_async")
    if body.abort_all_requests:  # the body is checked whole first: a bad one aborts nothing
        from engine.loader import checkpoint_files

        await anyio.to_thread.run_sync(checkpoint_files, Path(body.model_path))  # CheckpointError: 400
        await abort_request(request, AbortRequest(abort_all=True))
    engine = request.app.state.engine
    version = await engine.load_weights(body.model_path, version=body.weight_version)
    stats = engine.stats()
    return {"success": True, "message": f"loaded {body.model_path}; weight version {version}",
            "weight_version": version, "num_paused_requests": stats["num_running"] if stats["is_paused"] else 0}


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict[str, Any]:
    return {"weight_version": request.app.state.engine.stats()["weight_version"]}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> dict[str, Any]:
    # running requests keep the blocks they hold, so this never waits for them (SGLang's 400 when busy)
    dropped = await request.app.state.engine.reset_prefix_cache()
    return {"success": True, "num_flushed_blocks": dropped, "message": "Cache flushed."}


@router.post("/sleep")
async def sleep(request: Request, body: SleepRequest | None = None) -> dict[str, Any]:
    await request.app.state.engine.sleep(level=(body or SleepRequest()).level)
    return {"success": True}


@router.post("/wake_up")
async def wake_up(request: Request) -> dict[str, Any]:
    await request.app.state.engine.wake_up()
    return {"success": True}


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request, body: MemoryOccupationRequest | None = None) -> dict[str, Any]:
    tags = _memory_tags(body)
    if not set(RELEASED_TOGETHER) <= set(tags):
        raise BadRequest(f"tags={tags!r}: the engine releases the weights and the KV cache together (sleep "
                         f"level 1: weights to CPU memory, KV pool and CUDA graphs freed); send null or include "
                         f"both {list(RELEASED_TOGETHER)}", "tags")
    await request.app.state.engine.sleep(level=1)
    return {"success": True, "released": list(MEMORY_TAGS), "message": "sleep(level=1)"}


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request, body: MemoryOccupationRequest | None = None) -> dict[str, Any]:
    tags = _memory_tags(body)
    engine = request.app.state.engine
    was_asleep = engine.stats()["is_sleeping"]
    await engine.wake_up()
    resumed = list(MEMORY_TAGS) if was_asleep else []
    note = "" if not was_asleep or set(tags) == set(MEMORY_TAGS) else \
        f" (asked for {tags}: the engine wakes every region at once)"
    return {"success": True, "resumed": resumed,
            "message": ("wake_up()" + note) if was_asleep else "not released: nothing to resume"}

async def model_info(request: Request) -> dict[str, Any]:
    served = request.app.state.served
    return {"model_path": str(served.config.model), "tokenizer_path": served.tokenizer_path, "is_generation": True,
            "preferred_sampling_params": None, **served.card, "has_image_understanding": False,
            "has_audio_understanding": False,
            "weight_version": request.app.state.engine.stats()["weight_version"]}


async def server_info(request: Request) -> dict[str, Any]:
    from ourobatch import __version__

    served = request.app.state.served
    config, tokenizer_path = served.config, served.tokenizer_path
    stats = request.app.state.engine.stats()
    return {
        "model_path": str(config.model), "tokenizer_path": tokenizer_path, "served_model_name": served.name,
        "skip_tokenizer_init": tokenizer_path is None, "is_embedding": False, "dtype": config.dtype,
        "device": config.device, "context_length": stats["max_model_len"],
        "max_running_requests": config.max_num_seqs, "max_total_num_tokens": stats["kv_capacity_tokens"],
        "page_size": config.block_size, "chunked_prefill_size": config.max_num_batched_tokens,
        "random_seed": config.seed, "disable_radix_cache": not config.enable_prefix_caching,
        "tp_size": 1, "pp_size": 1, "dp_size": 1, "ep_size": 1, "disaggregation_mode": "null",
        "weight_version": stats["weight_version"], "version": __version__, "engine": "ourobatch",
        "engine_config": json.loads(json.dumps(dataclasses.asdict(config), default=str)),
        "internal_states": [stats]}


for path in ("/get_model_info", "/model_info"):  # SGLang's old and new names
    router.add_api_route(path, model_info, methods=["GET"])
for path in ("/get_server_info", "/server_info"):
    router.add_api_route(path, server_info, methods=["GET"])

