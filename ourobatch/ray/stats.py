"""EnginePool.stats(): every ready replica's Engine.stats(), summed, with per-replica entries."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import ray

from .replica import Replica, ReplicaState

# Keys that describe an engine rather than count its work: the first ready replica's value is reported.
SHARED_KEYS = ("max_model_len", "attention_backend", "cuda_graphs")
# Levels and sizes of a state every replica holds alike (they move together through the pool's broadcasts):
# the largest is reported, never a sum (two replicas asleep at level 1 are not at level 2)
MAX_KEYS = ("sleep_level", "weights_missing")


def sum_stats(per_replica: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Numbers add up (counters, queue lengths, KV blocks), booleans are or-ed, shared keys come from the
    first replica, MAX_KEYS take the largest, and kv_usage is recomputed from the summed blocks."""
    total: dict[str, Any] = {}
    for stats in per_replica:
        for key, value in stats.items():
            if key in SHARED_KEYS or not isinstance(value, (int, float)):
                total.setdefault(key, value)
            elif key in MAX_KEYS:
                total[key] = max(total.get(key, value), value)
            elif isinstance(value, bool):
                total[key] = bool(total.get(key, False)) or value
            else:
                total[key] = total.get(key, 0) + value
    if total.get("kv_blocks_total"):
        total["kv_usage"] = total["kv_blocks_used"] / total["kv_blocks_total"]
    return total


def pool_stats(replicas: Sequence[Replica], counters: Mapping[str, int], weight_version: int,
               timeout_s: float) -> dict[str, Any]:
    """Ask every ready replica for its stats (at most timeout_s; a replica that does not answer in time
    reports none) and sum them. Blocks the calling thread for that round trip, as Engine.stats() is a
    plain call too."""
    refs = {r.index: r.actor.stats.remote() for r in replicas if r.state == ReplicaState.READY}
    answered, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    answered_set = set(answered)
    entries, ready_stats = [], []
    for r in replicas:
        stats: dict[str, Any] = {}
        ref = refs.get(r.index)
        if ref is not None and ref in answered_set:
            try:
                stats = ray.get(ref)
                ready_stats.append(stats)
            except Exception:  # noqa: BLE001 - it died in between: it reports no stats this time
                stats = {}
        entries.append({**stats, "replica": r.index, "state": r.state.name.lower(), "load_tokens": r.load,
                        "requests_in_flight": len(r.subs), "requests_routed": r.requests_routed,
                        "restarts": r.restarts, "node_id": r.info.get("node_id"), "pid": r.info.get("pid")})
    total = sum_stats(ready_stats)
    total.update(counters)
    total.update(weight_version=weight_version, num_replicas=len(replicas),
                 num_replicas_ready=sum(r.state == ReplicaState.READY for r in replicas),
                 replica_restarts=sum(r.restarts for r in replicas), replicas=entries)
    return total
