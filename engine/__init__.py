"""engine: torch, no asyncio. Config and loader, the Ouro model, the paged per-loop KV pool,
attention, the sampler, and the executor that runs a StepPlan."""

__ourobatch_layer__ = "engine"  # the marker ourobatch/import_roots.py checks: this is ourobatch's engine

from .config import OuroConfig
from .executor import ModelExecutor
from .kv_cache import KVPool
from .loader import expected_shapes, load_model, load_state_dict
from .model import OuroForCausalLM
from .sampler import counter_uniforms, processed_logprobs, sample

__all__ = [
    "KVPool",
    "ModelExecutor",
    "OuroConfig",
    "OuroForCausalLM",
    "counter_uniforms",
    "expected_shapes",
    "load_model",
    "load_state_dict",
    "processed_logprobs",
    "sample",
]
