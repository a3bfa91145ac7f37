"""The CPU benchmark (layernorm.bench and `layernorm bench`): JSON schema, providers, tables,
plot, CLI and report section (never timings)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from layernorm.bench import harness, providers, results
from layernorm.commands import bench as command
from layernorm.commands import cli
from layernorm.commands.report import ReportContext
from layernorm.family import NORMS

TINY = harness.Case((3, 64), "float32")
IMPLS = providers.available(backends=("numpy", "fused"))
TORCH_BACKENDS = ("layernorm.torch", "torch.compile")


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    monkeypatch.setattr(harness, "PAUSE_S", 0.0)


@pytest.fixture(scope="module")
def result():
    return harness.run_bench([TINY], IMPLS, rounds=2, quick=True, progress=lambda msg: None)


@pytest.fixture(scope="module")
def latency():
    """What harness.first_call_latency() returns, its figures made up: measuring it starts two
    fresh processes (seconds), which is the benchmark's work;
    test_first_call_latency_runs_two_fresh_processes checks how it measures."""
    pytest.importorskip("torch")
    return {"first": {"import_s": 2.5, "forward_s": 0.01, "backward_s": 0.02},
            "second": {"import_s": 2.3, "forward_s": 0.01, "backward_s": 0.02}}


@pytest.fixture
def first_calls(monkeypatch, request):
    """Where the fused kernels are timed, the command's first_call_latency gives the module's
    measurement, and this list receives what each call returned."""
    calls = []
    if "fused" in IMPLS:
        latency = request.getfixturevalue("latency")
        monkeypatch.setattr(command, "first_call_latency",
                            lambda: calls.append(latency) or latency)
    return calls


def test_rows_carry_schema_machine_and_checks(result):
    """Protects the JSON rows: one per (impl, op) plus copy, with the documented fields."""
    rows = result["rows"]
    assert {(r["impl"], r["op"]) for r in rows} == (
        {(i, op) for i in IMPLS for op in providers.OPS} | {("copy", "copy")})
    for r in rows:
        assert r["norm"] == "layer_norm" and r["shape"] == [3, 64] and r["dtype"] == "float32"
        assert r["M"] == 3 and r["D"] == 64
        assert r["p20_ms"] <= r["p50_ms"] <= r["p80_ms"] and r["rounds"] == 2
        assert r["gbps"] > 0 and r["copy_gbps"] > 0 and r["reps"] >= 1
        assert r["machine"]["numpy"] and r["timestamp"] == result["meta"]["timestamp"]
        lo, hi = r["frac_copy_p20_p80"]
        assert lo <= r["frac_copy"] <= hi and isinstance(r["flags"], list)
        assert r["regime"] == harness.regime(TINY, r["llc_bytes"]) and r["cpus"] >= 1
        assert r["llc_bytes"] == result["meta"]["llc_bytes"]
        assert set(r["speedup"]) == ({p for p in IMPLS if p != r["impl"]}
                                     if r["impl"] != "copy" else set())
        assert set(r["speedup_p20_p80"]) == set(r["speedup"])
        for peer, (lo, hi) in r["speedup_p20_p80"].items():
            assert lo <= r["speedup"][peer] <= hi
        if r["impl"] != "copy":
            assert r["check"] <= 1
    fwd = next(r for r in rows if r["op"] == "fwd")
    assert fwd["bytes"] == 2 * 3 * 64 * 4
    json.dumps(result)  # serialisable as saved


def test_tables_name_every_row(result):
    """Protects the printed tables: every implementation in the full table; goals summarised."""
    text = results.format_table(result["rows"])
    assert all(i in text for i in IMPLS) and "3x64" in text and "p50 ms (p20-p80)" in text
    assert "LayerNorm" in text
    md = results.summary_table(result["rows"], markdown=True)
    assert md.startswith("| norm | shape |") and "copy GB/s" in md
    if "fused" in IMPLS:  # a verdict, no verdict, or the flags of this tiny case
        assert any(f"fwd {v}" in md for v in ("met", "missed", "noisy: rerun", "too close",
                                                 "no verdict", "overhead-bound", "busy"))


def test_plot_writes_a_png(result, tmp_path):
    """Protects the bandwidth plot: a PNG file."""
    pytest.importorskip("matplotlib")
    path = results.plot_bandwidth(result["rows"], tmp_path / "bw.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_shape():
    """Protects --shape: "4096x1024" parses; empty, zero or non-numeric extents are refused."""
    assert command.parse_shape("4096x1024") == (4096, 1024)
    assert command.parse_shape("2X3x5") == (2, 3, 5)
    for bad in ("", "4x0", "axb"):
        with pytest.raises(argparse.ArgumentTypeError):
            command.parse_shape(bad)


def test_cli_bench_saves_json(tmp_path, capsys, first_calls):
    """Protects `layernorm bench`: exit 0, the tables on stdout, the JSON at --out, every norm
    of the family by default (rows: per norm, each implementation's three operations and a
    copy), and with the fused kernels timed, their first-call latency printed and saved."""
    out = tmp_path / "r.json"
    argv = ["bench", "--shape", "2x48", "--rounds", "1", "--quick", "--out", str(out)]
    for impl in IMPLS:
        argv += ["--impl", impl]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "2x48" in text and "copy GB/s" in text
    saved = results.load(out)
    assert saved["meta"]["machine"]["numpy"] and len(saved["meta"]["loadavg"]) == 2
    assert len(saved["rows"]) == len(NORMS) * (3 * len(IMPLS) + 1)
    assert saved == json.loads(out.read_text())
    if "fused" in IMPLS:
        (latency,) = first_calls  # measured once, and that measurement saved and shown
        assert saved["meta"]["first_call"] == latency
        assert results.format_latency(latency) in text


def test_runs_go_to_an_ignored_folder_unless_out_names_a_file(tmp_path, monkeypatch, capsys):
    """Protects bench/results/ as the record: `layernorm bench` without --out writes under
    bench/runs/ (ignored by git), nothing under bench/results/, and the file holds one row a
    line in compact JSON that loads back unchanged."""
    root = Path(__file__).resolve().parents[1]
    assert "/bench/runs/" in (root / ".gitignore").read_text().split()
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--shape", "2x48", "--rounds", "1", "--quick", "--impl", "numpy",
                     "--norm", "layer_norm"]) == 0
    (saved,) = (tmp_path / results.RUNS_DIR).glob("cpu-*.json")
    assert not (tmp_path / results.RECORD_DIR).exists()
    assert f"saved {saved.relative_to(tmp_path)}" in capsys.readouterr().out
    text = saved.read_text()
    run = json.loads(text)
    assert results.load(saved) == run and text == results.dumps(run)
    lines = text.splitlines()  # {"meta":{...}, / "rows":[ / a row a line / ]}
    assert lines[1] == '"rows":[' and lines[-1] == "]}"
    assert [json.loads(line.rstrip(",")) for line in lines[2:-1]] == run["rows"]


def test_cuda_device_dispatches_to_the_gpu_harness(monkeypatch):
    """Protects --device cuda: the same args go to run_cuda, the GPU benchmark's command."""
    seen = []
    monkeypatch.setattr(command, "run_cuda", lambda args: seen.append(args) or 7)
    args = cli.build_parser().parse_args(["bench", "--device", "cuda", "--shape", "8x16"])
    assert args._run(args) == 7
    assert seen[0].shape == [(8, 16)] and seen[0].dtype is None


def test_report_section_writes_plot_and_table(tmp_path, monkeypatch, first_calls):
    """Protects the report section: Markdown with the summary, the plot and the saved JSON,
    the backends it leaves out named with their reasons, and with the fused kernels timed,
    their first-call latency."""
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(providers, "available", lambda norm="layer_norm": IMPLS)
    monkeypatch.setattr(providers, "why_not", lambda norm, b: "not here")
    monkeypatch.setattr(command, "REPORT_SHAPES", ((2, 32),))
    sec = command.report_section(ReportContext(outdir=tmp_path, quick=True))
    text = sec.body
    assert "![bandwidth](bench_cpu_bandwidth.png)" in text and "| 2x32 |" in text
    # the summary: what ran, then one headline per implementation timed, in BACKENDS order
    assert "2 implementations" in sec.summary[0]
    assert sec.summary[0].startswith("`layernorm bench` at 2x32 only (")
    assert [h.split("`")[1] for h in sec.summary[1:]] == IMPLS
    # each headline names the shapes it covers, so it cannot be read as the peers' grid
    assert all(h.startswith(f"`{impl}` at 2x32: ") for h, impl in zip(sec.summary[1:], IMPLS,
                                                                        strict=True))
    assert "The PyTorch API at 2x32: " in text or "layernorm.torch" not in IMPLS
    assert "left out here: " in text and "`torch.compile` (not here)" in text
    assert (tmp_path / "bench_cpu_bandwidth.png").exists()
    saved = json.loads((tmp_path / "bench_cpu.json").read_text())
    assert saved["rows"]
    if "fused" in IMPLS:
        (latency,) = first_calls  # measured once, and that measurement saved and shown
        assert saved["meta"]["first_call"] == latency
        assert results.format_latency(latency) in text


def test_first_call_latency_runs_two_fresh_processes(monkeypatch):
    """Protects the first-call report: its script, run in a fresh interpreter, prints import,
    forward and backward seconds; first_call_latency runs it in two fresh processes and returns
    both (the figures are not asserted)."""
    pytest.importorskip("torch")
    done = subprocess.run([sys.executable, "-c", harness._FIRST_CALL_SCRIPT], capture_output=True,
                text=True, check=True)
    printed = json.loads(done.stdout)
    assert set(printed) == {"import_s", "forward_s", "backward_s"}
    assert all(v > 0 for v in printed.values())
    runs = []

    def run(argv, **kw):
        runs.append(argv)
        return subprocess.CompletedProcess(argv, 0, done.stdout, "")

    monkeypatch.setattr(harness.subprocess, "run", run)
    latency = harness.first_call_latency()
    assert list(latency) == ["first", "second"] and latency["first"] == latency["second"] == printed
    assert runs == [[sys.executable, "-c", harness._FIRST_CALL_SCRIPT]] * 2
    assert "first: import" in results.format_latency(latency)


def test_inputs_follow_the_norm():
    """Protects the norm as a parameter: inputs are the arrays the family says the norm's
    passes read, and the reference gives one result per name of outputs()."""
    for name, n in NORMS.items():
        a = providers.inputs(name, (2, 8), "float32")
        assert set(a) == {*n.forward_inputs, *n.backward_inputs, *n.params}
        assert all(a[p].shape == (8,) for p in n.params) and a["x"].shape == (2, 8)
    assert providers.norms() == list(NORMS)
    a = providers.inputs("layer_norm", (2, 8), "float32")
    want = providers.reference("layer_norm", a)
    assert len(want) == len(providers.outputs("layer_norm")) == 4
    assert all(w.dtype == np.float64 for w in want)
    with pytest.raises(ValueError, match="norm must be one of"):
        harness.Case((2, 8), "float32", "group_norm")


@pytest.mark.parametrize("name", list(NORMS))
def test_every_provider_matches_the_reference(name):
    """Protects the benchmark's providers of every norm and its oracle: this package's results,
    in outputs() order, are within the tolerance table of the float64 reference in float32 and
    bfloat16 (for an add-norm, of the norm of h rounded once, as the norm is defined), so the
    timed code computes the right thing and the check column can fail it."""
    for dtype in ("float32", "bfloat16"):
        a = providers.inputs(name, (512, 64), dtype)
        want = providers.reference(name, a)
        for backend in ("numpy", "fused"):
            got = providers.PROVIDERS[(name, backend)].setup(a)[1]()
            assert harness.check(name, got, want, dtype) <= 1, (backend, dtype)


def test_check_is_the_error_over_the_tolerance():
    """Protects the check column: 0 for the reference itself, > 1 for a result off by more than
    its tolerance, inf for a NaN where the reference is finite."""
    a = providers.inputs("layer_norm", (4, 32), "float32")
    want = providers.reference("layer_norm", a)
    got = tuple(w.astype(np.float32) for w in want)
    assert harness.check("layer_norm", got, want, "float32") <= 1
    off = (got[0] * 1.01, *got[1:])
    assert harness.check("layer_norm", off, want, "float32") > 1
    nan = (got[0], np.full_like(got[1], np.nan), *got[2:])
    assert harness.check("layer_norm", nan, want, "float32") == np.inf


def test_yardstick_copies_and_checks_its_arguments():
    """Protects the bandwidth yardstick: an exact copy of every item size, of one block, of
    several with a short last one, and of none; mismatched or non-contiguous arrays raise."""
    yardstick = pytest.importorskip("layernorm.bench.yardstick")
    for dtype in (np.int8, np.float16, np.float32, np.float64):
        for n in (24, 2 * yardstick.BLOCK + 5, 0):
            src = np.arange(n).astype(dtype).reshape(-1, 1)  # (n, 1)
            dst = np.zeros_like(src)
            yardstick.copy(src, dst)
            np.testing.assert_array_equal(dst, src)
    src = np.arange(24, dtype=np.float64).reshape(2, 3, 4)
    with pytest.raises(ValueError, match="must match"):
        yardstick.copy(src, np.zeros((4, 5), np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        yardstick.copy(src[:, :, ::2], np.zeros((2, 3, 2), np.float64))


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_torch_api_and_compiled_providers_match_the_reference(backend):
    """Protects the layernorm.torch and torch.compile providers of every norm: on a tiny case in
    float32 and bfloat16 their results, in outputs() order, pass the same check the bench
    applies before timing, and every op runs (bwd again on its kept graph), so the rows the
    goal table compares time the right computation."""
    reason = providers.why_not("layer_norm", backend)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    for name in NORMS:
        for dtype in ("float32", "bfloat16"):
            a = providers.inputs(name, (2, 3, 64), dtype)
            ops, results_fn = providers.PROVIDERS[(name, backend)].setup(a)
            assert harness.check(name, results_fn(), providers.reference(name, a), dtype) <= 1, (
                name, dtype)
            for op in providers.OPS:
                ops[op]()
            ops["bwd"]()


def test_a_backend_that_cannot_run_says_why(monkeypatch):
    """Protects discovery: a provider whose probe fails is absent from available() and
    why_not() gives the probe's one-line reason; one whose module does not import is absent
    as not installed."""
    real = providers.PROVIDERS[("layer_norm", "torch.compile")]
    monkeypatch.setitem(providers.PROVIDERS, ("layer_norm", "torch.compile"),
                        providers.Provider(real.needs, real.setup, lambda: "no C++ compiler"))
    monkeypatch.setitem(providers.PROVIDERS, ("layer_norm", "torch"),
                        providers.Provider("no_such_module_here", real.setup))
    assert "torch.compile" not in providers.available() and "torch" not in providers.available()
    assert providers.why_not("layer_norm", "torch.compile") == "no C++ compiler"
    assert "not installed" in providers.why_not("layer_norm", "torch")


def _api_rows(eager: tuple[float, float, float], check: float = 0.0) -> list[dict]:
    """The layernorm.torch fwd+bwd row of one synthetic case whose per-round ratio of torch's
    time over ours has p50, p20, p80 = ``eager`` (torch.compile's: half of it)."""
    p50, lo, hi = eager
    return [{
        "norm": "rms_norm", "shape": [8, 512, 768], "dtype": "bfloat16", "threads": 2,
        "impl": "layernorm.torch", "op": "fwd+bwd", "p50_ms": 1.0, "p20_ms": 0.9,
        "p80_ms": 1.1, "check": check, "flags": [], "regime": results.DRAM,
        "speedup": {"torch": p50, "torch.compile": p50 / 2},
        "speedup_p20_p80": {"torch": [lo, hi], "torch.compile": [lo / 2, hi / 2]},
    }]


def _goal(rows: list[dict]) -> str:
    """The goal column of torch_table's one body row."""
    line = results.torch_table(rows, markdown=True).splitlines()[2]
    return line.strip("| ").split(" | ")[-1]


def test_torch_goal_verdict_needs_both_ends_of_the_spread():
    """Protects the PyTorch API goal table: met only when p20 of the ratio reaches 1.5x,
    missed only when even p80 falls short, "noisy: rerun" with the spread when p20 and p80
    disagree; a result failing its check meets nothing; no layernorm.torch rows, no table."""
    assert results.TORCH_API_GOAL == 1.5 and results.CLOSE == 0.10
    assert _goal(_api_rows((2.0, 1.7, 2.4))) == "met"
    assert _goal(_api_rows((1.2, 1.0, 1.3))) == "missed"
    assert _goal(_api_rows((1.6, 1.3, 1.9))) == "noisy: rerun (1.30x-1.90x)"
    # within 10% of the goal, either side: a narrow spread there is no verdict either
    assert _goal(_api_rows((1.6, 1.55, 1.62))) == (
        "too close to call (1.55x-1.62x, within 10% of 1.50x)")
    assert _goal(_api_rows((1.4, 1.36, 1.45))).startswith("too close to call")
    assert _goal(_api_rows((2.0, 1.7, 2.4), check=3.0)) == "fails its check (3.0x tol)"
    text = results.torch_table(_api_rows((2.0, 1.7, 2.4)))
    assert "RMSNorm" in text and "8x512x768" in text and "2.00x (1.70-2.40)" in text
    assert "1.00x (0.85-1.20)" in text  # torch.compile's ratio, shown without a goal
    assert results.torch_table([]) == ""
    assert results.verdict(0.78, 0.82, 0.80, "{:.0%}") == "noisy: rerun (78%-82%)"


def test_a_time_with_a_wide_spread_gets_no_verdict():
    """Protects the rule that no verdict rests on a noisy time: where a row's own p80 is 1.25
    times its p20 or more, the speedup and fraction-of-copy goals say "too noisy to tell" with
    the spread, however narrow the per-round ratios were; just under the limit they are
    judged."""
    rows = _api_rows((2.0, 1.9, 2.1))
    rows[0].update(p20_ms=16.7, p80_ms=74.8)
    assert _goal(rows) == "too noisy to tell (p20-p80 16.70 ms-74.80 ms)"
    rows[0].update(p20_ms=1.0, p80_ms=1.249)
    assert _goal(rows) == "met"
    row = {"flags": [], "regime": results.DRAM, "p20_ms": 0.8, "p80_ms": 1.0,
           "frac_copy_p20_p80": [0.9, 0.95]}
    assert results.fraction_verdict(row, results.FWD_GOAL) == (
        "too noisy to tell (p20-p80 800.0 us-1.00 ms)")
    assert results.fraction_verdict({**row, "p80_ms": 0.9}, results.FWD_GOAL) == "met"


@pytest.mark.parametrize("argv", [
    ["bench", "--impl", "jax"],
    ["bench", "--rounds", "0"],
    ["bench", "--rounds", "many"],
    ["bench", "--threads", "-1"],
    ["bench", "--norm", "group_norm"],
], ids=lambda a: " ".join(a))
def test_bench_command_line_mistakes_are_one_line_and_exit_2(argv, capsys):
    """Protects `layernorm bench`'s options from tracebacks and usage blocks: a mistake is one
    line on stderr naming the option, and exit status 2."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and argv[1] in err and "Traceback" not in err


def test_bench_says_which_implementations_it_leaves_out(monkeypatch, capsys, tmp_path):
    """Protects the implementations that cannot run here: left out of the default set with one
    line on stderr each naming it and the reason, the others still timed; asked for by name
    with --impl, a mistake: one line naming --impl and the reason, exit 2, nothing timed."""
    real = providers.why_not
    reason = "compiling failed (no C++ compiler)"
    monkeypatch.setattr(providers, "why_not", lambda norm, b: (
        reason if b == "torch.compile" else real(norm, b)))
    monkeypatch.setattr(providers, "BACKENDS", ("numpy", "torch.compile"))
    out = tmp_path / "r.json"
    assert cli.main(["bench", "--norm", "layer_norm", "--shape", "2x16", "--rounds", "1",
                     "--quick", "--out", str(out)]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        f"layernorm bench: torch.compile left out: {reason}")
    assert {r["impl"] for r in results.load(out)["rows"]} == {"numpy", "copy"}
    out.unlink()
    assert cli.main(["bench", "--impl", "torch.compile", "--impl", "numpy", "--norm",
                     "layer_norm", "--shape", "2x16", "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"layernorm bench: error: argument --impl: torch.compile cannot run here: {reason}"]
    assert not out.exists()


def _fake_cache(root, levels: dict[int, tuple[str, str]]):
    """A /sys/devices/system/cpu/cpu0/cache look-alike: level -> (type, size)."""
    for k, (level, (kind, size)) in enumerate(sorted(levels.items())):
        d = root / f"index{k}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return root


def test_llc_bytes_reads_the_highest_level_of_data(tmp_path):
    """Protects the cache size the regimes rest on: the highest level's size in bytes (K and M
    suffixes), an instruction cache never counts, and no cache folder is None."""
    cache = _fake_cache(tmp_path / "a", {1: ("Data", "32K"), 2: ("Unified", "512K"),
                                         3: ("Unified", "32768K")})
    assert harness.llc_bytes(cache) == 32 * 2**20
    cache = _fake_cache(tmp_path / "b", {1: ("Data", "48K"), 2: ("Instruction", "2M")})
    assert harness.llc_bytes(cache) == 48 * 2**10
    assert harness.llc_bytes(tmp_path / "none") is None


def test_regime_follows_the_bytes_against_the_cache():
    """Protects the labels: LayerNorm 3x64 float32 moves 1536 B forward (x, y), 2304 B
    backward (x, dy, dx) and 1536 B in the copy: "in cache" up to an LLC of 2304 B (the
    largest pass fits), "DRAM" down from 768 B (the copy is at least twice it), "straddles
    LLC" between; an add-norm's backward moves 5 streams, 3840 B; unknown LLC, unknown."""
    case = harness.Case((3, 64), "float32")
    assert harness.regime(case, 2304) == results.IN_CACHE
    assert harness.regime(case, 2303) == results.STRADDLES
    assert harness.regime(case, 769) == results.STRADDLES
    assert harness.regime(case, 768) == results.DRAM
    assert harness.regime(case, None) == results.UNKNOWN
    add = harness.Case((3, 64), "float32", "add_layer_norm")
    assert harness.regime(add, 3839) == results.STRADDLES
    assert harness.regime(add, 3840) == results.IN_CACHE


def test_every_row_and_the_meta_record_the_cache(monkeypatch):
    """Protects the JSON: with the LLC read as 1000 B, every row of LayerNorm 3x64 float32
    (copy 1536 B, under twice it; backward 2304 B, over it) says "straddles LLC" and 1000,
    and so does the run's meta."""
    monkeypatch.setattr(harness, "llc_bytes", lambda: 1000)
    run = harness.run_bench([TINY], ["numpy"], rounds=1, quick=True)
    assert run["meta"]["llc_bytes"] == 1000
    assert {(r["regime"], r["llc_bytes"]) for r in run["rows"]} == {(results.STRADDLES, 1000)}


def _row(impl: str, op: str, p50: float, frac: float, speedup: float | None = None,
         shape=(4, 1024, 4096), regime: str = results.DRAM, **extra) -> dict:
    """A synthetic row: p50 ms with +-5% as p20/p80, fraction of copy ``frac`` (+-5%), and,
    given ``speedup``, torch's time over this one's (+-10%)."""
    nbytes = 2 * int(np.prod(shape)) * 4
    row = {
        "norm": "layer_norm", "shape": list(shape), "dtype": "float32", "impl": impl, "op": op,
        "threads": 2, "cpus": 2, "other_cores": 0.0, "regime": regime, "llc_bytes": 2**25,
        "p50_ms": p50, "p20_ms": p50 * 0.95, "p80_ms": p50 * 1.05, "bytes": nbytes,
        "gbps": nbytes / p50 / 1e6, "copy_gbps": 20.0, "frac_copy": frac,
        "frac_copy_p20_p80": [frac * 0.95, frac * 1.05], "check": None if impl == "copy" else 0,
        "speedup": {} if speedup is None else {"torch": speedup},
        "speedup_p20_p80": {} if speedup is None else {"torch": [speedup * 0.9, speedup * 1.1]},
        "machine": {"cpu": "Test CPU"},
    }
    return {**row, **extra}


def _case_rows(shape=(4, 1024, 4096), regime: str = results.DRAM, copy_ms: float = 5.0,
               fused=(2.0, 4.0, 6.0), fracs=(0.95, 0.50), **extra) -> list[dict]:
    """One synthetic case: copy, fused (fwd, bwd, fwd+bwd p50 ms ``fused``; fwd and bwd
    ``fracs`` of copy; fwd+bwd 2.1x torch), torch, layernorm.torch (1.2x torch) and numpy."""
    kw = {"shape": shape, "regime": regime, **extra}
    return [
        _row("numpy", "fwd", 60.0, 0.05, **kw), _row("numpy", "bwd", 90.0, 0.06, **kw),
        _row("fused", "fwd", fused[0], fracs[0], **kw),
        _row("fused", "bwd", fused[1], fracs[1], **kw),
        _row("fused", "fwd+bwd", fused[2], 0.65, speedup=2.1, **kw),
        _row("layernorm.torch", "fwd+bwd", 7.0, 0.55, speedup=1.2, **kw),
        _row("torch", "fwd", 8.0, 0.40, **kw), _row("torch", "bwd", 9.0, 0.30, **kw),
        _row("torch", "fwd+bwd", 13.0, 0.30, **kw),
        _row("copy", "copy", copy_ms, 1.0, **kw),
    ]


def _flags(rows: list[dict], impl: str, op: str) -> list[str]:
    return next(r["flags"] for r in rows if (r["impl"], r["op"]) == (impl, op))


def test_a_case_that_straddles_the_cache_gets_no_bandwidth_verdict():
    """Protects the regimes' rule: the same figures are judged in DRAM ("met", "missed") and
    in cache, but not where the data straddles the LLC or the LLC is unknown; the speedup
    against torch is judged in every regime."""
    for regime in (results.DRAM, results.IN_CACHE):
        rows = results.flag_rows(_case_rows(regime=regime))
        fwd = next(r for r in rows if (r["impl"], r["op"]) == ("fused", "fwd"))
        assert results.fraction_verdict(fwd, results.FWD_GOAL) == "met"
    for regime in (results.STRADDLES, results.UNKNOWN):
        rows = results.flag_rows(_case_rows(regime=regime))
        fwd = next(r for r in rows if (r["impl"], r["op"]) == ("fused", "fwd"))
        assert results.fraction_verdict(fwd, results.FWD_GOAL) == f"{regime}: no verdict"
        goals = results.summary_table(rows, markdown=True).splitlines()[2].split(" | ")[-1]
        assert goals == (f"fwd {regime}: no verdict, bwd {regime}: no verdict, "
                         "speedup met |")


def test_impossible_figures_are_flagged_not_judged():
    """Protects the flags: fwd+bwd faster than bwd alone flags both rows and takes the place
    of the speedup verdict; a fraction of copy above 1.25 is implausible (1.2 is not); a copy
    under 50 us per call makes every row of the case overhead-bound; other processes using
    more than 0.1 core beyond what our threads leave free make the machine busy."""
    rows = results.flag_rows(_case_rows(fused=(2.0, 7.0, 6.0)))
    assert _flags(rows, "fused", "fwd+bwd") == ["implausible: fwd+bwd faster than bwd alone"]
    assert _flags(rows, "fused", "bwd") == ["implausible: slower than fwd+bwd"]
    assert _flags(rows, "fused", "fwd") == [] and _flags(rows, "torch", "fwd+bwd") == []
    goals = results.summary_table(rows).splitlines()[2]
    assert "speedup implausible: fwd+bwd faster than bwd alone" in goals
    assert "bwd implausible: slower than fwd+bwd" in goals and "fwd met" in goals

    rows = _case_rows()
    rows[2]["frac_copy"] = 2727.9  # fused fwd
    rows[3]["frac_copy"] = 1.2  # fused bwd: within the margin
    results.flag_rows(rows)
    assert _flags(rows, "fused", "fwd") == ["implausible: 2728x copy"]
    assert _flags(rows, "fused", "bwd") == []
    assert results.fraction_verdict(rows[2], results.FWD_GOAL) == "implausible: 2728x copy"

    rows = results.flag_rows(_case_rows(copy_ms=0.012))
    assert all(r["flags"] == ["overhead-bound (copy 12 us per call)"] for r in rows)
    assert results.fraction_verdict(rows[2], results.FWD_GOAL) == "overhead-bound"
    assert results.headlines(rows)[1].startswith(  # the flag, not the figure
        "`fused`: forward on LayerNorm 4x1024x4096 float32 (DRAM): overhead-bound, no verdict;")
    assert "speedup met" in results.summary_table(rows)  # a speedup stays a speedup

    rows = results.flag_rows(_case_rows(other_cores=0.5))
    assert _flags(rows, "fused", "fwd") == ["busy machine (other processes used 0.5 cores)"]
    assert "speedup busy machine" in results.summary_table(rows)
    rows = results.flag_rows(_case_rows(other_cores=0.5, threads=1))  # a core was free
    assert _flags(rows, "fused", "fwd") == []


def test_one_thread_is_singular(tmp_path, capsys):
    """Protects the wording of `layernorm bench`'s header: "1 thread", not "1 threads", and
    its tables in Markdown."""
    assert results.n_threads(1) == "1 thread" and results.n_threads(2) == "2 threads"
    before = harness.threads()
    try:
        assert cli.main(["bench", "--impl", "numpy", "--norm", "layer_norm", "--shape", "2x16",
                         "--rounds", "1", "--quick", "--threads", "1",
                         "--out", str(tmp_path / "r.json")]) == 0
    finally:
        harness.set_threads(before)
    out = capsys.readouterr().out
    assert "layernorm bench: 1 thread, 1 rounds" in out and "1 threads" not in out
    assert "| norm | shape | dtype | data in | impl | op |" in out  # every row's table


def test_headlines_give_the_number_behind_each_verdict():
    """Protects the report's summary lines: one per implementation in BACKENDS order, the copy
    left out; fused: forward and backward fractions of copy with spread, case, regime, goal and
    verdict, and its speedup over torch; layernorm.torch its speedup against the API goal;
    the others their fraction of copy without a goal; with several cases, counts by outcome
    and the flags."""
    lines = results.headlines(results.flag_rows(_case_rows()))
    assert [line.split("`")[1] for line in lines] == [
        "numpy", "fused", "layernorm.torch", "torch"]
    assert lines[1] == (
        "`fused`: forward 95% of copy (p20-p80 90%-100%) on LayerNorm 4x1024x4096 float32 "
        "(DRAM), goal 80%: met; backward 50% of copy (p20-p80 48%-52%) on LayerNorm "
        "4x1024x4096 float32 (DRAM), goal 70%: missed; fwd+bwd 2.10x torch (p20-p80 "
        "1.89x-2.31x) on LayerNorm 4x1024x4096 float32 (DRAM), goal 1.50x: met")
    assert lines[2] == (
        "`layernorm.torch`: fwd+bwd 1.20x torch (p20-p80 1.08x-1.32x) on LayerNorm "
        "4x1024x4096 float32 (DRAM), goal 1.50x: missed")
    assert lines[3].startswith("`torch`: forward 40% of copy (p20-p80 38%-42%) on LayerNorm")
    assert lines[3].endswith("; no goal")

    two = results.flag_rows(_case_rows() + _case_rows(shape=(8, 512, 768),
                                                      fused=(1.0, 3.0, 2.5), fracs=(0.99, 0.6)))
    fused = results.headlines(two)[1]
    assert fused.startswith("`fused`: forward >= 80% of copy: met in 2 of 2 cases; weakest 95%")
    assert ("backward >= 70% of copy: met in 0 of 2 cases, 1 missed, 1 flagged (e.g. "
            "implausible: slower than fwd+bwd on LayerNorm 8x512x768 float32); best 50%") in fused
    assert ("fwd+bwd >= 1.50x torch: met in 1 of 2 cases, 1 flagged (e.g. implausible: "
            "fwd+bwd faster than bwd alone on LayerNorm 8x512x768 float32)") in fused


def test_plot_draws_error_bars_and_says_where_data_lives():
    """Protects the bandwidth plot: every implementation's bars in both panels carry p20-p80
    error bars; each tick names the case's regime; the copy and goal lines are in the legend;
    the title says what is measured, on what machine and threads."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.container import BarContainer

    rows = results.flag_rows(_case_rows() + _case_rows(shape=(8, 512, 768),
                                                       regime=results.STRADDLES))
    fig = results.bandwidth_figure(rows)
    try:
        for ax in fig.axes[:2]:
            bars = [c for c in ax.containers if isinstance(c, BarContainer)]
            assert len(bars) == 4 and all(b.errorbar is not None for b in bars)
            assert all(len(b.errorbar.lines[2][0].get_segments()) == 2 for b in bars)
            legend = [t.get_text() for t in ax.get_legend().get_texts()]
            assert "copy of the same size, same run (p50)" in legend
            assert any(t.startswith("goal: ") for t in legend)
        ticks = [t.get_text() for t in fig.axes[1].get_xticklabels()]
        assert "(DRAM)" in ticks[0] and "(straddles LLC)" in ticks[1]
        assert "Test CPU, 2 threads" in fig._suptitle.get_text()
        assert fig.axes[0].get_ylabel() == "GB/s on minimal bytes"
    finally:
        plt.close(fig)


def _clipped(fig) -> list[str]:
    """The texts of ``fig`` (tick labels within the axes' limits, titles, axis labels,
    legends) that reach past its edges once drawn: what a saved PNG would cut off."""
    fig.canvas.draw()
    width, height = fig.bbox.width, fig.bbox.height
    out = []
    for ax in fig.axes:
        (x0, x1), (y0, y1) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
        ticks = [t for t in ax.get_xticklabels() if x0 <= t.get_position()[0] <= x1]
        ticks += [t for t in ax.get_yticklabels() if y0 <= t.get_position()[1] <= y1]
        texts = [*ticks, ax.title, ax.xaxis.label, ax.yaxis.label,
                 *([ax.get_legend()] if ax.get_legend() else [])]
        for t in texts:
            if getattr(t, "get_text", lambda: "legend")():
                e = t.get_window_extent()
                if e.x0 < 0 or e.y0 < 0 or e.x1 > width or e.y1 > height:
                    out.append(getattr(t, "get_text", lambda: "legend")())
    return out


def test_plots_keep_every_label_inside_the_figure():
    """Protects the plots' labels from being cut off at the figure's edge (the slanted case
    names of the bandwidth plot ran past its left edge): every tick label, title, axis label
    and legend of the bandwidth plot and of the peers plot lies inside the figure."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from layernorm.bench import peer_report, peers

    rows = results.flag_rows([
        row for norm in ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
        for shape, regime in (((4, 256, 768), results.IN_CACHE), ((4, 1024, 4096), results.DRAM))
        for row in _case_rows(shape=shape, regime=regime, norm=norm)])
    fig = results.bandwidth_figure(rows)
    try:
        assert _clipped(fig) == []
    finally:
        plt.close(fig)
    speed = {"p50_ms": 1.0, "p20_ms": 0.95, "p80_ms": 1.05}
    peer_rows = [{"norm": norm, "shape": shape, "dtype": "float32", "threads": 2, "mode": mode,
                  "best": "torch", "goal": 1.2,
                  "providers": {"layernorm": speed,
                                "torch": {**speed, "speedup": [1.0, 0.9, 1.1]}}}
                 for norm in NORMS for shape in peers.SHAPES for mode in peers.MODES]
    fig = peer_report.figure(peer_rows)
    try:
        assert _clipped(fig) == []
    finally:
        plt.close(fig)


def test_report_section_without_matplotlib_says_so(tmp_path, monkeypatch):
    """Protects `layernorm report` on a machine without matplotlib: the CPU section still
    comes, saying there is no plot, with its tables and JSON."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    monkeypatch.setattr(providers, "available", lambda norm="layer_norm": ["numpy"])
    monkeypatch.setattr(command, "REPORT_SHAPES", ((2, 32),))
    text = command.report_section(ReportContext(outdir=tmp_path, quick=True)).body
    assert "(matplotlib is not installed: no plot.)" in text and "| 2x32 |" in text
    assert "straddles LLC" in text and "<details>" in text
    assert not (tmp_path / "bench_cpu_bandwidth.png").exists()
    assert results.load(tmp_path / "bench_cpu.json")["rows"]


def test_older_result_files_load_without_verdicts_they_cannot_support(tmp_path):
    """Protects reading bench/results files written before rows had a regime, flags and
    speedup spreads: they load and render, a fraction of copy gets no verdict (the cache was
    not recorded) and a speedup none (no spread to judge it on)."""
    rows = _case_rows()
    for r in rows:
        for key in ("regime", "llc_bytes", "speedup_p20_p80", "flags"):
            r.pop(key, None)
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"meta": {}, "rows": rows}))
    loaded = results.load(path)["rows"]
    goals = results.summary_table(loaded, markdown=True).splitlines()[2].split(" | ")[-1]
    assert goals == "fwd LLC size unknown: no verdict, bwd LLC size unknown: no verdict |"
    assert results.headlines(loaded)[2] == (
        "`layernorm.torch`: fwd+bwd: no speedup over torch to judge")


def test_pass_bytes_count_a_shared_gradient_once():
    """Protects the bytes a bandwidth figure is credited with: the minimal bytes of each pass,
    except that the add-norms' backward through an implementation that returns dx as
    dresidual too (layernorm.torch, torch, torch.compile) counts four (M, D) arrays (h, dy, dh
    read; dx written), not five; the NumPy implementations write both and count five."""
    m, d, item = 6, 64, 4
    array = m * d * item
    for name, norm in NORMS.items():
        case = harness.Case((m, d), "float32", norm=name)
        for impl in ("numpy", "fused", *harness.SHARED_GRADIENT):
            shared = norm.residual and impl in harness.SHARED_GRADIENT
            bwd = (4 if shared else 5 if norm.residual else 3) * array
            fwd = (4 if norm.residual else 2) * array
            assert harness.pass_bytes(case, "bwd", item, impl) == bwd, (name, impl)
            assert harness.pass_bytes(case, "fwd", item, impl) == fwd, (name, impl)
            assert harness.pass_bytes(case, "fwd+bwd", item, impl) == fwd + bwd, (name, impl)


def test_a_result_records_the_command_that_made_it(monkeypatch, tmp_path):
    """Protects the command a result file records, which is how to make it again: the
    layernorm command (its script or python -m layernorm) as `layernorm ...`, and a tool as
    `python tools/<name>.py ...`, not as a layernorm command it is not."""
    from layernorm.bench.machine import command_line

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["/venv/bin/layernorm", "bench", "--peers"])
    assert command_line() == "layernorm bench --peers"
    monkeypatch.setattr("sys.argv", ["/x/layernorm/__main__.py", "report"])
    assert command_line() == "layernorm report"
    (tmp_path / "tools").mkdir()
    monkeypatch.setattr("sys.argv", [str(tmp_path / "tools" / "call_cost.py"), "--out", "f"])
    assert command_line() == "python tools/call_cost.py --out f"


def test_memory_efficient_backends_are_timed_beside_their_default_mode():
    """Protects the memory-efficient rows of `layernorm bench`: fused-me is checked against
    the float64 reference like fused, and the table gives its backward's time over the
    default mode's, per-round ratios, with a verdict against ME_GOAL (or the flag that
    prevents one)."""
    pytest.importorskip("torch")
    rows = harness.run_bench([TINY], ["fused", "fused-me"], rounds=2, quick=True,
                             progress=lambda msg: None)["rows"]
    me = [r for r in rows if r["impl"] == "fused-me"]
    assert {r["op"] for r in me} == set(providers.OPS)
    assert all(r["check"] is not None and r["check"] <= 1 for r in me)
    table = results.me_table(rows, markdown=True)
    line = next(ln for ln in table.splitlines() if "| fused |" in ln)
    base = results._find(rows, results._key(me[0]), "fused", "bwd")
    mine = results._find(rows, results._key(me[0]), "fused-me", "bwd")
    assert f"{base['p50_ms']:.3f}" in line and f"{mine['p50_ms']:.3f}" in line
    p50 = 1 / mine["speedup"]["fused"]
    assert f"{p50:.2f}x" in line
    verdict = results.me_verdict(rows, mine)
    assert verdict and verdict in line
    assert any(h.startswith("`fused-me`: backward") for h in results.headlines(rows))


def _me_pair(speedups, flags=()):
    """A default fused backward row and its memory-efficient twin, whose per-round ratios of
    the default's time over its own have p50, p20, p80 = ``speedups``."""
    base = {"norm": "layer_norm", "shape": [8, 64], "dtype": "float32", "op": "bwd",
            "impl": "fused", "flags": [], "p20_ms": 1.0, "p80_ms": 1.05, "speedup": {},
            "speedup_p20_p80": {}}
    me = {**base, "impl": "fused-me", "flags": list(flags), "speedup": {"fused": speedups[0]},
          "speedup_p20_p80": {"fused": list(speedups[1:])}}
    return [base, me], me


@pytest.mark.parametrize(("speedups", "flags", "want"), [
    ((1.0, 0.95, 1.05), (), "met"),  # ME / default 0.95-1.05: within 1.10 at p80
    ((0.8, 0.78, 0.82), (), "missed"),  # ME / default 1.22-1.28: beyond 1.10 at p20
    ((0.92, 0.85, 0.95), (), "within the noise (1.05-1.18)"),
    ((1.0, 0.95, 1.05), ("busy machine (load 1.2)",), "busy machine"),
])
def test_memory_efficient_verdict_judges_the_ratio_against_its_goal(speedups, flags, want):
    """Protects the goal of the memory-efficient backward (at most ME_GOAL times the
    default's time): met only when p80 of the per-round ratios is within it, missed only when
    p20 is beyond it, the spread shown between, and a flagged time gets no verdict."""
    rows, me = _me_pair(speedups, flags)
    assert results.me_verdict(rows, me) == want


# --- the report's advice from the peers' grid (layernorm.bench.peer_report.answers) ----------

STEADY_MS = (1.0, 0.98, 1.02)  # ours: p50, p20, p80 within STEADY
FASTER, SLOWER, LEVEL = (2.0, 1.95, 2.05), (0.5, 0.49, 0.51), (1.0, 0.98, 1.02)  # a peer's


def _peer_row(norm: str, shape: str, mode: str, ours: tuple = STEADY_MS,
              **peer_times: tuple) -> dict:
    """A row of `layernorm bench --peers`: ours' and each peer's (p50, p20, p80) ms, ours'
    speed over each peer its time over ours at p50 with a +-2% spread, judged as the command
    judges it. torch_compile names torch.compile."""
    from layernorm.bench import peers

    def timed(t):
        return {"p50_ms": t[0], "p20_ms": t[1], "p80_ms": t[2], "max_diff": 0.0}

    providers = {"layernorm": timed(ours)}
    for name, t in peer_times.items():
        q = t[0] / ours[0]
        providers[name.replace("_", ".")] = {**timed(t), "speedup": [q, q * 0.98, q * 1.02]}
    row = {"norm": norm, "shape": shape, "dims": list(peers.SHAPES[shape]), "dtype": "float32",
           "threads": 2, "mode": mode, "providers": providers}
    peers._judge(row)
    return row


def _use(rows: list[dict]) -> list[str]:
    """The advice's lines (and their nested notes), without the lead paragraph."""
    from layernorm.bench import peer_report

    return [ln for ln in peer_report.answers(rows)["use"].splitlines()
            if ln.lstrip().startswith("- ")]


def test_advice_names_a_choice_only_at_a_strict_majority_of_the_decided_shapes():
    """Protects "What to use on this machine" from naming a winner on a plurality: a choice is
    named where it was faster at more than half of the shapes decided (faster, slower or level;
    a noisy shape is not decided, so 3 of 5 decided names ours even though it is 3 of 6
    shapes); two against two, or a peer ahead at 2 shapes with 4 level, names no winner but the
    shapes where each was faster, or that most were level."""
    majority = [_peer_row("layer_norm", s, "inference", torch=SLOWER if s.startswith("decode")
                          else FASTER) for s in ("decode", "decode x8", "short", "BERT", "prefill")]
    majority.append(_peer_row("layer_norm", "training", "inference", (1.0, 0.6, 1.6),
                              torch=FASTER))  # ours' own time spread wide: too noisy to tell
    assert _use(majority) == [
        "- LayerNorm, inference: `layernorm.torch` (faster at 3 of 6 shapes; `torch` at "
        "decode, decode x8); too noisy to tell at training"]
    split = [_peer_row("add_layer_norm", s, "training", torch=t)
             for s, t in (("decode", SLOWER), ("short", SLOWER), ("prefill", FASTER),
                          ("training large", FASTER))]
    assert _use(split) == [
        "- add+LayerNorm, training: depends on the shape (none was faster at most of the 4 "
        "shapes decided): `layernorm.torch` at prefill, training large; `torch` at decode, "
        "short"]  # a tie lists ours first
    plurality = [_peer_row("rms_norm", s, "training", torch=t, torch_compile=c)
                 for s, t, c in (("decode", SLOWER, FASTER), ("short", SLOWER, FASTER),
                                 ("BERT", FASTER, SLOWER), ("prefill", FASTER, FASTER),
                                 ("training", FASTER, FASTER))]
    assert _use(plurality) == [
        "- RMSNorm, training: depends on the shape (none was faster at most of the 5 shapes "
        "decided): `layernorm.torch` at prefill, training; `torch` at decode, short; "
        "`torch.compile` at BERT"]
    mostly_level = [_peer_row("add_rms_norm", s, "inference", torch=FASTER, onnxruntime=t)
                    for s, t in (("decode", SLOWER), ("decode x8", SLOWER), ("short", LEVEL),
                                 ("BERT", LEVEL), ("prefill", LEVEL), ("training", LEVEL))]
    assert _use(mostly_level)[0] == (
        "- add+RMSNorm, inference: any (level at 4 of 6 shapes: short, BERT, prefill, "
        "training; `onnxruntime` at decode, decode x8)")


def test_advice_says_where_onnxruntime_applies_and_what_to_use_within_pytorch():
    """Protects the advice from offering onnxruntime as a drop-in: wherever it is named, a
    nested line says it applies to a model exported to ONNX and run in onnxruntime, not to a
    norm swapped in PyTorch, and gives the advice among the PyTorch providers alone; a line
    that does not name it has no such note."""
    rows = [_peer_row("rms_norm", s, "inference", torch=FASTER, onnxruntime=SLOWER)
            for s in ("decode", "short", "BERT")]
    rows += [_peer_row("rms_norm", s, "training", torch=FASTER) for s in ("decode", "short")]
    assert _use(rows) == [
        "- RMSNorm, inference: `onnxruntime` (faster at 3 of 3 shapes)",
        "  - `onnxruntime` means a model exported to ONNX and run in onnxruntime "
        "(`docs/export.md`), whose norms are its fused operators; it is not a per-op swap in a "
        "PyTorch model; within PyTorch: `layernorm.torch` (faster at 3 of 3 shapes)",
        "- RMSNorm, training: `layernorm.torch` (faster at 2 of 2 shapes)"]


def test_peers_report_section_says_which_command_and_shapes_each_line_covers(tmp_path,
                                                                            monkeypatch):
    """Protects the report from two sections that read as contradicting each other: the
    peers' summary, the advice and the faster answer name `layernorm bench --peers` and each
    shape with its extents, and the advice says that the CPU kernels section's shapes are
    others; the kernel section's lines name their shapes (see
    test_report_section_writes_plot_and_table)."""
    from layernorm.bench import peers

    rows = [_peer_row("layer_norm", s, m, torch=SLOWER) for s in ("decode", "BERT")
            for m in peers.MODES]
    monkeypatch.setattr(peers, "run", lambda cases, rounds, progress: {
        "meta": {"peers": {"torch": None, "torch.compile": None, "onnxruntime": None}},
        "rows": rows})
    monkeypatch.setattr(command, "_end_to_end", lambda result, rounds, threads: None)
    monkeypatch.setattr(command, "_plot", lambda *args: "(plot)")
    sec = command.peers_report_section(ReportContext(outdir=tmp_path, quick=True))
    grid = ("`layernorm bench --peers` (float32, 2 threads; 2 shapes: decode 1x1x4096, "
            "BERT 8x128x768)")
    # decode in inference: 0.5x torch, on its goal of 1/2 (too close to call)
    assert sec.summary[0] == (f"{grid}, inference and training: 0 of 4 cases met their goal "
                              "against the best peer, 3 missed, 1 undecided (too noisy to "
                              "tell, or within the guard band)")
    assert sec.answers["use"].startswith(f"From {grid}, per norm and mode: ")
    assert f"all timed in the same run of {grid}: " in sec.answers["faster"]
    assert sec.answers["use"].endswith(
        "This advice covers the shapes above only. The [CPU kernels and bandwidth]"
        "(#cpu-kernels-and-bandwidth) section times one training step (fwd+bwd) at 4x256x768 "
        "and 4x1024x4096 against torch eager alone, so its verdicts can differ from these "
        "lines without contradicting them.")
    assert f"<details><summary>All 4 cases of {grid}, inference and training</summary>" in (
        sec.body)
