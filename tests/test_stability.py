"""`layernorm stability`: the command, its exit status, the report section, and the figures
that docs/numerics.md quotes from it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from layernorm import stability
from layernorm.commands import cli, report
from layernorm.commands import stability as command

DOC = Path(__file__).resolve().parents[1] / "docs" / "numerics.md"


def test_command_prints_the_tables_and_writes_the_plot(tmp_path, capsys):
    """Protects `layernorm stability --quick`: four tables, every target met, a PNG written."""
    png = tmp_path / "sweep.png"
    assert cli.main(["stability", "--quick", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for title in ("Variance algorithms", "The library against the targets",
                  "The backward's cancellation", "Speed"):
        assert title in out
    assert "targets: all met" in out and "FAIL" not in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_exits_1_when_a_target_fails(monkeypatch, capsys):
    """Protects the exit status: a planted forward error of 1e-5 fails the float32 targets."""
    real = stability.layer_norm_forward

    def off(*args, **kwargs):
        y, cache = real(*args, **kwargs)
        return y * (1 + 1e-5), cache

    monkeypatch.setattr(stability, "layer_norm_forward", off)
    assert cli.main(["stability", "--quick", "--no-timing"]) == 1
    out = capsys.readouterr().out
    assert "FAIL 1e4 + N(0, 0.1) [float32, reference] y:" in out and "targets failed" in out


def test_report_section_embeds_plot_and_tables(tmp_path):
    """Protects the report section: a PNG in the report folder, linked from valid Markdown
    tables."""
    ctx = report.ReportContext(outdir=tmp_path, quick=True)
    md = command.report_section(ctx)
    assert (tmp_path / "stability.png").read_bytes()[:4] == b"\x89PNG"
    assert "![error against offset](stability.png)" in md
    assert "| case | dtype | naive |" in md and "all targets met" in md
    assert "| zero variance, \\|x\\| < 5 (absolute error) |" in md  # cell pipes escaped


def test_offset_sweep_shows_the_correction_working():
    """Protects the sweep behind the plot: in float64 the two-pass error grows with the offset
    (u * offset/std), the corrected two-pass stays at a few u."""
    sweep = stability.algorithm_table(stability.QUICK, np.random.default_rng(0))[1]["float64"]
    two = dict(sweep["two-pass"])
    corrected = dict(sweep["corrected two-pass"])
    assert two[1e14] > 1e-4 and two[1e14] > 1e6 * two[1e0]
    assert max(corrected.values()) < 8 * 2.0**-53


def _doc_appendix() -> str:
    text = DOC.read_text()
    match = re.search(r"<!-- stability:begin -->\n```text\n(.*?)```\n<!-- stability:end -->",
                      text, re.S)
    assert match, "docs/numerics.md lacks the appendix between the stability markers"
    return match.group(1)


def _same_but_fused_last_digits(printed: str, appendix: str) -> bool:
    """Equal line by line, except that a fused CPU row's figures may differ by up to 4x (its
    sums are vectorised in an order fixed by the CPU's vector width) with the same verdict."""
    got, want = printed.splitlines(), appendix.splitlines()
    if len(got) != len(want):
        return False
    for a, b in zip(got, want, strict=True):
        if a == b:
            continue
        ta, tb = a.split(), b.split()
        if stability.FUSED not in a or stability.FUSED not in b or len(ta) != len(tb):
            return False
        for u, v in zip(ta, tb, strict=True):
            if u == v:
                continue
            try:
                fu, fv = float(u), float(v)
            except ValueError:
                return False  # a word, e.g. pass/FAIL, differs
            if not (fu > 0 and fv > 0 and 0.25 <= fu / fv <= 4):
                return False
    return True


def test_fused_rows_may_differ_in_their_last_digits_only():
    """Protects the doc comparison: a fused CPU figure 2x off passes, 10x off or another
    verdict fails, and a reference figure must be equal."""
    row = "1e8 + N(0, 1)  float64  {} 2.6e-16  pass"
    fused, ref = stability.FUSED, "reference"
    assert _same_but_fused_last_digits(row.format(fused), row.format(fused).replace("2.6", "1.3"))
    assert not _same_but_fused_last_digits(row.format(fused),
                                           row.format(fused).replace("2.6e-16", "2.6e-15"))
    assert not _same_but_fused_last_digits(row.format(fused), row.format(fused).replace("pass",
                                                                                       "FAIL"))
    assert not _same_but_fused_last_digits(row.format(ref), row.format(ref).replace("2.6", "1.3"))


@pytest.mark.skipif(not DOC.exists(), reason="docs/numerics.md not in this checkout")
def test_doc_figures_are_what_the_command_prints(capsys):
    """Protects docs/numerics.md: its appendix is the output of `layernorm stability
    --no-timing` (seed 0), so every figure the doc quotes from it is what the command prints
    (the fused CPU rows up to their last digits, which depend on the CPU)."""
    pytest.importorskip("ml_dtypes")
    pytest.importorskip("numba")
    assert cli.main(["stability", "--no-timing"]) == 0
    printed = capsys.readouterr().out
    assert _same_but_fused_last_digits(printed, _doc_appendix()), (
        "docs/numerics.md is stale: paste the output of `layernorm stability --no-timing` "
        "into its appendix"
    )
