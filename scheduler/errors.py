"""The named errors of ourobatch.

    OurobatchError                      base of everything raised on purpose
    ├── InvalidTransition               a request status change outside the transition table (a bug)
    ├── RequestRejectedError (ValueError)   a request that can never be served as asked
    ├── CheckpointError (ValueError)    a checkpoint folder that is not a loadable Ouro checkpoint
    ├── EngineClosedError (RuntimeError)    a call on an engine that is closed or not started
    ├── EngineDeadError (RuntimeError)  the engine hit an unrecoverable error; pending callers get this
    │   └── (ourobatch.ray's ReplicaDiedError: a pool replica died with the request in flight)
    ├── EngineBusyError (RuntimeError)  a control call the engine's state forbids now (docs/state_machine.md)
    │   └── EngineAsleepError           a call that needs the weights on the device while the engine sleeps
    ├── WeightUpdateError (ValueError)  a tensor of a weight update is wrong (name, shape, dtype, repeat, NaN)
    └── InconsistentWeightsError (RuntimeError)  new requests while weights are missing (sleep level 2) or half-updated

Bad arguments (wrong types, values out of range) raise plain ``TypeError`` / ``ValueError`` whose message
names the field and the allowed values; ``RequestRejectedError`` is a ``ValueError`` too.
This module is part of the scheduler/engine boundary: it imports nothing.
"""

from __future__ import annotations

import copy


class OurobatchError(Exception):
    """Base class of every error ourobatch raises on purpose."""


class InvalidTransition(OurobatchError):
    """Raised when a request status change is not in the transition table (an internal bug)."""


class RequestRejectedError(OurobatchError, ValueError):
    """Raised when a request can never be served (longer than max_model_len or than the whole KV pool)."""


class CheckpointError(OurobatchError, ValueError):
    """Raised when a checkpoint folder is missing files, has unknown/missing tensors or mismatched shapes."""


class EngineClosedError(OurobatchError, RuntimeError):
    """Raised when a request is made to an engine that is closed or was never started."""


class EngineDeadError(OurobatchError, RuntimeError):
    """Raised to every pending caller when the engine stops on an unrecoverable error."""


class EngineBusyError(OurobatchError, RuntimeError):
    """Raised by a control call the engine's state forbids now (update_weights while requests run unpaused)."""


class EngineAsleepError(EngineBusyError):
    """Raised by a call that needs the weights on the device (score, update_weights, generate) while asleep."""


class WeightUpdateError(OurobatchError, ValueError):
    """Raised for a bad tensor in a weight update; `copied` names the tensors copied before it."""

    def __init__(self, message: str, copied: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.copied = copied


class InconsistentWeightsError(OurobatchError, RuntimeError):
    """Raised for new requests while weights are missing (after sleep(2)) or half-updated (a failed update),
    until an update covering every missing tensor succeeds."""


def fresh_error(error: BaseException) -> BaseException:
    """A new exception like `error` (type, args, attributes, cause), with no traceback; `error` itself, with
    its traceback dropped, if its class cannot be rebuilt from its args."""
    try:
        new = copy.copy(error)
    except Exception:  # noqa: BLE001 - an __init__ that its args do not fit
        return error.with_traceback(None)
    new.__cause__, new.__suppress_context__ = error.__cause__, True
    return new
