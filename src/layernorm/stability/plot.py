"""The offset sweep of table 1 as a PNG: each variance algorithm's error against the offset
of the data, one panel per dtype (needs matplotlib)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..numerics import unit_roundoff


def plot_sweep(sweep: dict[str, dict[str, list[tuple[float, float]]]], path: Path) -> Path:
    """PNG of each variance algorithm's error against the offset of the data, one panel per
    dtype with at least two offsets (a dtype with fewer is named in the figure's caption), each
    panel's offset axis only as wide as its data. Needs matplotlib (ImportError if missing)."""
    from matplotlib.figure import Figure  # Figure.savefig renders PNG with Agg, no pyplot
    from matplotlib.lines import Line2D

    floor = 1e-18  # exact zeros are drawn here, on the log axis
    shown = {d: s for d, s in sweep.items() if len({o for pts in s.values() for o, _ in pts}) > 1}
    left_out = [d for d in sweep if d not in shown]
    if not shown:
        raise ValueError("the sweep has no dtype with two or more offsets to plot")
    fig = Figure(figsize=(3.4 * len(shown) + 2.6, 4.2), layout="constrained")
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    handles: dict[str, object] = {}
    for ax, (dtype, series) in zip(axes, shown.items(), strict=True):
        finite = [e for pts in series.values() for _, e in pts if math.isfinite(e)]
        ceiling = 10 * max(max(finite, default=1.0), 1.0)  # non-finite errors drawn here
        for k, (name, points) in enumerate(series.items()):
            color = f"C{k}"
            xs = [o for o, _ in points]
            ys = [max(e, floor) if math.isfinite(e) else ceiling for _, e in points]
            (line,) = ax.loglog(xs, ys, marker="o", ms=3, color=color,
                                ls="--" if name == "library y" else "-")
            handles.setdefault("this library (its y)" if name == "library y" else name, line)
            bad = [(o, ceiling) for o, e in points if not math.isfinite(e)]
            if bad:
                ax.plot(*zip(*bad, strict=True), "x", color=color, ms=8, mew=2)
        u = unit_roundoff(np.dtype(dtype))
        ax.axhline(u, color="gray", ls=":", lw=1)
        ax.set_title(dtype)
        ax.set_xlabel("offset: each row is offset + N(0, 1)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("relative error of the normalized row\n(max abs error / max abs exact)")
    handles["unit roundoff of the dtype"] = Line2D([], [], color="gray", ls=":", lw=1)
    handles["overflow or NaN (drawn at the top)"] = Line2D([], [], color="black", ls="",
                                                           marker="x", ms=8, mew=2)
    fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=8,
               title="statistics computed by", title_fontsize=8)
    title = ("Variance algorithms against exact arithmetic as the mean grows "
             "(statistics in the dtype of x)")
    if left_out:
        title += (f"\nnot plotted, fewer than two offsets representable: "
                  f"{', '.join(left_out)} (see the table)")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=100)
    return path
