"""ourobatch: rollout generation for looped language models (Ouro) with deferred, batched deep loops."""

from .import_roots import check_import_roots as _check_import_roots

_check_import_roots()  # `scheduler` and `engine` are generic top-level names: ours, or an ImportError saying whose

from scheduler.errors import (
    CheckpointError,
    EngineAsleepError,
    EngineClosedError,
    EngineBusyError,
    EngineDeadError,
    InconsistentWeightsError,
    InvalidTransition,
    OurobatchError,
    RequestRejectedError,
    WeightUpdateError,
)
from ourobatch.outputs import CompletionOutput, RequestOutput
from scheduler.params import RequestOutputKind, SamplingParams

from .config import EngineConfig

# The engines pull in torch; load them on first use so `import scheduler` stays torch-free.
_LAZY = {"Engine": "ourobatch.async_engine", "SyncEngine": "ourobatch.sync_engine", "LLM": "ourobatch.llm"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ourobatch' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CompletionOutput",
    "Engine",
    "EngineAsleepError",
    "EngineClosedError",
    "EngineConfig",
    "EngineBusyError",
    "EngineDeadError",
    "InconsistentWeightsError",
    "InvalidTransition",
    "LLM",
    "OurobatchError",
    "RequestOutput",
    "RequestOutputKind",
    "RequestRejectedError",
    "SamplingParams",
    "SyncEngine",
    "WeightUpdateError",
    "__version__",
]
