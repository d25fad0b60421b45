"""The scheduler's counters (``Scheduler.stats()``; docs/api.md lists them): plain ints, torch-free."""

from __future__ import annotations


def new_counters() -> dict[str, int]:
    """Every counter at zero."""
    return {
        "steps": 0,
        "prefills": 0,
        "prefill_tokens": 0,
        "prefill_chunks": 0,  # prefill work items that ran tokens through the model
        "shallow_steps": 0,
        "shallow_rows": 0,
        "deep_calls": 0,
        "deep_rows": 0,
        "drafted_tokens": 0,
        "accepted_tokens": 0,
        "tested_drafts": 0,  # drafts the acceptance test reached: accepted ones + the first rejected one
        "rolled_back_positions": 0,
        "boundaries": 0,
        "tokens_generated": 0,
        "preemptions": 0,
        "recomputed_tokens": 0,  # tokens prefilled again after a preemption (outputs included)
        "prefix_cache_hits": 0,  # prefill tokens whose KV was shared instead of computed
        "prefill_tokens_requested": 0,  # tokens of every (re)prefill
        "prefill_tokens_computed": 0,  # of those, the ones run through the model
        "requests_added": 0,
        "finished_stop": 0,
        "finished_length": 0,
        "finished_abort": 0,
        "finished_error": 0,
    }
