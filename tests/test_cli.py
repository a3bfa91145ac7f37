"""The layernorm command: check's table and exit code, the report file, python -m."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from layernorm import selfcheck
from layernorm.commands import cli, report


def test_check_passes_and_prints_table(capsys):
    """Protects `layernorm check`: exit 0 and one passing row per shape and check."""
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    assert "finite differences (fast)" in out and "float16" in out
    assert "FAIL" not in out
    assert f"{len(selfcheck.run_checks())} passed, 0 failed" in out


def test_check_exits_1_on_a_broken_backward(monkeypatch, capsys):
    """Protects the exit code: a planted backward bug makes `layernorm check` fail."""
    real = selfcheck.layer_norm_backward

    def broken(dy, cache):
        dx, dg, db = real(dy, cache)
        return dx * 1.01, dg, db

    monkeypatch.setattr(selfcheck, "layer_norm_backward", broken)
    assert cli.main(["check"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "gradient check failed for x" in out


def test_check_counts_an_inconclusive_gradient_check_as_a_failure(monkeypatch, capsys):
    """Protects `layernorm check` from a silent pass or a traceback: a forward whose output has
    a large constant part gives no verdict, which is a FAIL row and exit 1."""
    real = selfcheck.layer_norm_forward

    def shifted(*args, **kwargs):
        y, cache = real(*args, **kwargs)
        with np.errstate(over="ignore"):  # the half-precision rows overflow: they fail too
            return y + 1e20, cache

    monkeypatch.setattr(selfcheck, "layer_norm_forward", shifted)
    assert cli.main(["check"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "inconclusive" in out


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
    """Protects the dtype rows: a float32/float16 result outside the tolerance table fails."""
    real = selfcheck.layer_norm_forward

    def skewed(x, gamma=None, beta=None, eps=1e-5):
        y, cache = real(x, gamma, beta, eps)
        return (y * 1.05 if y.dtype != np.float64 else y), cache

    monkeypatch.setattr(selfcheck, "layer_norm_forward", skewed)
    assert cli.main(["check"]) == 1
    lines = capsys.readouterr().out.splitlines()
    table = [r for r in lines if r.startswith("(")]
    dtype_rows = [r for r in table if "vs float64 reference" in r]
    fd_rows = [r for r in table if "finite differences" in r]
    assert dtype_rows and all(r.rstrip().endswith("FAIL") for r in dtype_rows)
    assert fd_rows and all(r.rstrip().endswith("pass") for r in fd_rows)
