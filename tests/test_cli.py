"""The layernorm command: check's table and exit code for every norm, command-line mistakes,
the report file, python -m."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from layernorm import reference, selfcheck
from layernorm.commands import cli, report
from layernorm.family import NORMS

NORM_NAMES = list(NORMS)


def _table_rows(out: str) -> list[str]:
    """The table's body rows: they start with a norm's title."""
    titles = tuple(n.title + " " for n in NORMS.values())
    return [line for line in out.splitlines() if line.startswith(titles)]


def test_check_passes_and_prints_table(capsys):
    """Protects `layernorm check`: exit 0, every norm of the family in the table with a
    zero-centred (1+gamma) row, every row passing, and the count in the summary."""
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert rows and all(r.rstrip().endswith("pass") for r in rows)
    for nm in NORMS.values():
        mine = [r for r in rows if r.startswith(nm.title + " ")]
        assert any("finite differences (fast)" in r for r in mine), nm.name
        assert any("1+gamma" in r for r in mine), nm.name
    assert "float16" in out and "FAIL" not in out
    assert f"{len(rows)} passed, 0 failed" in out


def _broken_backward(nm):
    """The reference backward of ``nm`` with a planted bug: dx 1% too large, or (add-norms)
    dh dropped from dx and dresidual."""
    real = getattr(reference, f"{nm.name}_backward")
    if nm.residual:
        return lambda dy, dh, cache: real(dy, None, cache)

    def broken(dy, cache):
        dx, *dparams = real(dy, cache)
        return (dx * 1.01, *dparams)

    return broken


@pytest.mark.parametrize("name", NORM_NAMES)
def test_check_exits_1_on_a_broken_backward(name, monkeypatch, capsys):
    """Protects the exit code and the gradient rows of every norm: a planted backward bug
    makes `layernorm check --norm NAME` fail, naming the norm and the argument."""
    nm = NORMS[name]
    monkeypatch.setattr(reference, f"{name}_backward", _broken_backward(nm))
    assert cli.main(["check", "--norm", name]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {nm.title} " in out and "gradient check failed for" in out
    # D = 1 is left out: a row of one element normalizes to 0 and dx is 0, 1% too large or not
    fd_rows = [r for r in _table_rows(out) if "finite differences" in r and "(6, 1)" not in r]
    assert fd_rows and all(r.rstrip().endswith("FAIL") for r in fd_rows)


def test_check_counts_an_inconclusive_gradient_check_as_a_failure(monkeypatch, capsys):
    """Protects `layernorm check` from a silent pass or a traceback: a forward whose output has
    a large constant part gives no verdict, which is a FAIL row and exit 1."""
    real = reference.layer_norm_forward

    def shifted(*args, **kwargs):
        y, cache = real(*args, **kwargs)
        with np.errstate(over="ignore"):  # the half-precision rows overflow: they fail too
            return y + 1e20, cache

    monkeypatch.setattr(reference, "layer_norm_forward", shifted)
    assert cli.main(["check", "--norm", "layer_norm"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "inconclusive" in out


def test_check_norm_option_picks_the_norms(capsys):
    """Protects --norm: only the named norms are checked, in the family's order, each once."""
    assert cli.main(["check", "--norm", "add_rms_norm", "--norm", "rms_norm",
                     "--norm", "rms_norm"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    titles = [r.split("  ")[0] for r in rows]
    first = titles.index("add+RMSNorm")
    assert set(titles) == {"RMSNorm", "add+RMSNorm"} and set(titles[:first]) == {"RMSNorm"}
    assert len(rows) == len(selfcheck.run_checks(norms=["rms_norm", "add_rms_norm"]))


@pytest.mark.parametrize("argv", [
    ["check", "--norm", "batch_norm"],
    ["check", "--seed", "-1"],
    ["check", "--seed", "one"],
    ["cost", "--norm", "layernorm"],
    ["cost", "--shape", "4096"],
    ["cost", "--shape", "4096 by 1024"],
    ["cost", "--shape", "0x1024"],
    ["cost", "--dtype", "int8"],
    ["cost", "--bandwidth", "0"],
    ["cost", "--bandwidth", "fast"],
], ids=lambda a: " ".join(a))
def test_command_line_mistakes_are_one_line_and_exit_2(argv, capsys):
    """Protects check and cost from tracebacks and usage blocks: a mistake is one line on
    stderr naming the option, and exit status 2."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and argv[1] in err and "Traceback" not in err


def test_report_writes_markdown(tmp_path, monkeypatch):
    """Protects `layernorm report`: a README.md with the machine table and each section."""
    monkeypatch.setattr(report, "SECTIONS",
                        [("Gradient checks", "layernorm.commands.check:report_section")])
    assert cli.main(["report", "--out", str(tmp_path), "--quick"]) == 0
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("# layernorm report")
    assert "| numpy | " + np.__version__ + " |" in text
    assert "## Gradient checks" in text and "0 failed" in text


def test_every_report_section_and_command_resolves():
    """Protects the registries: every listed section and command imports and is callable."""
    import importlib

    for _, spec in report.SECTIONS:
        module, func = spec.split(":")
        assert callable(getattr(importlib.import_module(module), func))
    parser = cli.build_parser()
    for name in cli.COMMANDS:
        assert parser.parse_args([name]).command == name


def test_python_dash_m():
    """Protects `python -m layernorm`, the same entry point as the console script."""
    res = subprocess.run([sys.executable, "-m", "layernorm", "--help"], capture_output=True,
                         text=True, check=False)
    assert res.returncode == 0 and "check" in res.stdout and "report" in res.stdout


def test_import_needs_numpy_only():
    """Protects the layering: `import layernorm` loads neither numba, torch nor triton."""
    code = ("import sys, layernorm; bad = [m for m in ('numba', 'torch', 'triton', 'mpmath', "
            "'matplotlib') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_check_exits_1_when_a_low_precision_result_is_off(monkeypatch, capsys):
    """Protects the dtype rows: a float32/float16 result outside the tolerance table fails
    them, and only them among the reference's rows."""
    real = reference.layer_norm_forward

    def skewed(*args, **kwargs):
        y, cache = real(*args, **kwargs)
        return (y * 1.05 if y.dtype != np.float64 else y), cache

    monkeypatch.setattr(reference, "layer_norm_forward", skewed)
    assert cli.main(["check", "--norm", "layer_norm"]) == 1
    table = _table_rows(capsys.readouterr().out)
    dtype_rows = [r for r in table if "vs float64 reference" in r]
    fd_rows = [r for r in table if "finite differences" in r]
    assert dtype_rows and all(r.rstrip().endswith("FAIL") for r in dtype_rows)
    assert fd_rows and all(r.rstrip().endswith("pass") for r in fd_rows)
