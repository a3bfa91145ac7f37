"""The docs' measured tables, each rendered by one function from its result file in the repository.

A generated table sits in its document between two comments naming it::

    <!-- generated: torch-speed (python tools/doc_tables.py) -->
    ...
    <!-- end: torch-speed -->

:data:`BLOCKS` maps each name to its document, its result file under ``bench/results/`` and
the function that renders it. ``python tools/doc_tables.py`` rewrites every block from its
file; ``--check`` only says which are stale, and ``tests/test_docs.py`` runs the same check, so
a table cannot drift from the measurement it shows. A new measurement becomes a table by saving
its JSON over the file and running the tool.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .._table import render
from ..family import NORMS
from . import peer_report, quant, results, w8a8

__all__ = ["BLOCKS", "Block", "bandwidth_table", "call_cost_table", "complexity_table",
           "kernel_times_table", "memory_efficient_table", "onnxruntime_rows_table",
           "quant_table", "stale", "update", "w8a8_table"]



def _rows(result: dict) -> dict[tuple, dict]:
    """A CPU benchmark's rows by (norm, shape "MxD", dtype, impl, op)."""
    return {(r["norm"], "x".join(map(str, r["shape"])), r["dtype"], r["impl"], r["op"]): r
            for r in result["rows"]}


def _frac(row: dict, band: bool = True) -> str:
    lo, hi = row["frac_copy_p20_p80"]
    return f"{row['frac_copy']:.0%}" + (f" ({100 * lo:.0f}–{100 * hi:.0f})" if band else "")


def complexity_table(result: dict) -> str:
    """docs/complexity.md: per norm and dtype at 8x1024x4096, copy GB/s, the fused kernels'
    and torch's fractions of copy, and torch's fwd+bwd time over the fused kernels'."""
    rows = _rows(result)
    body = []
    for norm, member in NORMS.items():
        for dtype in ("float32", "bfloat16"):
            def r(impl: str, op: str, norm: str = norm, dtype: str = dtype) -> dict:
                return rows[norm, "8x1024x4096", dtype, impl, op]

            body.append([member.title, dtype, f"{r('fused', 'fwd')['copy_gbps']:.1f}",
                         _frac(r("fused", "fwd")), _frac(r("fused", "bwd")),
                         _frac(r("torch", "fwd"), False), _frac(r("torch", "bwd"), False),
                         f"{r('fused', 'fwd+bwd')['speedup']['torch']:.2f}x"])
    return render(["norm", "dtype", "copy GB/s", "fused fwd", "fused bwd", "torch fwd",
                   "torch bwd", "fwd+bwd vs torch"], body, True)


def bandwidth_table(result: dict) -> str:
    """docs/cpu-kernels.md: layernorm.torch's passes as fractions of copy (p50 of per-round
    ratios), per norm, dtype and pass, the two shapes of the run side by side."""
    rows = _rows(result)
    shapes = list(dict.fromkeys("x".join(map(str, r["shape"])) for r in result["rows"]))
    body = []
    for norm, member in NORMS.items():
        cells = [", ".join(f"{rows[norm, s, dtype, 'layernorm.torch', op]['frac_copy']:.0%}"
                           for s in shapes)
                 for dtype in ("float32", "bfloat16") for op in ("fwd", "bwd")]
        body.append([member.title, *cells])
    table = render(["norm", "float32 fwd", "float32 bwd", "bfloat16 fwd", "bfloat16 bwd"], body,
                   True)
    return f"{table}\n\n({' first, '.join(shapes)} second.)"


def call_cost_table(result: dict) -> str:
    """docs/cpu-kernels.md: the parts of one call, as ``tools/call_cost.py`` saved them."""
    m = result["meta"]
    head = (f"One row of {m['d']} float32 elements, {m['threads']} threads set, torch "
            f"{m['machine'].get('torch', '?')}; microseconds per call, median of "
            f"{m['batches']} batches.\n\n")
    body = [[("&nbsp;" * 2 * r["depth"]) + r["part"], f"{r['us']:.2f}"] for r in result["rows"]]
    return head + render(["part", "us"], body, True)


def kernel_times_table(result: dict) -> str:
    """docs/cpu-kernels.md: the kernels alone against torch's, as ``tools/kernel_times.py``
    saved them (p50 ms per call over the rounds, one thread)."""
    m = result["meta"]
    names = ("ours fwd", "torch fwd", "ours bwd", "torch bwd")
    body = [[f"({r['M']}, {r['D']})", r["dtype"], *(f"{r['ms'][k]:.3f}" for k in names)]
            for r in result["rows"]]
    return (f"LayerNorm, 1 thread, torch {m['machine'].get('torch', '?')}; p50 ms per call over "
            f"{m['rounds']} rounds.\n\n" + render(["shape", "dtype", *names], body, True))


def onnxruntime_rows_table(result: dict) -> str:
    """docs/export.md: onnxruntime's LayerNormalization and SkipLayerNormalization against
    the fused kernels on rows c + (i mod 4), as ``tools/onnxruntime_rows.py`` saved them."""
    m = result["meta"]
    body = [[f"{r['c']:.0e}".replace("e+0", "e"), str(r["D"]),
             f"{r['LayerNormalization']:.1e}", f"{r['SkipLayerNormalization']:.1e}"]
            for r in result["rows"]]
    return (f"Max abs difference of y from ours, float32, onnxruntime {m['onnxruntime']} (CPU "
            "provider):\n\n" + render(["c", "D", "LayerNormalization",
                                          "SkipLayerNormalization"], body, True))


def memory_efficient_table(result: dict) -> str:
    """docs/cpu-kernels.md: the memory-efficient backward's time over the default mode's, per
    case, for the fused kernels and layernorm.torch (:func:`results.me_table`)."""
    m = result["meta"]
    return (f"{results.n_threads(m['threads'])}, {m['machine'].get('cpu', 'unknown CPU')}, "
            f"`{m['command']}`:\n\n" + results.me_table(result["rows"], markdown=True))


def quant_table(result: dict) -> str:
    """docs/quantized.md: ``layernorm bench --quant``'s tables of the quantized norm and its
    goals' counts."""
    m = result["meta"]
    return (f"{m['machine'].get('cpu', 'unknown CPU')}, torch {m['machine'].get('torch', '?')}, "
            f"{m['rounds']} rounds, `{m['command']}`:\n\n" + quant.format_quant(result)
            + "\n\n" + quant.summary_line(result["rows"]) + ".")


def w8a8_table(result: dict) -> str:
    """docs/quantized.md: the W8A8 model end to end, from the same run."""
    e2e = result["w8a8"]
    ao = f" torchao {e2e['torchao']}." if "torchao" in e2e else ""
    return w8a8.format_w8a8(e2e) + ao


@dataclass(frozen=True)
class Block:
    """A generated table: the document it sits in, its result file, how it is made."""

    doc: str  # relative to the repository's root
    result: str  # relative to bench/results/
    make: Callable[[dict], str]


BLOCKS: dict[str, Block] = {
    "torch-speed": Block("docs/torch.md", "cpu-peers-full.json", peer_report.doc_section),
    "complexity-bench": Block("docs/complexity.md", "cpu-family-8x1024x4096.json",
                              complexity_table),
    "cpu-bandwidth": Block("docs/cpu-kernels.md", "cpu-bandwidth.json", bandwidth_table),
    "call-cost": Block("docs/cpu-kernels.md", "call-cost.json", call_cost_table),
    "kernel-times": Block("docs/cpu-kernels.md", "kernel-times.json", kernel_times_table),
    "onnxruntime-rows": Block("docs/export.md", "onnxruntime-rows.json",
                              onnxruntime_rows_table),
    "memory-efficient": Block("docs/cpu-kernels.md", "cpu-memory-efficient-1of3.json",
                              memory_efficient_table),
    "quant-speed": Block("docs/quantized.md", "cpu-quant.json", quant_table),
    "quant-w8a8": Block("docs/quantized.md", "cpu-quant.json", w8a8_table),
}
_TOOL = "python tools/doc_tables.py"


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated: {re.escape(name)} \([^)]*\) -->)\n(.*?)\n?"
                      rf"(<!-- end: {re.escape(name)} -->)", re.S)


def _render(root: Path, name: str) -> str:
    block = BLOCKS[name]
    result = json.loads((root / "bench" / "results" / block.result).read_text())
    return block.make(result)


def _apply(root: Path, write: bool) -> list[str]:
    """The names of the blocks whose text differs from their file's table (rewriting them when
    ``write``). Raises ValueError where a document lacks a block's markers."""
    changed = []
    for doc in dict.fromkeys(b.doc for b in BLOCKS.values()):
        path = root / doc
        text = new = path.read_text()
        for name in (n for n, b in BLOCKS.items() if b.doc == doc):
            pattern = _pattern(name)
            if not pattern.search(new):
                raise ValueError(f"{doc} has no block {name!r}: put '<!-- generated: {name} "
                                 f"({_TOOL}) -->' and '<!-- end: {name} -->' where it goes")
            table = _render(root, name)
            if pattern.search(new).group(2) != table:
                changed.append(name)
                new = pattern.sub(lambda m, t=table: f"{m.group(1)}\n{t}\n{m.group(3)}", new)
        if write and new != text:
            path.write_text(new)
    return changed


def stale(root: Path) -> list[str]:
    """The generated blocks under ``root`` that their result files no longer give."""
    return _apply(root, write=False)


def update(root: Path) -> list[str]:
    """Rewrite every generated block under ``root`` from its result file; the names changed."""
    return _apply(root, write=True)
