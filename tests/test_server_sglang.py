"""SGLang's control routes as slime and AReaL call them, on a real uvicorn on 127.0.0.1 serving the shipped
pointer-chase model: each control route with httpx (methods, shapes, the named 400s, /health_generate's
bounds), and examples/slime_client.py run as its own process, whose tokens and log-probs are compared with
in-process engines on the same weights (the shipped checkpoint and a perturbed copy of it) while its weight
versions advance. /generate's SGLang fields: tests/test_server_sglang_generate.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from tests.server_helpers import MODEL, ROOT
from tests.sglang_helpers import CONFIG, HEALTH_TIMEOUT, PROMPT, TOL, _error, _stats
# the module's fixtures server, client, reference and gate
from tests.sglang_helpers import client_fixture, gate_fixture, reference_fixture, server_fixture  # noqa: F401


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory):
    """A copy of the shipped checkpoint with every tensor moved by seeded noise: other weights to load."""
    path = tmp_path_factory.mktemp("perturbed")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(MODEL / name, path / name)
    gen = torch.Generator().manual_seed(0)
    tensors = {k: v + (0.2 * v.float().std() if v.numel() > 1 else 0.1)
               * torch.randn(v.shape, generator=gen).to(v.dtype)
               for k, v in load_file(str(MODEL / "model.safetensors")).items()}
    save_file(tensors, str(path / "model.safetensors"))
    return path


# ---------------------------------------------------------------------- health, flush, info


def test_health_generate_and_flush_cache_answer_get_as_slime_waits_on_them(server, client):
    before = _stats(server)["finished_length"]
    assert client.get("/health_generate").json() == {"status": "ok"}
    assert _stats(server)["finished_length"] == before + 1  # it generated: one token, max_new_tokens 1
    for method in ("GET", "POST"):
        r = client.request(method, "/flush_cache")
        assert r.status_code == 200 and r.json()["success"] is True, r.text


def test_health_generate_is_503_at_once_where_nothing_can_be_generated(server, client):
    assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        t0 = time.monotonic()
        err = _error(client.get("/health_generate"), 503)
        assert time.monotonic() - t0 < HEALTH_TIMEOUT  # no probe queued behind the pause
        assert "paused" in err["message"] and "/continue_generation" in err["message"]
    finally:
        assert client.post("/continue_generation").status_code == 200
    assert client.post("/release_memory_occupation", json={}).status_code == 200
    try:
        assert "/resume_memory_occupation" in _error(client.get("/health_generate"), 503)["message"]
    finally:
        assert client.post("/resume_memory_occupation", json={}).status_code == 200
    assert client.get("/health_generate").status_code == 200


def test_health_generate_never_hangs_on_an_engine_that_makes_no_step(server, client, gate):
    aborted = _stats(server)["finished_abort"]
    gate.hold(after=0)  # the probe's prefill is held in flight: no step completes
    t0 = time.monotonic()
    err = _error(client.get("/health_generate"), 503)
    assert HEALTH_TIMEOUT <= time.monotonic() - t0 < HEALTH_TIMEOUT + 30
    assert "no engine step completed" in err["message"]
    gate.open()
    assert _stats(server)["finished_abort"] == aborted + 1  # the probe was aborted, not left queued
    assert _stats(server)["kv_blocks_held_by_live_requests"] == 0


def test_health_generate_counts_a_busy_engine_as_healthy(server, client):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    with httpx.Client(base_url=server.url, timeout=120) as other:
        done = []
        worker = threading.Thread(target=lambda: done.append(other.post("/generate", json=body)))
        worker.start()
        assert client.get("/health_generate").status_code == 200
        worker.join()
    assert done[0].status_code == 200 and len(done[0].json()["output_ids"]) == 40


def test_server_and_model_info_report_honest_values(server, client):
    stats = _stats(server)
    model = client.get("/get_model_info").json()
    assert model == client.get("/model_info").json()
    assert model["model_path"] == str(MODEL) and model["tokenizer_path"] == str(MODEL / "tokenizer.json")
    assert model["is_generation"] is True and model["weight_version"] == stats["weight_version"]
    assert (model["model_type"], model["architectures"]) == (
        json.loads((MODEL / "config.json").read_text())["model_type"],
        json.loads((MODEL / "config.json").read_text())["architectures"])
    info = client.get("/get_server_info").json()
    assert info == client.get("/server_info").json() | {"internal_states": info["internal_states"]}
    assert info["model_path"] == str(MODEL) and info["context_length"] == 64 == stats["max_model_len"]
    assert info["max_total_num_tokens"] == stats["kv_capacity_tokens"] and info["max_running_requests"] == 64
    assert info["page_size"] == CONFIG.block_size and (info["tp_size"], info["dp_size"]) == (1, 1)
    assert info["skip_tokenizer_init"] is False and info["internal_states"][0]["kv_blocks_total"] > 0


# ---------------------------------------------------------------------- memory occupation


def test_release_and_resume_memory_occupation_map_to_sleep_and_wake_up(server, client):
    body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    before = client.post("/generate", json=body).json()["output_token_logprobs"]
    r = client.post("/release_memory_occupation", json={"tags": None})
    assert r.status_code == 200 and r.json()["released"] == ["weights", "kv_cache", "cuda_graph"], r.text
    assert _stats(server)["sleep_level"] == 1  # weights kept in CPU memory: SGLang's weights CPU backup
    assert client.get("/release_memory_occupation").status_code == 200  # GET too; a no-op at that level
    staged = client.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()  # slime's onload_weights
    assert staged["resumed"] == ["weights", "kv_cache", "cuda_graph"] and "every region" in staged["message"]
    assert _stats(server)["is_sleeping"] is False
    later = client.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}).json()
    assert later["resumed"] == []  # already back
    after = client.post("/generate", json=body).json()["output_token_logprobs"]  # the weights survived it
    assert [t for _, t, _ in after] == [t for _, t, _ in before]
    assert [lp for lp, _, _ in after] == pytest.approx([lp for lp, _, _ in before], abs=TOL)


@pytest.mark.parametrize("route, tags, needle", [
    ("/release_memory_occupation", ["kv_cache"], "together"),
    ("/release_memory_occupation", ["weights"], "together"),
    ("/release_memory_occupation", ["gpu"], "must be one of"),
    ("/resume_memory_occupation", [], "must be one of"),
])
def test_memory_tags_that_cannot_be_honoured_are_a_400_naming_tags(server, client, route, tags, needle):
    err = _error(client.post(route, json={"tags": tags}), 400, "tags")
    assert needle in err["message"]
    assert _stats(server)["is_sleeping"] is False  # refused before any engine call


# ---------------------------------------------------------------------- pause modes


def _pause_mid_request(server, client, gate, mode: str, weights=None) -> tuple[dict, int, dict]:
    """A 12-token request paused after its third token in `mode`, `weights` loaded while paused (if given),
    then continued: (its final /generate event, the tokens it had at the pause, the stats delta)."""
    stats0 = _stats(server)
    body = {"input_ids": PROMPT, "stream": True, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 12, "ignore_eos": True, "temperature": 1.0, "sampling_seed": 77}}
    gate.hold(after=2)  # the prefill and one decode step run; the third step is held in flight
    with httpx.Client(base_url=server.url, timeout=120) as other, other.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        assert gate.entered.wait(60)
        answer = []
        pausing = threading.Thread(target=lambda: answer.append(client.post("/pause_generation", json={"mode": mode})))
        pausing.start()
        for _ in range(100_000):  # until the pause is registered (each read is a lock and a dict)
            if _stats(server)["control_state"] == "pausing":
                break
        gate.allow(1)  # the held step finishes; then the engine is paused with the request kept
        pausing.join(60)
        assert answer and answer[0].status_code == 200, answer
        stats1 = _stats(server)
        assert stats1["is_paused"] and stats1["num_running"] == 1
        kept = stats1["tokens_generated"] - stats0["tokens_generated"]
        if weights is not None:
            version = str(stats1["weight_version"] + 1)  # slime sends str(int)
            update = client.post("/update_weights_from_disk",
                                 json={"model_path": str(weights), "weight_version": version})
            assert update.status_code == 200 and update.json()["num_paused_requests"] == 1, update.text
        gate.open()
        assert client.post("/continue_generation", json={}).status_code == 200
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    stats2 = _stats(server)
    return events[-1], kept, {k: stats2[k] - stats0[k] for k in ("preemptions", "recomputed_tokens")}


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_sglang_pause_modes_keep_the_request_and_retract_recomputes_it(server, client, gate, reference, mode):
    last, kept, delta = _pause_mid_request(server, client, gate, mode)
    ref = reference.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=77))
    assert kept == 3 and last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert last["output_ids"] == ref.outputs[0].token_ids  # counter-based draws: a recompute changes nothing
    lps = [lp for lp, _, _ in last["meta_info"]["output_token_logprobs"]]
    assert lps == pytest.approx(ref.outputs[0].logprobs, abs=TOL)
    if mode == "in_place":
        assert delta == {"preemptions": 0, "recomputed_tokens": 0}  # continued on its KV
    else:
        # re-prefilled: what the prefix cache still holds of the prompt's full blocks is not recomputed
        assert delta["preemptions"] == 1 and 0 < delta["recomputed_tokens"] <= len(PROMPT) + kept


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_new_weights_while_paused_retract_recomputes_in_place_keeps_the_old_kv(server, client, gate, perturbed,
                                                                                mode):
    version = _stats(server)["weight_version"]
    try:
        last, kept, delta = _pause_mid_request(server, client, gate, mode, weights=perturbed)
    finally:
        restore = client.post("/update_weights_from_disk", json={"model_path": str(MODEL)})
        assert restore.status_code == 200, restore.text
    tokens = last["output_ids"]
    lps = [lp for lp, _, _ in last["meta_info"]["output_token_logprobs"]]
    assert last["meta_info"]["weight_version"] == version and len(tokens) == 12  # admitted under the old weights
    with SyncEngine(CONFIG) as old, SyncEngine(EngineConfig(model=str(perturbed), max_model_len=64)) as new:
        head, tail = old.score(PROMPT, tokens)[:kept], new.score(PROMPT, tokens)[kept:]
    assert lps[:kept] == pytest.approx(head, abs=TOL)  # drawn before the pause, from the old weights
    if mode == "retract":  # re-prefilled under the new weights: the tail is theirs, position for position
        assert delta["preemptions"] == 1 and lps[kept:] == pytest.approx(tail, abs=TOL)
    else:  # the new weights on top of the old weights' KV: neither model's scoring
        assert delta["preemptions"] == 0 and lps[kept:] != pytest.approx(tail, abs=1e-3)


def test_pause_modes_that_do_not_exist_are_a_400_listing_them(client):
    err = _error(client.post("/pause_generation", json={"mode": "freeze"}), 400, "mode")
    assert "retract" in err["message"] and "in_place" in err["message"]


# ---------------------------------------------------------------------- update_weights_from_disk


@pytest.mark.parametrize("body, param, needle", [
    ({"flush_cache": False}, "flush_cache", "prefix cache"),
    ({"is_async": True}, "is_async", "is_async"),
    ({"weight_version": "07"}, "weight_version", "leading zeros"),
    ({"weight_version": "v7"}, "weight_version", "decimal digits"),
    ({"keep_pause": True}, "keep_pause", "keep_pause"),
])
def test_update_weights_fields_that_cannot_be_honoured_are_named(server, client, body, param, needle):
    version = _stats(server)["weight_version"]
    err = _error(client.post("/update_weights_from_disk", json={"model_path": str(MODEL), **body}), 400, param)
    assert needle in err["message"]
    assert _stats(server)["weight_version"] == version


def test_update_weights_takes_slimes_string_version_and_flush_cache(server, client):
    r = client.post("/update_weights_from_disk", json={"model_path": str(MODEL), "weight_version": "12",
                                                      "flush_cache": True, "load_format": None})
    assert r.status_code == 200 and r.json()["weight_version"] == 12, r.text
    assert str(client.get("/get_weight_version").json()["weight_version"]) == "12"  # slime compares str()
    assert client.get("/get_model_info").json()["weight_version"] == 12
    out = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["weight_version"] == 12


# ---------------------------------------------------------------------- the slime-shaped client


def _run_slime_client(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "examples" / "slime_client.py"), "--url", url, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_slime_client_end_to_end(server, perturbed):
    before = _stats(server)["weight_version"]
    proc = _run_slime_client(server.url, "--weights", str(perturbed), "--weights", str(MODEL),
                             "--start-version", "20", "--num-prompts", "3")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["startup"] == {"health_tries": 1, "flush_tries": 1}
    assert report["server_info"]["model_path"] == str(MODEL) and report["model_info"]["is_generation"] is True
    rounds = report["rounds"]
    assert [r["weight_version"] for r in rounds] == [before, 21, 22]  # the versions advance
    assert [r["update"]["weight_version"] for r in rounds[1:]] == [21, 22]
    for weights, rnd in zip([MODEL, perturbed, MODEL], rounds):
        with SyncEngine(EngineConfig(model=str(weights), max_model_len=64)) as engine:
            for s in rnd["samples"]:
                ref = engine.generate(s["prompt_token_ids"], SamplingParams(
                    max_tokens=8, seed=s["sampling_seed"], include_stop_str_in_output=True,
                    spaces_between_special_tokens=False)).outputs[0]
                assert s["tokens"] == ref.token_ids and s["log_probs"] == pytest.approx(ref.logprobs, abs=TOL)
                assert s["weight_version"] == rnd["weight_version"]
                assert s["finish_reason"]["type"] == {"stop": "stop", "length": "length"}[ref.finish_reason]
    assert len({s["id"] for r in rounds for s in r["samples"]}) == 3 * 3 * 2
    assert any(s["tokens"] != t["tokens"] for s, t in zip(rounds[0]["samples"], rounds[1]["samples"]))
    off = report["offload"]
    assert off["release"]["released"] == ["weights", "kv_cache", "cuda_graph"] and off["asleep_health"] == 503
    assert off["onload_weights"]["resumed"] and off["health"] == 200


def test_slime_client_with_top_p_below_1_is_refused_by_name(server):
    proc = _run_slime_client(server.url, "--top-p", "0.9", "--num-prompts", "1", "--n-samples-per-prompt", "1")
    assert proc.returncode == 2
    assert "HTTP 400 from /generate" in proc.stderr and "return_top_p_token_ids" in proc.stderr
