"""CPU versus peers in words and a figure, from the rows of :func:`layernorm.bench.peers.run`.

    table, plot  the table (ours over the best peer, and each peer) and a plot
    summary      the headlines: the cases that met their goal, the weakest
    answers      the report's first screen from a run: ours' speed per norm and mode, and what
                 to use (:func:`advice`: a choice only at a strict majority of the shapes
                 decided), each saying the grid it covers (:func:`scope`)
    doc_section  what docs/torch.md shows of a saved run
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .._table import render
from ..family import norm as family_norm
from . import results
from .end_to_end import end_to_end_verdict, format_end_to_end
from .peers import MODES, PEERS, SHAPES, _judge

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["ONNX_ROUTE", "advice", "answers", "doc_section", "figure", "plot", "scope",
           "summary", "table"]


def _cell(p: dict) -> str:
    if "absent" in p:
        return f"absent ({p['absent']})"
    if "p50_ms" not in p:
        return "-"
    s = p.get("speedup")
    text = f"{_ms(p['p50_ms'])}"
    if s is not None:
        text += f" ({s[0]:.2f}x: {s[1]:.2f}-{s[2]:.2f})"
    return text


def _ms(ms: float) -> str:
    return f"{ms * 1e3:.1f} us" if ms < 1 else f"{ms:.2f} ms"


def table(rows: list[dict], markdown: bool = True) -> str:
    """One line per case: ours p50 (p20-p80), each peer's p50 with ours' speed over it
    (p50: p20-p80 of per-round ratios), the largest difference of any peer's output from ours,
    and the verdict against the goal."""
    head = ["norm", "shape", "dtype", "mode", "thr", "ours p50 (p20-p80)",
            *(f"{p} (ours' speed over it)" for p in PEERS), "max |diff|", "verdict"]
    body = []
    for r in rows:
        ours = r["providers"].get("layernorm", {})
        our_cell = (f"{_ms(ours['p50_ms'])} ({_ms(ours['p20_ms'])}-{_ms(ours['p80_ms'])})"
                    if "p50_ms" in ours else _cell(ours))
        diffs = [p["max_diff"] for k, p in r["providers"].items()
                 if k != "layernorm" and p.get("max_diff") is not None]
        body.append([r["norm"], f"{r['shape']} {'x'.join(map(str, r['dims']))}", r["dtype"],
                     r["mode"], str(r["threads"]), our_cell,
                     *(_cell(r["providers"].get(p, {})) for p in PEERS),
                     f"{max(diffs):.1e}" if diffs else "-", r["verdict"]])
    return render(head, body, markdown)


def summary(rows: list[dict]) -> list[str]:
    """Headlines: how many steady rows met the goal, and the weakest ratio over the best peer."""
    judged = [r for r in rows if r.get("best")]
    met = [r for r in judged if r["verdict"] == "met"]
    missed = [r for r in judged if r["verdict"] == "missed"]
    lines = [f"{len(met)} of {len(judged)} cases met their goal against the best peer, "
             f"{len(missed)} missed, {len(judged) - len(met) - len(missed)} undecided "
             f"(too noisy to tell, or within the guard band)"]
    if judged:
        worst = min(judged, key=lambda r: r["providers"][r["best"]]["speedup"][0])
        s = worst["providers"][worst["best"]]["speedup"]
        lines.append(f"weakest: {worst['norm']} {worst['shape']} {worst['dtype']} "
                     f"{worst['mode']} {worst['threads']} thread(s): {s[0]:.2f}x "
                     f"{worst['best']} ({s[1]:.2f}-{s[2]:.2f})")
    return lines


def _grid(rows: list[dict]) -> list[tuple[str, int]]:
    """The (dtype, threads) pairs of ``rows``, sorted."""
    return sorted({(r["dtype"], r["threads"]) for r in rows})


def _standing(rows: list[dict], names: tuple[str, ...] = PEERS) -> dict[tuple[str, str], dict]:
    """Per (norm, mode): each row's fastest at p50 of the peers ``names`` (every one timed,
    whatever the row is judged against) and ours' speed over it, sorted into faster (p20 of
    the per-round ratios above 1), slower (p80 below 1), level, and too noisy to tell (a
    time's p80/p20 at :data:`layernorm.bench.results.STEADY` or more). Each entry is (case,
    peer, ours' speed at p50 or None): the case is the row's shape, followed by its dtype and
    threads where ``rows`` hold several of those."""
    several = len(_grid(rows)) > 1
    out: dict[tuple[str, str], dict] = {}
    for r in rows:
        case = f"{r['shape']} ({r['dtype']}, {r['threads']}t)" if several else r["shape"]
        ours = r["providers"].get("layernorm", {})
        timed = {k: v for k, v in r["providers"].items()
                 if k in names and "p50_ms" in v and "speedup" in v}
        if "p50_ms" not in ours or not timed:
            continue
        peer = min(timed, key=lambda k: timed[k]["p50_ms"])
        s = out.setdefault((r["norm"], r["mode"]), {"faster": [], "slower": [], "level": [],
                                                     "noisy": []})
        if results.noisy(ours, timed[peer]):
            s["noisy"].append((case, peer, None))
            continue
        p50, lo, hi = timed[peer]["speedup"]
        s["faster" if lo > 1 else "slower" if hi < 1 else "level"].append((case, peer, p50))
    return out


def scope(rows: list[dict]) -> str:
    """The grid ``rows`` cover, in words: the command that times it, its dtypes and thread
    counts, and each shape with its extents, so that a figure quoted from it says where it
    holds."""
    grid = _grid(rows)
    dtypes = list(dict.fromkeys(d for d, _ in grid))
    threads = sorted({t for _, t in grid})
    if len(grid) == len(dtypes) * len(threads):  # every dtype at every thread count
        where = (f"{' and '.join(dtypes)}, {' and '.join(map(str, threads))} "
                 f"thread{'s' if threads != [1] else ''}")
    else:
        where = "; ".join(f"{d}, {t} thread{'s' if t > 1 else ''}" for d, t in grid)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    named = ", ".join(f"{s} {'x'.join(map(str, SHAPES[s]))}" if s in SHAPES else s
                      for s in shapes)
    return f"`layernorm bench --peers` ({where}; {len(shapes)} shapes: {named})"


# What onnxruntime's place in the advice means for a PyTorch user.
ONNX_ROUTE = ("`onnxruntime` means a model exported to ONNX and run in onnxruntime "
              "(`docs/export.md`), whose norms are its fused operators; it is not a per-op "
              "swap in a PyTorch model")


def advice(s: dict, unit: str = "shapes") -> str:
    """What to use for one norm and mode, from its standing (:func:`_standing`): a choice only
    where it was faster beyond the noise at a strict majority of the shapes decided (faster,
    slower or level; a shape too noisy to tell is not decided); "any" where no shape was
    decided either way, or where the level shapes are that majority; otherwise "depends on
    the shape", naming the shapes where each was faster. The too-noisy shapes follow, named.
    ``unit`` names what the entries are: "shapes", or "cases" where they span several dtypes
    or thread counts."""
    wins: dict[str, list[str]] = {}
    for shape, _, _ in s["faster"]:
        wins.setdefault("layernorm.torch", []).append(shape)
    for shape, peer, _ in s["slower"]:
        wins.setdefault(peer, []).append(shape)
    level = [shape for shape, _, _ in s["level"]]
    decided = len(level) + sum(len(v) for v in wins.values())
    total = decided + len(s["noisy"])
    noisy = ", ".join(shape for shape, _, _ in s["noisy"])
    tail = f"; too noisy to tell at {noisy}" if noisy else ""
    if not decided:
        return f"none named (too noisy to tell at all {total} {unit}: {noisy})"
    ranked = sorted(wins, key=lambda k: -len(wins[k]))  # ties keep ours first
    at = [f"`{k}` at {', '.join(wins[k])}" for k in ranked]
    if not wins:
        return (f"any (no {unit[:-1]} faster or slower beyond the noise; level at "
                f"{', '.join(level)}){tail}")
    top = ranked[0]
    if 2 * len(wins[top]) > decided:
        return (f"`{top}` (faster at {len(wins[top])} of {total} {unit}"
                + "".join(f"; {a}" for a in at[1:])
                + (f"; level at {', '.join(level)}" if level else "") + f"){tail}")
    if 2 * len(level) > decided:
        return (f"any (level at {len(level)} of {total} {unit}: {', '.join(level)}; "
                + "; ".join(at) + f"){tail}")
    return (f"depends on the shape (none was faster at most of the {decided} {unit} "
            "decided): "
            + "; ".join(at) + (f"; level at {', '.join(level)}" if level else "") + tail)


def answers(rows: list[dict], e2e: dict | None = None) -> dict[str, str]:
    """The report's first screen from one run: "faster" (per norm and mode, ours' speed over
    the fastest peer of each shape, median and counts, noisy shapes named as such; the
    end-to-end model) and "use" (per norm and mode, :func:`advice`; where onnxruntime is
    named, what it applies to and the advice among the PyTorch providers alone)."""
    standing = _standing(rows)
    if not standing:
        return {}
    in_torch = _standing(rows, ("torch", "torch.compile"))
    unit = "cases" if len(_grid(rows)) > 1 else "shapes"
    lines, use = [], []
    for norm in dict.fromkeys(r["norm"] for r in rows):
        cells = []
        for mode in MODES:
            s = standing.get((norm, mode))
            if s is None:
                cells.append("not timed")
                continue
            steady = s["faster"] + s["slower"] + s["level"]
            n = len(steady) + len(s["noisy"])
            title = f"{family_norm(norm).title}, {mode}"
            use.append(f"- {title}: {advice(s, unit)}")
            if any(peer == "onnxruntime" for _, peer, _ in s["slower"]):
                within = in_torch.get((norm, mode))
                use.append(f"  - {ONNX_ROUTE}"
                           + (f"; within PyTorch: {advice(within, unit)}" if within else ""))
            if not steady:
                cells.append(f"too noisy to tell at all {n} {unit}")
                continue
            med = float(np.median([q for _, _, q in steady]))
            weakest = min(steady, key=lambda t: t[2])
            text = (f"**{med:.2f}x** (faster at {len(s['faster'])}, level at "
                    f"{len(s['level'])}, slower at {len(s['slower'])} of {n} {unit}")
            if s["noisy"]:
                text += f"; too noisy to tell at {len(s['noisy'])}"
            if weakest[2] < 1:
                text += f"; slowest {weakest[2]:.2f}x {weakest[1]} at {weakest[0]}"
            cells.append(text + ")")
        lines.append(f"| {family_norm(norm).title} | " + " | ".join(cells) + " |")
    where = scope(rows)
    faster = (
        f"Ours (`layernorm.torch`) against the fastest of torch eager, torch.compile and "
        f"onnxruntime at each shape, all timed in the same run of {where}: the median, over "
        "the shapes timed steadily, of the fastest peer's time over ours, above 1 meaning ours "
        "is faster. A shape counts as faster or slower only where the per-round ratios' "
        "p20-p80 lies wholly on that side of 1, and not at all where a time was too noisy to "
        "tell. onnxruntime's times are its fused operator alone, as a model exported to ONNX "
        "runs it.\n\n"
        "| norm | inference | training |\n|---|---|---|\n" + "\n".join(lines))
    if e2e is not None:
        faster += "\n\nIn a Llama-shaped model (" + "; ".join(
            f"{task}: {e2e[task]['speedup'][0]:.2f}x, {end_to_end_verdict(task, e2e[task])}"
            for task in ("train step", "generate")) + ")."
    use_text = (f"From {where}, per norm and mode: ours against the fastest peer at each "
                "shape. A choice is named only where it was faster beyond the noise at more "
                "than half of the shapes decided (faster, slower or level; a shape too noisy "
                "to tell is not decided); where level shapes are that majority, any will do; "
                "otherwise it depends on the shape, and the line names the shapes where each "
                "was faster."
                + ("" if unit == "cases" else " Other dtypes and thread counts: "
                   "`layernorm bench --peers --full`.")
                + "\n\n" + "\n".join(use))
    return {"faster": faster, "use": use_text}


def figure(rows: list[dict]) -> Figure:
    """Ours' speed over the fastest peer judged per case (p20-p80 bars), one panel per mode,
    dtype and thread count, each case's goal marked. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    short = {"layer_norm": "LN", "rms_norm": "RMS", "add_layer_norm": "add+LN",
             "add_rms_norm": "add+RMS"}
    panels = sorted({(r["mode"], r["dtype"], r["threads"]) for r in rows})
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 4.2 * len(panels)), squeeze=False,
                             layout="constrained")
    for ax, (mode, dtype, thr) in zip(axes[:, 0], panels, strict=True):
        mine = [r for r in rows if (r["mode"], r["dtype"], r["threads"]) == (mode, dtype, thr)
                and r.get("best")]
        labels = [f"{short[r['norm']]} {r['shape']}" for r in mine]
        s = np.array([r["providers"][r["best"]]["speedup"] for r in mine]).reshape(-1, 3)
        xs = np.arange(len(mine))
        ax.bar(xs, s[:, 0], color="tab:blue", alpha=0.7)
        ax.errorbar(xs, s[:, 0], yerr=[s[:, 0] - s[:, 1], s[:, 2] - s[:, 0]], fmt="none",
                    ecolor="black", capsize=2)
        ax.scatter(xs, [r["goal"] for r in mine], marker="_", s=120, color="tab:red",
                   zorder=3, label="goal (decode: against torch eager)")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(xs, labels, fontsize=7, rotation=50, ha="right", rotation_mode="anchor")
        ax.set_ylabel("peer's time / ours")
        ax.set_title(f"{mode}, {dtype}, {thr} thread{'s' if thr > 1 else ''}: ours against "
                     f"the fastest peer judged", fontsize=10)
        ax.legend(fontsize=8)
    return fig


def plot(rows: list[dict], path: Path) -> Path:
    """:func:`figure` saved as a PNG at ``path``; returns ``path``. Raises ImportError without
    matplotlib."""
    fig = figure(rows)
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def doc_section(result: dict) -> str:
    """What docs/torch.md shows of a saved run: per dtype and thread count the headlines, then
    the table of every case, one per dtype and thread count (tests/test_docs.py checks the
    document against the file with this function)."""
    rows = result["rows"]
    for r in rows:  # the verdicts by this version's rules, not the file's
        _judge(r)
    groups = sorted({(r["dtype"], r["threads"]) for r in rows}, key=lambda k: (k[0], -k[1]))
    parts = []
    for dtype, thr in groups:
        mine = [r for r in rows if r["dtype"] == dtype and r["threads"] == thr]
        parts.append(f"**{dtype}, {thr} thread{'s' if thr > 1 else ''}**\n\n"
                     + "\n".join(f"- {line}" for line in summary(mine)) + "\n\n"
                     + table(mine))
    if "end_to_end" in result:
        parts.append(format_end_to_end(result["end_to_end"]))
    return "\n\n".join(parts)
