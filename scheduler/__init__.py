"""ourobatch.scheduler: torch-free requests, KV-block accounting, cohorts and the sans-IO Scheduler."""

from .block_manager import BlockManager
from .cohort import Cohort
from .config import MODES, SchedulerConfig
from .scheduler import RequestUpdate, Scheduler
from .frontend import EngineCore, ParentRequest, child_seed
from .errors import (
    CheckpointError,
    EngineClosedError,
    EngineDeadError,
    InvalidTransition,
    OurobatchError,
    RequestRejectedError,
)
from .outputs import CompletionOutput, RequestOutput
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
    "CompletionOutput",
    "DeepWork",
    "EngineCore",
    "EngineClosedError",
    "EngineDeadError",
    "Executor",
    "InvalidTransition",
    "MODES",
    "OurobatchError",
    "ParentRequest",
    "Phase",
    "PrefillWork",
    "Request",
    "RequestOutput",
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
    "child_seed",
    "set_status",
]
