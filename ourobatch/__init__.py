"""ourobatch: rollout generation for looped language models (Ouro) with deferred, batched deep loops."""

from ourobatch.scheduler.errors import (
    CheckpointError,
    EngineClosedError,
    EngineDeadError,
    InvalidTransition,
    OurobatchError,
    RequestRejectedError,
)
from ourobatch.scheduler.outputs import CompletionOutput, RequestOutput
from ourobatch.scheduler.params import RequestOutputKind, SamplingParams

from .config import EngineConfig
from .sync_engine import SyncEngine

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CompletionOutput",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "InvalidTransition",
    "OurobatchError",
    "RequestOutput",
    "RequestOutputKind",
    "RequestRejectedError",
    "SamplingParams",
    "SyncEngine",
    "__version__",
]
