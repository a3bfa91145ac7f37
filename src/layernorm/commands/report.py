"""``layernorm report``: one Markdown file showing what the library does on this machine.

Each command contributes a section: a function ``(ctx) -> Markdown`` in its module of
:mod:`layernorm.commands`, listed in ``SECTIONS``. The report records the command, the time,
the machine and the versions (:func:`layernorm.bench.machine.machine_info`), then each
section in order.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..bench.machine import machine_info

# (title, "module:function"), in the order they appear in the report.
SECTIONS: list[tuple[str, str]] = [
    ("Gradient checks", "layernorm.commands.check:report_section"),
    ("Numerical stability", "layernorm.commands.stability:report_section"),
    ("CPU kernels and bandwidth", "layernorm.commands.bench:report_section"),
    ("GPU kernels", "layernorm.commands.bench:gpu_report_section"),
]


@dataclass(frozen=True)
class ReportContext:
    """What a section may use: where to put files (plots) and whether to keep it short."""

    outdir: Path
    quick: bool


def _section(spec: str, ctx: ReportContext) -> str:
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)(ctx)


def write_report(outdir: Path, quick: bool = False) -> Path:
    """Run every section and write ``outdir/README.md``; returns its path."""
    from .. import __version__

    outdir.mkdir(parents=True, exist_ok=True)
    ctx = ReportContext(outdir=outdir, quick=quick)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    parts = [
        "# layernorm report",
        "",
        f"Written by `{' '.join(['layernorm', *sys.argv[1:]])}` (layernorm {__version__}) "
        f"on {started}.",
        "",
        "| machine | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in machine_info().items()),
        "",
    ]
    for title, spec in SECTIONS:
        print(f"report: {title} ...", flush=True)
        t0 = time.perf_counter()
        body = _section(spec, ctx)
        parts += [f"## {title}", "", body.rstrip(), "", f"_({time.perf_counter() - t0:.1f} s)_", ""]
    path = outdir / "README.md"
    path.write_text("\n".join(parts))
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("report"), help="output folder")
    parser.add_argument("--quick", action="store_true", help="shorter benchmarks and sweeps")


def run(args: argparse.Namespace) -> int:
    path = write_report(args.out, args.quick)
    print(f"report written to {path}")
    return 0
