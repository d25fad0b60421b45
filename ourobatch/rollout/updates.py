"""One weight update through the collector: pause the engine ("keep"), apply the on_update policy to
the samples in flight, copy, resume. The engine stops for the copy only.

- "continue" (PipelineRL): kept requests go on with their KV, computed under the old weights; their
  later tokens record the new version (mixed versions, per token).
- "recompute" (AReaL): kept requests are re-prefilled (prompt + tokens so far) under the new weights
  (``resume(recompute_kv=True)``); their earlier tokens keep their old versions.
- "abort": the collector's requests in flight are aborted before the copy and resubmitted from scratch
  after it (the sample tasks wait for the update to finish).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from scheduler.errors import OurobatchError


async def push_weights(engine: Any, policy: str, runs: Iterable[Any], push: Callable[[], Any]) -> int:
    """Returns the new version; the engine is resumed whatever happens (a resume refused because the
    failed copy left weights missing does not hide the copy's own error)."""
    error: BaseException | None = None
    await engine.pause("keep")
    try:
        if policy == "abort":
            for run in runs:
                for i, rid in list(run.live.items()):
                    run.restart.add(i)
                    await engine.abort(rid)
        return await push()
    except BaseException as exc:
        error = exc
        raise
    finally:
        try:
            await engine.resume(recompute_kv=policy == "recompute")
        except OurobatchError:
            if error is None:
                raise
