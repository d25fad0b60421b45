"""The decode attention kernels alone on the engine's own KV pool, each timed back to back and with a break
between calls.

attention_sweep.py times a kernel in a CUDA graph of back-to-back calls (decode_attention.py did, before session 40).
With programmatic dependent launch (PDL) a call's programs then start on the SMs its predecessor's last programs leave,
so whatever a kernel spends in its last round (a persistent grid's uneven share of (request, head) pairs, its
drain) and in its first (the ring's fill) can hide behind the next call. In the decode step the kernel after the
attention is o_proj's split-K partials, which waits for the whole attention. Here one engine core is driven to a
pure-decode state (step_profile.decoding_core: N requests at about prompt + tokens / 2 positions), one step's
decode attention calls are recorded (at full depth 96: every loop's layers, each with its q, its plane of the pool
and the step's block tables), and each kernel is timed over them twice: back to back, and with a one-element add
between calls (attention_sweep.time_separated: the add is launched without PDL, so it starts only when the call
before has ended and the next call starts only when it has; its own time alone is subtracted).

    python benchmarks/attention_in_pool.py --out DIR [--n 64] [--kernels triton,32x12p1,32x6p2,32x12p1@128]

`triton` is the paged kernel at the dispatch table's launch; any other name is a Gluon ring
(attention_dispatch.parse_ring: BLOCK_NxSTAGES[pCTAS_PER_SM]). A persistent ring's @CTAS runs it on exactly CTAS
CTAs: at N = 64, 32x12p1@128 gives each of 128 CTAs one head of 8 requests (the CTAs walk pairs pid, pid + 128, ...;
16 heads divide 128), the attention phase of a layer kernel of one 8-CTA cluster per head (docs/decode_floor.md).
Every kernel's output on the first recorded call is compared with the Triton kernel's. Needs CUDA (and Gluon for the
rings).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention_dispatch import DecodeConfig, parse_ring  # noqa: E402

BYTES_PER_POSITION = 2 * 16 * 128 * 2  # keys and values of Ouro-1.4B's 16 kv heads of 128, bf16


def parse_kernels(text: str) -> list[tuple[str, DecodeConfig | None, int | None]]:
    """"triton,32x12p1,32x12p1@128" -> [("triton", None, None), ("32x12p1", DecodeConfig(32, 12, ctas_per_sm=1),
    None), ("32x12p1@128", DecodeConfig(32, 12, ctas_per_sm=1), 128)]: a persistent ring's "@CTAS" launches exactly
    that many CTAs (a multiple of its CTAs an SM) instead of CTAs an SM x the SMs."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError("--kernels must name at least one kernel: triton, or a Gluon ring BLOCK_NxSTAGES[pCTAS]")
    kernels = []
    for name in names:
        ring, at, ctas = name.partition("@")
        try:
            config = None if name == "triton" else parse_ring(ring)
            count = int(ctas) if at else None
            if at and (config is None or not config.ctas_per_sm or count < 1 or count % config.ctas_per_sm):
                raise ValueError
        except ValueError:
            raise ValueError(f"--kernels item {name!r}: triton, or a Gluon ring BLOCK_NxSTAGES[pCTAS_PER_SM] "
                             "(e.g. 32x6, 32x12p1, 32x6p2), a persistent one with @CTAS (a multiple of its CTAs an "
                             "SM, e.g. 32x12p1@128)") from None
        kernels.append((name, config, count))
    return kernels


def record_calls(core, limit: int = 96) -> list[tuple]:
    """One decode step of `core`, recording the one-row calls of triton_paged_attention (the engine's dispatch)
    with their own q, planes, block tables, lengths, row starts and scale."""
    from engine import triton_attention

    calls: list[tuple] = []
    dispatch = triton_attention.triton_paged_attention

    def record(q, k, v, tables, lens, starts, max_rows, scale, tiles=None, out=None):
        if max_rows == 1 and tiles is None and len(calls) < limit:
            calls.append((q.clone(), k, v, tables.clone(), lens.clone(), starts.clone(), scale))
        return dispatch(q, k, v, tables, lens, starts, max_rows, scale, tiles, out)

    triton_attention.triton_paged_attention = record
    try:
        plan = core.schedule()
        core.update(plan, core.executor.execute(plan))
    finally:
        triton_attention.triton_paged_attention = dispatch
    torch.cuda.synchronize()
    return calls


def launcher(calls: list[tuple], config: DecodeConfig | None, ctas: int | None = None):
    """fn(i): the kernel on recorded call i (mod their count); config None: the Triton paged kernel at the table's
    launch, else that Gluon ring (on `ctas` CTAs where given: the grid of a GPU of ctas / ctas_per_sm SMs)."""
    from engine.gluon_attention import launch_decode_attention
    from engine.triton_attention import default_config, launch_paged_attention

    def fn(i: int):
        q, k, v, tables, lens, starts, scale = calls[i % len(calls)]
        if config is None:
            launch = default_config(q, k, lens.shape[0], 1)
            return launch_paged_attention(q, k, v, tables, lens, starts, 1, scale, launch)
        sms = ctas // config.ctas_per_sm if ctas else None
        return launch_decode_attention(q, k, v, tables, lens, starts, scale, config, sms=sms)
    return fn


def measure(calls: list[tuple], kernels, rounds: int) -> list[dict]:
    """Per round and kernel: us a call back to back (attention_sweep.time_call) and with breaks (time_separated),
    over at least every recorded call in one CUDA graph."""
    from attention_sweep import time_call, time_separated

    kv_bytes = BYTES_PER_POSITION * int(calls[0][4].sum())
    ref = launcher(calls, None)(0).float()
    rows = []
    for rnd in range(rounds):
        for name, config, ctas in kernels:
            fn = launcher(calls, config, ctas)
            out = fn(0).float()
            chained = time_call(fn, 1e-4, len(calls), True) * 1e6
            alone = time_separated(fn, 1e-4, len(calls)) * 1e6
            rows.append(dict(kernel=name, round=rnd + 1, back_to_back_us=chained, with_breaks_us=alone,
                             tbps_with_breaks=kv_bytes / alone / 1e6, rel_err=float((out - ref).norm() / ref.norm())))
            print(rows[-1], flush=True)
    return rows


def markdown(rows: list[dict], kv_bytes: int, device: str) -> str:
    lines = [f"Decode attention alone on the engine's pool ({kv_bytes / 1e6:.0f} MB of keys and values a call), "
             f"{device}:", "",
             "| kernel | round | back to back us | with breaks us | TB/s with breaks | rel. err vs triton |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['round']} | {r['back_to_back_us']:.1f} | {r['with_breaks_us']:.1f} | "
              f"{r['tbps_with_breaks']:.2f} | {r['rel_err']:.1e} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    from throughput import add_checkpoint_args, ensure_checkpoint

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--n", type=int, default=64, help="requests decoding at once")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--kernels", default="triton,32x12p1,32x6p2,32x12p1@128")
    ap.add_argument("--rounds", type=int, default=2)
    add_checkpoint_args(ap)
    args = ap.parse_args(argv)
    try:
        kernels = parse_kernels(args.kernels)
    except ValueError as e:
        ap.error(str(e))
    if args.n < 1 or args.rounds < 1:
        ap.error(f"--n and --rounds must be >= 1, got {args.n} and {args.rounds}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device: the kernels are Triton and Gluon")
    from engine.loader import load_model
    from step_profile import decoding_core

    model_dir = ensure_checkpoint(args)
    model = load_model(model_dir, torch.bfloat16, "cuda")
    model.fuse_projections()
    calls = record_calls(decoding_core(model_dir, model, args, "interval1", args.n, graphs=False))
    if not calls:
        ap.error(f"no one-row decode attention call was made at --n {args.n}: small batches run the whole loop pass "
                 "as one launch (engine/gluon_layers.py); take a larger --n")
    kv_bytes = BYTES_PER_POSITION * int(calls[0][4].sum())
    rows = measure(calls, kernels, args.rounds)
    device = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    result = dict(n=args.n, prompt=args.prompt, tokens=args.tokens, calls=len(calls), kv_bytes=kv_bytes,
                  device=device, rows=rows)
    (args.out / "attention_in_pool.json").write_text(json.dumps(result, indent=1))
    (args.out / "attention_in_pool.md").write_text(markdown(rows, kv_bytes, device) + "\n")
    print(markdown(rows, kv_bytes, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
