"""``layernorm stability``: the norms' numerical error against exact answers, as tables.

Runs :func:`layernorm.stability.run_suite` and prints its tables (and the offset sweep's plot
with ``--plot``); exit status 1 if a target fails.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import stability

__all__ = ["DESCRIPTION", "add_arguments", "report_section", "run"]

DESCRIPTION = stability.__doc__  # the five tables, for --help


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smaller sizes (as the report)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--plot", type=Path, default=None,
                        help="also write the offset-sweep plot to this PNG file")
    parser.add_argument("--no-timing", action="store_true", help="skip the speed table")


def run(args: argparse.Namespace) -> int:
    res = stability.run_suite(args.quick, args.seed, timing=not args.no_timing)
    print("\n\n".join(stability.format_table(t) for t in res.tables))
    if args.plot is not None:
        print(f"\nplot written to {stability.plot_sweep(res.sweep, args.plot)}")
    for line in res.failed:
        print(f"FAIL {line}")
    print(f"\n{'targets: all met' if not res.failed else f'{len(res.failed)} targets failed'}")
    return 1 if res.failed else 0


def report_section(ctx: object) -> str:
    res = stability.run_suite(quick=ctx.quick)
    png = stability.plot_sweep(res.sweep, ctx.outdir / "stability.png")
    verdict = "all targets met" if not res.failed else f"{len(res.failed)} targets FAILED"
    return (
        "Errors of the variance algorithms and of the library against exact answers (integer "
        "arithmetic; see docs/numerics.md). Reproduce with "
        f"`layernorm stability{' --quick' if ctx.quick else ''}`.\n\n"
        f"![error against offset]({png.name})\n\n"
        + "\n\n".join(stability.format_table(t, markdown=True) for t in res.tables)
        + f"\n\n**{verdict}.**\n"
    )
