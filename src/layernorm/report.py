"""``layernorm report``: one Markdown file showing what the library does on this machine.

Each capability contributes a section: a function ``report_section(ctx) -> str`` in its
own module, listed in ``SECTIONS``. The report records the command, the time, the machine
and the versions, then each section in order.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# (title, "module:function"), in the order they appear in the report.
SECTIONS: list[tuple[str, str]] = [
    ("Gradient checks", "layernorm.check:report_section"),
    ("Numerical stability", "layernorm.stability:report_section"),
    ("CPU kernels and bandwidth", "layernorm.bench:report_section"),
    ("GPU kernels", "layernorm.gpu.bench:report_section"),
]


@dataclass(frozen=True)
class ReportContext:
    """What a section may use: where to put files (plots) and whether to keep it short."""

    outdir: Path
    quick: bool


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, str]:
    """Machine and versions, for the report header and benchmark rows."""
    import numpy

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "logical cpus": str(os.cpu_count()),
        "numpy": numpy.__version__,
    }
    for mod in ("numba", "torch", "triton", "ml_dtypes", "matplotlib"):
        try:
            info[mod] = importlib.import_module(mod).__version__
        except ImportError:
            info[mod] = "not installed"
    return info


def _section(spec: str, ctx: ReportContext) -> str:
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)(ctx)


def write_report(outdir: Path, quick: bool = False) -> Path:
    """Run every section and write ``outdir/README.md``; returns its path."""
    from . import __version__

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
