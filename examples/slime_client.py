"""A slime-shaped client for ``python -m ourobatch serve``: the HTTP calls slime makes of an SGLang server, in
its order and shapes (slime/backends/sglang_utils/sglang_engine.py, slime/rollout/sglang_rollout.py,
slime/ray/rollout.py), with httpx instead of requests/aiohttp.

    python -m ourobatch serve --model models/pointer-chase --max-model-len 64 &
    python examples/slime_client.py --url http://127.0.0.1:8000 --weights models/pointer-chase

1. start-up waits: GET /health_generate until 200, then GET /flush_cache until 200 (slime retries both);
   GET /get_server_info and /get_model_info (slime's external-engine discovery);
2. per rollout round: POST /generate for every prompt x sample, concurrently, with slime's sampling params
   (``no_stop_trim``, ``spaces_between_special_tokens`` false, ``custom_params`` when top_p < 1,
   ``sampling_seed`` per sample as with --sglang-enable-deterministic-inference) and ``return_logprob``; the
   tokens and log-probs are read from ``meta_info.output_token_logprobs`` as slime reads them;
3. between rounds, slime's weight update from disk: POST /pause_generation {} (SGLang's default, "abort"),
   /flush_cache, /update_weights_from_disk with a string weight_version and flush_cache, then
   /continue_generation, and GET /get_weight_version compared as slime compares it (str == str);
4. at the end, slime's colocated offload and staged onload: /flush_cache, /release_memory_occupation {},
   /resume_memory_occupation {"tags": ["weights"]}, then {"tags": ["kv_cache", "cuda_graph"]}, and one more
   /health_generate.

It prints one JSON object (every round's samples, the server and model info, what each control call
answered) and exits 0; an HTTP error prints the route, status and body on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


class ServerError(RuntimeError):
    def __init__(self, route: str, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code} from {route}: {response.text}")


def check(route: str, response: httpx.Response) -> Any:
    if response.status_code != 200:
        raise ServerError(route, response)
    return response.json()


def wait_until_ok(client: httpx.Client, route: str, deadline_s: float) -> int:
    """slime's start-up loop on one GET route; returns the number of tries."""
    end = time.monotonic() + deadline_s
    tries = 0
    while True:
        tries += 1
        try:
            if client.get(route).status_code == 200:
                return tries
        except httpx.TransportError:
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{route} did not answer 200 within {deadline_s} s")
        time.sleep(1)  # slime waits 2 s (health) and 1 s (flush) between tries


def sampling_params(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """slime's GenerateState.sampling_params, and the per-sample sampling_seed of deterministic inference."""
    params: dict[str, Any] = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                  max_new_tokens=args.max_new_tokens, stop=None, stop_token_ids=None,
                                  skip_special_tokens=True, no_stop_trim=True, spaces_between_special_tokens=False)
    if args.top_p != 1.0:
        params["custom_params"] = {"return_top_p_token_ids": True}
    params["sampling_seed"] = seed
    return params


async def rollout(url: str, prompts: list[list[int]], args: argparse.Namespace) -> list[dict[str, Any]]:
    async def one(client: httpx.AsyncClient, prompt: list[int], seed: int) -> dict[str, Any]:
        payload = {"input_ids": prompt, "sampling_params": sampling_params(args, seed), "return_logprob": True}
        output = check("/generate", await client.post("/generate", json=payload))
        meta = output["meta_info"]
        pairs = meta.get("output_token_logprobs", [])
        return {"prompt_token_ids": prompt, "sampling_seed": seed, "text": output["text"],
                "tokens": [item[1] for item in pairs], "log_probs": [item[0] for item in pairs],
                "finish_reason": meta["finish_reason"], "weight_version": meta.get("weight_version"),
                "id": meta["id"], "e2e_latency": meta.get("e2e_latency"), "prompt_tokens": meta["prompt_tokens"],
                "cached_tokens": meta.get("cached_tokens", 0)}

    async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as client:
        jobs = [one(client, p, args.seed + i) for p in prompts for i in range(args.n_samples_per_prompt)]
        return list(await asyncio.gather(*jobs))


def update_weights_from_disk(client: httpx.Client, weights: str, version: str) -> dict[str, Any]:
    """slime's disk update of one engine: pause, flush, load with a string version, continue, check."""
    answers = {"pause": check("/pause_generation", client.post("/pause_generation", json={}))}
    answers["flush"] = check("/flush_cache", client.get("/flush_cache"))
    body = {"model_path": weights, "weight_version": version, "flush_cache": True}
    answers["update"] = check("/update_weights_from_disk", client.post("/update_weights_from_disk", json=body))
    answers["continue"] = check("/continue_generation", client.post("/continue_generation", json={}))
    reported = check("/get_weight_version", client.get("/get_weight_version"))["weight_version"]
    if str(reported) != str(version):  # slime's check after every update
        raise RuntimeError(f"weight version mismatch: expected {version}, the engine reports {reported}")
    answers["weight_version"] = reported
    return answers


def offload_and_onload(client: httpx.Client) -> dict[str, Any]:
    """slime's colocated offload (release) and staged onload (weights first, then KV cache and graphs)."""
    answers = {"flush": check("/flush_cache", client.get("/flush_cache"))}
    answers["release"] = check("/release_memory_occupation", client.post("/release_memory_occupation", json={}))
    answers["asleep_health"] = client.get("/health_generate").status_code
    answers["onload_weights"] = check("/resume_memory_occupation",
                                      client.post("/resume_memory_occupation", json={"tags": ["weights"]}))
    answers["onload_kv"] = check("/resume_memory_occupation", client.post(
        "/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}))
    answers["health"] = client.get("/health_generate").status_code
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--weights", action="append", default=[],
                        help="a checkpoint folder to load between rounds (repeat: one update per folder)")
    parser.add_argument("--tasks", default=str(ROOT / "models" / "pointer-chase" / "heldout_tasks.jsonl"),
                        help="a JSON-lines file with prompt_token_ids per line")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--n-samples-per-prompt", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=1234, help="sampling_seed of sample i is seed + i")
    parser.add_argument("--start-version", type=int, default=0, help="slime's --update-weight-start-version")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    lines = Path(args.tasks).read_text().splitlines()[:args.num_prompts]
    prompts = [json.loads(line)["prompt_token_ids"] for line in lines]
    report: dict[str, Any] = {"rounds": []}
    try:
        with httpx.Client(base_url=args.url, timeout=args.timeout) as client:
            report["startup"] = {"health_tries": wait_until_ok(client, "/health_generate", args.timeout),
                                 "flush_tries": wait_until_ok(client, "/flush_cache", args.timeout)}
            report["server_info"] = check("/get_server_info", client.get("/get_server_info"))
            report["model_info"] = check("/get_model_info", client.get("/get_model_info"))
            current = check("/get_weight_version", client.get("/get_weight_version"))["weight_version"]
            report["rounds"].append({"weight_version": current,
                                     "samples": asyncio.run(rollout(args.url, prompts, args))})
            version = args.start_version  # the trainer's count: each update sends str(version + 1)
            for weights in args.weights:
                version += 1
                update = update_weights_from_disk(client, weights, str(version))
                samples = asyncio.run(rollout(args.url, prompts, args))
                report["rounds"].append({"weight_version": version, "weights": weights, "update": update,
                                         "samples": samples})
            report["offload"] = offload_and_onload(client)
    except ServerError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
