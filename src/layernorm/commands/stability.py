"""``layernorm stability``: the norms' numerical error against exact answers, as tables.

Runs :func:`layernorm.stability.run_suite` and prints its tables (and the offset sweep's plot
with ``--plot``); exit status 1 if a target of ours fails.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import stability
from . import seed, usage_error, writable
from .report import Section, folded

__all__ = ["DESCRIPTION", "add_arguments", "report_section", "run"]

DESCRIPTION = stability.__doc__  # the seven tables, for --help


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smaller sizes (as the report)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the random inputs")
    parser.add_argument("--plot", type=Path, default=None,
                        help="also write the offset-sweep plot to this PNG file")
    parser.add_argument("--no-timing", action="store_true", help="skip the speed table")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip the peers' table (torch.compile compiles each of its cases)")


def run(args: argparse.Namespace) -> int:
    if args.plot is not None:
        problem = writable(args.plot)
        if problem is None and args.plot.suffix.lower() != ".png":
            problem = f"must name a .png file, got {args.plot}"
        if problem is not None:
            return usage_error("layernorm stability", f"argument --plot: {problem}")
    res = stability.run_suite(args.quick, args.seed, timing=not args.no_timing,
                              peers=not args.no_peers)
    print("\n\n".join(stability.format_table(t, markdown=True) for t in res.tables))
    if args.plot is not None:
        print(f"\nplot written to {stability.plot_sweep(res.sweep, args.plot)}")
    for line in res.failed:
        print(f"FAIL {line}")
    print(f"\n{'targets: all met' if not res.failed else f'{len(res.failed)} targets failed'}")
    return 1 if res.failed else 0


def _headline_figure(res: stability.Results) -> str:
    """The variance table's float32 row at offset 1e4: the library's error against the
    naive one-pass formula's, or "" when the run has no such row."""
    table = res.tables[0]
    for row in table.rows:
        if row[0] == "offset 1e+04" and row[1] == "float32":
            naive, ours = row[table.head.index("naive")], row[table.head.index("library y")]
            naive = ("gives no finite answer" if naive in ("inf", "nan") else
                     f"has a relative error of {naive}")
            return (f"on float32 rows at offset 1e4 (mean/std = 1e4) the library's y has a "
                    f"relative error of {ours}, where the one-pass formula E[x^2] - E[x]^2 "
                    f"{naive}")
    return ""


def _targets(res: stability.Results) -> int:
    """How many rows of the tables carry a target of ours: those with a result, and every row
    of the peers' table (ours is held to its dtype's target there)."""
    return sum(row[t.head.index("result")] in ("pass", "FAIL") if "result" in t.head
               else t.title == stability.PEER_TITLE for t in res.tables for row in t.rows)


def _peer_standing(res: stability.Results) -> str:
    """One sentence: on how many of table 5's cases each peer misses ours' targets, or that
    the run has no peers' table."""
    table = next((t for t in res.tables if t.title == stability.PEER_TITLE), None)
    if table is None:
        return ""
    n = len(table.rows)
    parts = [f"{peer} absent" if all(row[table.head.index(f"{peer} y")] == "absent"
                                      for row in table.rows)
             else f"{peer} on {len(res.missed.get(peer, []))}"
             for peer in stability.PEERS]
    return (f"on the same {n} adversarial cases (large means, constant rows, values near 1e30 "
            f"and 1e300, half-precision extremes, long rows) the peers miss those targets: "
            + ", ".join(parts))


def report_section(ctx: object) -> Section:
    res = stability.run_suite(quick=ctx.quick)
    try:
        png = stability.plot_sweep(res.sweep, ctx.outdir / "stability.png")
        plot = (f"![Error of each variance algorithm against the offset of the data, per dtype]"
                f"({png.name})")
    except ImportError:
        plot = "(matplotlib is not installed, so there is no plot: pip install matplotlib.)"
    n = _targets(res)
    head = (f"all {n} targets met" if not res.failed else
            f"**FAIL**: {len(res.failed)} of {n} targets missed, e.g. {res.failed[0]}")
    figure = _headline_figure(res)
    peers = _peer_standing(res)
    summary = [f"{head} against an exact oracle (integer arithmetic)"
               + (f"; {figure}." if figure else "."),
               *([f"{peers[0].upper()}{peers[1:]}."] if peers else [])]
    right = (f"**{'Yes' if not res.failed else 'No'}, against exact answers:** "
             f"{head.replace('**FAIL**: ', '')} on the adversarial suite"
             + (f"; {peers}." if peers else "."))
    shown = [t for t in res.tables[1:] if t.title == stability.PEER_TITLE]
    rest = [t for t in res.tables[1:] if t.title != stability.PEER_TITLE]
    body = (
        "Errors of the variance algorithms and of the library against exact answers (integer "
        "arithmetic; see docs/numerics.md), and of torch, torch.compile and onnxruntime on the "
        "same inputs. Reproduce with "
        f"`layernorm stability{' --quick' if ctx.quick else ''}`.\n\n"
        f"**{'All targets met' if not res.failed else head}.**\n\n{plot}\n\n"
        + stability.format_table(res.tables[0], markdown=True) + "\n\n"
        + "".join(stability.format_table(t, markdown=True) + "\n\n" for t in shown)
        + "\n\n".join(folded(t.title, stability.format_table(t, markdown=True)) for t in rest)
        + "\n"
    )
    return Section(summary, body, {"right": right})
