"""Reads benchmarks/flow_probe.py's timer stamps (torch only, no GPU: tests/test_flow_probe.py checks it on
hand-made stamps). Per layer, every time is in us against the attention's last program end (negative: before it);
the summary is the median over the layers of:
    attention_us        the attention's span, first program start to last end
    head_end_us         each kv head's last program end
    o_first_start_us    o_proj's first program start (its launch, past the attention's launch_dependents)
    split_counts_us     each split's last program to see its counts
    split_end_us        each split's last program end
    split_work_us       each split's median program time from its counts to its end
    o_end_us            o_proj's last program end
"""

from __future__ import annotations

import torch


def layer_times(att: torch.Tensor, o: torch.Tensor, seqs: int, kv_heads: int, n_tiles: int, splits: int) -> dict:
    """One layer's times (us, against the attention's end): att [seqs x kv heads, 2] (start, end; program
    seq + seqs x head), o [n_tiles x splits, 3] (start, counts seen, end; program tile + n_tiles x split), in ns."""
    end = att[:, 1].max()
    us = lambda t: (t - end).double() / 1e3  # noqa: E731
    by_head = att[:, 1].reshape(kv_heads, seqs)
    by_split = o.reshape(splits, n_tiles, 3)
    return {"attention_us": float((end - att[:, 0].min()).double() / 1e3),
            "head_end_us": us(by_head.max(1).values).tolist(),
            "o_first_start_us": float(us(o[:, 0].min())),
            "split_counts_us": us(by_split[:, :, 1].max(1).values).tolist(),
            "split_end_us": us(by_split[:, :, 2].max(1).values).tolist(),
            "split_work_us": ((by_split[:, :, 2] - by_split[:, :, 1]).double().median(1).values / 1e3).tolist(),
            "o_end_us": float(us(o[:, 2].max()))}


def summarize(att: torch.Tensor, o: torch.Tensor, seqs: int, kv_heads: int, n_tiles: int, splits: int) -> dict:
    """Medians over the layers of layer_times (att [layers, programs, 2], o [layers, programs, 3])."""
    per = [layer_times(att[i], o[i], seqs, kv_heads, n_tiles, splits) for i in range(att.shape[0])]
    return {key: (torch.tensor([p[key] for p in per]).median(0).values.tolist() if isinstance(per[0][key], list)
                  else float(torch.tensor([p[key] for p in per]).median())) for key in per[0]}


def trace_table(traces: dict) -> str:
    """The summaries as a markdown table, a row per way."""
    fmt = lambda v: " / ".join(f"{x:+.2f}" for x in v) if isinstance(v, list) else f"{v:+.2f}"  # noqa: E731
    lines = ["| way | attention span | o_proj's first start | each split's counts seen | each split's end | "
             "each split's work | o_proj's end | kv heads' last ends |", "|---|---|---|---|---|---|---|---|"]
    for name, t in traces.items():
        lines.append(f"| {name} | {t['attention_us']:.2f} | {fmt(t['o_first_start_us'])} | "
                     f"{fmt(t['split_counts_us'])} | {fmt(t['split_end_us'])} | {fmt(t['split_work_us'])} | "
                     f"{fmt(t['o_end_us'])} | {fmt(t['head_end_us'])} |")
    return "\n".join(lines) + "\n(us against the attention's last program end; medians over the layers)\n"
