"""Assembly: a checkpoint folder and an EngineConfig -> model, KV pool, executor, EngineCore (the composition
root both engines, LLM and the CLIs build through; the checks that need no weights run first)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from engine.config import OuroConfig
from engine.executor import ModelExecutor, resolve_attention, resolve_cuda_graphs
from engine.kv_cache import KVPool
from engine.loader import LoadTimings, expected_shapes, load_model
from engine.model import OuroForCausalLM
from engine.warmup_pass import PassSetup
from scheduler.config import SchedulerConfig, check_shallow_loops
from ourobatch.runtime.engine_core import EngineCore
from ourobatch.log import get_logger

from .compile_cache import StartupCompiles
from .config import EngineConfig
from .kernel_prefetch import KernelPrefetch, early_capture
from .warmup import StartupClock, WarmupPlan, warm_up

log = get_logger()


def check_machine(config: EngineConfig, num_cuda_devices: int | None = None) -> None:
    """The options that depend on this machine, checked before anything is loaded: a CUDA device must
    exist, and the Triton backend and CUDA graphs run only on one. `num_cuda_devices`: for tests."""
    if num_cuda_devices is None:
        num_cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    on_cuda = config.device.startswith("cuda")
    if on_cuda:
        index = int(config.device.partition(":")[2] or 0)
        if num_cuda_devices == 0:
            raise ValueError(f"EngineConfig.device={config.device!r}, but this machine has no CUDA device "
                             f"(or torch was built without CUDA); use device='cpu'")
        if index >= num_cuda_devices:
            raise ValueError(f"EngineConfig.device={config.device!r}, but this machine has {num_cuda_devices} "
                             f"CUDA device(s): use 'cuda' or cuda:0 .. cuda:{num_cuda_devices - 1}")
    if config.attention_backend == "triton" and not on_cuda:
        raise ValueError(f"EngineConfig.attention_backend='triton' needs a CUDA device (device={config.device!r});"
                         f" use attention_backend='auto' or 'torch'")
    if config.cuda_graphs:
        if not on_cuda:
            raise ValueError(f"EngineConfig.cuda_graphs=True needs a CUDA device (device={config.device!r}); "
                             f"use cuda_graphs=None or False")
        if config.attention_backend == "torch":
            raise ValueError("EngineConfig.cuda_graphs=True needs the Triton attention backend, but "
                             "attention_backend='torch'; use attention_backend='auto' or 'triton', or "
                             "cuda_graphs=None or False")


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    name = config.dtype
    if name == "auto":
        name = "bfloat16" if config.device.startswith("cuda") else "float32"
    return getattr(torch, name)


def resolve_head_dtype(config: EngineConfig) -> torch.dtype | None:
    """The lm_head matmul's dtype: None (the model's) for head_dtype="auto"."""
    return None if config.head_dtype == "auto" else getattr(torch, config.head_dtype)


def resolve_async_scheduling(config: EngineConfig) -> bool:
    """async_scheduling=None: on for CUDA except in verify mode (EngineConfig refuses verify + True)."""
    if config.async_scheduling is None:
        return config.device.startswith("cuda") and config.mode != "verify"
    return config.async_scheduling


# CUDA memory kept out of the KV pool for activations, graphs and the sampler's [rows, vocab] buffers.
ACTIVATION_RESERVE_BYTES = 3 * 2**30


def auto_num_blocks(config: EngineConfig, model_config: OuroConfig, dtype: torch.dtype) -> int:
    """CPU: room for max_num_seqs requests of max_model_len (plus the lazy watermark), capped at
    kv_cache_memory_gb.
    CUDA: what gpu_memory_utilization of the device leaves after the weights (call after loading them)."""
    mc = model_config
    per_block = KVPool.bytes_per_block(mc, config.block_size, dtype)
    wanted = config.max_num_seqs * math.ceil(effective_max_model_len(config, mc) / config.block_size)
    if config.kv_allocation == "lazy":  # admission keeps the watermark free: add it, so all of them fit
        wanted += math.ceil(config.kv_watermark * wanted / (1 - config.kv_watermark)) + 1
    if config.device.startswith("cuda"):
        device = torch.device(config.device)
        free, total = torch.cuda.mem_get_info(device)
        # The engine's share (vLLM's meaning): u x total, less what this process already holds (the weights),
        # and never more than is free. So two engines with u = 0.45 each share one GPU whatever their order.
        own = torch.cuda.memory_reserved(device)
        budget = min(free, config.gpu_memory_utilization * total - own) - ACTIVATION_RESERVE_BYTES
        if budget < per_block:
            raise ValueError(f"no GPU memory left for the KV pool ({free / 2**30:.1f} GiB free); raise "
                             f"gpu_memory_utilization or set num_kv_blocks")
        return max(1, min(wanted, int(budget) // per_block))
    return max(1, min(wanted, int(config.kv_cache_memory_gb * 2**30) // per_block))


def check_checkpoint_fit(config: EngineConfig, mc: OuroConfig) -> None:
    """The options that depend on the checkpoint's config.json (cheap: no weights are read)."""
    check_shallow_loops("EngineConfig", config.shallow_loops, mc.total_ut_steps)  # the rule's one wording


def check_attention(config: EngineConfig, head_dim: int, dtype: torch.dtype) -> None:
    """CUDA: the Triton kernel must handle the checkpoint's head_dim and the dtype when it is asked for
    (attention_backend='triton') or needed (cuda_graphs=True, which captures the Triton path)."""
    if not config.device.startswith("cuda") or config.attention_backend == "torch":
        return
    if not (config.attention_backend == "triton" or config.cuda_graphs):
        return  # 'auto' falls back to the torch reference by itself
    try:
        from engine.triton_attention import supports
    except ImportError:
        why = "the `triton` package is not installed"
    else:
        if supports(head_dim, dtype):
            return
        why = (f"the Triton kernel needs a power-of-two head_dim >= 16 and a 16/32-bit float dtype, "
               f"got head_dim={head_dim}, dtype={str(dtype).removeprefix('torch.')}")
    if config.attention_backend == "triton":
        raise ValueError(f"EngineConfig.attention_backend='triton' cannot run: {why}; use 'auto' or 'torch'")
    raise ValueError(f"EngineConfig.cuda_graphs=True needs the Triton attention backend, which cannot run: {why};"
                     f" use cuda_graphs=None or False")


def effective_max_model_len(config: EngineConfig, mc: OuroConfig) -> int:
    """max_model_len capped by the checkpoint's max_position_embeddings (RoPE is not extrapolated)."""
    return min(config.max_model_len, mc.max_position_embeddings)


def make_scheduler_config(config: EngineConfig, mc: OuroConfig, num_blocks: int) -> SchedulerConfig:
    """The scheduler's view of an engine; the CLI also builds one before loading, to check its input."""
    return SchedulerConfig(
        num_kv_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
        max_model_len=effective_max_model_len(config, mc),
        max_num_batched_tokens=config.max_num_batched_tokens, total_ut_steps=mc.total_ut_steps,
        max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding,
        shallow_loops=config.shallow_loops, deep_interval=config.deep_interval, mode=config.mode,
        vocab_size=mc.vocab_size, eos_token_ids=frozenset(mc.eos_token_ids),
        kv_allocation=config.kv_allocation, enable_prefix_caching=config.enable_prefix_caching,
        kv_watermark=config.kv_watermark)


def check_before_loading(config: EngineConfig) -> tuple[OuroConfig, torch.dtype]:
    """Every check that needs no weights (the machine, config.json, the kernels); cheap, so callers like
    the CLI run it before reading their input. Returns the checkpoint's config and the resolved dtype."""
    check_machine(config)
    return _check_checkpoint(config)


def _check_checkpoint(config: EngineConfig) -> tuple[OuroConfig, torch.dtype]:
    """check_before_loading's checks after the machine's."""
    dtype = resolve_dtype(config)
    mc = OuroConfig.from_checkpoint(config.model)
    check_checkpoint_fit(config, mc)
    check_attention(config, mc.head_dim, dtype)
    return mc, dtype


def kernel_shapes_for(config: EngineConfig, mc: OuroConfig, dtype: torch.dtype, max_model_len: int,
                      num_sms: int | None = None):
    """The kernel warm-up's shapes (engine/kernel_cases.KernelShapes) of the engine this config builds,
    before any weight is loaded: the executor's own choices (attention backend, graphs, buckets) resolved
    the way it resolves them. `num_sms`: the device's (asked when None)."""
    from engine import kernel_cases

    device = torch.device(config.device)
    attention = resolve_attention(config.attention_backend, device, mc.head_dim, dtype)
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return kernel_cases.kernel_shapes(
        mc, dtype, resolve_head_dtype(config), block_size=config.block_size,
        table_width=math.ceil(max_model_len / config.block_size), max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len, mode=config.mode,
        deep_interval=config.deep_interval, attention=attention,
        cuda_graphs=resolve_cuda_graphs(config.cuda_graphs, device, attention), num_sms=num_sms)


def tensor_names(mc: OuroConfig) -> list[str]:
    """The tensors a full weight load must cover (a tied lm_head is the embedding's storage)."""
    return [n for n in expected_shapes(mc) if not (mc.tie_word_embeddings and n == "lm_head.weight")]


def _weights(config: EngineConfig, model: OuroForCausalLM | None, dtype: torch.dtype, should_stop,
             clock: StartupClock, loading: LoadTimings | None) -> OuroForCausalLM:
    """The "weights" phase: the checkpoint loaded (unless a model is given) and its projections fused."""
    with clock.phase("weights"):
        if model is None:
            model = load_model(config.model, dtype, config.device, should_stop, loading)
            model.fuse_projections()
    return model


def _executor(config: EngineConfig, model: OuroForCausalLM, pool: KVPool, max_model_len: int) -> ModelExecutor:
    return ModelExecutor(model, pool, config.device, max_num_seqs=config.max_num_seqs,
                         max_blocks_per_seq=math.ceil(max_model_len / config.block_size),
                         deep_interval=config.deep_interval, attention=config.attention_backend,
                         cuda_graphs=config.cuda_graphs, logprobs_mode=config.logprobs_mode,
                         head_dtype=resolve_head_dtype(config), max_num_batched_tokens=config.max_num_batched_tokens)


def build_engine_core(config: EngineConfig, model: OuroForCausalLM | None = None,
                      should_stop: Callable[[], bool] | None = None) -> EngineCore:
    """Load the checkpoint and wire model, pool, executor and scheduler. Blocking (loads weights).

    `model`: an already loaded model of this checkpoint, dtype and device, to share (benchmarks)."""
    clock, plan = StartupClock(), WarmupPlan.for_engine(config.warmup, config.device)
    with clock.phase("setup"):
        check_machine(config)  # its clear errors before anything starts
        compiles = StartupCompiles(config.compile_cache_dir, config.device)  # the folders, before the driver's build
    # Triton's driver and key start now, beside the checks and Triton's import (engine/warmup_pass.PassSetup)
    with PassSetup(torch.device(config.device) if plan.kernels else torch.device("cpu")) as setup:
        with clock.phase("setup"):  # the checkpoint's checks, then the compile counter (Triton's import)
            with clock.phase("setup_checks"):  # (the machine's were made above)
                mc, dtype = _check_checkpoint(config)
                max_model_len = effective_max_model_len(config, mc)
            clock.counter = compiles.count()
        if max_model_len < config.max_model_len:
            log.warning("max_model_len_capped", requested=config.max_model_len,
                        max_position_embeddings=mc.max_position_embeddings, effective=max_model_len)
        shapes = (lambda: kernel_shapes_for(config, mc, dtype, max_model_len)) if plan.kernels else None
        loading = LoadTimings() if model is None else None
        # the kernels compile while the weights load (they need only the config's shapes)
        with KernelPrefetch(shapes, config.device, clock, should_stop, early=early_capture(), setup=setup) as prefetch:
            model = _weights(config, model, dtype, should_stop, clock, loading)
            prefetch.loaded()
            with clock.phase("kv_pool"):
                num_blocks = config.num_kv_blocks or auto_num_blocks(config, mc, dtype)
                pool = KVPool.for_model(mc, num_blocks, config.block_size, dtype, config.device)
            with clock.phase("executor"):  # its buffers, the layer stack, the graph cache
                executor = _executor(config, model, pool, max_model_len)
            scheduler_config = make_scheduler_config(config, mc, num_blocks)
            # kernels, CUDA graphs (every bucket of the mode's calls) and dummy requests now: no request pays them
            warm_up(executor, scheduler_config, plan, clock, seed=config.seed,
                    async_scheduling=resolve_async_scheduling(config), should_stop=should_stop, prefetch=prefetch)

    def extra_stats() -> dict:
        stats = {"max_model_len": max_model_len, "kv_capacity_tokens": pool.num_blocks * pool.block_size,
                 "kv_pool_bytes": pool.num_bytes, "attention_backend": executor.attention,
                 "cuda_graphs": executor.graphs is not None}
        if config.device.startswith("cuda"):
            stats["peak_memory_bytes"] = torch.cuda.max_memory_allocated(torch.device(config.device))
        return stats

    core = EngineCore(scheduler_config, executor, extra_stats=extra_stats, seed=config.seed,
                      tensor_names=lambda: tensor_names(mc), async_scheduling=resolve_async_scheduling(config))
    log.info("engine_ready", model=str(config.model), mode=config.mode, deep_interval=config.deep_interval,
             shallow_loops=config.shallow_loops, max_model_len=max_model_len, kv_blocks=num_blocks,
             dtype=str(dtype), device=config.device, **clock.fields(),
             **(loading.fields() if loading is not None else {}))
    compiles.log()
    return core
