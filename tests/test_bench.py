"""The CPU benchmark (layernorm.bench and `layernorm bench`): JSON schema, providers, tables,
plot, CLI and report section (never timings)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from layernorm.bench import harness, providers, results
from layernorm.commands import bench as command
from layernorm.commands import cli
from layernorm.commands.report import ReportContext
from layernorm.family import NORMS

TINY = harness.Case((3, 64), "float32")
IMPLS = [i for i in ("numpy", "fused") if i in providers.available()]


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    monkeypatch.setattr(harness, "PAUSE_S", 0.0)


@pytest.fixture(scope="module")
def result():
    return harness.run_bench([TINY], IMPLS, rounds=2, quick=True, progress=lambda msg: None)


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
        assert set(r["speedup"]) == ({p for p in IMPLS if p != r["impl"]}
                                     if r["impl"] != "copy" else set())
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
    if "fused" in IMPLS:
        assert "fwd met" in md or "fwd missed" in md


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


def test_cli_bench_saves_json(tmp_path, capsys):
    """Protects `layernorm bench`: exit 0, the tables on stdout, the JSON at --out, every norm
    of the family by default (rows: per norm, each implementation's three operations and a
    copy)."""
    out = tmp_path / "r.json"
    argv = ["bench", "--shape", "2x48", "--rounds", "1", "--quick", "--out", str(out)]
    for impl in IMPLS:
        argv += ["--impl", impl]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "2x48" in text and "copy GB/s" in text
    saved = results.load(out)
    assert saved["meta"]["machine"]["numpy"]
    assert len(saved["rows"]) == len(NORMS) * (3 * len(IMPLS) + 1)
    assert saved == json.loads(out.read_text())


def test_cuda_device_dispatches_to_the_gpu_harness(monkeypatch):
    """Protects --device cuda: the same args go to run_cuda, the GPU benchmark's command."""
    seen = []
    monkeypatch.setattr(command, "run_cuda", lambda args: seen.append(args) or 7)
    args = cli.build_parser().parse_args(["bench", "--device", "cuda", "--shape", "8x16"])
    assert args._run(args) == 7
    assert seen[0].shape == [(8, 16)] and seen[0].dtype is None


def test_report_section_writes_plot_and_table(tmp_path, monkeypatch):
    """Protects the report section: Markdown with the summary, the plot and the saved JSON."""
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(command, "STANDARD_SHAPES", ((2, 32),))
    monkeypatch.setattr(providers, "available", lambda norm="layer_norm": IMPLS)
    text = command.report_section(ReportContext(outdir=tmp_path, quick=True))
    assert "![bandwidth](bench_cpu_bandwidth.png)" in text and "| 2x32 |" in text
    assert (tmp_path / "bench_cpu_bandwidth.png").exists()
    assert json.loads((tmp_path / "bench_cpu.json").read_text())["rows"]


def test_first_call_latency_runs_cold_then_warm():
    """Protects the first-call report: a fresh process with an empty Numba cache, then one
    that loads that cache; each gives import, forward and backward seconds (not asserted)."""
    pytest.importorskip("numba")
    latency = harness.first_call_latency()
    assert list(latency) == ["cold", "warm"]
    for t in latency.values():
        assert set(t) == {"import_s", "forward_s", "backward_s"}
        assert all(v > 0 for v in t.values())
    assert "cold: import" in results.format_latency(latency)


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
    """Protects the bandwidth yardstick: an exact copy of every item size; mismatched or
    non-contiguous arrays raise."""
    yardstick = pytest.importorskip("layernorm.bench.yardstick")
    for dtype in (np.float16, np.float32, np.float64):
        src = np.arange(24, dtype=dtype).reshape(2, 3, 4)
        dst = np.zeros_like(src)
        yardstick.copy(src, dst)
        np.testing.assert_array_equal(dst, src)
    with pytest.raises(ValueError, match="must match"):
        yardstick.copy(src, np.zeros((4, 5), np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        yardstick.copy(src[:, :, ::2], np.zeros((2, 3, 2), np.float64))
