"""The composition root: a checkpoint folder and an EngineConfig -> model, KV pool, executor, EngineCore."""

from __future__ import annotations

import math

import torch

from ourobatch.engine.config import OuroConfig
from ourobatch.engine.executor import ModelExecutor
from ourobatch.engine.kv_cache import KVPool
from ourobatch.engine.loader import load_model
from ourobatch.engine.model import OuroForCausalLM
from ourobatch.scheduler.core import SchedulerConfig
from ourobatch.scheduler.frontend import EngineCore
from ourobatch.scheduler.log import get_logger

from .config import EngineConfig

log = get_logger()


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    name = config.dtype
    if name == "auto":
        name = "bfloat16" if config.device.startswith("cuda") else "float32"
    return getattr(torch, name)


# CUDA memory kept out of the KV pool for activations, graphs and the sampler's [rows, vocab] buffers.
ACTIVATION_RESERVE_BYTES = 3 * 2**30


def auto_num_blocks(config: EngineConfig, model_config: OuroConfig, dtype: torch.dtype) -> int:
    """CPU: room for max_num_seqs requests of max_model_len, capped at kv_cache_memory_gb.
    CUDA: what gpu_memory_utilization of the device leaves after the weights (call after loading them)."""
    mc = model_config
    per_block = (2 * mc.total_ut_steps * mc.num_hidden_layers * config.block_size * mc.num_key_value_heads
                 * mc.head_dim * torch.empty((), dtype=dtype).element_size())
    wanted = config.max_num_seqs * math.ceil(config.max_model_len / config.block_size)
    if config.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(config.device))
        budget = free - (1 - config.gpu_memory_utilization) * total - ACTIVATION_RESERVE_BYTES
        if budget < per_block:
            raise ValueError(f"no GPU memory left for the KV pool ({free / 2**30:.1f} GiB free); raise "
                             f"gpu_memory_utilization or set num_kv_blocks")
        return max(1, min(wanted, int(budget) // per_block))
    return max(1, min(wanted, int(config.kv_cache_memory_gb * 2**30) // per_block))


def build_engine_core(config: EngineConfig, model: OuroForCausalLM | None = None) -> EngineCore:
    """Load the checkpoint and wire model, pool, executor and scheduler. Blocking (loads weights).

    `model`: an already loaded model of this checkpoint, dtype and device, to share (benchmarks)."""
    dtype = resolve_dtype(config)
    mc = OuroConfig.from_checkpoint(config.model)
    T = mc.total_ut_steps
    if config.shallow_loops > T - 1:
        raise ValueError(
            f"EngineConfig.shallow_loops must satisfy 1 <= shallow_loops <= {T - 1} for this checkpoint "
            f"(total_ut_steps={T}), got {config.shallow_loops}")
    if model is None:
        model = load_model(config.model, dtype, config.device)
        model.fuse_projections()
    num_blocks = config.num_kv_blocks or auto_num_blocks(config, mc, dtype)
    pool = KVPool(T, mc.num_hidden_layers, num_blocks, config.block_size, mc.num_key_value_heads, mc.head_dim,
                  dtype, config.device)
    max_model_len = min(config.max_model_len, mc.max_position_embeddings)
    executor = ModelExecutor(model, pool, config.device, max_num_seqs=config.max_num_seqs,
                             max_blocks_per_seq=math.ceil(max_model_len / config.block_size),
                             deep_interval=config.deep_interval, attention=config.attention_backend,
                             cuda_graphs=config.cuda_graphs)
    scheduler_config = SchedulerConfig(
        num_kv_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens, total_ut_steps=T,
        shallow_loops=config.shallow_loops, deep_interval=config.deep_interval, mode=config.mode,
        vocab_size=mc.vocab_size, eos_token_ids=frozenset(mc.eos_token_ids))
    def extra_stats() -> dict:
        stats = {"kv_capacity_tokens": pool.num_blocks * pool.block_size, "kv_pool_bytes": pool.num_bytes,
                 "attention_backend": executor.attention, "cuda_graphs": executor.graphs is not None}
        if config.device.startswith("cuda"):
            stats["peak_memory_bytes"] = torch.cuda.max_memory_allocated(torch.device(config.device))
        return stats

    core = EngineCore(scheduler_config, executor, extra_stats=extra_stats)
    log.info("engine_ready", model=str(config.model), mode=config.mode, deep_interval=config.deep_interval,
             shallow_loops=config.shallow_loops, kv_blocks=num_blocks, dtype=str(dtype), device=config.device)
    return core
