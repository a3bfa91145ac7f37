"""The ``layernorm`` command: one sub-command per module of :mod:`layernorm.commands`.

Each module has ``add_arguments`` and ``run``; the first line of its docstring is the
sub-command's help, and its ``DESCRIPTION`` (else its docstring) the ``--help`` text, shown as
plain text (:func:`plain`). ``layernorm --version`` prints ``layernorm`` and the package's
version (:data:`layernorm.__version__`), exit status 0. A missing optional dependency, or a
file that cannot be written, ends the command with one line and exit status 2, as a
command-line mistake does. Ctrl-C (KeyboardInterrupt) ends any command with one line,
``layernorm COMMAND: interrupted``, and exit status 130 (128 + SIGINT, as a shell reports a
command ended by it).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence

from .. import __version__
from . import one_line_errors, usage_error

COMMANDS: dict[str, str] = {
    "bench": "layernorm.commands.bench",
    "build": "layernorm.commands.build",
    "check": "layernorm.commands.check",
    "cost": "layernorm.commands.cost",
    "memory": "layernorm.commands.memory",
    "report": "layernorm.commands.report",
    "stability": "layernorm.commands.stability",
}

# The extras' packages: a command that needs one that is missing says which, in one line.
OPTIONAL = {"torch": "torch", "triton": "gpu", "matplotlib": "dev",
            "mpmath": "dev", "ml_dtypes": "fast", "transformers": "dev"}

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :func:`name` -> name
_LITERAL = re.compile(r"``([^`]+)``")  # ``code`` -> code
_EMPHASIS = re.compile(r"(?<![\w*])\*([^\s*][^*]*?)\*(?![\w*])")  # *word* -> word


def plain(text: str) -> str:
    """A docstring as plain text for ``--help``: reStructuredText roles, literals and emphasis
    reduced to their words."""
    return _EMPHASIS.sub(r"\1", _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layernorm",
        description="Layer normalization and its family (RMSNorm, the add-norms): reference, "
                    "gradient checks, numerics, cost model, fused kernels and their speed.",
    )
    one_line_errors(parser)
    parser.add_argument("--version", action="version", version=f"layernorm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        mod = importlib.import_module(module)
        summary = plain((mod.__doc__ or "").strip().splitlines()[0])
        summary = summary.removeprefix(f"layernorm {name}: ")
        description = plain(getattr(mod, "DESCRIPTION", None) or mod.__doc__ or "")
        p = sub.add_parser(name, help=summary, description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        one_line_errors(p)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


# The exit status of a command ended by Ctrl-C: 128 + SIGINT's number, as shells report it.
INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    prog = "layernorm"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.error(f"a command is needed: {', '.join(COMMANDS)} (layernorm --help)")
        prog = f"layernorm {args.command}"
        return int(args._run(args))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top not in OPTIONAL:
            raise
        return usage_error(prog, f"needs {top}, which is not installed: from a checkout, "
                                 f"pip install -e '.[{OPTIONAL[top]}]'")
    except OSError as exc:
        if exc.filename is None:
            raise
        return usage_error(prog, f"{exc.filename}: {exc.strerror or exc}")


if __name__ == "__main__":
    sys.exit(main())
