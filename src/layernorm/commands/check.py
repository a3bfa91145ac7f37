"""``layernorm check``: gradient checks of the reference on a few shapes and dtypes.

float64 is checked by finite differences (:func:`layernorm.check_vjp`, fast and full
modes). Lower precisions are checked against the float64 reference on the same rounded
inputs, with the tolerances of :mod:`layernorm.tolerances`. The checks are
:func:`layernorm.selfcheck.run_checks`; exit status 1 if any fails.
"""

from __future__ import annotations

import argparse

from .._table import render
from ..selfcheck import CheckRow, run_checks

__all__ = ["add_arguments", "format_table", "report_section", "run"]


def format_table(rows: list[CheckRow], markdown: bool = False) -> str:
    head = ["shape", "dtype", "check", "max abs err", "max rel err", "tolerance", "s", "result"]
    body = [
        [str(r.shape), r.dtype, r.method, f"{r.max_abs_err:.2e}", f"{r.max_rel_err:.2e}",
         r.tolerance, f"{r.seconds:.2f}", "pass" if r.passed else "FAIL"]
        for r in rows
    ]
    return render(head, body, markdown)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


def run(args: argparse.Namespace) -> int:
    rows = run_checks(args.seed)
    print(format_table(rows))
    for r in rows:
        if not r.passed:
            print(f"\nFAIL {r.shape} {r.dtype} {r.method}: {r.detail}")
    failed = sum(not r.passed for r in rows)
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


def report_section(ctx: object) -> str:
    rows = run_checks()
    failed = sum(not r.passed for r in rows)
    return (
        "Gradients of the NumPy reference checked by central differences in float64 "
        "(`check_vjp`, fast and full modes), and each lower precision against the float64 "
        "reference on the same rounded inputs (tolerances from `layernorm.tolerances`). "
        "Reproduce with `layernorm check`.\n\n"
        + format_table(rows, markdown=True)
        + f"\n\n**{len(rows) - failed} passed, {failed} failed.**\n"
    )
