"""``layernorm check``: gradient checks of every norm's reference, and its backends against it.

For each norm of the family (``--norm``, repeatable; default all): float64 gradients by
finite differences (:func:`layernorm.check_vjp`, fast mode, and full mode on the small
shapes); each lower precision against the float64 reference on the same rounded inputs; the
fused CPU kernels (where the C++ engine runs) against the reference in every dtype, all with the
tolerances of :mod:`layernorm.tolerances`. One shape's rows use zero-centred gamma (the
scale column says 1+gamma). The checks are :func:`layernorm.selfcheck.run_checks`; exit
status 1 if any fails, 2 for a command-line mistake.
"""

from __future__ import annotations

import argparse

from .._table import render
from ..family import NORMS
from ..selfcheck import CheckRow, run_checks
from . import seed
from .report import Section, folded

__all__ = ["add_arguments", "format_table", "report_section", "run"]


def format_table(rows: list[CheckRow], markdown: bool = True) -> str:
    head = ["norm", "shape", "scale", "dtype", "check", "max abs err", "max rel err",
            "tolerance", "s", "result"]
    body = [
        [NORMS[r.norm].title, str(r.shape), r.scale, r.dtype, r.method, f"{r.max_abs_err:.2e}",
         f"{r.max_rel_err:.2e}", r.tolerance, f"{r.seconds:.2f}", "pass" if r.passed else "FAIL"]
        for r in rows
    ]
    return render(head, body, markdown)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=seed, default=0, help="seed of the random inputs")
    parser.add_argument("--norm", action="append", choices=list(NORMS),
                        help="the norm to check (repeatable; default every norm of the family)")


def _summary(rows: list[CheckRow]) -> str:
    failed = sum(not r.passed for r in rows)
    return f"{len(rows) - failed} passed, {failed} failed"


def run(args: argparse.Namespace) -> int:
    rows = run_checks(args.seed, args.norm)
    print(format_table(rows))
    for r in rows:
        if not r.passed:
            print(f"\nFAIL {NORMS[r.norm].title} {r.shape} {r.scale} {r.dtype} {r.method}: "
                  f"{r.detail}")
    print(f"\n{_summary(rows)}")
    return 1 if any(not r.passed for r in rows) else 0


def _fd_figures(rows: list[CheckRow]) -> tuple[float, float]:
    """The largest finite-difference error and the smallest tolerance among those checks."""
    fd = [r for r in rows if r.method.startswith("finite differences") and r.passed]
    return (max((r.max_abs_err for r in fd), default=float("nan")),
            min((float(r.tolerance) for r in fd), default=float("nan")))


def report_section(ctx: object) -> Section:
    rows = run_checks()
    failed = [r for r in rows if not r.passed]
    err, tol = _fd_figures(rows)
    norms = ", ".join(dict.fromkeys(NORMS[r.norm].title for r in rows))
    head = (f"pass: all {len(rows)} checks of {norms}" if not failed else
            f"**FAIL**: {len(failed)} of {len(rows)} checks failed, e.g. "
            f"{NORMS[failed[0].norm].title} {failed[0].shape} {failed[0].dtype} "
            f"{failed[0].method}")
    summary = [
        f"{head}. Hand-derived backward against finite differences in float64: largest error "
        f"{err:.1e}, smallest tolerance {tol:.1e}; every lower precision and the fused CPU "
        "kernels against the float64 reference within `layernorm.tolerances`.",
    ]
    body = (
        "Every norm of the family: gradients of the NumPy reference checked by central "
        "differences in float64 (`check_vjp`, fast mode, and full mode on the small shapes), "
        "each lower precision against the float64 reference on the same rounded inputs, and "
        "the fused CPU kernels against the reference in every dtype (tolerances from "
        "`layernorm.tolerances`); the rows of one shape use zero-centred gamma (scale "
        "1+gamma). Reproduce with `layernorm check`.\n\n"
        f"**{_summary(rows)}.**\n\n"
        + folded(f"All {len(rows)} checks", format_table(rows, markdown=True)) + "\n"
    )
    if failed:
        right = (f"**No: {len(failed)} of {len(rows)} gradient checks failed** (e.g. "
                 f"{NORMS[failed[0].norm].title} {failed[0].shape} {failed[0].dtype}, "
                 f"{failed[0].method}); the section lists each.")
    else:
        kinds = {r.method.split(" (")[0] for r in rows}
        fused = ("and the fused CPU kernels agree with the reference in every dtype"
                 if "fused CPU vs reference" in kinds else
                 "(the fused CPU kernels were not checked: the C++ engine is not available "
                 "here)")
        right = (f"**Yes, in every check run here.** All {len(rows)} checks of {norms} "
                 "passed: the hand-derived backward agrees with central finite differences in "
                 f"float64 (errors at most {err:.1e}, tolerances at least {tol:.1e}), every "
                 "lower precision agrees with the float64 reference within the tolerance "
                 f"table, {fused}.")
    return Section(summary, body, {"right": right})
