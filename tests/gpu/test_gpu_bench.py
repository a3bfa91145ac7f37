"""The GPU benchmark's parts that need no GPU: shapes, result rows and files, the table, the
report section, and the refusal to run without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from layernorm.bench import gpu as bench
from layernorm.commands import bench as command
from layernorm.cost import minimal_bytes


def _rows(device="NVIDIA H100 80GB HBM3"):
    """Synthetic results: three providers, two passes, two N, bfloat16."""
    rows = []
    for n in (1024, 4096):
        m = bench.rows_for(n)
        for pass_ in ("fwd", "bwd"):
            for provider, ms in (("layernorm", 0.05), ("torch", 0.10), ("torch.compile", 0.04)):
                rows.append(bench.make_row(device, "bfloat16", m, n, provider, pass_,
                                           ms * n / 1024, 3000.0))
    return rows


def test_default_sweep():
    """Protects the benchmark's shapes: N from 256 to 256K by powers of two, M = 32,768 rows,
    fewer for the largest N so M·N stays within 2**30 elements."""
    shapes = bench.parse_shapes(None, quick=False)
    assert [n for _, n in shapes] == [2**k for k in range(8, 19)]
    assert all(m == 32768 for m, n in shapes if n <= 32768)
    assert all(m * n <= 2**30 and m < 32768 for m, n in shapes if n > 32768)
    assert len(bench.parse_shapes(None, quick=True)) < len(shapes)


def test_parse_shapes():
    """Protects --shape: tuples from `layernorm bench --shape` (leading extents multiply into
    M; a 1-tuple is N), 'MxN', 'N' and ints (default M); bad values are named."""
    assert bench.parse_shapes([(64, 1000), (2, 8, 512), (4096,), "3x5", "8192", 1024],
                              quick=False) == [(64, 1000), (16, 512), (32768, 4096), (3, 5),
                                               (32768, 8192), (32768, 1024)]
    with pytest.raises(ValueError, match="shape"):
        bench.parse_shapes(["64 by 1000"], quick=False)
    with pytest.raises(ValueError, match="shape"):
        bench.parse_shapes([(0, 10)], quick=False)


@pytest.mark.parametrize("pass_,dtype,itemsize", [("fwd", "bfloat16", 2), ("bwd", "float32", 4)])
def test_row_has_exactly_the_keys_and_minimal_byte_bandwidth(pass_, dtype, itemsize):
    """Protects the JSON schema and the bandwidth formula: GB/s on minimal bytes
    (2·M·N·itemsize forward, 3·M·N·itemsize backward) over the median time."""
    row = bench.make_row("gpu", dtype, 1000, 4096, "layernorm", pass_, 0.5, 3000.0)
    assert tuple(row) == bench.RESULT_KEYS
    assert row["gbps"] == pytest.approx(minimal_bytes(pass_, 1000, 4096, itemsize) / 0.5e-3 / 1e9)
    streams = 2 if pass_ == "fwd" else 3
    assert row["gbps"] == pytest.approx(streams * 1000 * 4096 * itemsize / 0.5e6)


def test_results_files(tmp_path):
    """Protects writing and finding results: a folder gets a time-sorted gpu-*.json, a .json
    path is used as given, the newest file wins, and rows with other keys are refused."""
    rows = _rows()
    older = tmp_path / ("gpu-20240101-000000-x.json")
    older.write_text(json.dumps(rows[:1]))
    path = bench.write_results(rows, tmp_path, rows[0]["device"])
    assert path.parent == tmp_path and path.name.startswith("gpu-") and "h100" in path.name
    assert bench.latest_results(tmp_path) == path
    assert bench.load_results(path) == rows
    named = bench.write_results(rows, tmp_path / "sub" / "mine.json", "gpu")
    assert named == tmp_path / "sub" / "mine.json" and named.exists()
    bad = tmp_path / "gpu-29990101-000000-bad.json"
    bad.write_text(json.dumps([{**rows[0], "extra": 1}]))
    with pytest.raises(ValueError, match="exactly the keys"):
        bench.load_results(bad)
    assert bench.latest_results(tmp_path / "none") is None


def test_table_shows_fraction_of_copy_and_speed_against_each_peer():
    """Protects the printed table: per (dtype, pass, N), each provider's fraction of copy
    bandwidth and our speed against every peer (peer ms / our ms)."""
    text = bench.format_table(_rows())
    head, _, first, *_ = text.splitlines()
    assert "layernorm of copy" in head and "vs torch" in head and "vs torch.compile" in head
    cells = first.split()
    assert cells[:4] == ["bfloat16", "fwd", "1024", "32768"]
    assert "2.00x" in cells and "0.80x" in cells  # torch 0.10 / 0.05, compile 0.04 / 0.05
    md = bench.format_table(_rows(), markdown=True)
    assert md.startswith("| dtype | pass | N |") and md.count("\n") == 5


def test_report_section_without_results(tmp_path, monkeypatch):
    """Protects the report before any GPU run: it says plainly there are no measurements and
    gives the command that makes them."""
    monkeypatch.chdir(tmp_path)
    text = command.gpu_report_section(SimpleNamespace(outdir=tmp_path, quick=True))
    assert "No GPU measurements exist yet" in text and "`layernorm bench --device cuda`" in text


def test_report_section_with_results(tmp_path, monkeypatch):
    """Protects the report's GPU section: the newest results as a table and a bandwidth plot."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    bench.write_results(_rows(), None, "NVIDIA H100 80GB HBM3")
    out = tmp_path / "report"
    out.mkdir()
    text = command.gpu_report_section(SimpleNamespace(outdir=out, quick=True))
    assert "NVIDIA H100" in text and "| bfloat16 | bwd | 4096 |" in text
    assert "![fraction of copy bandwidth](gpu-bandwidth.png)" in text
    assert (out / "gpu-bandwidth.png").stat().st_size > 0


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")  # torch.compile
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_measure_provider_checks_and_times_both_passes(dtype, monkeypatch):
    """Protects the measurement of one provider apart from CUDA timing: our layer_norm and
    eager torch pass the reference check on the first rows, forward and backward (through
    autograd, grads cleared before each run) are both run, and a wrong provider is caught."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    calls = []

    def fake_time(fn, rounds, flush, before=None):
        if before:
            before()
        fn()
        calls.append(fn)
        return [1.0] * rounds

    monkeypatch.setattr(bench, "_time_ms", fake_time)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(8, 96, generator=g).to(device, getattr(torch, dtype)) for _ in "ab")
    w, b = torch.ones(96, device=device), torch.zeros(96, device=device)
    providers = {p.name: p for p in bench._providers(96)[0]}
    for name in ("layernorm", "torch"):
        times, err = bench._measure_provider(providers[name], dtype, x, w.to(x.dtype),
                                             b.to(x.dtype), dy, 3, None)
        assert err is None and set(times) == {"fwd", "bwd"} and times["fwd"] == [1.0] * 3
    assert len(calls) == 4
    wrong = bench.Provider("wrong", lambda x, w, b: x * 2)
    _, err = bench._measure_provider(wrong, dtype, x, w.to(x.dtype), b.to(x.dtype), dy, 3, None)
    assert err is not None and err.startswith("y:")


def test_run_cuda_without_a_gpu(capsys):
    """Protects `layernorm bench --device cuda` on a machine without CUDA: a clear message and
    exit status 2, nothing written."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: run_cuda would measure")
    args = SimpleNamespace(dtype=None, shape=None, quick=True, out=None, rounds=None)
    assert command.run_cuda(args) == 2
    assert "no CUDA device" in capsys.readouterr().out


def test_bench_module_needs_no_torch():
    """Protects the layering: the GPU benchmark's results and report section
    (layernorm.bench.gpu, layernorm.commands.bench) import neither torch nor triton, so
    `layernorm report` works without the gpu extra."""
    code = ("import sys; from layernorm.bench import gpu; from layernorm.commands import bench; "
            "gpu.latest_results(); "
            "bad = [m for m in ('torch', 'triton') if m in sys.modules]; print(bad); "
            "sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert res.returncode == 0, res.stdout + res.stderr
