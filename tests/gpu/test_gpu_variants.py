"""tools/gpu_variants.py's parts that need no GPU: the variant specs, the knobs, the table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
try:
    import gpu_variants
finally:
    sys.path.remove(str(TOOLS))


def test_parse_variant():
    """Protects the variant specs: NAME:KNOB=VALUE,... gives the settings; no name, an unknown
    knob or a value that is not a positive integer is refused, naming it."""
    assert gpu_variants.parse_variant("bwd8k:MAX_SHORT_D_BWD=8192,PROGRAMS_PER_SM=2") == (
        "bwd8k", {"MAX_SHORT_D_BWD": 8192, "PROGRAMS_PER_SM": 2})
    for bad, match in (("MAX_SHORT_D_BWD=8192", "expected NAME:"), (":LONG_BLOCK=4", "NAME"),
                       ("x:BLOCK=4", "unknown knob 'BLOCK'"), ("x:LONG_BLOCK=0", "positive"),
                       ("x:LONG_BLOCK=2k", "positive"), ("x:LONG_BLOCK", "positive")):
        with pytest.raises(ValueError, match=match):
            gpu_variants.parse_variant(bad)


def test_knobs_are_the_kernels_tuning_constants():
    """Protects the knobs from drifting from the kernels: each is an integer constant of
    layernorm.gpu.launch, and settings_of sets them inside its block and restores them."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from layernorm.gpu import launch

    before = {k: getattr(launch, k) for k in gpu_variants.KNOBS}
    assert all(isinstance(v, int) and v > 0 for v in before.values())
    with gpu_variants.settings_of(launch, {"MAX_SHORT_D_BWD": 8192}):
        assert launch.MAX_SHORT_D_BWD == 8192 and not launch.plan("bwd", 8192).long
    assert {k: getattr(launch, k) for k in gpu_variants.KNOBS} == before


def test_table_shows_each_variant_against_copy():
    """Protects the printed table: one line per (norm, dtype, pass, N), each variant's
    fraction of the copy bandwidth, 'err' for a failed one and '-' for one not measured."""
    def row(provider, gbps, ms=1.0):
        return {"norm": "rms_norm", "dtype": "bfloat16", "pass": "bwd", "N": 8192,
                "provider": provider, "gbps": gbps, "ms": ms, "copy_gbps": 3000.0}

    lines = gpu_variants.format_lines(
        [row("layernorm[default]", 1800.0), row("layernorm[bwd8k]", None, ms=None)],
        ["default", "bwd8k", "other"])
    assert len(lines) == 2
    assert lines[1].split() == ["rms_norm", "bfloat16", "bwd", "8192", "3000", "0.600", "err",
                                "-"]


def test_measure_sets_each_variant_while_it_runs(tmp_path):
    """Protects the measuring loop: each (N, norm, pass) runs every variant with the kernels'
    constants set to its settings (and restored after), a variant that raises is a row with
    null ms while the others go on, and the rows are written to the file."""
    from types import SimpleNamespace

    from layernorm.bench import gpu

    launch = SimpleNamespace(LONG_BLOCK=4096)
    seen = []

    class Session:
        def copy_gbps(self, dtype, M, N):
            return 3000.0

        def run(self, prov, norm, dtype, M, N, pass_):
            seen.append((prov.name, pass_, launch.LONG_BLOCK))
            if prov.name == "layernorm[small]" and pass_ == "bwd":
                raise RuntimeError("out of resources: shared memory")
            return gpu.Measured([0.2, 0.1, 0.3], "cuda_graph")

        def release(self):
            pass

    out = tmp_path / "v.json"
    rows = gpu_variants.measure(Session(), launch, "gpu", "bfloat16", [8192], ["rms_norm"],
                                {"default": {}, "small": {"LONG_BLOCK": 1024}}, out)
    assert seen == [("layernorm[default]", "fwd", 4096), ("layernorm[small]", "fwd", 1024),
                    ("layernorm[default]", "bwd", 4096), ("layernorm[small]", "bwd", 1024)]
    assert launch.LONG_BLOCK == 4096
    assert [(r["provider"], r["pass"], r["ms"]) for r in rows] == [
        ("layernorm[default]", "fwd", 0.2), ("layernorm[small]", "fwd", 0.2),
        ("layernorm[default]", "bwd", 0.2), ("layernorm[small]", "bwd", None)]
    assert json.loads(out.read_text()) == rows
