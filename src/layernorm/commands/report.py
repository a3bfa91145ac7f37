"""``layernorm report``: one Markdown file showing what the library does on this machine.

Each command contributes a section: a function ``(ctx) -> Section`` in its module of
:mod:`layernorm.commands`, listed in ``SECTIONS``. A section gives its verdict in a few
Markdown lines, its details, and plain sentences answering any of the user's questions
(``QUESTIONS``: is it right, is it faster than what I have, what to use here). The report
opens with those answers, then every section's verdict (the summary, with links to the
sections), then the command, the time, the machine and the versions
(:func:`layernorm.bench.machine.machine_info`), then the sections in order.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..bench.machine import machine_info
from . import usage_error, writable

__all__ = ["QUESTIONS", "SECTIONS", "ReportContext", "Section", "add_arguments", "anchor",
           "folded", "run", "write_report"]

# (title, "module:function"), in the order they appear in the report.
SECTIONS: list[tuple[str, str]] = [
    ("Gradient checks", "layernorm.commands.check:report_section"),
    ("Numerical stability", "layernorm.commands.stability:report_section"),
    ("CPU kernels and bandwidth", "layernorm.commands.bench:report_section"),
    ("CPU versus peers", "layernorm.commands.bench:peers_report_section"),
    ("Memory-efficient backward", "layernorm.commands.memory:report_section"),
    ("Quantized output", "layernorm.commands.bench:quant_report_section"),
    ("GPU kernels", "layernorm.commands.bench:gpu_report_section"),
]

# The user's questions, answered first, in this order: (key of Section.answers, heading).
QUESTIONS: list[tuple[str, str]] = [
    ("right", "Is it right?"),
    ("faster", "Is it faster than what I have?"),
    ("use", "What to use on this machine"),
]


@dataclass(frozen=True)
class ReportContext:
    """What a section may use: where to put files (plots) and whether to keep it short."""

    outdir: Path
    quick: bool


@dataclass(frozen=True)
class Section:
    """A section's verdict (``summary``: Markdown lines, the first the headline, each with the
    number that supports it), its details (``body``: Markdown) and its answers to any of
    :data:`QUESTIONS` (``answers``: key -> Markdown, plain sentences first)."""

    summary: list[str]
    body: str
    answers: dict[str, str] = field(default_factory=dict)


def anchor(title: str) -> str:
    """The link target of a Markdown heading, as GitHub and most renderers make it."""
    return "#" + re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def folded(summary: str, text: str) -> str:
    """``text`` folded under ``summary``: an HTML details element, open on a click."""
    return f"<details><summary>{summary}</summary>\n\n{text.strip()}\n\n</details>"


def _section(spec: str, ctx: ReportContext) -> Section:
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)(ctx)


def _answers(done: list[tuple[str, Section, float]]) -> list[str]:
    """The first screen: each question with every section's answer to it, in section order."""
    lines = []
    for key, question in QUESTIONS:
        said = [(title, sec.answers[key]) for title, sec, _ in done if key in sec.answers]
        lines += [f"## {question}", ""]
        if not said:
            lines += ["No section of this report answers it.", ""]
        for title, text in said:
            link = f"([{title.lower()}]({anchor(title)}))"
            text = text.strip()
            # after a list (nested items included) the link gets a line of its own, not the
            # last item's
            lines += ([text, "", link, ""] if text.splitlines()[-1].lstrip().startswith("- ")
                      else [f"{text} {link}", ""])
    return lines


def _summary(done: list[tuple[str, Section, float]]) -> list[str]:
    lines = ["## Summary", ""]
    for title, sec, _ in done:
        head, *rest = sec.summary or ["(no verdict)"]
        lines.append(f"- **{title}** ([details]({anchor(title)})): {head}")
        lines += [f"  - {line}" for line in rest]
    return lines


def write_report(outdir: Path, quick: bool = False) -> Path:
    """Run every section and write ``outdir/README.md``; returns its path."""
    from .. import __version__

    outdir.mkdir(parents=True, exist_ok=True)
    ctx = ReportContext(outdir=outdir, quick=quick)
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    t_start = time.perf_counter()
    done = []
    for title, spec in SECTIONS:
        print(f"report: {title} ...", flush=True)
        t0 = time.perf_counter()
        done.append((title, _section(spec, ctx), time.perf_counter() - t0))
    info = machine_info()
    command = " ".join(["layernorm", *sys.argv[1:]])
    parts = [
        "# layernorm report",
        "",
        f"What layernorm {__version__} does on this machine ({info.get('cpu', '?')}, "
        f"{info.get('logical cpus', '?')} logical CPUs): written by `{command}` on {started} "
        f"in {time.perf_counter() - t_start:.0f} s. First the answers to three questions, "
        "then each section's verdict with the figure behind it, then the sections.",
        "",
        *_answers(done),
        *_summary(done),
        "",
        "## Machine",
        "",
        "| machine | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in info.items()),
        "",
    ]
    for title, sec, seconds in done:
        parts += [f"## {title}", "", sec.body.rstrip(), "", f"_({seconds:.1f} s)_", ""]
    path = outdir / "README.md"
    path.write_text("\n".join(parts))
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("report"),
                        help="folder for README.md and its plots (default: report)")
    parser.add_argument("--quick", action="store_true", help="shorter benchmarks and sweeps")


def run(args: argparse.Namespace) -> int:
    problem = writable(args.out, folder=True)
    if problem is not None:
        return usage_error("layernorm report", f"argument --out: {problem}")
    path = write_report(args.out, args.quick)
    print(f"report written to {path}")
    return 0
