"""layernorm.numerics: the exact oracle (every norm of the family), the variance algorithms,
Chan's merge and the error measures; and the reference's accuracy targets, asserted against the
exact oracle."""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import layernorm as ln
from layernorm import numerics as nx
from layernorm.family import NORMS

RNG = np.random.default_rng(2024)
U32 = 2.0**-24


def _dtype(name):
    if name == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.dtype(name)


def _affine(d, dt, rng=RNG):
    return (1 + 0.5 * rng.standard_normal(d)).astype(dt), rng.standard_normal(d).astype(dt)


def _errors(x, gamma, beta, dy, eps=1e-5):
    """Normwise relative errors of the reference's y, dx, dgamma, dbeta against the oracle."""
    y, cache = ln.layer_norm_forward(x, gamma, beta, eps)
    got = (y, *ln.layer_norm_backward(dy, cache))
    ex = nx.exact_layer_norm(x, gamma, beta, eps, dy)
    want = (ex.y, ex.dx, ex.dgamma, ex.dbeta)
    return [nx.relative_error(g, w) for g, w in zip(got, want, strict=True)], got, ex


# --- the exact oracle ----------------------------------------------------------------------


def _mpmath_norm(x, gamma, beta, eps, dy, centred=True, zero_centered_gamma=False, dh=None):
    """The textbook formulas at 300 bits with mpmath: independent of the integer oracle.
    LayerNorm (centred) or RMSNorm; scale = 1 + gamma with zero_centered_gamma; dx + dh."""
    mpmath = pytest.importorskip("mpmath")
    mp = mpmath.mp.clone()
    mp.prec = 300
    m, d = x.shape
    y, dx = np.empty((m, d)), np.empty((m, d))
    f = [[mp.mpf(float(v)) for v in row] for row in x.astype(np.float64)]
    scale = [mp.mpf(float(v)) + (1 if zero_centered_gamma else 0) for v in gamma]
    shift = [mp.mpf(float(v)) for v in beta] if beta is not None else [mp.mpf(0)] * d
    for r in range(m):
        mean = mp.fsum(f[r]) / d if centred else mp.mpf(0)
        var = mp.fsum([(v - mean) ** 2 for v in f[r]]) / d
        rstd = 1 / mp.sqrt(var + mp.mpf(eps))
        xhat = [(v - mean) * rstd for v in f[r]]
        g = [mp.mpf(float(dy[r, j])) * scale[j] for j in range(d)]
        mg = mp.fsum(g) / d if centred else mp.mpf(0)
        mgx = mp.fsum([g[j] * xhat[j] for j in range(d)]) / d
        for j in range(d):
            y[r, j] = float(scale[j] * xhat[j] + shift[j])
            extra = mp.mpf(float(dh[r, j])) if dh is not None else 0
            dx[r, j] = float(rstd * (g[j] - mg - xhat[j] * mgx) + extra)
    return y, dx


@pytest.mark.parametrize(
    "dtype,offset,std,eps",
    [("float64", 1e8, 1e-3, 1e-12), ("float32", 1e4, 0.1, 1e-5), ("float16", 3e4, 1e4, 1e-5),
     ("bfloat16", 5.0, 3.0, 0.5), ("float32", 1e20, 1e19, 1e-5), ("float64", 1e-30, 1e-32, 1e-70)],
)
def test_exact_oracle_agrees_with_mpmath(dtype, offset, std, eps):
    """Protects the oracle: integer arithmetic agrees with 300-bit mpmath to 1 ulp of float64."""
    dt = _dtype(dtype)
    x = (offset + std * RNG.standard_normal((3, 17))).astype(dt)
    gamma, beta = _affine(17, dt)
    dy = RNG.standard_normal((3, 17)).astype(dt)
    ex = nx.exact_layer_norm(x, gamma, beta, eps, dy)
    y, dx = _mpmath_norm(x, gamma, beta, eps, dy)
    np.testing.assert_allclose(ex.y, y, rtol=2.3e-16, atol=0)
    np.testing.assert_allclose(ex.dx, dx, rtol=2.3e-16, atol=0)


@pytest.mark.parametrize(
    "norm,dtype,offset,std,eps,zcg",
    [("rms_norm", "float64", 0.0, 1.0, 1e-6, False),
     ("rms_norm", "float32", 1e4, 1.0, 1e-6, True),
     ("rms_norm", "bfloat16", 0.0, 1e25, 1e-6, False),
     ("rms_norm", "float64", 0.0, 1e250, 1e-6, True),
     ("rms_norm", "float16", 0.0, 1e-3, 0.5, False),
     ("add_rms_norm", "float32", 3.0, 1.0, 1e-6, False),
     ("add_layer_norm", "float64", 1e8, 1e-3, 1e-12, True),
     ("add_layer_norm", "bfloat16", 5.0, 3.0, 1e-5, False)],
)
def test_exact_norm_agrees_with_mpmath_across_the_family(norm, dtype, offset, std, eps, zcg):
    """Protects exact_norm for RMSNorm (including squares beyond float64's range and eps that
    dominates), zero-centred gamma and the add-norms (the rounded h and dx = dh + dnorm):
    the integer arithmetic agrees with 300-bit mpmath to 1 ulp of float64."""
    fam = NORMS[norm]
    dt = _dtype(dtype)
    v = offset + std * RNG.standard_normal((3, 13))
    gamma = (0.1 * RNG.standard_normal(13) if zcg else 1 + 0.5 * RNG.standard_normal(13)).astype(dt)
    beta = RNG.standard_normal(13).astype(dt) if fam.centred else None
    dy = RNG.standard_normal((3, 13)).astype(dt)
    dh = None
    x = v.astype(dt)
    if fam.residual:
        residual = (0.5 * v).astype(dt)
        x = np.add((v - residual.astype(np.float64)).astype(dt), residual, dtype=np.float64)
        x = x.astype(dt)  # h, rounded once: what the oracle takes for an add-norm
        dh = RNG.standard_normal((3, 13)).astype(dt)
    ex = nx.exact_norm(x, gamma, beta, eps, dy, centred=fam.centred, zero_centered_gamma=zcg,
                       dh=dh)
    y, dx = _mpmath_norm(x, gamma, beta, eps, dy, fam.centred, zcg, dh)
    np.testing.assert_allclose(ex.y, y, rtol=2.3e-16, atol=0)
    np.testing.assert_allclose(ex.dx, dx, rtol=2.3e-16, atol=0)
    assert (ex.dbeta is None) == (not fam.centred)


def test_exact_rms_norm_closed_forms():
    """Protects the RMSNorm oracle on answers known in closed form: a zero row has y = 0 and
    dx = g/sqrt(eps); a row of equal values c has xhat = c/sqrt(c**2 + eps) and, for dy = 1,
    dx = rstd*(1 - xhat**2) = eps/(c**2 + eps)**1.5 (only eps keeps g = 1 off xhat); RMSNorm's
    xhat of x is LayerNorm's of the row [x, -x] (mean 0, the same mean square)."""
    eps = 1e-6
    zero = nx.exact_norm(np.zeros((1, 4)), dy=np.array([[1.0, -2.0, 0.5, 3.0]]), eps=eps,
                         centred=False)
    np.testing.assert_array_equal(zero.y, 0.0)
    np.testing.assert_allclose(zero.dx, [[1.0, -2.0, 0.5, 3.0]] / np.sqrt(eps), rtol=1e-15)
    const = nx.exact_norm(np.full((1, 5), 3.0), dy=np.ones((1, 5)), eps=eps, centred=False)
    np.testing.assert_allclose(const.xhat, 3.0 / math.sqrt(9.0 + eps), rtol=1e-15)
    np.testing.assert_allclose(const.dx, eps / (9.0 + eps) ** 1.5, rtol=1e-15)
    x = RNG.standard_normal((2, 6))
    rms = nx.exact_norm(x, eps=eps, centred=False)
    mirrored = nx.exact_norm(np.concatenate([x, -x], axis=1), eps=eps)
    np.testing.assert_allclose(rms.xhat, mirrored.xhat[:, :6], rtol=1e-15, atol=0)
    np.testing.assert_array_equal(rms.mean, 0.0)


def test_exact_oracle_closed_forms():
    """Protects the oracle on known answers: zero variance, two values, D = 1, no rows."""
    x = np.array([[0.1] * 5, [-3.0, 5.0, -3.0, 5.0, -3.0]])  # (2, 5)
    gamma = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    beta = np.array([0.5, -0.25, 0.0, 1.0, 2.0])
    dy = np.arange(10.0).reshape(2, 5)
    ex = nx.exact_layer_norm(x, gamma, beta, 1e-5, dy)
    np.testing.assert_array_equal(ex.y[0], beta)  # var = 0: y = beta exactly
    g = dy[0] * gamma
    np.testing.assert_allclose(ex.dx[0], (g - g.mean()) / math.sqrt(1e-5), rtol=1e-15, atol=0)
    assert ex.mean[0] == 0.1 and ex.var[0] == 0.0
    assert ex.rstd[0] == pytest.approx(1 / math.sqrt(1e-5), rel=3e-16, abs=0)
    assert ex.mean[1] == 0.2 and ex.var[1] == 15.36  # exact: 0.2 = 1/5, 15.36 = 384/25
    np.testing.assert_array_equal(ex.dbeta, dy.sum(axis=0))
    d1 = nx.exact_layer_norm(np.array([[7.0], [-2.0]]), dy=np.ones((2, 1)))
    np.testing.assert_array_equal(d1.y, 0.0)
    np.testing.assert_array_equal(d1.dx, 0.0)
    none = nx.exact_layer_norm(np.ones((0, 3)), dy=np.ones((0, 3)))  # no rows
    assert none.y.shape == (0, 3)
    np.testing.assert_array_equal(none.dgamma, np.zeros(3))


def test_exact_oracle_keeps_leading_axes_and_overflowing_variance():
    """Protects the oracle's shapes and its range: var beyond float64 is inf, y still exact."""
    x = np.array([[[1e200, -1e200, 0.0, 3e199]]])  # (1, 1, 4)
    ex = nx.exact_layer_norm(x, dy=np.ones_like(x))
    assert ex.y.shape == ex.xhat.shape == ex.dx.shape == (1, 1, 4)
    assert ex.mean.shape == ex.var.shape == ex.rstd.shape == (1, 1)
    assert ex.var[0, 0] == math.inf and 0 < ex.rstd[0, 0] < 1e-199
    assert np.all(np.isfinite(ex.y)) and abs(ex.y.mean()) < 1e-15
    np.testing.assert_array_equal(ex.dx, 0.0)  # dy = 1 lies in span{1}: dx = 0 exactly


def test_exact_oracle_rejects_bad_input():
    """Protects the oracle's input checks: errors name the argument."""
    with pytest.raises(ValueError, match="dh needs dy"):
        nx.exact_norm(np.ones((2, 3)), dh=np.ones((2, 3)))
    with pytest.raises(ValueError, match="dh must have the shape of x"):
        nx.exact_norm(np.ones((2, 3)), dy=np.ones((2, 3)), dh=np.ones(3))
    with pytest.raises(ValueError, match="beta must be None for RMSNorm"):
        nx.exact_norm(np.ones((2, 3)), beta=np.ones(3), centred=False)
    with pytest.raises(ValueError, match="x must be finite"):
        nx.exact_layer_norm(np.array([[1.0, np.nan]]))
    with pytest.raises(ValueError, match="dy must have the shape of x"):
        nx.exact_layer_norm(np.ones((2, 3)), dy=np.ones((3, 2)))
    with pytest.raises(ValueError, match="gamma must have shape"):
        nx.exact_layer_norm(np.ones((2, 3)), gamma=np.ones(2))
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        nx.exact_layer_norm(np.ones((2, 3), dtype=int))
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        nx.exact_layer_norm(np.ones((2, 3)), eps=-1.0)
    with pytest.raises(ValueError, match="row 0 is constant and eps = 0"):
        nx.exact_layer_norm(np.ones((2, 3)), eps=0.0)


def test_error_measures():
    """Protects relative_error and ulp_error: normwise, inf for NaN, absolute for all-zero."""
    exact = np.array([1.0, -4.0, 2.0])
    assert nx.relative_error(exact + [0.0, 0.0, 1e-3], exact) == pytest.approx(2.5e-4, rel=1e-12)
    assert nx.relative_error(np.array([1.0, np.nan, 2.0]), exact) == math.inf
    assert nx.relative_error(np.array([0.0, 3e-9]), np.zeros(2)) == 3e-9
    assert nx.ulp(1.0, np.float32) == 2.0**-23
    assert nx.ulp(1.5, np.float16) == 2.0**-10
    assert nx.ulp(-3.0, _dtype("bfloat16")) == 2.0**-6
    assert nx.unit_roundoff(np.float64) == 2.0**-53
    rounded = exact.astype(np.float16)
    assert nx.ulp_error(rounded, exact + 1e-4, np.float16) <= 0.5
    with pytest.raises(TypeError, match="dtype must be"):
        nx.ulp(1.0, np.int32)


# --- variance algorithms ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(nx.VARIANCE_ALGORITHMS))
def test_every_algorithm_is_accurate_on_benign_rows(name):
    """Protects each algorithm's implementation: float64 rows of N(0, 1), D = 1000."""
    x = RNG.standard_normal((3, 1000))
    ex = nx.exact_layer_norm(x)
    stats = nx.VARIANCE_ALGORITHMS[name](x, None)
    np.testing.assert_allclose(stats.var, ex.var, rtol=1e-12, atol=0)
    np.testing.assert_allclose(stats.mean + stats.mean_lo, ex.mean, rtol=0, atol=1e-14)
    assert nx.relative_error(nx.normalize(x, stats), ex.xhat) < 1e-14


def test_the_failures_the_algorithms_demonstrate():
    """Protects the demonstrations: naive cancels, two-pass keeps the mean's error, Welford's
    error grows with D; the corrected two-pass is accurate in all three."""
    x = (1e4 + RNG.standard_normal((2, 4096))).astype(np.float32)
    want = nx.exact_layer_norm(x).xhat
    err = {name: nx.relative_error(nx.normalize(x, algo(x, None)), want)
           for name, algo in nx.VARIANCE_ALGORITHMS.items() if name != "naive"}
    with np.errstate(invalid="ignore"):
        naive = nx.relative_error(nx.normalize(x, nx.variance_naive(x)), want)
    assert naive > 1e-1  # E[x²] - E[x]² at offset/std = 1e4 in float32: garbage or NaN
    assert err["two-pass"] > 1e-5  # ~ u * offset/std
    assert err["Welford"] > 1e-4
    assert err["corrected two-pass"] < 4 * U32


def test_squares_overflow_in_float16_but_not_in_the_library():
    """Protects the half-precision demonstration: float16 x ~ 6e4 squared is inf."""
    x = RNG.uniform(-6e4, 6e4, (2, 64)).astype(np.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        assert not np.any(np.isfinite(nx.variance_naive(x).var))  # inf, or inf - inf
        assert np.all(np.isinf(nx.variance_two_pass(x).var))
    assert np.all(np.isfinite(nx.variance_two_pass(x, np.float32).var))


def test_chan_with_one_block_is_two_pass():
    """Protects variance_chan's blocking: a block as long as the row is plain two-pass."""
    x = RNG.standard_normal((3, 50)).astype(np.float32)
    one = nx.variance_chan(x, block=64)
    two = nx.variance_two_pass(x)
    np.testing.assert_array_equal(one.var, two.var)
    np.testing.assert_array_equal(one.mean, two.mean)


@settings(max_examples=150, deadline=None)
@given(
    row=hnp.arrays(np.float64, st.integers(2, 120),
                   elements=st.floats(-1e3, 1e3, allow_subnormal=False)),
    offset=st.sampled_from([0.0, 10.0, -1e3, 1e5]),
    cuts=st.lists(st.floats(0, 1), max_size=8),
)
def test_chan_merge_over_any_split_agrees_with_welford_and_corrected(row, offset, cuts):
    """Protects Chan's merge: any split of a row, merged left to right, gives the mean and var
    of Welford and of the corrected two-pass within the bound D·u·(var + mean²) they share."""
    x = (row + offset)[None, :]  # (1, D)
    d = x.shape[1]
    bounds = sorted({0, d, *(int(c * d) for c in cuts)})
    parts = [nx.moments(x[:, a:b]) for a, b in pairwise(bounds) if b > a]
    acc = parts[0]
    for p in parts[1:]:
        acc = nx.chan_merge(acc, p)
    assert acc.count == d
    chan_var = acc.m2 / d
    exact = nx.exact_layer_norm(x)
    tol_var = 16 * d * 2.0**-53 * (exact.var + exact.mean**2) + 1e-300
    tol_mean = 16 * d * 2.0**-53 * np.abs(x).max()
    for other in (nx.variance_welford(x), nx.variance_corrected_two_pass(x)):
        assert np.all(np.abs(chan_var - other.var) <= tol_var)
        assert np.all(np.abs(acc.mean - (other.mean + other.mean_lo)) <= tol_mean)
    assert np.all(np.abs(chan_var - exact.var) <= tol_var)


def test_algorithm_input_checks():
    """Protects the algorithms' errors: each names the argument."""
    with pytest.raises(ValueError, match="block must be a positive integer"):
        nx.variance_chan(np.ones((2, 4)), block=0)
    with pytest.raises(TypeError, match="dtype must be"):
        nx.variance_two_pass(np.ones((2, 4)), dtype=np.int64)
    with pytest.raises(ValueError, match="non-empty last axis"):
        nx.variance_welford(np.ones((2, 0)))
    with pytest.raises(ValueError, match="same rows"):
        nx.chan_merge(nx.moments(np.ones((2, 4))), nx.moments(np.ones((3, 4))))
    with pytest.raises(ValueError, match="mechanism must be one of"):
        nx.float32_backward(np.ones((2, 4), np.float32), None, np.ones((2, 4), np.float32),
                            1e-5, "float16")


# --- the reference against the exact oracle: the accuracy targets -----------------------


def test_float64_large_offset_tiny_variance():
    """Protects the correction pass: float64 x = 1e8 + N(0, 1e-3), eps = 1e-12, y error <= 1e-12
    (a plain two-pass: ~3e-9)."""
    x = 1e8 + 1e-3 * RNG.standard_normal((8, 512))
    gamma, beta = _affine(512, np.float64)
    dy = RNG.standard_normal((8, 512))
    (ey, edx, edg, edb), _, _ = _errors(x, gamma, beta, dy, eps=1e-12)
    assert ey <= 1e-12 and edx <= 1e-12 and edg <= 1e-12 and edb <= 1e-12


@pytest.mark.parametrize("offset,std", [(1e4, 0.1), (1e2, 1.0), (1e4, 1.0), (1e6, 1.0)])
def test_float32_offsets(offset, std):
    """Protects float32 accuracy at large offsets, with gamma and beta: y <= 2e-6, dx <= 2e-5
    (public two-pass solutions at 1e4 + N(0, 0.1): 5.9e-3 and 1.2e-3)."""
    x = (offset + std * RNG.standard_normal((8, 512))).astype(np.float32)
    gamma, beta = _affine(512, np.float32)
    dy = RNG.standard_normal((8, 512)).astype(np.float32)
    (ey, edx, edg, edb), _, _ = _errors(x, gamma, beta, dy)
    assert ey <= 2e-6 and edx <= 2e-5
    assert edg <= 1e-6 and edb <= 1e-6


@pytest.mark.parametrize("order", ["C", "F"])
def test_float32_long_rows_in_either_memory_order(order):
    """Protects pairwise row sums for D = 1e5, also for column-major x and dy (a strided row
    summed sequentially gave y error 1.6e-5)."""
    x = (1e4 + RNG.standard_normal((2, 100_000))).astype(np.float32)
    dy = RNG.standard_normal((2, 100_000)).astype(np.float32)
    y, cache = ln.layer_norm_forward(np.asarray(x, order=order))
    dx = ln.layer_norm_backward(np.asarray(dy, order=order), cache)[0]
    ex = nx.exact_layer_norm(x, dy=dy)
    assert nx.relative_error(y, ex.y) <= 2e-6
    assert nx.relative_error(dx, ex.dx) <= 2e-5


@pytest.mark.parametrize(
    "dtype,values",
    [("float16", "extremes"), ("float16", "normal"), ("bfloat16", "normal"),
     ("bfloat16", "extremes")],
)
def test_half_precision_within_output_ulps(dtype, values):
    """Protects half precision: finite and within 1 output ulp (at max|exact|) of the exact
    answer, for float16 up to ±6e4 and bfloat16."""
    dt = _dtype(dtype)
    shape = (4, 256)
    x = RNG.uniform(-6e4, 6e4, shape) if values == "extremes" else RNG.standard_normal(shape)
    x = x.astype(dt)
    gamma, beta = _affine(256, dt)
    dy = RNG.standard_normal(shape).astype(dt)
    _, (y, dx, dg, db), ex = _errors(x, gamma, beta, dy)
    for got, want in ((y, ex.y), (dx, ex.dx)):
        assert np.all(np.isfinite(got.astype(np.float64)))
        assert nx.ulp_error(got, want, dt) <= 1.0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_zero_variance_rows(dtype):
    """Protects var = 0 in every dtype: finite, y = beta (rounded once) and
    dx = rstd·(g - mean(g)) with rstd = 1/sqrt(eps), to 4 output ulps."""
    dt = _dtype(dtype)
    x = np.repeat(RNG.uniform(-100, 100, (5, 1)), 200, axis=1).astype(dt)
    gamma, beta = _affine(200, dt)
    dy = RNG.standard_normal((5, 200)).astype(dt)
    _, (y, dx, _, _), ex = _errors(x, gamma, beta, dy)
    np.testing.assert_array_equal(y.astype(np.float64),
                                  np.broadcast_to(beta.astype(np.float64), y.shape))
    assert np.all(np.isfinite(dx.astype(np.float64)))
    g = dy.astype(np.float64) * gamma.astype(np.float64)
    closed = (g - g.mean(axis=1, keepdims=True)) / math.sqrt(1e-5)
    assert nx.relative_error(ex.dx, closed) < 1e-15
    assert nx.ulp_error(dx, closed, dt) <= 4.0


@pytest.mark.parametrize(
    "dtype,scale", [("float32", 1e20), ("bfloat16", 1e30), ("float64", 1e200), ("float32", 3e37)]
)
def test_rows_whose_squares_overflow(dtype, scale):
    """Protects the rescaled path: |x| so large that the sum or the squares overflow cdt
    (without it: y = beta or NaN). Also the sum overflow at 3e37 * 64 rows' worth of values."""
    dt = _dtype(dtype)
    x = (scale * (3 + RNG.standard_normal((3, 64)))).astype(dt)
    x[1] = x[1, 0]  # a constant row: xhat = 0, rstd = 1/sqrt(eps)
    dy = RNG.standard_normal((3, 64)).astype(dt)
    gamma, beta = _affine(64, dt)
    with np.errstate(over="raise", invalid="raise"):  # the fallback must not warn
        _, (y, dx, _, _), ex = _errors(x, gamma, beta, dy)
    assert nx.ulp_error(y, ex.y, dt) <= 2.0 and nx.ulp_error(dx, ex.dx, dt) <= 2.0
    cache = ln.layer_norm_forward(x)[1]
    np.testing.assert_allclose(cache.rstd.astype(np.float64), ex.rstd, rtol=1e-6, atol=0)


def test_dgamma_dbeta_over_a_million_rows():
    """Protects float64 accumulation of the row sums: M = 1e6 float32 rows, relative error
    <= 1e-6; a float32 column sum (sequential over rows) loses ten times more."""
    m, d = 1_000_000, 4
    x = (3 + RNG.standard_normal((m, d))).astype(np.float32)
    dy = (0.1 + RNG.standard_normal((m, d))).astype(np.float32)
    gamma, beta = np.ones(d, np.float32), np.zeros(d, np.float32)
    _, cache = ln.layer_norm_forward(x, gamma, beta)
    _, dgamma, dbeta = ln.layer_norm_backward(dy, cache)
    want_g, want_b = nx.float64_param_grads(x, dy)
    assert nx.relative_error(dgamma, want_g) <= 1e-6
    assert nx.relative_error(dbeta, want_b) <= 1e-6
    assert nx.relative_error(dy.sum(axis=0), want_b) > 10 * nx.relative_error(dbeta, want_b)


@pytest.mark.parametrize("centred", [True, False])
def test_float64_param_grads_is_exact_enough(centred):
    """Protects the many-row oracle (LayerNorm and RMSNorm) against the exact one on a size
    both can do."""
    x = RNG.standard_normal((300, 5)).astype(np.float32)
    dy = RNG.standard_normal((300, 5)).astype(np.float32)
    ex = nx.exact_norm(x, dy=dy, centred=centred)
    dgamma, dbeta = nx.float64_param_grads(x, dy, centred=centred)
    np.testing.assert_allclose(dgamma, ex.dgamma, rtol=1e-14, atol=1e-14)
    np.testing.assert_array_equal(dbeta, nx.exact_layer_norm(x, dy=dy).dbeta)


# --- the backward's cancellation ----------------------------------------------------------


@pytest.mark.parametrize("rho", [1e-1, 1e-3, 1e-5])
def test_backward_cancellation_scales_with_kappa(rho):
    """Protects the documented scaling: when g is near span{1, xhat}, the float32 reference's
    dx error stays within 6·u·kappa and float64 arithmetic from a float32 cache within 1.5·u·kappa
    (docs/numerics.md); the float64 reference within 1e-15·kappa."""
    x, gamma, dy = nx.cancellation_inputs(RNG, 4, 512, rho, 0.0)
    ex = nx.exact_layer_norm(x, gamma, None, 1e-5, dy)
    kappa = np.abs(dy.astype(np.float64) * gamma).max() * ex.rstd.max() / np.abs(ex.dx).max()
    ref, _, f64 = (nx.relative_error(nx.float32_backward(x, gamma, dy, 1e-5, m), ex.dx)
                   for m in nx.BACKWARD_MECHANISMS)
    assert ref <= 6 * U32 * kappa
    assert f64 <= 1.5 * U32 * kappa
    cache = ln.layer_norm_forward(x.astype(np.float64), gamma.astype(np.float64))[1]
    dx64 = ln.layer_norm_backward(dy.astype(np.float64), cache)[0]
    assert nx.relative_error(dx64, ex.dx) <= 1e-15 * kappa


def test_dx_target_holds_up_to_kappa_50():
    """Protects the regime where the float32 dx target (2e-5) holds: kappa up to ~50."""
    x, gamma, dy = nx.cancellation_inputs(RNG, 4, 1024, 3e-2, 1e4)
    ex = nx.exact_layer_norm(x, gamma, None, 1e-5, dy)
    kappa = np.abs(dy.astype(np.float64) * gamma).max() * ex.rstd.max() / np.abs(ex.dx).max()
    assert 20 < kappa < 80
    dx = ln.layer_norm_backward(dy, ln.layer_norm_forward(x, gamma)[1])[0]
    assert nx.relative_error(dx, ex.dx) <= 2e-5


def test_backward_is_independent_of_memory_order_with_gamma():
    """Protects the backward's C-order copy of dy: with gamma, a column-major dy must give
    bit-identical results (summed along a strided row it would be sequential, 8x worse)."""
    x = (1e4 + RNG.standard_normal((3, 20_000))).astype(np.float32)
    dy = RNG.standard_normal((3, 20_000)).astype(np.float32)
    gamma = RNG.standard_normal(20_000).astype(np.float32)
    _, cache = ln.layer_norm_forward(x, gamma, None)
    want = ln.layer_norm_backward(dy, cache)
    got = ln.layer_norm_backward(np.asfortranarray(dy), cache)
    for a, b in zip(got[:2], want[:2], strict=True):
        np.testing.assert_array_equal(a, b)
