"""The ``layernorm`` command: one sub-command per module of :mod:`layernorm.commands`.

Each module has ``add_arguments`` and ``run``; the first line of its docstring is the
sub-command's help, and its ``DESCRIPTION`` (else its docstring) the ``--help`` text.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS: dict[str, str] = {
    "bench": "layernorm.commands.bench",
    "check": "layernorm.commands.check",
    "cost": "layernorm.commands.cost",
    "report": "layernorm.commands.report",
    "stability": "layernorm.commands.stability",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layernorm",
        description="Layer normalization: reference, gradient checks, numerics, fused kernels.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        mod = importlib.import_module(module)
        summary = (mod.__doc__ or "").strip().splitlines()[0]
        summary = summary.split("``: ", 1)[-1]  # drop a leading "``layernorm NAME``: "
        description = getattr(mod, "DESCRIPTION", mod.__doc__)
        p = sub.add_parser(name, help=summary, description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
