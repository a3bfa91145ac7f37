"""The short GPU call's parts that run without a GPU: the tests each of its steps selects
(``pytest tests/gpu -m STEP``, tests/gpu/conftest.py), the log of test outcomes it keeps as it
goes, the decode timing tool (tools/gpu_decode.py) on CPU tensors, and tools/gpu_session.sh's
refusal of an unknown step."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from layernorm.family import NORMS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}

# prints {nodeid: [its quick steps]} of tests/gpu, collected as pytest -m would see them
COLLECT = """
import json, sys, pytest
class Steps:
    def pytest_collection_finish(self, session):
        steps = ("gpu_oracle", "gpu_invariance", "gpu_scale")
        print("STEPS", json.dumps({i.nodeid: [m.name for m in i.iter_markers()
                                               if m.name in steps] for i in session.items}))
sys.exit(pytest.main(["tests/gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
                     plugins=[Steps()]))
"""


@pytest.fixture(scope="module")
def steps() -> dict[str, list[str]]:
    res = subprocess.run([sys.executable, "-c", COLLECT], capture_output=True, text=True,
                         cwd=ROOT, env=ENV, check=False)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("STEPS ")), None)
    assert res.returncode == 0 and line, res.stdout[-2000:] + res.stderr[-2000:]
    return json.loads(line[len("STEPS "):])


def _chosen(steps, step):
    return [test for test, marks in steps.items() if step in marks]


def test_the_oracle_step_covers_every_norm_and_mode_in_both_dtypes(steps):
    """Protects step (1) of the short call: every norm, short and long rows, in bfloat16 and
    float32, against the float64 oracle through the launchers, the memory-efficient backward,
    the quantized output and the PyTorch API's Triton path; and no float16 or float64 case,
    which would spend the call's minutes on what models do not train in."""
    oracle = _chosen(steps, "gpu_oracle")
    for name in NORMS:
        for dtype in ("bfloat16", "float32"):
            for path in ("short", "long"):
                for test in ("test_gpu.py::test_family_matches_the_oracle",
                             "test_gpu_memory_efficient.py::test_matches_the_reference"):
                    assert f"tests/gpu/{test}[{path}-{name}-{dtype}]" in oracle
            assert (f"tests/gpu/test_gpu_torch.py::test_the_triton_path_matches_the_float64_"
                    f"oracle[{dtype}-{name}]") in oracle
    quant = [t for t in oracle if "test_scales_and_q_match_the_float64_oracle" in t]
    assert len(quant) == 2 * 2 * 3 * 2 * 2  # path, dtype, group, output dtype, norm
    assert not [t for t in oracle if re.search(r"(?<!b)float16|float64", t.split("[")[1])]


def test_the_other_steps_and_their_sizes(steps):
    """Protects steps (2) and (3): bit-identical reruns and batch invariance, on the small
    grids and at 2**27 elements on the real one; then exactly one bfloat16 problem past 2**31
    elements; and no test in two steps, none outside tests/gpu's GPU tests."""
    invariance = _chosen(steps, "gpu_invariance")
    for name in NORMS:
        for N in (4096, 65536):
            for test in ("test_bit_identical_at_scale", "test_batch_invariant_at_scale"):
                assert f"tests/gpu/test_gpu_scale.py::{test}[{name}-{N}]" in invariance
    assert sum("test_deterministic" in t for t in invariance) == 8
    assert sum("test_batch_invariance" in t for t in invariance) == 4
    assert _chosen(steps, "gpu_scale") == [
        "tests/gpu/test_gpu_scale.py::test_offsets_past_two_to_the_31[add_rms_norm-4096]"]
    assert all(len(marks) <= 1 for marks in steps.values())
    chosen = {t for t, marks in steps.items() if marks}
    assert 150 < len(chosen) < 300 and not [t for t in chosen if "bench" in t or "compile" in t]


def _gpu_conftest():
    """tests/gpu/conftest.py as a module of its own (its hooks called directly)."""
    spec = importlib.util.spec_from_file_location("gpu_conftest", Path(__file__).with_name(
        "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_rule_that_matches_nothing_is_an_error():
    """Protects the steps from losing a test unseen: a test renamed (or a parameter) so that
    its rule matches nothing in a file collected whole stops the run with a usage error
    naming the rule; a file not collected, or named with a node id, is not checked."""
    conftest = _gpu_conftest()

    def item(file, test, **params):
        marks = []
        return SimpleNamespace(path=Path("tests/gpu") / file, originalname=test,
                               callspec=SimpleNamespace(params=params), marks=marks,
                               add_marker=marks.append)

    def scale_file(offsets_test):
        return [item("test_gpu_scale.py", name, name="add_rms_norm", N=4096)
                for name in ("test_bit_identical_at_scale", "test_batch_invariant_at_scale",
                             offsets_test)]

    whole = SimpleNamespace(args=["tests/gpu"])
    items = scale_file("test_offsets_past_two_to_the_31")
    conftest.pytest_collection_modifyitems(whole, items)  # only that file: its rules hold
    assert [i.marks for i in items] == [["gpu_invariance"], ["gpu_invariance"], ["gpu_scale"]]
    with pytest.raises(pytest.UsageError, match="gpu_scale: no test test_gpu_scale.py::test_off"):
        conftest.pytest_collection_modifyitems(whole, scale_file("test_offsets_past_int32"))
    # a file a node id picks tests from is not checked: the rest of it was not collected
    one = SimpleNamespace(args=["tests/gpu/test_gpu_scale.py::test_bit_identical_at_scale"])
    conftest.pytest_collection_modifyitems(one, scale_file("test_offsets_past_int32")[:1])


def test_the_log_keeps_each_outcome_as_it_comes(tmp_path):
    """Protects the short call's test record: with LAYERNORM_TEST_LOG set, each test's
    outcome (a failure with its message's last line, a skip in setup with its reason) is one
    JSON line, written when the test ends, in the main process only under xdist."""
    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "def test_passes():\n    assert 1 + 1 == 2\n"
        "def test_fails():\n    assert 1 + 1 == 3, 'arithmetic'\n"
        "@pytest.mark.skip(reason='not here')\ndef test_skipped():\n    pass\n")
    (tmp_path / "conftest.py").write_text(Path(__file__).with_name("conftest.py").read_text())
    log = tmp_path / "log.jsonl"
    res = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path), "-q", "-n", "2",
                          "-p", "no:cacheprovider"], capture_output=True, text=True,
                         cwd=tmp_path, check=False, env={**ENV, "LAYERNORM_TEST_LOG": str(log)})
    assert res.returncode == 1, res.stdout + res.stderr
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    got = {line["test"].split("::")[-1]: line for line in lines}
    assert len(lines) == 3 and set(got) == {"test_passes", "test_fails", "test_skipped"}
    assert got["test_passes"]["outcome"] == "passed" and got["test_passes"]["message"] == ""
    assert got["test_fails"]["outcome"] == "failed"
    assert "arithmetic" in got["test_fails"]["message"]
    assert got["test_skipped"]["outcome"] == "skipped in setup"
    assert "not here" in got["test_skipped"]["message"]


def _decode_tool():
    spec = importlib.util.spec_from_file_location("gpu_decode", ROOT / "tools" /
                                                  "gpu_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_decode_tool_on_cpu_tensors(tmp_path, monkeypatch):
    """Protects tools/gpu_decode.py end to end where no GPU is: each (norm, M) gets a row per
    provider that imports, checked against the reference before timing (a provider whose
    output is wrong gets an error row, not a time); the rows go to --out as JSON with the
    run's metadata; the table puts ours over torch eager."""
    from layernorm.bench import gpu, gpu_measure

    tool = _decode_tool()
    real = gpu_measure.providers_for

    def with_a_wrong_one(norm, N, compiled=True):
        found, notes = real(norm, N, compiled)
        found = [p for p in found if p.name in ("layernorm", "torch")]

        def wrong(*args):  # y off by 0.5
            out = found[1].fn(*args)
            return (out[0] + 0.5, out[1]) if isinstance(out, tuple) else out + 0.5
        return [*found, gpu.Provider("wrong", wrong)], notes

    monkeypatch.setattr(gpu_measure, "providers_for", with_a_wrong_one)
    out = tmp_path / "decode.json"
    assert tool.main(["--device", "cpu", "--calls", "2", "--rounds", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["device"] == "cpu" and data["meta"]["calls"] == 2
    rows = data["rows"]
    assert len(rows) == len(tool.NORMS) * len(tool.ROWS) * 3
    for r in rows:
        assert r["mode"] == "eager" and r["N"] == 4096 and r["dtype"] == "bfloat16"
        if r["provider"] == "wrong":
            assert r["error"].startswith("AssertionError: differs from the reference: y:")
        else:
            assert r["p20"] <= r["us"] <= r["p80"] and r["us"] > 0


def test_the_decode_table_says_the_goal_under_graph_replay():
    """Protects the decode verdict: ours over torch eager per call under graph replay, met at
    most 1.2x and missed above; no verdict for eager calls; each provider's launch cost is
    eager minus graph."""
    tool = _decode_tool()
    rows = []
    for norm in tool.NORMS:
        for M in tool.ROWS:
            ours_graph = 3.0 if norm == "rms_norm" else 4.0
            for provider, mode, us in (("layernorm", "eager", 20.0), ("torch", "eager", 10.0),
                                       ("layernorm", "graph", ours_graph),
                                       ("torch", "graph", 3.0)):
                rows.append({"norm": norm, "M": M, "provider": provider, "mode": mode,
                             "us": us})
    lines = tool.table(rows).splitlines()
    rms = [ln.split() for ln in lines if ln.split()[:1] == ["rms_norm"]]
    layer = [ln.split() for ln in lines if ln.split()[:1] == ["layer_norm"]]
    assert ["rms_norm", "1", "eager", "20.00", "10.00", "2.00x", "-"] in rms
    assert ["rms_norm", "1", "graph", "3.00", "3.00", "1.00x", "met"] in rms
    assert ["layer_norm", "8", "graph", "4.00", "3.00", "1.33x", "missed"] in layer
    assert ["rms_norm", "1", "launch", "(eager", "-", "graph)", "17.00", "7.00"] in rms


def test_the_decode_tool_without_cuda_says_so():
    """Protects tools/gpu_decode.py on a machine without CUDA: one line and exit status 2."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the tool would measure")
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_decode.py")],
                         capture_output=True, text=True, env=ENV, check=False)
    assert res.returncode == 2 and res.stderr == "tools/gpu_decode.py: no CUDA device here\n"


def test_the_session_script_refuses_an_unknown_step(tmp_path):
    """Protects tools/gpu_session.sh from spending a GPU call on a typo: an unknown step is
    its usage line and exit status 2 before anything is installed or run."""
    res = subprocess.run(["bash", str(ROOT / "tools" / "gpu_session.sh"), "quik"],
                         capture_output=True, text=True, check=False,
                         env={**os.environ, "OUT": str(tmp_path / "out")})
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("usage: tools/gpu_session.sh tests|") and "quick" in res.stderr


def test_the_decode_tool_keeps_each_row_as_it_comes(tmp_path, monkeypatch):
    """Protects the decode step's results from its time limit: --out is rewritten after
    every row, so a run stopped part way keeps the rows it measured."""
    tool = _decode_tool()
    done = []

    def stops_at_the_third(fn, calls, rounds, sync):
        if len(done) == 2:
            raise KeyboardInterrupt  # as the step's time limit would stop it
        done.append(1)
        return [1.0, 2.0, 3.0]

    monkeypatch.setattr(tool, "_per_call_eager", stops_at_the_third)
    out = tmp_path / "decode.json"
    with pytest.raises(KeyboardInterrupt):
        tool.main(["--device", "cpu", "--calls", "1", "--rounds", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["norm"], r["M"], r["provider"], r["us"]) for r in rows] == [
        ("rms_norm", 1, "layernorm", 2.0), ("rms_norm", 1, "torch", 2.0)]


def _pack(tmp_path, files: dict[str, bytes]) -> tuple[Path, Path, Path]:
    """A tar.xz of ``files`` split in two halves, with its sha256sum line, as
    tools/gpu_wheels.sh packs QuACK's site."""
    import hashlib
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    whole = buf.getvalue()
    first, second = tmp_path / "site.tar.xz.part00", tmp_path / "site.tar.xz.part01"
    first.write_bytes(whole[:len(whole) // 2])
    second.write_bytes(whole[len(whole) // 2:])
    sums = tmp_path / "site.tar.xz.sha256"
    sums.write_text(f"{hashlib.sha256(whole).hexdigest()}  site.tar.xz\n")
    return first, second, sums


def test_the_packed_site_unpacks_only_when_whole(tmp_path):
    """Protects the peers' arrival on the GPU machine (tools/gpu_unpack.py, which
    tools/gpu_session.sh runs once both halves are there): the halves joined unpack to the
    packed files; a half that is not the packed one is refused with one line, exit status 1,
    nothing unpacked; a wrong command line is its usage, exit status 2."""
    tool = ROOT / "tools" / "gpu_unpack.py"
    files = {"quack/__init__.py": b"VERSION = 1\n", "nvidia_cutlass_dsl/lib.so": bytes(range(256))}
    first, second, sums = _pack(tmp_path, files)

    def run(*args):
        return subprocess.run([sys.executable, str(tool), *map(str, args)], capture_output=True,
                              text=True, check=False)

    site = tmp_path / "site"
    res = run(first, second, sums, site)
    assert res.returncode == 0, res.stderr
    assert {p.relative_to(site).as_posix(): p.read_bytes() for p in site.rglob("*")
            if p.is_file()} == files
    other = tmp_path / "other"
    other.mkdir()
    _, wrong, _ = _pack(other, {"quack/__init__.py": b"VERSION = 2\n"})
    res = run(first, wrong, sums, tmp_path / "refused")
    assert res.returncode == 1 and len(res.stderr.splitlines()) == 1
    assert "do not match the SHA-256" in res.stderr and not (tmp_path / "refused").exists()
    res = run(first, second)
    assert res.returncode == 2 and res.stderr.startswith("usage: tools/gpu_unpack.py")
