"""The fused CPU kernels (layernorm.cpu, the C++ engine) against the NumPy reference, and
their contracts."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")

from layernorm import cpu, reference  # noqa: E402 - after the skip
from layernorm.family import NORMS  # noqa: E402
from layernorm.tolerances import assert_close  # noqa: E402

LN = NORMS["layer_norm"]

HALF = ["float16"]
try:
    import ml_dtypes  # noqa: F401

    HALF.append("bfloat16")
except ImportError:
    pass


def _bits(arrays):
    """The bytes of each array (None stays None); a dict's values in order."""
    arrays = arrays.values() if isinstance(arrays, dict) else arrays
    return [None if a is None else a.tobytes() for a in arrays]


@pytest.mark.parametrize("dtype", ["float32", "float64", *HALF])
def test_matches_reference_per_dtype(dtype, family_inputs, run_norm, float64_oracle,
                                     results_close):
    """Protects the fused results: y, dx, dgamma, dbeta within the dtype's tolerance, ragged D."""
    (x, g, b), (dy,) = family_inputs(LN, (3, 37, 769), dtype)
    got = run_norm(cpu, LN, [x, g, b], [dy])
    assert all(a.dtype == x.dtype for a in got.values())
    assert got["y"].shape == x.shape and got["dx"].shape == x.shape
    results_close(got, float64_oracle(LN, [x, g, b], [dy]).results, dtype)


@pytest.mark.parametrize("d", [1, 2, 7, 100, 1023, 1025, 3000])
def test_row_lengths_around_the_block_sizes(d, family_inputs, run_norm, float64_oracle,
                                            results_close):
    """Protects the blocked sums' edges: D below, at and across BLOCK and SPAN boundaries."""
    (x, g, b), (dy,) = family_inputs(LN, (9, d), "float32")
    results_close(run_norm(cpu, LN, [x, g, b], [dy]),
                  float64_oracle(LN, [x, g, b], [dy]).results, "float32")


def test_large_mean_small_spread_keeps_float32_accuracy(family_inputs, run_norm, float64_oracle,
                                                        results_close):
    """Protects the correction pass: x = 1000 + N(0, 0.01), ragged D = 769 (QuACK's case)."""
    (x, g, b), (dy,) = family_inputs(LN, (64, 769), "float32", loc=1000.0, spread=0.01)
    results_close(run_norm(cpu, LN, [x, g, b], [dy]),
                  float64_oracle(LN, [x, g, b], [dy]).results, "float32")


def test_rows_whose_float32_sums_overflow(family_inputs, run_norm, float64_oracle, results_close):
    """Protects the scaled float64 path: |x| ~ 1e20 and +-3e38 rows, where float32 sums overflow."""
    (x, g, b), (dy,) = family_inputs(LN, (4, 300), "float32")
    x[0] *= np.float32(1e20)
    x[1] = 3e38
    x[1, ::2] = -3e38
    got = run_norm(cpu, LN, [x, g, b], [dy])
    assert all(np.all(np.isfinite(a)) for a in got.values())
    results_close(got, float64_oracle(LN, [x, g, b], [dy]).results, "float32")


@pytest.mark.parametrize("dtype, value", [("float32", 0.1), ("float32", -3e38),
                                          ("float64", 1.5e308), ("float64", 7.0)])
def test_constant_rows_match_the_reference(dtype, value, family_inputs, run_norm, float64_oracle,
                                           results_close):
    """Protects constant rows, up to the top of the range: xhat = 0 exactly, so y = beta and
    dgamma = 0 exactly (no tolerance: nothing is rounded)."""
    (x, g, b), (dy,) = family_inputs(LN, (3, 77), dtype)
    x[...] = value
    got = run_norm(cpu, LN, [x, g, b], [dy])
    np.testing.assert_array_equal(got["y"], np.broadcast_to(b, x.shape))
    np.testing.assert_array_equal(got["dgamma"], np.zeros_like(g))
    results_close(got, float64_oracle(LN, [x, g, b], [dy]).results, dtype)


def test_nan_row_stays_nan_and_others_are_unaffected(family_inputs, run_norm, float64_oracle,
                                                     results_close):
    """Protects NaN propagation: a NaN in one row gives NaN in that row only."""
    (x, g, b), (dy,) = family_inputs(LN, (3, 50), "float32")
    x[1, 7] = np.nan
    got = run_norm(cpu, LN, [x, g, b], [dy])
    assert np.all(np.isnan(got["y"][1])) and np.all(np.isnan(got["dx"][1]))
    want = float64_oracle(LN, [x[[0, 2]], g, b], [dy[[0, 2]]]).results
    results_close({k: got[k][[0, 2]] for k in ("y", "dx")},
                  {k: want[k] for k in ("y", "dx")}, "float32")


@pytest.mark.parametrize("has_gamma", [True, False])
@pytest.mark.parametrize("has_beta", [True, False])
def test_gamma_and_beta_optional_independently(has_gamma, has_beta, family_inputs, run_norm,
                                               float64_oracle, results_close):
    """Protects the optional parameters: dgamma/dbeta are None exactly when absent."""
    (x, g, b), (dy,) = family_inputs(LN, (5, 64), "float32")
    g = g if has_gamma else None
    b = b if has_beta else None
    got = run_norm(cpu, LN, [x, g, b], [dy])
    assert (got["dgamma"] is None) == (not has_gamma)
    assert (got["dbeta"] is None) == (not has_beta)
    results_close(got, float64_oracle(LN, [x, g, b], [dy]).results, "float32")


def test_parameter_dtypes_follow_the_reference(family_inputs, run_norm):
    """Protects dtypes: float64 gamma/beta with float32 x give float64 dgamma/dbeta."""
    (x, g, b), (dy,) = family_inputs(LN, (4, 16), "float32")
    got = run_norm(cpu, LN, [x, g.astype(np.float64), b.astype(np.float16)], [dy])
    assert got["y"].dtype == np.float32 and got["dgamma"].dtype == np.float64
    assert got["dbeta"].dtype == np.float16


def test_d_equals_1(family_inputs, run_norm, float64_oracle, results_close):
    """Protects D = 1: xhat = 0, so y = beta and dx = 0 exactly."""
    (x, g, b), (dy,) = family_inputs(LN, (6, 1), "float32")
    got = run_norm(cpu, LN, [x, g, b], [dy])
    np.testing.assert_array_equal(got["y"], np.broadcast_to(b, x.shape))
    np.testing.assert_array_equal(got["dx"], np.zeros_like(x))
    results_close(got, float64_oracle(LN, [x, g, b], [dy]).results, "float32")


def test_zero_rows(family_inputs, run_norm):
    """Protects M = 0: empty y and dx, zero dgamma and dbeta."""
    (x, g, b), (dy,) = family_inputs(LN, (0, 8), "float32")
    y, dx, dg, db = run_norm(cpu, LN, [x, g, b], [dy]).values()
    assert y.shape == (0, 8) and dx.shape == (0, 8)
    np.testing.assert_array_equal(dg, np.zeros(8, np.float32))
    np.testing.assert_array_equal(db, np.zeros(8, np.float32))


def test_non_contiguous_inputs_give_the_contiguous_results(family_inputs, run_norm):
    """Protects strided and transposed inputs: same bits as their contiguous copies."""
    (x, g, b), (dy,) = family_inputs(LN, (40, 130), "float32")
    xs = x[:, ::2]  # (40, 65) strided rows
    dys = dy[:, ::2]
    gs, bs = g[::2], b[::2]
    contiguous = [np.ascontiguousarray(a) for a in (xs, gs, bs)]
    assert _bits(run_norm(cpu, LN, [xs, gs, bs], [dys])) == \
        _bits(run_norm(cpu, LN, contiguous, [np.ascontiguousarray(dys)]))
    xt = x.T  # (130, 40) Fortran order
    (_, gt, bt), _ = family_inputs(LN, (40,), "float32")
    _, (dyt,) = family_inputs(LN, (130, 40), "float32", seed=3)
    assert _bits(run_norm(cpu, LN, [xt, gt, bt], [dyt])) == \
        _bits(run_norm(cpu, LN, [np.ascontiguousarray(xt), gt, bt], [dyt]))


@pytest.mark.parametrize("name", list(NORMS))
def test_bitwise_deterministic_run_to_run_and_across_alignment(name, family_inputs, run_norm):
    """Protects determinism for every norm: two runs, and x at another address alignment, give
    equal bits."""
    norm = NORMS[name]
    args, cot = family_inputs(norm, (300, 1500), "float32")
    first = _bits(run_norm(cpu, norm, args, cot))
    assert _bits(run_norm(cpu, norm, args, cot)) == first
    x = args[0]
    buf = np.empty(x.size + 1, np.float32)
    shifted = buf[1:].reshape(x.shape)  # 4 bytes off the original alignment
    shifted[...] = x
    assert _bits(run_norm(cpu, norm, [shifted, *args[1:]], cot)) == first


@pytest.mark.parametrize("name", list(NORMS))
def test_bitwise_identical_across_thread_counts(name, family_inputs, run_norm, cpu_threads):
    """Protects the fixed chunking for every norm: 1, 2 and 3 threads give equal bits
    (the parameters' gradients included)."""
    norm = NORMS[name]
    args, cot = family_inputs(norm, (300, 520), "float32")
    bits = []
    for n in (1, 2, 3):
        with cpu_threads(n):
            bits.append(_bits(run_norm(cpu, norm, args, cot)))
    assert bits[0] == bits[1] == bits[2]


def test_dgamma_dbeta_near_the_oracle_through_a_float64_row(family_inputs, cpu_threads):
    """Protects dgamma and dbeta through the row tiles and chunks, with a row whose float32
    sums overflow (the float64 path) inside a tile: within float32's "param" tolerance of the
    exact sums (scale: the column's sum of |dy * xhat|, the size of its terms), the same bits
    on 1, 2 and 3 threads (the chunks are fixed by M, not by the threads)."""
    from layernorm.numerics import exact_norm

    # 4 chunks of 50-51 rows: tiles and leftover rows
    (x, g, b), (dy,) = family_inputs(LN, (203, 300), "float32")
    x[77] = 3e38
    x[77, ::2] = -3e38
    got = []
    for n in (1, 2, 3):
        with cpu_threads(n):
            _, cache = cpu.layer_norm_forward(x, g, b)
            got.append(cpu.layer_norm_backward(dy, cache)[1:])
    assert cache.stats[77, cpu.SCALE] < 2.0**-100  # the float64 path was taken
    assert all(_bits(grads) == _bits(got[0]) for grads in got)
    ex = exact_norm(x, g, b, 1e-5, dy)
    terms = np.abs(dy.astype(np.float64))
    for name, have, want, size in (("dgamma", got[0][0], ex.dgamma, terms * np.abs(ex.xhat)),
                                   ("dbeta", got[0][1], ex.dbeta, terms)):
        assert_close(have, want, "float32", "param", scale=float(size.sum(0).max()), name=name)


def test_dgamma_dbeta_over_a_million_rows_keep_float32_relative_accuracy(family_inputs):
    """Protects the accuracy goal: dgamma/dbeta over 1e6 float32 rows within 1e-6 (relative,
    norm-wise) of an fsum over float64 products."""
    import math

    (x, g, b), (dy,) = family_inputs(LN, (1_000_000, 8), "float32", seed=5)
    _, cache = cpu.layer_norm_forward(x, g, b)
    _, dg, db = cpu.layer_norm_backward(dy, cache)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    mean = x64.mean(axis=1, keepdims=True)
    xhat = (x64 - mean) / np.sqrt(((x64 - mean) ** 2).mean(axis=1, keepdims=True) + 1e-5)
    terms = dy64 * xhat  # (M, D)
    want_g = np.array([math.fsum(terms[:, j]) for j in range(8)])
    want_b = np.array([math.fsum(dy64[:, j]) for j in range(8)])
    for got, want in ((dg, want_g), (db, want_b)):
        err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
        assert err <= 1e-6, err


@pytest.mark.skipif(not cpu.api._engine(), reason="the C++ engine is not built here")
def test_n_chunks_is_a_power_of_two_set_by_m():
    """Protects the engine's chunk rule (the dgamma/dbeta bits depend on it): powers of two up
    to kMaxChunks (16), at least kRowsPerChunk (32) rows each."""
    n_chunks = cpu.api._engine()._n_chunks
    assert [n_chunks(m) for m in (0, 1, 63, 64, 128, 4096, 10**6)] == [1, 1, 1, 2, 4, 16, 16]


def test_out_buffers_are_filled_and_returned(family_inputs, run_norm):
    """Protects out=: the given arrays are returned, with the same values as fresh outputs."""
    for dtype in ("float32", "float16"):
        (x, g, b), (dy,) = family_inputs(LN, (3, 5, 40), dtype)
        y_out = np.empty_like(x)
        y, cache = cpu.layer_norm_forward(x, g, b, out=y_out)
        assert y is y_out
        dx_out = np.full_like(x, np.nan)
        dx, dg, db = cpu.layer_norm_backward(dy, cache, out=dx_out)
        assert dx is dx_out
        assert _bits((y, dx, dg, db)) == _bits(run_norm(cpu, LN, [x, g, b], [dy]))


def test_bad_out_buffers_raise(family_inputs):
    """Protects out= validation: type, shape/dtype, contiguity and overlap with the inputs."""
    (x, g, b), (dy,) = family_inputs(LN, (4, 8), "float32")
    with pytest.raises(TypeError, match="out must be a numpy.ndarray"):
        cpu.layer_norm_forward(x, out=[0.0] * 32)
    with pytest.raises(ValueError, match="out must have shape"):
        cpu.layer_norm_forward(x, out=np.empty((4, 8), np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        cpu.layer_norm_forward(x, out=np.empty((8, 4), np.float32).T)
    with pytest.raises(ValueError, match="overlap"):
        cpu.layer_norm_forward(x, out=x)
    _, cache = cpu.layer_norm_forward(x, g, b)
    with pytest.raises(ValueError, match="overlap"):
        cpu.layer_norm_backward(dy, cache, out=dy)


def test_bad_inputs_raise_errors_naming_the_argument(family_inputs):
    """Protects validation: the reference's checks, and a foreign cache."""
    (x, g, b), (dy,) = family_inputs(LN, (4, 8), "float32")
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        cpu.layer_norm_forward(np.ones((2, 3), np.int64))
    with pytest.raises(ValueError, match="x must have at least one axis"):
        cpu.layer_norm_forward(np.float32(1.0))
    with pytest.raises(ValueError, match="gamma must have shape"):
        cpu.layer_norm_forward(x, np.ones(7, np.float32))
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        cpu.layer_norm_forward(x, eps=-1.0)
    _, cache = cpu.layer_norm_forward(x, g, b)
    with pytest.raises(ValueError, match="dy must have the shape"):
        cpu.layer_norm_backward(dy[:2], cache)
    with pytest.raises(TypeError, match="dy must have a floating dtype"):
        cpu.layer_norm_backward(dy.astype(np.int32), cache)
    with pytest.raises(TypeError, match="cache must be the CpuNormCache"):
        cpu.layer_norm_backward(dy, reference.layer_norm_forward(x, g, b)[1])


def test_cache_keeps_x_by_reference_and_counts_its_own_bytes(family_inputs):
    """Protects the cache: x is not copied when C-contiguous (half dtypes included: the kernels
    read their bits); nbytes counts the row statistics (NSTATS float64 a row), the checksums
    (8 bytes a row), the copy of gamma and x when it is a copy."""
    (x, g, b), _ = family_inputs(LN, (10, 30), "float32")
    _, cache = cpu.layer_norm_forward(x, g, b)
    assert np.shares_memory(cache.x, x) and not cache.owns_x
    assert cache.nbytes == cpu.NSTATS * 10 * 8 + 10 * 8 + 30 * 4
    xh = x.astype(np.float16)
    _, cache = cpu.layer_norm_forward(xh)
    assert np.shares_memory(cache.x, xh) and not cache.owns_x
    _, cache = cpu.layer_norm_forward(x.T)
    assert cache.owns_x and cache.nbytes == cpu.NSTATS * 30 * 8 + 30 * 8 + 10 * 4 + 30 * 10 * 4
    x[3] *= np.float32(1e37)  # a scaled row: mean and rstd are reported unscaled
    _, cache = cpu.layer_norm_forward(x)
    _, want = reference.layer_norm_forward(x.astype(np.float64))
    x64 = x.astype(np.float64)
    # Not table entries: the table bounds results (y, dx, dgamma, dbeta), not the statistics a
    # cache reports; 1e-6 (relative) is float32's accuracy for a mean and an rstd (~8 u).
    np.testing.assert_allclose(cache.mean, x64.mean(axis=1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cache.rstd, want.rstd, rtol=1e-6, atol=0)


def test_without_torch_the_numpy_fallback_runs_with_one_warning():
    """Protects the NumPy API where torch is absent: `import layernorm.cpu` works, the first
    call warns once, naming what is missing and the `fast` extra, and the results are the
    fallback's (the reference's arithmetic: equal to the reference here)."""
    code = (
        "import sys, warnings; sys.modules['torch'] = None\n"
        "import numpy as np, layernorm, layernorm.cpu as cpu\n"
        "x = np.random.default_rng(0).standard_normal((5, 16))\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    y, c = cpu.layer_norm_forward(x); y2, _ = cpu.layer_norm_forward(x)\n"
        "    dx, _, _ = cpu.layer_norm_backward(np.ones_like(x), c)\n"
        "print(len(w), w[0].message)\n"
        "print(np.array_equal(y, layernorm.layer_norm_forward(x)[0]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout.splitlines()
    assert out[0].startswith("1 ") and "torch" in out[0] and "fast" in out[0], out
    assert out[1] == "True", out


def test_out_must_not_overlap_the_parameters():
    """Protects gamma: with M = 1 an out= view of gamma would overwrite it and the cache."""
    g = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="must not overlap"):
        cpu.layer_norm_forward(x, g, None, out=g.reshape(1, 16))
    _, cache = cpu.layer_norm_forward(x, g, None)
    with pytest.raises(ValueError, match="must not overlap"):
        cpu.layer_norm_backward(x.copy(), cache, out=cache.scale.reshape(1, 16))


def test_non_native_byte_order():
    """Protects big-endian inputs on the fused path: made native before the engine reads them."""
    x = np.random.default_rng(2).standard_normal((3, 8))
    y, _ = cpu.layer_norm_forward(x.astype(">f4"), np.ones(8, ">f4"))
    want, _ = reference.layer_norm_forward(x.astype(np.float32), np.ones(8, np.float32))
    assert_close(y, want, "float32", name="y")


@pytest.mark.parametrize("spread", [1.0, 0.01])
def test_float64_keeps_the_mean_correction(spread, run_norm):
    """Protects the float64 mean as hi + lo: x = 1e8 + N(0, spread) float64, where rounding the
    corrected mean to one float64 lost the correction (y off by 1.2e-9 and 1.2e-7, dx by
    1.4e-10 and 2.5e-8); now within a few u of the exact answer, as the reference."""
    from layernorm.numerics import exact_layer_norm, relative_error

    rng = np.random.default_rng(11)
    x = 1e8 + spread * rng.standard_normal((8, 1024))
    dy = rng.standard_normal(x.shape)
    y, dx, _, _ = run_norm(cpu, LN, [x, None, None], [dy]).values()
    ex = exact_layer_norm(x, dy=dy)
    u = 2.0**-53
    assert relative_error(y, ex.y) <= 8 * u
    assert relative_error(dx, ex.dx) <= 8 * u


def test_float64_rows_whose_sums_overflow_use_blocked_sums():
    """Protects the scaled path's accuracy: ±9e307 values with D = 65537, whose float64 sums
    overflow; sequential sums there gave y 40 u from the exact answer (the reference: 2.3 u)."""
    from layernorm.numerics import exact_layer_norm, relative_error

    rng = np.random.default_rng(12)
    x = np.where(rng.random((2, 65537)) < 0.5, 9e307, -9e307) * rng.random((2, 65537))
    ex = exact_layer_norm(x)
    y, cache = cpu.layer_norm_forward(x)
    assert relative_error(y, ex.y) <= 8 * 2.0**-53
    assert np.all(cache.stats[:, cpu.SCALE] < 1.0)  # the scaled path ran


def test_float64_near_the_top_of_the_range_stays_finite(run_norm):
    """Protects the scaled path's output: x - mean overflows float64 for this row (-1.7e308 -
    1.25e307), where y came out -inf and dx NaN; the row is normalized in its scaled form."""
    from layernorm.numerics import exact_layer_norm, relative_error

    x = np.array([[1.7e308, -1.7e308, 1.0e308, -0.5e308]])
    g = np.array([0.5, 1.5, -1.0, 2.0])
    b = np.array([0.1, 0.0, -0.2, 0.3])
    dy = np.array([[0.3, -1.0, 0.7, 0.2]])
    y, dx, dg, db = run_norm(cpu, LN, [x, g, b], [dy]).values()
    assert all(np.all(np.isfinite(a)) for a in (y, dx, dg, db))
    ex = exact_layer_norm(x, g, b, dy=dy)
    for got, want in ((y, ex.y), (dg, ex.dgamma), (db, ex.dbeta)):
        assert relative_error(got, want) <= 8 * 2.0**-53
    # dx ~ 1e-308: subnormal in float64, so its error is absolute, a few subnormal spacings
    assert np.max(np.abs(dx - ex.dx)) <= 8 * 2.0**-1074 + 8 * 2.0**-53 * np.max(np.abs(ex.dx))


@pytest.mark.parametrize("dtype", ["float32", "float64", *HALF])
def test_out_never_overlaps_the_callers_arrays(dtype, family_inputs):
    """Protects the caller's x and gamma from the backward's out=: refused for every dtype
    (float16 and bfloat16 wrote dx over x or gamma, because the check compared out with the
    cache's converted copies), also when x was a temporary view of the memory out uses (then
    the memory's owner stands in for it, in both modes)."""
    (x, g, b), (dy,) = family_inputs(LN, (1, 16), dtype)
    x0, g0 = x.copy(), g.copy()
    _, cache = cpu.layer_norm_forward(x, g, b)
    for victim in (x, g.reshape(1, 16)):
        with pytest.raises(ValueError, match="must not overlap"):
            cpu.layer_norm_backward(dy, cache, out=victim)
    base = np.concatenate([x, x]).copy()  # (2, 16): x comes from a view that dies at once
    for me in (False, True):  # the memory-efficient cache keeps no view of x at all
        _, cache = cpu.layer_norm_forward(base[1:], g, b, memory_efficient=me)
        with pytest.raises(ValueError, match="must not overlap"):
            cpu.layer_norm_backward(dy, cache, out=base[1:])
    assert _bits((x, g)) == _bits((x0, g0))
    fresh = np.empty_like(x)  # a buffer of its own is fine
    assert cpu.layer_norm_backward(dy, cache, out=fresh)[0] is fresh


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", ["float32", "float64", *HALF])
def test_backward_differentiates_the_forward_that_ran(backend, dtype, family_inputs):
    """Protects the one rule for gamma: changing it in place between forward and backward does
    not change the backward (the caches copy it). The fused float32 path used the old gamma
    and the reference the new one."""
    mod = cpu if backend == "cpu" else reference
    (x, g, b), (dy,) = family_inputs(LN, (5, 24), dtype)
    g64 = g.astype(np.float64)  # a float64 parameter, as the modules keep
    want = mod.layer_norm_backward(dy, mod.layer_norm_forward(x, g64.copy(), b)[1])
    _, cache = mod.layer_norm_forward(x, g64, b)
    g64 *= 2.0  # an optimizer step between forward and backward
    assert _bits(mod.layer_norm_backward(dy, cache)) == _bits(want)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_out_never_overlaps_an_array_like_callers_memory(dtype, family_inputs):
    """Protects array-likes (a memoryview, a torch CPU tensor) from out=: their memory is only
    visible through np.asarray, and an out aliasing x was accepted, x overwritten by y and dx
    then computed from y; also from a memory-efficient cache, which keeps no view of x."""
    (x, g, b), (dy,) = family_inputs(LN, (4, 16), dtype)
    likes = [("memoryview", lambda a: memoryview(a), lambda like: np.asarray(like))]
    torch = pytest.importorskip("torch")
    likes.append(("torch", torch.from_numpy, lambda like: like.numpy()))
    for _, wrap, unwrap in likes:
        xl, dyl = wrap(x.copy()), wrap(dy.copy())
        with pytest.raises(ValueError, match="must not overlap"):
            cpu.layer_norm_forward(xl, g, b, out=unwrap(xl))
        for me in (False, True):  # the memory-efficient cache keeps no view of x
            _, cache = cpu.layer_norm_forward(xl, g, b, memory_efficient=me)
            for victim in (xl, dyl):
                with pytest.raises(ValueError, match="must not overlap"):
                    cpu.layer_norm_backward(dyl, cache, out=unwrap(victim))
        assert _bits((unwrap(xl), unwrap(dyl))) == _bits((x, dy))


def test_float64_dy_near_the_top_of_the_range():
    """Protects the backward's fallback for float64: dy = ±1e307, whose blocked sums overflow
    (the reference's pairwise sums happen not to), gave NaN dx; the fallback now sums a
    power-of-two scaling of dy. The exact dx reaches 1.5e307."""
    from layernorm.numerics import exact_layer_norm, relative_error

    x = np.random.default_rng(1).standard_normal((1, 64))
    dy = np.full((1, 64), 1e307)
    dy[0, ::2] = -1e307
    dy[0, :8] = 1e307
    ex = exact_layer_norm(x, dy=dy)
    dx = cpu.layer_norm_backward(dy, cpu.layer_norm_forward(x)[1])[0]
    assert relative_error(dx, ex.dx) <= 8 * 2.0**-53


def test_dir_lists_the_public_api_only():
    """Protects `dir(layernorm.cpu)`: it lists `__all__`, not the submodules or the statistics'
    columns, while `from layernorm.cpu import statistics` still works."""
    import layernorm.cpu
    from layernorm.cpu import statistics

    assert dir(layernorm.cpu) == sorted(layernorm.cpu.__all__)
    assert "layer_norm_forward" in dir(layernorm.cpu) and "RMSNorm" in dir(layernorm.cpu)
    for hidden in ("api", "fallback", "statistics", "module", "HI", "NSTATS"):
        assert hidden not in dir(layernorm.cpu)
    assert layernorm.cpu.statistics is statistics and cpu.NSTATS == statistics.NSTATS
