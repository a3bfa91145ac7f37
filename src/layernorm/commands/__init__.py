"""The ``layernorm`` command: one module per sub-command, argparse and formatting only.

Each module has ``add_arguments(parser)`` and ``run(args) -> exit status``, and the ones that
contribute to ``layernorm report`` a ``report_section(ctx) -> Markdown``; the computation they
print lives in the library (:mod:`layernorm.selfcheck`, :mod:`layernorm.stability`,
:mod:`layernorm.cost`, :mod:`layernorm.bench`).
"""

from __future__ import annotations

import argparse

__all__ = ["one_line_errors"]


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` report a command-line mistake in one line on stderr, exit status 2,
    instead of argparse's usage block (``--help`` still shows the usage)."""
    def error(message: str) -> None:
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parser.error = error  # type: ignore[method-assign]
