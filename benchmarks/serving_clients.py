"""benchmarks/serving.py's clients: the in-process async Engine (with the step log and the compile
counter) or the HTTP server in a subprocess (openai's AsyncOpenAI, httpx for /metrics)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator

import anyio

from ourobatch import Engine, EngineConfig, SamplingParams, compile_cache
from scheduler.params import RequestOutputKind

sys.path.insert(0, str(Path(__file__).resolve().parent))
from public_path import budget_kwargs  # noqa: E402
from step_log import StepLog  # noqa: E402
from step_trace import allocator_counts  # noqa: E402

MODEL_NAME = "bench"
METRICS = {"ourobatch_num_requests_running": "num_running", "ourobatch_num_requests_waiting": "num_waiting",
           "ourobatch_generation_tokens_total": "tokens_generated", "ourobatch_deep_calls_total": "deep_calls",
           "ourobatch_scheduler_steps_total": "steps"}


class EngineClient:
    """Requests through the in-process async Engine."""

    transport = "engine"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.step_log = StepLog.attach(engine.core, compile_cache.compile_counts)  # no step runs yet

    async def take_steps(self) -> list[dict] | None:
        """The steps read since the last call (the stepping thread handed back first, so none is half-read)."""
        deadline = time.perf_counter() + 10
        while self.engine.driver.step_in_flight and time.perf_counter() < deadline:
            await anyio.sleep(0.001)
        return self.step_log.take()

    def compile_counts(self) -> Any:
        """Triton kernels compiled / loaded so far in this process (None without the counter: CPU)."""
        return compile_cache.compile_counts()

    def drain_reasons(self) -> dict[str, int] | None:
        """Why steps were not planned ahead (async scheduling), so far (read between rounds)."""
        return dict(self.engine.core.scheduler.drain_reasons)

    def allocator(self) -> dict[str, int] | None:
        """The CUDA caching allocator's counters (cudaMalloc / cudaFree calls, retries); None on the CPU."""
        return allocator_counts(self.engine.core.executor.device.type == "cuda")

    async def stream(self, rid: str, prompt: list[int], max_tokens: int, seed: int) -> AsyncIterator[tuple[int, Any]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        async with self.engine.stream(prompt, params, request_id=rid) as stream:
            async for out in stream:
                yield len(out.outputs[0].token_ids), out.outputs[0].finish_reason

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def graph_captures(self) -> int | None:
        graphs = self.engine.core.executor.graphs
        return graphs.num_captures if graphs is not None else None

    async def reset_cache(self) -> None:
        await self.engine.reset_prefix_cache()


class HttpClient:
    """Requests through the server: openai's AsyncOpenAI on /v1/completions (SSE), httpx for /metrics."""

    transport = "http"

    def __init__(self, url: str) -> None:
        import httpx
        import openai

        self.oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
        self.http = httpx.AsyncClient(base_url=url, timeout=60)

    async def stream(self, rid: str, prompt: list[int], max_tokens: int, seed: int) -> AsyncIterator[tuple[int, Any]]:
        # logprobs=0 + token ids: each chunk lists its tokens (text is empty without a tokenizer)
        stream = await self.oai.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=1.0, seed=seed, stream=True,
            logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        async with stream:
            async for chunk in stream:
                for c in chunk.choices:
                    yield len(c.logprobs.tokens or []) if c.logprobs else 0, c.finish_reason

    async def stats(self) -> dict[str, Any]:
        values = {}
        for line in (await self.http.get("/metrics")).text.splitlines():
            name, _, value = line.partition(" ")
            if name in METRICS:
                values[METRICS[name]] = int(float(value))
        return values

    def graph_captures(self) -> int | None:
        return None  # in the server's process

    async def take_steps(self) -> list[dict] | None:
        return None  # the step log, the compile counter and the drain reasons live in the server's process

    def compile_counts(self) -> Any:
        return None

    def drain_reasons(self) -> dict[str, int] | None:
        return None

    def allocator(self) -> dict[str, int] | None:
        return None

    async def reset_cache(self) -> None:
        (await self.http.post("/flush_cache")).raise_for_status()

    async def aclose(self) -> None:
        await self.oai.close()
        await self.http.aclose()


@contextlib.contextmanager
def server_process(model_dir: str, args: Any, mode: str, B: int, s: int, max_model_len: int):
    """`python -m ourobatch serve` on a free port of 127.0.0.1; yields its url once the app is up."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # the child binds it
    flags = dict(device=args.device, dtype=args.dtype, mode=mode, deep_interval=B, shallow_loops=s,
                 max_num_seqs=args.max_num_seqs, max_model_len=max_model_len, block_size=args.block_size,
                 gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
                 **budget_kwargs(args))  # the rest: serve's own defaults
    cmd = [sys.executable, "-m", "ourobatch", "serve", "--model", model_dir, "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", MODEL_NAME, "--log-level", "info"]
    cmd += [x for k, v in flags.items() if v is not None for x in ("--" + k.replace("_", "-"), str(v))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:  # uvicorn's startup line (access lines go to stdout)
            lines.append(line)
            if "Application startup complete" in line:
                break
        else:
            raise RuntimeError("the server exited during startup:\n" + "".join(lines[-40:]))
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining the pipe
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()  # SIGTERM: the server drains and exits
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.asynccontextmanager
async def open_client(model_dir: str, args: Any, mode: str, B: int, s: int, max_model_len: int):
    if args.server:
        with server_process(model_dir, args, mode, B, s, max_model_len) as url:
            client = HttpClient(url)
            try:
                yield client
            finally:
                await client.aclose()
        return
    cfg = EngineConfig(model=model_dir, device=args.device, dtype=args.dtype, mode=mode, deep_interval=B,
                       shallow_loops=s, max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
                       block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                       num_kv_blocks=args.num_kv_blocks,
                       **budget_kwargs(args))
    async with Engine(cfg) as engine:
        yield EngineClient(engine)
