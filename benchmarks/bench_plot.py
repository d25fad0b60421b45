"""The accuracy-against-speed plot that benchmarks/quality.py and benchmarks/pareto.py both draw."""

from __future__ import annotations

import sys
from pathlib import Path

MODE_COLORS = {"full": "k", "eager": "tab:gray", "deferred": "tab:blue", "verify": "tab:green"}


def pyplot(skipped: str):
    """matplotlib.pyplot on the Agg backend, or None (with a warning naming what is `skipped`) where matplotlib
    is not importable: the benchmarks' plots are optional, their numbers are not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"warning: matplotlib is not importable; {skipped} skipped", file=sys.stderr)
        return None
    return plt


def mode_color(row: dict) -> str:
    """Full depth (deep_interval 1, whatever the mode) in black, then one color per mode."""
    return MODE_COLORS["full" if row["deep_interval"] == 1 else row["mode"]]


def accuracy_plot(rows: list[dict], x_key: str, path: Path, *, xlabel: str, ylabel: str, title: str) -> bool:
    """One point per row at (row[x_key], accuracy) with its 95% CI; rows whose x is None are left out.
    Returns False (and warns) when matplotlib is not importable."""
    plt = pyplot(Path(path).name)
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(r for r in rows if r[x_key] is not None):
        x, y = r[x_key], r["accuracy"]
        lo, hi = r["accuracy_ci95"]
        ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", capsize=3, color=mode_color(r))
        ax.annotate(r["config"], (x, y), textcoords="offset points", xytext=(4, (10, -14, 22, -26)[i % 4]),
                    fontsize=8, arrowprops=dict(arrowstyle="-", lw=0.4, color="0.5"))
    ax.axvline(1.0, color="k", lw=0.6, ls=":")
    ax.set_ylim(-0.15, 1.15)  # room for the labels above and below
    ax.set_yticks([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
