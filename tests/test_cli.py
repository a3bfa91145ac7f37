"""The layernorm command: check's table and exit code for every norm, command-line mistakes,
the report file, python -m."""

from __future__ import annotations

import importlib
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from layernorm import reference, selfcheck
from layernorm.commands import cli, report
from layernorm.commands import shape as commands_shape
from layernorm.family import NORMS

NORM_NAMES = list(NORMS)


def _table_rows(out: str) -> list[str]:
    """The Markdown table's body rows, as "cell  cell  ...  result" with the cells'
    padding dropped: they start with a norm's title."""
    titles = tuple(f"| {n.title} |" for n in NORMS.values())
    return ["  ".join(c.strip() for c in line.strip("|").split("|"))
            for line in out.splitlines() if line.startswith(titles)]


@pytest.fixture
def default_checks(monkeypatch, check_rows):
    """`layernorm check` and its report section get the session's rows of run_checks() at its
    defaults (tests/conftest.py) instead of computing them again; the list receives the
    arguments of each call, and any other arguments run the real checks."""
    from layernorm.commands import check

    calls = []

    def run_checks(seed=0, norms=None):
        calls.append((seed, norms))
        return list(check_rows) if (seed, norms) == (0, None) else selfcheck.run_checks(seed,
                                                                                      norms)

    monkeypatch.setattr(check, "run_checks", run_checks)
    return calls


def test_check_passes_and_prints_table(capsys, default_checks, check_rows):
    """Protects `layernorm check`: exit 0, every norm of the family in the table with a
    zero-centred (1+gamma) row, every row passing, and the count in the summary."""
    assert cli.main(["check"]) == 0
    assert default_checks == [(0, None)]  # the checks at their defaults: seed 0, every norm
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert rows and all(r.rstrip().endswith("pass") for r in rows)
    for nm in NORMS.values():
        mine = [r for r in rows if r.startswith(nm.title + "  ")]
        assert any("finite differences (fast)" in r for r in mine), nm.name
        assert any("1+gamma" in r for r in mine), nm.name
    assert "float16" in out and "FAIL" not in out
    assert len(rows) == len(check_rows) and f"{len(rows)} passed, 0 failed" in out


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


def test_check_norm_option_picks_the_norms(capsys, check_rows):
    """Protects --norm: only the named norms are checked, in the family's order, each once
    (as many rows as those norms have among every norm's)."""
    assert cli.main(["check", "--norm", "add_rms_norm", "--norm", "rms_norm",
                     "--norm", "rms_norm"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    titles = [r.split("  ")[0] for r in rows]
    first = titles.index("add+RMSNorm")
    assert set(titles) == {"RMSNorm", "add+RMSNorm"} and set(titles[:first]) == {"RMSNorm"}
    assert len(rows) == sum(r.norm in ("rms_norm", "add_rms_norm") for r in check_rows)


def _exit_and_stderr(argv: list[str], capsys) -> tuple[int, str]:
    """Run the command line; its exit status (argparse's SystemExit or run's return) and
    stderr."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("argv", "names"), [
    (["--bogus"], "--bogus"),
    ([], "a command is needed"),
    (["check", "--norm", "batch_norm"], "--norm"),
    (["check", "--seed", "-1"], "--seed"),
    (["check", "--seed", "one"], "--seed"),
    (["cost", "--norm", "layernorm"], "--norm"),
    (["cost", "--shape", "10"], "--shape"),
    (["cost", "--shape", "0x5"], "--shape"),
    (["cost", "--shape", "axb"], "--shape"),
    (["cost", "--shape", "4096 by 1024"], "--shape"),
    (["cost", "--shape", "-4x8"], "--shape"),
    (["cost", "--dtype", "int8"], "--dtype"),
    (["cost", "--bandwidth", "-5"], "--bandwidth"),
    (["cost", "--bandwidth", "0"], "--bandwidth"),
    (["cost", "--bandwidth", "fast"], "--bandwidth"),
    (["cost", "--bandwidth", "nan"], "--bandwidth"),
    (["cost", "--kept", "3"], "--kept"),
    (["cost", "--memory-efficient", "--kept", "-1"], "--kept"),
    (["cost", "--memory-efficient", "--kept", "some"], "--kept"),
    (["cost", "--memory-efficient", "--kept", "800"], "--kept"),
    (["cost", "--memory-efficient", "--shape", "64x64", "--kept", "65"], "--kept"),
    (["bench", "--shape", "10"], "--shape"),
    (["bench", "--shape", "8x0"], "--shape"),
    (["bench", "--dtype", "float8"], "--dtype"),
    (["bench", "--threads", "0"], "--threads"),
    (["bench", "--rounds", "many"], "--rounds"),
    (["bench", "--impl", "jax"], "--impl"),
    (["bench", "--device", "tpu"], "--device"),
    (["bench", "--out", "/proc/forbidden/run.json"], "--out"),
    (["bench", "--quant", "--shape", "8x64"], "--quant"),
    (["bench", "--quant", "--dtype", "float32"], "--quant"),
    (["bench", "--quant", "--peers"], "--quant"),
    (["bench", "--quant", "--full"], "--full"),
    (["memory", "--hidden", "100"], "--hidden"),
    (["memory", "--tokens", "0"], "--tokens"),
    (["memory", "--dtype", "float16"], "--dtype"),
    (["memory", "--shape", "8"], "--shape"),
    (["memory", "--out", "/proc/forbidden/memory.json"], "--out"),
    (["stability", "--seed", "-1"], "--seed"),
    (["stability", "--plot", "/proc/forbidden/sweep.png"], "--plot"),
    (["stability", "--plot", "sweep.pdf"], "--plot"),
    (["report", "--out", "/proc/forbidden"], "--out"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_command_line_mistakes_are_one_line_and_exit_2(argv, names, capsys, tmp_path,
                                                       monkeypatch):
    """Protects every command from tracebacks and usage blocks: a mistake is one line on
    stderr naming the option (or what is missing), exit status 2, before any work is done."""
    monkeypatch.chdir(tmp_path)  # a relative --plot or --out would land here
    code, err = _exit_and_stderr(argv, capsys)
    assert code == 2
    assert len(err.splitlines()) == 1 and names in err and "Traceback" not in err
    assert err.startswith("layernorm")
    assert not any(tmp_path.iterdir())  # nothing written


def test_one_shape_rule_for_every_command():
    """Protects the shape rule: cost, bench and the GPU sweep accept and refuse the same
    texts, through one parser."""
    from layernorm.bench import gpu
    from layernorm.commands import bench, cost

    parsers = {name: cli.build_parser()._subparsers._group_actions[0].choices[name]
               for name in ("bench", "cost")}
    for name, parser in parsers.items():
        shape_action = next(a for a in parser._actions if a.dest == "shape")
        assert shape_action.type is commands_shape, name
    assert commands_shape("8x512x768") == (8, 512, 768) and commands_shape("2X3") == (2, 3)
    assert gpu.parse_shapes(["8x512x768"], quick=False) == [(4096, 768)]
    assert bench.parse_shape is commands_shape and cost.shape is commands_shape


def test_bench_device_cuda_without_a_gpu_exits_2(monkeypatch, capsys):
    """Protects `layernorm bench --device cuda` on a machine without a GPU: one line naming
    --device and the reason, exit 2, nothing measured."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = _exit_and_stderr(["bench", "--device", "cuda", "--shape", "64x64"], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert "--device" in err and "no CUDA device" in err


def test_a_missing_optional_dependency_is_one_line(monkeypatch, capsys):
    """Protects the commands where an extra is not installed: torch missing makes `bench
    --device cuda` say so, and any command whose run meets a missing optional package names
    the package and the extra to install, exit 2, no traceback."""
    monkeypatch.setitem(sys.modules, "torch", None)
    code, err = _exit_and_stderr(["bench", "--device", "cuda"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "needs torch" in err

    from layernorm.commands import cost

    def needs_matplotlib(args):
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr(cost, "run", needs_matplotlib)
    code, err = _exit_and_stderr(["cost"], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert "needs matplotlib" in err and "pip install -e '.[dev]'" in err

    def a_bug(args):  # a missing module of our own is a bug: it is not hidden
        raise ModuleNotFoundError("No module named 'layernorm.nothing'", name="layernorm.nothing")

    monkeypatch.setattr(cost, "run", a_bug)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["cost"])


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_ctrl_c_ends_any_command_with_one_line_and_status_130(name, monkeypatch, capsys):
    """Protects Ctrl-C: a KeyboardInterrupt in any command ends it with one line on stderr
    naming the command and exit status 130 (128 + SIGINT), never a traceback, and so it does
    while the parser is built, before a command is known."""
    def interrupted(*args):
        raise KeyboardInterrupt

    def main(argv):  # a KeyboardInterrupt that escapes is a failure, not the end of pytest
        try:
            return cli.main(argv)
        except KeyboardInterrupt:
            pytest.fail("KeyboardInterrupt escaped main()")

    monkeypatch.setattr(importlib.import_module(cli.COMMANDS[name]), "run", interrupted)
    assert main([name]) == 130
    captured = capsys.readouterr()
    assert captured.err == f"layernorm {name}: interrupted\n" and captured.out == ""
    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main([name]) == 130
    assert capsys.readouterr().err == "layernorm: interrupted\n"


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT is a POSIX signal")
def test_sigint_ends_a_running_command_with_one_line(tmp_path):
    """Protects Ctrl-C on a real process: SIGINT sent to `python -m layernorm report` once its
    first section (the gradient checks, seconds of work) has started ends it with one line on
    stderr and exit status 130, without a traceback, and nothing written. The child starts
    with SIGINT's default action, as a command in a terminal does: run in the background by a
    shell without job control (``cmd &``), the suite would hand it SIGINT ignored, and Python
    then installs no handler."""
    proc = subprocess.Popen([sys.executable, "-m", "layernorm", "report", "--quick", "--out",
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().startswith("report: ")  # a section has started
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, err) == (130, "layernorm report: interrupted\n"), err
    assert not any(tmp_path.iterdir())


def test_help_is_plain_text(capsys):
    """Protects --help: no reStructuredText roles or double-backtick literals in any
    command's help, and no words about the project's history."""
    for argv in ([], *([name] for name in cli.COMMANDS)):
        with pytest.raises(SystemExit) as exc:
            cli.main([*argv, "--help"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        assert "``" not in text and not re.search(r":[a-z]+:`", text), argv
        assert not re.search(r"\b(issue|commit|session)s?\b", text, re.I), argv


def test_plain_reduces_markup_to_words():
    """Protects the help's conversion: roles, literals and emphasis become their words, and
    a product like a * b is left alone."""
    assert cli.plain("``layernorm cost`` (:mod:`layernorm.cost`, :func:`~a.b`)") == (
        "layernorm cost (layernorm.cost, a.b)")
    assert cli.plain("the *minimal bytes* of a * b") == "the minimal bytes of a * b"


def test_report_writes_markdown(tmp_path, monkeypatch, default_checks):
    """Protects `layernorm report`: README.md opens with the summary (each section's verdict
    linking to its section) before the machine table and the sections' details."""
    monkeypatch.setattr(report, "SECTIONS",
                        [("Gradient checks", "layernorm.commands.check:report_section")])
    assert cli.main(["report", "--out", str(tmp_path), "--quick"]) == 0
    assert default_checks == [(0, None)]
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("# layernorm report")
    summary, machine, details = (text.index("## Summary"), text.index("## Machine"),
                                 text.index("## Gradient checks"))
    assert summary < machine < details
    line = next(ln for ln in text.splitlines() if ln.startswith("- **Gradient checks**"))
    assert "(#gradient-checks)" in line and "pass: all " in line
    assert "| numpy | " + np.__version__ + " |" in text
    assert "0 failed" in text[details:] and "<details><summary>All " in text[details:]


def test_an_answer_ending_in_a_nested_list_gets_its_link_on_a_line_of_its_own():
    """Protects the first screen's Markdown: an answer whose last line is a nested list item
    (the advice's note on onnxruntime) is followed by its section link as a paragraph, not
    with the link glued to that note."""
    use = "Lead.\n\n- RMSNorm, inference: `onnxruntime`\n  - a note"
    lines = report._answers([("CPU versus peers", report.Section([], "", {"use": use}), 0.0)])
    at = lines.index("## What to use on this machine")
    assert lines[at:at + 6] == ["## What to use on this machine", "", use, "",
                                "([cpu versus peers](#cpu-versus-peers))", ""]


def test_anchor_matches_the_headings():
    """Protects the summary's links: the anchor of each section title as Markdown renderers
    make it."""
    assert report.anchor("CPU kernels and bandwidth") == "#cpu-kernels-and-bandwidth"
    assert report.anchor("GPU kernels") == "#gpu-kernels"
    assert report.anchor("Numerical stability") == "#numerical-stability"


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


def test_version_prints_the_installed_version(capsys):
    """Protects `layernorm --version`: exactly one line, `layernorm` and the version pip
    installed (which `layernorm.__version__` states), on stdout with exit status 0, in
    process and through `python -m layernorm`."""
    from importlib.metadata import version

    import layernorm

    installed = version("layernorm")
    assert layernorm.__version__ == installed
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr() == (f"layernorm {installed}\n", "")
    res = subprocess.run([sys.executable, "-m", "layernorm", "--version"], capture_output=True,
                         text=True, check=False)
    assert (res.returncode, res.stdout, res.stderr) == (0, f"layernorm {installed}\n", "")


def test_import_needs_numpy_only():
    """Protects the layering: `import layernorm` loads neither torch nor triton."""
    code = ("import sys, layernorm; bad = [m for m in ('torch', 'triton', 'mpmath', "
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
