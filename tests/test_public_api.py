"""The public facade is small and pinned: this test fails when it drifts."""

import ourobatch
import engine
import scheduler

PUBLIC = {
    "CheckpointError", "CompletionOutput", "Engine", "EngineClosedError", "EngineConfig", "EngineDeadError",
    "InvalidTransition", "LLM", "OurobatchError", "RequestOutput", "RequestOutputKind", "RequestRejectedError",
    "SamplingParams", "SyncEngine", "__version__", "EngineBusyError", "EngineAsleepError", "InconsistentWeightsError",
    "WeightUpdateError",
}


def test_import_ourobatch_needs_neither_torch_nor_the_server_stack():
    import subprocess
    import sys

    code = ("import sys, ourobatch; ourobatch.SamplingParams(); import ourobatch.compat, ourobatch.text; "
            "bad = [m for m in ('torch', 'fastapi', 'uvicorn', 'prometheus_client') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_top_level_all_is_pinned():
    assert set(ourobatch.__all__) == PUBLIC


def test_every_name_in_all_exists():
    for module in (ourobatch, engine, scheduler):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_errors_form_one_tree():
    for name in ("CheckpointError", "EngineClosedError", "EngineDeadError", "InvalidTransition",
                 "RequestRejectedError"):
        assert issubclass(getattr(ourobatch, name), ourobatch.OurobatchError)
    assert issubclass(ourobatch.RequestRejectedError, ValueError)
    assert issubclass(ourobatch.CheckpointError, ValueError)
    assert issubclass(ourobatch.EngineAsleepError, ourobatch.EngineBusyError)


def test_design_field_names():
    import dataclasses

    completion = {f.name for f in dataclasses.fields(ourobatch.CompletionOutput)}
    assert {"index", "token_ids", "logprobs", "readout_loops", "cumulative_logprob", "finish_reason", "seed",
            "weight_version"} <= completion
    request = {f.name for f in dataclasses.fields(ourobatch.RequestOutput)}
    assert {"request_id", "prompt_token_ids", "outputs", "finished"} <= request
    config = {f.name for f in dataclasses.fields(ourobatch.EngineConfig)}
    assert {"model", "device", "dtype", "mode", "deep_interval", "shallow_loops", "max_num_seqs",
            "max_model_len", "block_size", "num_kv_blocks"} <= config
