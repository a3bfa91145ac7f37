"""The ``layernorm`` command: one module per sub-command, argparse and formatting only.

Each module has ``add_arguments(parser)`` and ``run(args) -> exit status``, and the ones that
contribute to ``layernorm report`` a ``report_section(ctx)``; the computation they print lives
in the library (:mod:`layernorm.selfcheck`, :mod:`layernorm.stability`, :mod:`layernorm.cost`,
:mod:`layernorm.bench`).

The rules every command shares live here: a mistake on the command line is one line on stderr
naming the option and the problem, exit status 2 (:func:`one_line_errors`, :func:`usage_error`);
one parser for shapes (:func:`shape`), counts (:func:`count`, :func:`seed`) and output paths
(:func:`writable`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .. import _validate

__all__ = ["count", "one_line_errors", "seed", "shape", "usage_error", "writable"]


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` report a command-line mistake in one line on stderr, exit status 2,
    instead of argparse's usage block (``--help`` still shows the usage)."""
    def error(message: str) -> None:
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parser.error = error  # type: ignore[method-assign]


def usage_error(prog: str, message: str) -> int:
    """Print ``prog: error: message`` on stderr as one line; returns exit status 2."""
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def shape(text: str) -> tuple[int, ...]:
    """``--shape``: ``MxD`` or ``AxBxD`` (leading extents multiply into the rows), every extent
    a positive integer (:func:`layernorm._validate.parse_shape`)."""
    try:
        return _validate.parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _integer(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def count(text: str) -> int:
    """An integer >= 1 (``--rounds``, ``--threads``)."""
    return _integer(text, 1, "an integer >= 1")


def seed(text: str) -> int:
    """A seed: an integer >= 0, as NumPy's generators take."""
    return _integer(text, 0, "a non-negative integer")


def writable(path: Path, *, folder: bool = False) -> str | None:
    """Why ``path`` (a file, or with ``folder`` a folder to write files into) cannot be
    written, or None once it can: its folder exists or can be created, and is writable.
    Called before a long run, so that a wrong path costs nothing."""
    target = path if folder else path.parent
    if not folder and path.is_dir():
        return f"{path} is a folder, not a file"
    if target.exists() and not target.is_dir():
        return f"{target} is not a folder"
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {target}: {exc.strerror or exc}"
    if not os.access(target, os.W_OK | os.X_OK):
        return f"cannot write into {target}: permission denied"
    return None
