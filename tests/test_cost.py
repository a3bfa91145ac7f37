"""The cost model agrees with measurement: tracemalloc peaks and the cache's nbytes."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import layernorm as ln
from layernorm import cost

RNG = np.random.default_rng(3)


def _dtype(name):
    if name == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.dtype(name)


def _peak(fn, *args):
    """Peak bytes traced while fn runs, beyond what was allocated before it.

    fn runs once untraced first: the first call in a process imports numpy.ma (NumPy loads
    it lazily; validation refuses masked arrays), about 1 MB that is not the model's business.
    """
    fn(*args)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = fn(*args)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return peak, out


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(512, 256), (64, 4096)])
def test_reference_peak_memory_matches_model(dtype, affine, shape):
    """Protects the memory model: measured peaks of forward and backward within 10%."""
    dt = _dtype(dtype)
    m, d = shape
    x = RNG.standard_normal(shape).astype(dt)
    dy = RNG.standard_normal(shape).astype(dt)
    g = RNG.standard_normal(d).astype(dt) if affine else None
    b = RNG.standard_normal(d).astype(dt) if affine else None
    item = np.dtype(dt).itemsize

    peak_f, (y, cache) = _peak(ln.layer_norm_forward, x, g, b)
    model_f = cost.cost("fwd", m, d, item, gamma=affine, beta=affine)
    assert abs(peak_f - model_f.reference_peak_bytes) <= 0.10 * model_f.reference_peak_bytes

    peak_b, _ = _peak(ln.layer_norm_backward, dy, cache)
    model_b = cost.cost("bwd", m, d, item, gamma=affine, beta=affine)
    assert abs(peak_b - model_b.reference_peak_bytes) <= 0.10 * model_b.reference_peak_bytes


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_cache_nbytes_equals_model(dtype):
    """Protects the cache model: xhat (M·D) and rstd (M) in the compute dtype, exactly."""
    x = RNG.standard_normal((3, 7, 33)).astype(dtype)
    _, cache = ln.layer_norm_forward(x, np.ones(33, dtype), np.zeros(33, dtype))
    model = cost.cost("fwd", 21, 33, np.dtype(dtype).itemsize)
    assert cache.nbytes == model.cache_bytes


def test_minimal_bytes_and_flops():
    """Protects the headline byte formulas (2·M·D·s fwd, 3·M·D·s bwd) and Θ(M·D) FLOPs."""
    assert cost.minimal_bytes("fwd", 1000, 512, 2) == 2 * 1000 * 512 * 2
    assert cost.minimal_bytes("bwd", 1000, 512, 4) == 3 * 1000 * 512 * 4
    assert cost.minimal_bytes("bwd", 10, 8, 4, extras=True) == 3 * 80 * 4 + 4 * 8 * 4 + 80
    c1, c2 = cost.cost("fwd", 100, 64, 4), cost.cost("fwd", 200, 128, 4)
    assert c2.flops == pytest.approx(4 * c1.flops, rel=0.01)
    assert c1.intensity < 2  # about one FLOP per byte: bandwidth-bound


def test_reference_moves_several_times_the_minimal_bytes():
    """Protects the pass count: the unfused reference is 8.5x (fwd) and 6.7x (bwd) minimal."""
    f = cost.cost("fwd", 64, 1024, 4)
    b = cost.cost("bwd", 64, 1024, 4)
    assert f.reference_traffic_ratio == pytest.approx(17 / 2)
    assert b.reference_traffic_ratio == pytest.approx(20 / 3)


def test_roofline():
    """Protects the roofline: bandwidth-bound unless FLOPs dominate."""
    assert cost.roofline_seconds(1e9, 1e9, 1e10) == pytest.approx(0.1)
    assert cost.roofline_seconds(1e9, 1e12, 1e10, peak_flops=1e12) == pytest.approx(1.0)
    c = cost.cost("bwd", 4096, 4096, 2)
    assert c.roofline_seconds(1e12) == pytest.approx(3 * 4096 * 4096 * 2 / 1e12)
    with pytest.raises(ValueError, match="bandwidth"):
        cost.roofline_seconds(1, 1, 0)


def test_bad_arguments():
    """Protects clear errors for a pass, itemsize or size the model does not know."""
    with pytest.raises(ValueError, match="pass_"):
        cost.cost("sideways", 1, 1, 4)
    with pytest.raises(ValueError, match="itemsize"):
        cost.cost("fwd", 1, 1, 3)
    with pytest.raises(ValueError, match="D >= 1"):
        cost.cost("fwd", 1, 0, 4)


def test_cost_command_prints_the_model(capsys):
    """Protects `layernorm cost`: one row per shape, dtype and pass, figures from the model."""
    from layernorm.commands import cli
    from layernorm.commands import cost as command

    assert cli.main(["cost", "--shape", "8x512x768", "--dtype", "float32", "--bandwidth",
                     "40"]) == 0
    out = capsys.readouterr().out
    c = cost.cost("fwd", 4096, 768, 4)
    assert f"| 8x512x768 | float32 | fwd | {c.flops / 1e9:.3f} |" in out
    assert f"{c.roofline_seconds(40e9) * 1e3:.3f}" in out
    assert out.count("| 8x512x768 |") == 2
    with pytest.raises(ValueError, match="shape must look like"):
        command.table(["4096 by 1024"], ["float32"], None)
