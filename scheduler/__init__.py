"""scheduler: the sans-IO scheduling policy, torch-free: requests, KV-block accounting, cohorts, the Scheduler
and the plans it hands the engine (docs/architecture.md)."""

__ourobatch_layer__ = "scheduler"  # the marker ourobatch/import_roots.py checks: this is ourobatch's scheduler

from .block_manager import BlockManager
from .cohort import Cohort
from .config import MODES, SchedulerConfig
from .scheduler import RequestUpdate, Scheduler
from .errors import (
    CheckpointError,
    EngineClosedError,
    EngineDeadError,
    InvalidTransition,
    OurobatchError,
    RequestRejectedError,
)
from .params import RequestOutputKind, SamplingParams
from .plan import (
    DeepWork,
    Executor,
    Phase,
    PrefillWork,
    SampledToken,
    SampleSpec,
    ShallowWork,
    StepFailure,
    StepPlan,
    StepResult,
)
from .request import TRANSITIONS, Request, RequestStatus, set_status

__all__ = [
    "BlockManager",
    "CheckpointError",
    "Cohort",
    "DeepWork",
    "EngineClosedError",
    "EngineDeadError",
    "Executor",
    "InvalidTransition",
    "MODES",
    "OurobatchError",
    "Phase",
    "PrefillWork",
    "Request",
    "RequestOutputKind",
    "RequestRejectedError",
    "RequestStatus",
    "RequestUpdate",
    "SampleSpec",
    "SampledToken",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "ShallowWork",
    "StepFailure",
    "StepPlan",
    "StepResult",
    "TRANSITIONS",
    "set_status",
]
