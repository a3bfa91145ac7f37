"""The GPU benchmark's parts that need no GPU: shapes, byte counts, result rows and files, the
sweep (with a fake session: error rows, incremental writes), provider discovery, the reference
check of a pass, the table, the report section, and the refusal to run without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from layernorm.bench import gpu as bench
from layernorm.bench import gpu_measure as measuring
from layernorm.commands import bench as command
from layernorm.family import NORMS

SRC = str(Path(bench.__file__).parents[2])


def _rows(device="NVIDIA H100 80GB HBM3"):
    """Synthetic results: three providers, two passes, two N, bfloat16, layer_norm."""
    rows = []
    for n in (1024, 4096):
        m = bench.rows_for(n)
        for pass_ in ("fwd", "bwd"):
            for provider, ms in (("layernorm", 0.05), ("torch", 0.10), ("torch.compile", 0.04)):
                rows.append(bench.make_row(device, "layer_norm", "bfloat16", m, n, provider,
                                           pass_, ms * n / 1024, 3000.0, timing="cuda_graph"))
    return rows


def test_default_sweep():
    """Protects the benchmark's shapes: N from 256 to 256K by powers of two, M = 32,768 rows,
    and in bfloat16 QuACK's row counts at 128K and 256K (16,384 and 8,192) so figures compare
    with its published ones; float32 keeps a tensor to the same 4 GiB (half the rows from
    64K), so an add-norm's backward fits an 80 GB H100."""
    shapes = bench.parse_shapes(None, quick=False)
    assert [n for _, n in shapes] == [2**k for k in range(8, 19)]
    assert dict((n, m) for m, n in shapes) == {
        **{2**k: 32768 for k in range(8, 17)}, 131072: 16384, 262144: 8192}
    fp32 = bench.parse_shapes(None, quick=False, dtype="float32")
    assert dict((n, m) for m, n in fp32) == {
        **{2**k: 32768 for k in range(8, 16)}, 65536: 16384, 131072: 8192, 262144: 4096}
    assert max(m * n * 4 for m, n in fp32) == max(m * n * 2 for m, n in shapes) == 4 * 2**30
    quick = bench.parse_shapes(None, quick=True)
    assert len(quick) < len(shapes) and set(quick) <= set(shapes)


def test_parse_shapes():
    """Protects --shape on CUDA: the rule of every command (at least two positive extents,
    leading extents multiply into M), as tuples or 'MxN'; anything else is refused, named."""
    assert bench.parse_shapes([(64, 1000), (2, 8, 512), "3x5"], quick=False) == [
        (64, 1000), (16, 512), (3, 5)]
    for bad in (["64 by 1000"], [(0, 10)], [(4096,)], ["8192"], [1024], [(True, 8)]):
        with pytest.raises(ValueError, match="shape"):
            bench.parse_shapes(bad, quick=False)


# (M, N) arrays read and written, and parameters (read forward; read and their gradients
# written backward): fwd x -> y (and residual -> h), bwd x|h, dy (, dh) -> dx (, dresidual).
@pytest.mark.parametrize("norm,pass_,streams,params", [
    ("layer_norm", "fwd", 2, 2), ("layer_norm", "bwd", 3, 4),
    ("rms_norm", "fwd", 2, 1), ("rms_norm", "bwd", 3, 2),
    ("add_layer_norm", "fwd", 4, 2), ("add_layer_norm", "bwd", 5, 4),
    ("add_rms_norm", "fwd", 4, 1), ("add_rms_norm", "bwd", 5, 2),
])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_pass_bytes_per_norm_and_pass(norm, pass_, streams, params, itemsize):
    """Protects the bandwidth formula of every norm and pass: minimal bytes are the (M, N)
    streams the pass must move plus the (N,) parameters, at the input's item size."""
    M, N = 1000, 4096
    assert bench.pass_bytes(norm, pass_, M, N, itemsize) == (streams * M + params) * N * itemsize


def test_rows_have_the_schema():
    """Protects the JSON schema: a measured row has exactly RESULT_KEYS and its timing, with
    GB/s on pass_bytes over the median time; a failed row has null ms and gbps and the error
    instead of a timing."""
    row = bench.make_row("gpu", "add_rms_norm", "bfloat16", 1000, 4096, "layernorm", "bwd", 0.5,
                         3000.0, timing="events")
    assert tuple(row) == (*bench.RESULT_KEYS, "timing") and row["timing"] == "events"
    assert row["gbps"] == pytest.approx(
        bench.pass_bytes("add_rms_norm", "bwd", 1000, 4096, 2) / 0.5e6)
    failed = bench.make_row("gpu", "rms_norm", "float32", 8192, 262144, "liger", "fwd", None,
                            3000.0, error="RuntimeError: n = 262144 exceeds 65536")
    assert tuple(failed) == (*bench.RESULT_KEYS, "error")
    assert failed["ms"] is None and failed["gbps"] is None
    json.dumps([row, failed], allow_nan=False)


def test_results_files(tmp_path):
    """Protects writing and finding results: a folder gets a time-sorted gpu-*.json (one per
    run, however often it is rewritten), a .json path (any case) is used as given, the newest
    file of the folders searched wins, rows with unknown keys are refused, files from before
    the family (no norm) read as layer_norm, and with no --out a run goes to bench/runs."""
    rows = _rows()
    older = tmp_path / "gpu-20240101-000000-x.json"
    older.write_text(json.dumps([{k: v for k, v in rows[0].items() if k != "norm"}]))
    assert bench.load_results(older) == [rows[0]]
    path = bench.write_results(rows[:2], tmp_path, rows[0]["device"])
    assert bench.write_results(rows, tmp_path, rows[0]["device"]) == path
    assert path.parent == tmp_path and path.name.startswith("gpu-") and "h100" in path.name
    assert sorted(p.name for p in tmp_path.iterdir()) == [older.name, path.name]
    assert bench.latest_results(tmp_path) == path
    assert bench.load_results(path) == rows
    named = bench.write_results(rows, tmp_path / "sub" / "mine.json", "gpu")
    assert named == tmp_path / "sub" / "mine.json" and named.exists()
    upper = bench.write_results(rows, tmp_path / "MINE.JSON", "gpu")  # as the CLI reads --out
    assert upper == tmp_path / "MINE.JSON" and upper.is_file()
    bad = tmp_path / "gpu-29990101-000000-bad.json"
    bad.write_text(json.dumps([{**rows[0], "extra": 1}]))
    with pytest.raises(ValueError, match="keys"):
        bench.load_results(bad)
    assert bench.latest_results(tmp_path / "none") is None
    newer = tmp_path / "runs" / "gpu-29990101-000001-x.json"
    bench.write_results(rows, newer, "gpu")
    assert bench.latest_results(tmp_path / "runs", tmp_path) == newer  # newest of the folders
    assert bench.results_file(None, "H100").parent == bench.RUNS_DIR == Path("bench", "runs")


def test_table_shows_fraction_of_copy_and_speed_against_each_peer():
    """Protects the printed table: per (norm, dtype, pass, N), each provider's fraction of copy
    bandwidth ("err" where it raised) and our speed against every peer (peer ms / our ms)."""
    rows = _rows()
    rows.append(bench.make_row(rows[0]["device"], "layer_norm", "bfloat16", 32768, 1024, "liger",
                               "fwd", None, 3000.0, error="RuntimeError: boom"))
    text = bench.format_table(rows)
    head, _, first, *_ = text.splitlines()
    assert "layernorm of copy" in head and "vs torch" in head and "vs liger" in head
    cells = first.split()
    assert cells[:5] == ["layer_norm", "bfloat16", "fwd", "1024", "32768"]
    assert "2.00x" in cells and "0.80x" in cells  # torch 0.10 / 0.05, compile 0.04 / 0.05
    assert "err" in cells and cells[-1] == "-"  # liger raised: no speed against it
    md = bench.format_table(_rows(), markdown=True)
    assert md.startswith("| norm | dtype | pass | N |") and md.count("\n") == 5


def test_report_section_without_results(tmp_path, monkeypatch):
    """Protects the report before any GPU run: it says plainly there are no measurements and
    gives the command that makes them."""
    monkeypatch.chdir(tmp_path)
    sec = command.gpu_report_section(SimpleNamespace(outdir=tmp_path, quick=True))
    assert "No GPU measurements exist yet" in sec.body
    assert "`layernorm bench --device cuda`" in sec.body
    assert sec.summary[0].startswith("not measured")
    assert sec.answers["faster"].startswith("On a GPU: not measured")


def test_report_section_with_results(tmp_path, monkeypatch):
    """Protects the report's GPU section: the newest results as a table and a bandwidth plot,
    failed rows included in the table and left out of the plot."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    rows = _rows() + [bench.make_row("NVIDIA H100 80GB HBM3", "rms_norm", "bfloat16", 16384,
                                     131072, "liger", "fwd", None, 3000.0, error="E: x")]
    bench.write_results(rows, None, "NVIDIA H100 80GB HBM3")
    out = tmp_path / "report"
    out.mkdir()
    sec = command.gpu_report_section(SimpleNamespace(outdir=out, quick=True))
    text = sec.body
    assert "NVIDIA H100" in text and "| layer_norm | bfloat16 | bwd | 4096 |" in text
    assert "| rms_norm | bfloat16 | fwd | 131072 |" in text
    assert "(gpu-bandwidth.png)" in text and "<details>" in text
    assert "measured on NVIDIA H100" in sec.summary[0] and "1 row failed" in sec.summary[0]
    assert sec.answers["faster"].startswith("On a GPU (NVIDIA H100 80GB HBM3, not this machine")
    assert (out / "gpu-bandwidth.png").stat().st_size > 0


class FakeSession:
    """A sweep's measuring side without a GPU: ``fail(provider, N, pass_)`` gives the
    exception a run raises (or None); ``before_run`` is called first with the run's
    arguments."""

    def __init__(self, fail=lambda p, n, pass_: None, before_run=lambda *a: None,
                 timing="cuda_graph"):
        self.fail, self.before_run, self.timing = fail, before_run, timing
        self.released = 0

    def copy_gbps(self, dtype, M, N):
        return 3000.0

    def providers(self, norm, N):
        return ([bench.Provider(p, None) for p in ("layernorm", "torch", "liger")],
                ["quack: not importable (ModuleNotFoundError: No module named 'quack')"])

    def run(self, prov, norm, dtype, M, N, pass_):
        self.before_run(prov, norm, dtype, M, N, pass_)
        exc = self.fail(prov.name, N, pass_)
        if exc is not None:
            raise exc
        capture_error = None if self.timing == "cuda_graph" else "RuntimeError: not capturable"
        return bench.Measured([0.3, 0.1, 0.2], self.timing, None, capture_error)

    def release(self):
        self.released += 1


SHAPES = [(32768, 4096), (16384, 131072)]


def test_sweep_records_errors_and_goes_on(tmp_path, capsys):
    """Protects the sweep against a provider's failure, of any kind: it becomes a row with null
    ms and the exception named in one line, the device is released, and every later row is
    still measured; a shape whose copy fails is skipped with a note."""

    def fail(provider, n, pass_):
        if provider == "liger" and n > 65536:  # as Liger raises past its block size
            return RuntimeError(f"Cannot launch Triton kernel since n = {n} exceeds the "
                                "recommended Triton blocksize = 65536.\nsecond line")
        if provider == "torch" and pass_ == "bwd":
            return ValueError("any exception, not only out of memory")
        return None

    session = FakeSession(fail)
    path = tmp_path / "r.json"
    rows, problems = bench.sweep(session, "gpu", ["bfloat16"], SHAPES, list(NORMS), path)
    assert len(rows) == len(SHAPES) * len(NORMS) * 3 * 2  # every (shape, norm, provider, pass)
    assert bench.load_results(path) == rows
    failed = [r for r in rows if r["ms"] is None]
    assert {(r["provider"], r["N"], r["pass"]) for r in failed} == (
        {("liger", 131072, p) for p in ("fwd", "bwd")}
        | {("torch", n, "bwd") for _, n in SHAPES})
    assert session.released == len(failed)
    liger = next(r for r in failed if r["provider"] == "liger")
    assert liger["error"] == ("RuntimeError: Cannot launch Triton kernel since n = 131072 "
                              "exceeds the recommended Triton blocksize = 65536.")
    assert all("timing" not in r and r["gbps"] is None for r in failed)
    done = [r for r in rows if r["ms"] is not None]
    assert all(r["ms"] == 0.2 and r["timing"] == "cuda_graph" and "error" not in r for r in done)
    assert rows[-1]["provider"] == "liger" and rows[-1]["N"] == 131072  # went on to the end
    assert problems.count(
        "quack: not importable (ModuleNotFoundError: No module named 'quack')") == 1
    assert any(p.startswith("torch layer_norm N=4096 bfloat16 bwd: failed: ValueError")
               for p in problems)
    assert "failed" in capsys.readouterr().out

    class NoCopy(FakeSession):
        def copy_gbps(self, dtype, M, N):
            if N > 65536:
                raise RuntimeError("CUDA out of memory. Tried to allocate 8.00 GiB")
            return 3000.0

    rows, problems = bench.sweep(NoCopy(), "gpu", ["float32"], SHAPES, ["rms_norm"], path)
    assert {r["N"] for r in rows} == {4096}
    assert "copy M=16384 N=131072 float32: RuntimeError: CUDA out of memory. Tried to allocate " \
           "8.00 GiB; shape skipped" in problems


def test_sweep_writes_each_row_as_it_comes(tmp_path):
    """Protects the results of a long run: the file is rewritten after every row, so a crash
    late (here an exception the sweep does not catch) keeps every earlier row."""
    path = tmp_path / "sub" / "r.json"
    seen = []

    def before_run(*args):
        seen.append(len(json.loads(path.read_text())) if path.exists() else 0)

    rows, _ = bench.sweep(FakeSession(before_run=before_run), "gpu", ["float32"], SHAPES[:1],
                          ["layer_norm", "add_rms_norm"], path)
    assert seen == list(range(len(rows)))

    class Crash(BaseException):
        pass

    def crash_at_fifth(*args):
        if path.exists() and len(json.loads(path.read_text())) == 4:
            raise Crash

    path.unlink()
    with pytest.raises(Crash):
        bench.sweep(FakeSession(before_run=crash_at_fifth), "gpu", ["float32"], SHAPES,
                    list(NORMS), path)
    kept = bench.load_results(path)
    assert len(kept) == 4 and [r["provider"] for r in kept] == ["layernorm"] * 2 + ["torch"] * 2
    assert not list(path.parent.glob("*.tmp"))


def test_sweep_notes_events_timing_once(tmp_path):
    """Protects the timing record: a pass that does not capture in a CUDA graph is timed by
    events, says so in its rows, and is noted once per (provider, norm, pass), not per shape."""
    rows, problems = bench.sweep(FakeSession(timing="events"), "gpu", ["bfloat16"], SHAPES,
                                 ["rms_norm"], tmp_path / "r.json")
    assert {r["timing"] for r in rows} == {"events"}
    notes = [p for p in problems if "timed by events" in p]
    assert len(notes) == 3 * 2 and all("first at N=4096" in p for p in notes)


def test_sweep_resumes_where_a_run_stopped(tmp_path):
    """Protects --resume: the measured rows of an earlier run are kept as they are and not
    measured again, a failed one is measured again and replaced, a shape with kept rows keeps
    their copy bandwidth (one copy figure per shape), and the result is the whole sweep."""
    path = tmp_path / "r.json"
    full, _ = bench.sweep(FakeSession(), "gpu", ["bfloat16"], SHAPES, ["rms_norm"], path)
    cut = [dict(r, copy_gbps=2500.0, ms=0.5, gbps=1.0) for r in full[:5]]
    cut[4].update(ms=None, gbps=None, error="RuntimeError: out of memory")
    runs = []

    class Counting(FakeSession):
        def copy_gbps(self, dtype, M, N):
            runs.append(("copy", N))
            return 3000.0

    session = Counting(before_run=lambda prov, norm, dtype, M, N, pass_:
                       runs.append((prov.name, N, pass_)))
    rows, _ = bench.sweep(session, "gpu", ["bfloat16"], SHAPES, ["rms_norm"], path, kept=cut)
    assert rows[:4] == cut[:4]  # kept as they were
    assert sorted(map(bench._key, rows)) == sorted(map(bench._key, full))  # the whole sweep
    assert bench.load_results(path) == rows
    assert [r for r in rows if r["ms"] is None] == []  # the failed row was measured again
    assert runs[0] == (full[4]["provider"], SHAPES[0][1], full[4]["pass"])
    assert len([r for r in runs if r[0] != "copy"]) == len(full) - 4
    assert runs.count(("copy", SHAPES[0][1])) == 0 and runs.count(("copy", SHAPES[1][1])) == 1
    assert {r["copy_gbps"] for r in rows if r["N"] == SHAPES[0][1]} == {2500.0}
    assert {r["copy_gbps"] for r in rows if r["N"] == SHAPES[1][1]} == {3000.0}
    again, _ = bench.sweep(session, "gpu", ["bfloat16"], SHAPES, ["rms_norm"], path, kept=rows)
    assert again == rows and len(runs) == len(full) - 4 + 1  # nothing left to measure


def _module(monkeypatch, name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def _fake_ours(monkeypatch, torch):
    """A stand-in for layernorm.torch (being written): the eager functions, by name."""
    F = torch.nn.functional

    def add(norm_fn):
        def fn(x, residual, shape, *params, eps):
            h = x + residual
            return norm_fn(h, shape, *params, eps=eps), h
        return fn

    _module(monkeypatch, "layernorm.torch", layer_norm=F.layer_norm, rms_norm=F.rms_norm,
            add_layer_norm=add(F.layer_norm), add_rms_norm=add(F.rms_norm))


COMPILE_WARNING = "ignore:`torch.jit.script_method` is deprecated"  # torch.compile's import


@pytest.mark.filterwarnings(COMPILE_WARNING)
def test_provider_discovery_absent_when_unimportable(monkeypatch):
    """Protects discovery: ours, eager torch and torch.compile for every norm; Liger and QuACK
    absent, with one note each, when they do not import (and ours, when layernorm.torch does
    not)."""
    torch = pytest.importorskip("torch")
    _fake_ours(monkeypatch, torch)
    for name in ("liger_kernel", "quack"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    for norm in NORMS:
        found, notes = measuring.providers_for(norm, 256)
        assert [p.name for p in found] == ["layernorm", "torch", "torch.compile"]
        # --compile-n leaves torch.compile out at other row lengths, and only it
        assert [p.name for p in measuring.providers_for(norm, 256, compiled=False)[0]] == [
            "layernorm", "torch"]
        # and the session asks for it at the row lengths --compile-n names alone
        for compile_ns, N, has in ((frozenset({4096}), 256, False), (frozenset({256}), 256, True),
                                   (None, 256, True)):
            found = measuring.CudaSession.providers(SimpleNamespace(compile_ns=compile_ns),
                                                    norm, N)[0]
            assert ("torch.compile" in [p.name for p in found]) == has
        # neither library has an add + LayerNorm: nothing to miss there
        missed = [] if norm == "add_layer_norm" else ["liger", "quack"]
        assert [n.split(": ")[0] for n in notes] == missed
        assert all("(ModuleNotFoundError: " in n for n in notes)
    monkeypatch.setitem(sys.modules, "layernorm.torch", None)
    found, notes = measuring.providers_for("rms_norm", 256)
    assert [p.name for p in found] == ["torch", "torch.compile"]
    assert notes[0].startswith("layernorm: no rms_norm from layernorm.torch (ModuleNotFoundError")


def _fake_peers(monkeypatch, torch, calls):
    """Liger and QuACK as their current sources define the entry points the benchmark uses,
    computed by eager torch on the CPU; every call's non-tensor arguments go to ``calls``."""
    F = torch.nn.functional

    def fn_class(name, body):
        def apply(*args):
            calls.append((name, [a for a in args if not isinstance(a, torch.Tensor)]))
            return body(*args)
        return type(name, (), {"apply": staticmethod(apply)})

    _module(monkeypatch, "liger_kernel")
    _module(monkeypatch, "liger_kernel.ops")
    _module(monkeypatch, "liger_kernel.ops.layer_norm", LigerLayerNormFunction=fn_class(
        "LigerLayerNormFunction", lambda x, w, b, eps: F.layer_norm(x, w.shape, w, b, eps)))
    _module(monkeypatch, "liger_kernel.ops.rms_norm", LigerRMSNormFunction=fn_class(
        "LigerRMSNormFunction",
        lambda x, w, eps, offset, mode, in_place: F.rms_norm(x, w.shape, w, eps)))

    def fused_add(x, r, w, eps, offset, mode, in_place):
        h = x + r
        return F.rms_norm(h, w.shape, w, eps), h

    _module(monkeypatch, "liger_kernel.ops.fused_add_rms_norm",
            LigerFusedAddRMSNormFunction=fn_class("LigerFusedAddRMSNormFunction", fused_add))

    def rmsnorm(x, weight=None, bias=None, residual=None, out_dtype=None, residual_dtype=None,
                eps=1e-6, prenorm=False, weight_offset=0.0):
        calls.append(("rmsnorm", [eps, prenorm]))
        h = x if residual is None else x + residual
        y = F.rms_norm(h.float(), weight.shape, weight, eps).to(x.dtype)
        return (y, h) if prenorm and residual is not None else y

    def layernorm_fwd(x, weight, bias=None, eps=1e-6, return_rstd=False, return_mean=False):
        calls.append(("layernorm_fwd", [eps, return_rstd, return_mean]))
        assert weight.dtype == bias.dtype == torch.float32  # QuACK asserts it
        xf = x.float()
        mean = xf.mean(-1)
        rstd = torch.rsqrt(((xf - mean[:, None]) ** 2).mean(-1) + eps)
        y = ((xf - mean[:, None]) * rstd[:, None] * weight + bias).to(x.dtype)
        return y, rstd, mean

    def layernorm_bwd(x, weight, dout, rstd, mean, has_bias=True):
        calls.append(("layernorm_bwd", [has_bias]))
        xhat = (x.float() - mean[:, None]) * rstd[:, None]
        g = dout.float() * weight
        dx = rstd[:, None] * (g - g.mean(-1, keepdim=True)
                              - xhat * (g * xhat).mean(-1, keepdim=True))
        return dx.to(x.dtype), (dout.float() * xhat).sum(0), dout.float().sum(0)

    _module(monkeypatch, "quack")
    _module(monkeypatch, "quack.rmsnorm", rmsnorm=rmsnorm, layernorm_fwd=layernorm_fwd,
            layernorm_bwd=layernorm_bwd)


@pytest.mark.filterwarnings(COMPILE_WARNING)
def test_peer_providers_call_the_current_entry_points(monkeypatch):
    """Protects the Liger and QuACK wiring: each is present exactly for the norms it has
    (Liger: LayerNorm, RMSNorm, fused add + RMSNorm; QuACK: rmsnorm with and without a residual,
    layernorm_fwd and layernorm_bwd), called with the arguments their sources take (Liger not
    in place; QuACK's float32 parameters; its layer norm's backward through layernorm_bwd), and
    each passes the reference check forward and backward."""
    torch = pytest.importorskip("torch")
    _fake_ours(monkeypatch, torch)
    calls = []
    _fake_peers(monkeypatch, torch, calls)
    has = {"layer_norm": {"liger", "quack"}, "rms_norm": {"liger", "quack"},
           "add_layer_norm": set(), "add_rms_norm": {"liger", "quack"}}
    g = torch.Generator().manual_seed(0)
    for norm, peers in has.items():
        found, notes = measuring.providers_for(norm, 64)
        assert notes == []
        by = {p.name: p for p in found}
        assert set(by) == {"layernorm", "torch", "torch.compile", *peers}
        nm = NORMS[norm]
        inputs = [torch.randn(8, 64, generator=g) for _ in nm.forward_inputs]
        params = [1 + 0.1 * torch.randn(64, generator=g), 0.1 * torch.randn(64, generator=g)]
        cot = [torch.randn(8, 64, generator=g) for _ in nm.forward_outputs]
        for name in peers:
            assert by[name].fp32_params == (name == "quack")
            for pass_ in bench.PASSES:
                fn, mismatch = measuring.prepare(by[name], norm, "float32", inputs,
                                             params[:len(nm.params)], cot, pass_)
                assert mismatch is None, (name, norm, pass_, mismatch)
                fn()
    eps = {n: NORMS[n].eps for n in NORMS}
    assert ("LigerRMSNormFunction", [eps["rms_norm"], 0.0, "llama", False]) in calls
    assert ("LigerFusedAddRMSNormFunction", [eps["add_rms_norm"], 0.0, "llama", False]) in calls
    assert ("LigerLayerNormFunction", [eps["layer_norm"]]) in calls
    assert ("rmsnorm", [eps["add_rms_norm"], True]) in calls
    assert ("layernorm_fwd", [eps["layer_norm"], True, True]) in calls
    assert ("layernorm_bwd", [True]) in calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("norm", list(NORMS))
def test_prepare_checks_every_norm_forward_and_backward(norm, dtype):
    """Protects the correctness gate of every norm: eager torch passes the reference check on
    the first rows, forward (y, and h) and backward (dx, and dresidual, through autograd.grad
    with dy and dh), and the call returned is the pass (the outputs, or every gradient); a
    provider wrong in y, h or dx is caught and the output named."""
    torch = pytest.importorskip("torch")
    nm = NORMS[norm]
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(8, 96, generator=g).to(dt) for _ in nm.forward_inputs]
    params = [(1 + 0.1 * torch.randn(96, generator=g)).to(dt),
              (0.1 * torch.randn(96, generator=g)).to(dt)][:len(nm.params)]
    cot = [torch.randn(8, 96, generator=g).to(dt) for _ in nm.forward_outputs]
    eager = measuring._eager(norm, 96, nm.eps)
    right = bench.Provider("torch", eager)
    fwd, mismatch = measuring.prepare(right, norm, dtype, inputs, params, cot, "fwd")
    assert mismatch is None and len(measuring._as_tuple(fwd())) == len(nm.forward_outputs)
    bwd, mismatch = measuring.prepare(right, norm, dtype, inputs, params, cot, "bwd")
    assert mismatch is None and len(bwd()) == len(inputs) + len(params)

    def wrong_y(*a):
        out = measuring._as_tuple(eager(*a))
        return (out[0] * 2, *out[1:])

    def wrong_h(*a):
        y, h = eager(*a)
        return y, h + 1

    def wrong_dx(*a):  # right forward, zero gradient for x (and residual)
        k = len(nm.forward_inputs)
        out = measuring._as_tuple(eager(*(t.detach() for t in a[:k]), *a[k:]))
        zero = sum(0 * t for t in a[:k])
        return tuple(o + zero for o in out)

    wrongs = [("y", wrong_y, "fwd"), ("dx", wrong_dx, "bwd")]
    if nm.residual:
        wrongs.append(("h", wrong_h, "fwd"))
    for name, fn, pass_ in wrongs:
        _, mismatch = measuring.prepare(bench.Provider("wrong", fn), norm, dtype, inputs, params,
                                    cot, pass_)
        assert mismatch is not None and mismatch.startswith(f"{name}:"), (name, mismatch)


def test_run_cuda_without_a_gpu(capsys, tmp_path, monkeypatch):
    """Protects `layernorm bench --device cuda` on a machine without CUDA: a clear message and
    exit status 2, nothing written."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: run_cuda would measure")
    monkeypatch.chdir(tmp_path)
    args = SimpleNamespace(dtype=None, shape=None, quick=True, out=None, rounds=None,
                           resume=False)
    assert command.run_cuda(args) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "bench").exists()


def test_cli_without_a_gpu_fails_cleanly(tmp_path):
    """Protects the command line itself without CUDA: `python -m layernorm bench --device cuda`
    exits with status 2 and one line on stderr naming the command and the option, no
    traceback, no file."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the command would measure")
    env = {**os.environ, "PYTHONPATH": SRC}
    res = subprocess.run([sys.executable, "-m", "layernorm", "bench", "--device", "cuda"],
                         capture_output=True, text=True, check=False, cwd=tmp_path, env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("layernorm bench: error: argument --device: no CUDA device")
    assert len(res.stderr.splitlines()) == 1 and res.stdout == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [["--resume"], ["--device", "cuda", "--resume"],
                                  ["--device", "cuda", "--resume", "--out", "results"]])
def test_resume_needs_a_cuda_results_file(argv, tmp_path, capsys, monkeypatch):
    """Protects --resume from a silent fresh run: without --device cuda and an --out .json
    file to resume it is a one-line mistake, exit status 2, nothing written."""
    from layernorm.commands import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("layernorm bench: error: argument --resume: needs --device cuda")
    assert len(err.splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_compile_n_needs_cuda(tmp_path, capsys, monkeypatch):
    """Protects --compile-n from being ignored: it chooses the row lengths of the GPU
    benchmark's torch.compile peer, so without --device cuda it is a one-line mistake, exit
    status 2, nothing written; a row length that is not a positive count is refused too."""
    from layernorm.commands import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--compile-n", "4096"]) == 2
    err = capsys.readouterr().err
    assert err == "layernorm bench: error: argument --compile-n: only with --device cuda\n"
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "--device", "cuda", "--compile-n", "0"])
    assert stop.value.code == 2 and "argument --compile-n" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_kept_rows_of_this_device_only(tmp_path, monkeypatch):
    """Protects a resumed file from mixing devices: its rows are kept only if they were
    measured on this device; a file that is not rows, or another device's, is refused."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert bench.kept_rows(tmp_path / "none.json") == []
    path = bench.write_results(_rows(), tmp_path / "r.json", "x")
    assert bench.kept_rows(path) == _rows()
    bench.write_results(_rows("NVIDIA A100-SXM4-80GB"), path, "x")
    with pytest.raises(ValueError, match="rows measured on NVIDIA A100-SXM4-80GB, not on this "
                                         "NVIDIA H100"):
        bench.kept_rows(path)
    path.write_text("{}")
    with pytest.raises(ValueError, match="expected a JSON list"):
        bench.kept_rows(path)


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
