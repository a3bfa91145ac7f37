"""The CPU benchmark's results: JSON files, the tables and the bandwidth plot.

    save, load, default_path  ``{"meta": ..., "rows": [...]}`` as JSON, by default
                              bench/results/cpu-<host>-<time>.json
    format_table              every row: p50 (p20-p80), GB/s, fraction of copy, speedups, check
    summary_table             per case: copy GB/s, fused and PyTorch fractions of copy, the goals
    torch_table               per case: torch eager's and torch.compile's fwd+bwd time over
                              layernorm.torch's, the goal for the PyTorch API
    verdict                   met, missed, or noisy: a goal judged at both ends of the spread
    plot_bandwidth            GB/s per case, backend and pass, with the copy and the goals
    format_latency            the first-call latency of a fresh process, cold and warm
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np

from .._table import render
from ..family import norm as family_norm
from .providers import BACKENDS

__all__ = ["BWD_GOAL", "FWD_GOAL", "STEP_GOAL", "TORCH_API_GOAL", "default_path",
           "format_latency", "format_table", "load", "plot_bandwidth", "save", "summary_table",
           "torch_table", "verdict"]

FWD_GOAL, BWD_GOAL, STEP_GOAL = 0.80, 0.70, 1.5  # fractions of copy; fwd+bwd speedup vs torch
TORCH_API_GOAL = 1.5  # torch eager's fwd+bwd time over layernorm.torch's


def default_path() -> Path:
    """bench/results/cpu-<host>-<YYYYmmdd-HHMMSS>.json under the current folder."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in platform.node()) or "host"
    return Path("bench") / "results" / f"cpu-{host}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def save(result: dict, path: Path) -> Path:
    """Write a run (``{"meta": ..., "rows": [...]}``) as JSON to ``path``; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def load(path: Path) -> dict:
    """A run saved by :func:`save`; rows without a ``norm`` are LayerNorm's."""
    result = json.loads(Path(path).read_text())
    if not isinstance(result, dict) or set(result) != {"meta", "rows"}:
        raise ValueError(f"{path}: expected a JSON object with keys 'meta' and 'rows'")
    for row in result["rows"]:
        row.setdefault("norm", "layer_norm")  # files saved when LayerNorm was the only norm
    return result


def _title(r: dict) -> str:
    return family_norm(r["norm"]).title


def format_table(rows: list[dict], markdown: bool = False) -> str:
    """Every row: p50 (p20-p80) ms, GB/s, fraction of copy, speedups against the peers."""
    head = ["norm", "shape", "dtype", "impl", "op", "p50 ms (p20-p80)", "GB/s", "of copy",
            "speedup vs peers", "check"]
    body = []
    for r in rows:
        sp = ", ".join(f"{v:.2f}x vs {k}" for k, v in r["speedup"].items())
        chk = "" if r["check"] is None else ("ok" if r["check"] <= 1 else
                                             f"{r['check']:.1f}x tol")
        body.append([
            _title(r), "x".join(map(str, r["shape"])), r["dtype"], r["impl"], r["op"],
            f"{r['p50_ms']:.3f} ({r['p20_ms']:.3f}-{r['p80_ms']:.3f})", f"{r['gbps']:.1f}",
            f"{r['frac_copy']:.0%}", sp, chk,
        ])
    return render(head, body, markdown)


def _find(rows: list[dict], case: tuple, impl: str, op: str) -> dict | None:
    """The row of ``case`` (norm, shape, dtype), ``impl`` and ``op``, or None."""
    for r in rows:
        if (r["norm"], r["shape"], r["dtype"]) == case and r["impl"] == impl and r["op"] == op:
            return r
    return None


def _cases(rows: list[dict]) -> list[tuple]:
    """The (norm, shape, dtype) of the rows, in order of appearance."""
    cases = []
    for r in rows:
        case = (r["norm"], r["shape"], r["dtype"])
        if case not in cases:
            cases.append(case)
    return cases


def verdict(lo: float, hi: float, goal: float, fmt: str = "{:.2f}x") -> str:
    """A goal (at least ``goal``) judged on a measurement's p20-p80 spread ``lo``-``hi``:
    "met" when even p20 reaches it, "missed" when even p80 falls short, else "noisy: rerun"
    with the spread, since the run cannot tell."""
    if lo >= goal:
        return "met"
    if hi < goal:
        return "missed"
    return f"noisy: rerun ({fmt.format(lo)}-{fmt.format(hi)})"


def _ratio(row: dict | None, peer: str) -> tuple[float, float, float] | None:
    """``peer``'s time over ``row``'s, (p50, p20, p80) over per-round ratios, or None."""
    if row is None or peer not in row["speedup"]:
        return None
    lo, hi = row["speedup_p20_p80"][peer]
    return row["speedup"][peer], lo, hi


def summary_table(rows: list[dict], markdown: bool = False) -> str:
    """Per case: copy GB/s, fused and PyTorch fractions of copy, fused speedup vs PyTorch,
    and the goals' verdicts (:func:`verdict`)."""
    head = ["norm", "shape", "dtype", "threads", "copy GB/s", "fused fwd", "fused bwd",
            "torch fwd", "torch bwd", "fused/torch fwd+bwd", "goals"]
    body = []
    for case in _cases(rows):
        r = _find(rows, case, "copy", "copy")
        if r is None:
            continue

        def frac(impl: str, op: str, case=case) -> str:
            f = _find(rows, case, impl, op)
            if f is None:
                return "-"
            lo, hi = f["frac_copy_p20_p80"]
            return f"{f['frac_copy']:.0%} ({lo:.0%}-{hi:.0%})"

        goals = []
        for op, goal in (("fwd", FWD_GOAL), ("bwd", BWD_GOAL)):
            f = _find(rows, case, "fused", op)
            if f:
                goals.append(f"{op} " + verdict(*f["frac_copy_p20_p80"], goal, "{:.0%}"))
        speed = _ratio(_find(rows, case, "fused", "fwd+bwd"), "torch")
        if speed:
            goals.append("speedup " + verdict(*speed[1:], STEP_GOAL))
        body.append([
            _title(r), "x".join(map(str, r["shape"])), r["dtype"], str(r["threads"]),
            f"{r['copy_gbps']:.1f}", frac("fused", "fwd"), frac("fused", "bwd"),
            frac("torch", "fwd"), frac("torch", "bwd"),
            "-" if speed is None else f"{speed[0]:.2f}x", ", ".join(goals),
        ])
    return render(head, body, markdown)


def torch_table(rows: list[dict], markdown: bool = False) -> str:
    """Per case timed with ``layernorm.torch``: torch eager's and torch.compile's fwd+bwd time
    over layernorm.torch's, p50 (p20-p80) of per-round ratios, and the goal: torch eager's over
    ours >= :data:`TORCH_API_GOAL` (:func:`verdict`; a result failing its check meets nothing).
    Empty when no case has both layernorm.torch and torch rows."""
    head = ["norm", "shape", "dtype", "threads", "layernorm.torch fwd+bwd ms",
            "torch / layernorm.torch", "torch.compile / layernorm.torch",
            f"goal >= {TORCH_API_GOAL}x torch"]
    body = []
    for case in _cases(rows):
        ours = _find(rows, case, "layernorm.torch", "fwd+bwd")
        eager = _ratio(ours, "torch")
        if eager is None:
            continue
        compiled = _ratio(ours, "torch.compile")
        ratios = ["-" if q is None else f"{q[0]:.2f}x ({q[1]:.2f}-{q[2]:.2f})"
                  for q in (eager, compiled)]
        goal = (verdict(*eager[1:], TORCH_API_GOAL) if ours["check"] <= 1
                else f"fails its check ({ours['check']:.1f}x tol)")
        body.append([
            _title(ours), "x".join(map(str, ours["shape"])), ours["dtype"], str(ours["threads"]),
            f"{ours['p50_ms']:.3f} ({ours['p20_ms']:.3f}-{ours['p80_ms']:.3f})", *ratios, goal,
        ])
    return render(head, body, markdown) if body else ""


def plot_bandwidth(rows: list[dict], path: Path) -> Path:
    """Bar chart of GB/s on minimal bytes per case, backend and pass, with copy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _cases(rows)
    impls = [i for i in BACKENDS if any(r["impl"] == i for r in rows)]
    # one panel per pass, stacked, so that many cases keep readable labels
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.75 * len(cases) + 2), 7), sharex=True)
    width = 0.8 / max(1, len(impls))
    for ax, op, goal in zip(axes, ("fwd", "bwd"), (FWD_GOAL, BWD_GOAL), strict=True):
        for k, impl in enumerate(impls):
            vals = [(_find(rows, c, impl, op) or {}).get("gbps", 0.0) for c in cases]
            ax.bar(np.arange(len(cases)) + (k - (len(impls) - 1) / 2) * width, vals, width,
                   label=impl)
        for i, c in enumerate(cases):
            cp = _find(rows, c, "copy", "copy")
            ax.hlines([cp["gbps"], goal * cp["gbps"]], i - 0.45, i + 0.45,
                      colors=["black", "gray"], linestyles=["solid", "dashed"])
        ax.set_title(f"{op}: GB/s on minimal bytes (black: copy, dashed: {goal:.0%} of it)",
                     fontsize=9)
        ax.set_ylabel("GB/s")
    axes[1].set_xticks(np.arange(len(cases)))
    axes[1].set_xticklabels([f"{family_norm(n).title} {'x'.join(map(str, s))} {d}"
                             for n, s, d in cases], fontsize=8, rotation=35, ha="right")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_latency(latency: dict[str, dict[str, float]]) -> str:
    """One line: import, forward and backward seconds of each fresh-process run."""
    return "first call, fresh process (float32): " + "; ".join(
        f"{label}: import {t['import_s']:.2f} s, forward {t['forward_s']:.2f} s, "
        f"backward {t['backward_s']:.2f} s" for label, t in latency.items())
