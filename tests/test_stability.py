"""`layernorm stability`: the command, its exit status, the report section, and the figures
that docs/numerics.md quotes from it."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from layernorm import stability
from layernorm.commands import cli, report
from layernorm.commands import stability as command

DOC = Path(__file__).resolve().parents[1] / "docs" / "numerics.md"


def test_command_prints_the_tables_and_writes_the_plot(tmp_path, capsys):
    """Protects `layernorm stability --quick`: five tables, every target met, a PNG written."""
    png = tmp_path / "sweep.png"
    assert cli.main(["stability", "--quick", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for title in ("Variance algorithms", "The library against the targets",
                  "The backward's cancellation", "The family against the targets", "Speed"):
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
    tables, the later tables folded, and a verdict for the summary that counts the targets
    and quotes the float32 offset-1e4 row."""
    ctx = report.ReportContext(outdir=tmp_path, quick=True)
    sec = command.report_section(ctx)
    md = sec.body
    assert (tmp_path / "stability.png").read_bytes()[:4] == b"\x89PNG"
    assert "(stability.png)" in md and "![Error of each variance algorithm" in md
    assert "| case | dtype | naive |" in md and "All targets met" in md
    assert "| zero variance, \\|x\\| < 5 (absolute error) |" in md  # cell pipes escaped
    assert md.count("<details>") == 4 and md.count("</details>") == 4  # all tables but the first
    [line] = sec.summary
    assert line.startswith("all ") and " targets met against an exact oracle" in line
    assert int(line.split()[1]) == md.count("| pass |")  # each target row: "| pass | oracle |"
    assert "offset 1e4" in line and "relative error of" in line


def test_report_section_without_matplotlib(tmp_path, monkeypatch):
    """Protects the report where matplotlib is missing: the section says so instead of
    failing, and writes no plot."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    sec = command.report_section(report.ReportContext(outdir=tmp_path, quick=True))
    assert "matplotlib is not installed" in sec.body and not (tmp_path / "stability.png").exists()


def test_plot_has_one_panel_per_dtype_with_data(tmp_path, monkeypatch):
    """Protects the plot's readability: a dtype with a single offset gets no panel (it is named
    in the title instead), each panel's offset axis ends at its own data, and non-finite
    errors are marked rather than dropped."""
    import matplotlib.figure

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, path, **kw: saved.append(self))
    sweep = {"bfloat16": {"naive": [(1.0, 0.1)]},
             "float16": {"naive": [(1.0, 1e-3), (1e2, math.inf)]},
             "float64": {"naive": [(1.0, 1e-16), (1e14, 0.5)]}}
    stability.plot_sweep(sweep, tmp_path / "p.png")
    [fig] = saved
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["float16", "float64"]
    assert "bfloat16" in fig._suptitle.get_text()
    assert axes[0].get_xlim()[1] < 1e3 and axes[1].get_xlim()[1] > 1e13
    assert any(line.get_marker() == "x" for line in axes[0].get_lines())
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "unit roundoff of the dtype" in labels and "overflow or NaN (drawn at the top)" in labels


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
    match = re.search(r"<!-- stability:begin -->\n(.*?)\n<!-- stability:end -->",
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


_SMALL = stability.Sizes(rows=2, d=64, long_d=1000, many_rows=20_000, timing_shape=(8, 8),
                         repeats=1)


@pytest.fixture(scope="module")
def family():
    """Table 4 on small sizes: (table, failed targets)."""
    pytest.importorskip("ml_dtypes")
    return stability.family_table(_SMALL, np.random.default_rng(5))


def test_family_table_meets_every_target(family):
    """Protects the family's accuracy: RMSNorm, add+LayerNorm and add+RMSNorm, in every
    dtype and each backend, meet the targets against the exact oracle (float64 1e-13, float32
    y 2e-6 and dx 2e-5, half dtypes 2 ulps, h correctly rounded), with RMSNorm's dgamma over
    many rows within 1e-6."""
    table, failed = family
    assert failed == []
    assert all(row[-2] == "pass" for row in table.rows)
    titles = {row[0] for row in table.rows}
    assert titles == {n.title for n in stability.NORMS.values()}
    for title in ("RMSNorm", "add+LayerNorm", "add+RMSNorm"):
        assert {row[2] for row in table.rows if row[0] == title} == {
            "float64", "float32", "float16", "bfloat16"}
    many = [row for row in table.rows if row[1].startswith("many rows")]
    assert many and all(row[0] == "RMSNorm" and "dgamma <= 1e-06" in row[-3] for row in many)


def test_family_table_covers_overflow_and_zero_centred_gamma(family):
    """Protects the rows that matter most: every RMS norm has rows whose squares overflow
    float32, bfloat16 and float64 (|x| up to 1e30 and 1e300), and every norm a zero-centred
    gamma row, all with a target."""
    rows = family[0].rows
    for title in ("RMSNorm", "add+RMSNorm"):
        overflow = {row[2] for row in rows if row[0] == title and "squares overflow" in row[1]}
        assert overflow == {"float32", "bfloat16", "float64"}
    for norm in stability.NORMS.values():
        assert any(row[0] == norm.title and "zero-centred gamma" in row[1] and row[-3]
                   for row in rows)


def test_family_table_reports_a_planted_error(monkeypatch):
    """Protects table 4's verdicts: an RMSNorm forward off by 1e-5 fails its float32 target,
    and the failure names the norm, the case and the backend."""
    from layernorm import reference

    real = reference.rms_norm_forward

    def off(*args, **kwargs):
        y, cache = real(*args, **kwargs)
        return y * (1 + 1e-5), cache

    monkeypatch.setattr(reference, "rms_norm_forward", off)
    sizes = stability.Sizes(rows=2, d=32, long_d=100, many_rows=100, timing_shape=(8, 8),
                            repeats=1)
    failed = stability.family_table(sizes, np.random.default_rng(0))[1]
    assert any(f.startswith("RMSNorm: N(0, 1) [float32, reference] y:") for f in failed)
    assert not any(f.startswith("add+RMSNorm") or "fused CPU" in f for f in failed)
