"""The NumPy reference: agreement with an independent derivation, finite differences,
edge cases, invariances, dtype policy, and a cross-check against PyTorch's autograd."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import layernorm as ln
from layernorm import tolerances
from layernorm.tolerances import tolerance

RNG = np.random.default_rng(1234)


def staged_chain_rule(x, gamma, beta, eps, dy):
    """Forward and backward written node by node through the computational graph.

    Independent of the library's compact formula: every intermediate of the forward
    gets its own adjoint, accumulated by the chain rule. x, dy: (M, D) float64.
    """
    d = x.shape[1]
    mu = x.sum(1, keepdims=True) / d  # (M, 1)
    xmu = x - mu  # (M, D)
    sq = xmu**2  # (M, D)
    var = sq.sum(1, keepdims=True) / d  # (M, 1)
    sqrtvar = np.sqrt(var + eps)  # (M, 1)
    ivar = 1.0 / sqrtvar  # (M, 1)
    xhat = xmu * ivar  # (M, D)
    y = gamma * xhat + beta  # (M, D)

    dbeta = dy.sum(0)  # (D,)
    dgamma = (dy * xhat).sum(0)  # (D,)
    dxhat = dy * gamma  # (M, D)
    divar = (dxhat * xmu).sum(1, keepdims=True)  # (M, 1)
    dxmu = dxhat * ivar  # (M, D) through xhat = xmu * ivar
    dsqrtvar = -divar / sqrtvar**2  # (M, 1)
    dvar = 0.5 * dsqrtvar / sqrtvar  # (M, 1)
    dsq = np.ones_like(sq) * dvar / d  # (M, D)
    dxmu = dxmu + 2 * xmu * dsq  # (M, D) through sq = xmu**2
    dmu = -dxmu.sum(1, keepdims=True)  # (M, 1)
    dx = dxmu + dmu / d  # (M, D) through xmu = x - mu and mu = mean(x)
    return y, dx, dgamma, dbeta


def _affine(d, rng=RNG):
    return rng.standard_normal(d), rng.standard_normal(d)


def _fwd_bwd(x, gamma, beta, dy, eps=1e-5):
    y, cache = ln.layer_norm_forward(x, gamma, beta, eps)
    return (y, *ln.layer_norm_backward(dy, cache))


def assert_close(got, want, dtype="float64", quantity="out"):
    tolerances.assert_close(got, want, dtype, quantity)


@pytest.mark.parametrize("shape", [(5, 7), (16, 128), (3, 1), (2, 1000)])
@pytest.mark.parametrize("eps", [1e-5, 1e-1])
def test_matches_independent_chain_rule_derivation(shape, eps):
    """Protects the compact backward formula against an independent staged derivation."""
    x = RNG.standard_normal(shape) * 3 + 1
    dy = RNG.standard_normal(shape)
    gamma, beta = _affine(shape[1])
    want = staged_chain_rule(x, gamma, beta, eps, dy)
    got = _fwd_bwd(x, gamma, beta, dy, eps)
    for g, w in zip(got, want, strict=True):  # dgamma, dbeta of <= 16 rows: "out" as y and dx
        assert_close(g, w)


def _as_f(gamma, beta):
    def f(x, *p):
        it = iter(p)
        g = next(it) if gamma else None
        b = next(it) if beta else None
        return ln.layer_norm_forward(x, g, b)[0]

    def vjp(x, *rest):
        *p, dy = rest
        it = iter(p)
        g = next(it) if gamma else None
        b = next(it) if beta else None
        dx, dg, db = ln.layer_norm_backward(dy, ln.layer_norm_forward(x, g, b)[1])
        return (dx, *([dg] if gamma else []), *([db] if beta else []))

    return f, vjp


@pytest.mark.parametrize("shape", [(33,), (4, 16), (2, 3, 8), (2, 2, 3, 5)])
@pytest.mark.parametrize("gamma,beta", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("mode", ["fast", "full"])
def test_finite_differences_float64(shape, gamma, beta, mode):
    """Protects dx, dgamma, dbeta in 1-D to 4-D, with each parameter present or absent."""
    x = RNG.standard_normal(shape) * 2 - 0.3
    g, b = _affine(shape[-1])
    args = (x, *([g] if gamma else []), *([b] if beta else []))
    f, vjp = _as_f(gamma, beta)
    report = ln.check_vjp(f, vjp, args, mode=mode)
    assert report.max_rel_err < 1e-7


def test_gradients_are_none_exactly_when_parameter_is_none():
    """Protects the return contract: dgamma/dbeta None iff the parameter was None."""
    x = RNG.standard_normal((3, 4))
    g, b = _affine(4)
    for gamma, beta in [(g, b), (g, None), (None, b), (None, None)]:
        _, dx, dg, db = _fwd_bwd(x, gamma, beta, np.ones_like(x))
        assert dx.shape == x.shape
        assert (dg is None) == (gamma is None) and (db is None) == (beta is None)
        if dg is not None:
            assert dg.shape == (4,)
        if db is not None:
            assert db.shape == (4,)


def test_cache_holds_only_xhat_rstd_and_gamma():
    """Protects requirement 2: the cache holds xhat (M·D), rstd (M) and a copy of gamma (D)."""
    x = RNG.standard_normal((6, 5, 8))
    g, b = _affine(8)
    y, cache = ln.layer_norm_forward(x, g, b)
    assert cache.xhat.shape == (30, 8) and cache.rstd.shape == (30,)
    assert not np.shares_memory(cache.scale, g) and np.array_equal(cache.scale, g)
    arrays = [v for v in vars(cache).values() if isinstance(v, np.ndarray)]
    assert sum(a.nbytes for a in arrays) == cache.nbytes == (30 * 8 + 30 + 8) * 8
    assert not np.shares_memory(y, cache.xhat)  # the caller may write y
    assert_close(cache.xhat,
                 ((x - x.mean(-1, keepdims=True)) * cache.rstd.reshape(6, 5, 1)).reshape(30, 8))


def test_all_zero_input():
    """Protects var = 0: y = beta and dx = rstd·(g - mean(g)) with rstd = 1/sqrt(eps)."""
    x = np.zeros((3, 6))
    g, b = _affine(6)
    dy = RNG.standard_normal((3, 6))
    y, dx, dg, db = _fwd_bwd(x, g, b, dy, eps=1e-5)
    np.testing.assert_array_equal(y, np.broadcast_to(b, y.shape))  # xhat = 0 exactly
    gg = dy * g
    want = (gg - gg.mean(1, keepdims=True)) / np.sqrt(1e-5)  # (3, 6) of size ~ 1/sqrt(eps)
    tolerances.assert_close(dx, want, "float64", scale=np.max(np.abs(want)), name="dx")
    np.testing.assert_array_equal(dg, np.zeros(6))
    assert_close(db, dy.sum(0), quantity="param")


def test_d_equals_one():
    """Protects D = 1: every row is its own mean, so y = beta and dx = 0."""
    x = RNG.standard_normal((5, 1)) * 100
    g, b = np.array([2.5]), np.array([-0.7])
    y, dx, dg, db = _fwd_bwd(x, g, b, RNG.standard_normal((5, 1)))
    np.testing.assert_array_equal(y, np.full((5, 1), -0.7))  # x - mean = 0 exactly
    np.testing.assert_array_equal(dx, np.zeros((5, 1)))


def test_one_constant_row_among_random_rows():
    """Protects row independence: a zero-variance row neither breaks nor affects the others."""
    x = RNG.standard_normal((4, 32))
    x[2] = 7.25
    g, b = _affine(32)
    dy = RNG.standard_normal((4, 32))
    y, dx, _, _ = _fwd_bwd(x, g, b, dy)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx))
    np.testing.assert_array_equal(y[2], b)  # xhat = 0 exactly
    others = [0, 1, 3]
    y3, dx3, _, _ = _fwd_bwd(x[others], g, b, dy[others])
    np.testing.assert_array_equal(y[others], y3)
    np.testing.assert_array_equal(dx[others], dx3)


@pytest.mark.parametrize("a,c", [(3.0, 0.0), (1e-3, 5.0), (250.0, -1e4)])
def test_scale_and_shift_invariance(a, c):
    """Protects y(a·x + c) = y(x) and dx(a·x + c) = dx(x)/a (eps scaled by a², exact maths)."""
    x = RNG.standard_normal((6, 40))
    g, b = _affine(40)
    dy = RNG.standard_normal((6, 40))
    y1, dx1, dg1, db1 = _fwd_bwd(x, g, b, dy, eps=1e-5)
    y2, dx2, dg2, db2 = _fwd_bwd(a * x + c, g, b, dy, eps=1e-5 * a * a)
    # Not a table tolerance: a * x + c is rounded, so the two sides have different inputs; 1e-9
    # bounds that input perturbation (~ u * |c| / (a * std) = 5e-13 for a = 1e-3, c = 5),
    # conditioned by the shift, not the error of one computation.
    np.testing.assert_allclose(y2, y1, atol=1e-9, rtol=1e-9)
    np.testing.assert_allclose(dx2 * a, dx1, atol=1e-9, rtol=1e-9)
    np.testing.assert_allclose(dg2, dg1, atol=1e-9, rtol=1e-9)
    np.testing.assert_array_equal(db2, db1)  # dbeta = sum of dy: the same dy


@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
def test_leading_axes_are_independent_rows(ndim):
    """Protects the (..., D) contract: any leading shape equals the same rows as (M, D)."""
    shape = (2, 3, 4, 10)[-ndim:]
    x = RNG.standard_normal(shape)
    dy = RNG.standard_normal(shape)
    g, b = _affine(10)
    got = _fwd_bwd(x, g, b, dy)
    flat = _fwd_bwd(x.reshape(-1, 10), g, b, dy.reshape(-1, 10))
    assert got[0].shape == shape and got[1].shape == shape
    np.testing.assert_array_equal(got[0], flat[0].reshape(shape))
    np.testing.assert_array_equal(got[1], flat[1].reshape(shape))


def test_non_contiguous_inputs_and_no_mutation():
    """Protects strided inputs (transposes, slices) and the promise never to modify inputs."""
    base = RNG.standard_normal((12, 40))
    x = base.T[::2]  # (20, 12), non-contiguous
    dy = RNG.standard_normal((12, 40)).T[::2]
    g = RNG.standard_normal(24)[::2]
    b = RNG.standard_normal(24)[::2]
    saved = [a.copy() for a in (x, dy, g, b)]
    got = _fwd_bwd(x, g, b, dy)
    want = _fwd_bwd(*(np.ascontiguousarray(a) for a in (x, g, b, dy)))
    for a, w in zip(got, want, strict=True):
        assert_close(a, w)
    for a, s in zip((x, dy, g, b), saved, strict=True):
        np.testing.assert_array_equal(a, s)


def test_float16_with_large_values_is_right():
    """Protects the dtype policy: float16 |x| ~ 300 (x² overflows float16) still normalizes.

    Statistics in float16 would give var = inf, y = beta and dx = 0; ours stay in float32.
    """
    x = (300 + 20 * RNG.standard_normal((8, 64))).astype(np.float16)
    g, b = (a.astype(np.float16) for a in _affine(64))
    dy = RNG.standard_normal((8, 64)).astype(np.float16)
    y, dx, dg, db = _fwd_bwd(x, g, b, dy)
    assert y.dtype == dx.dtype == dg.dtype == db.dtype == np.float16
    want = _fwd_bwd(*(a.astype(np.float64) for a in (x, g, b, dy)))
    assert_close(y, want[0], "float16")
    assert_close(dx, want[1], "float16")
    assert np.abs(dx).max() > 1e-3  # not the silent dx = 0 of float16 statistics


def test_float16_extremes_stay_finite():
    """Protects float16 near its largest value 65504: squares would overflow in float16."""
    x = np.array([[6e4, -6e4, 3e4, -1e4]], dtype=np.float16)
    y, cache = ln.layer_norm_forward(x)
    dx, _, _ = ln.layer_norm_backward(np.ones_like(x), cache)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx))
    assert_close(y, ln.layer_norm_forward(x.astype(np.float64))[0], "float16")


def test_float64_constant_rows_at_the_top_of_the_range():
    """Protects the overflow path: a constant float64 row near 1e307 (its sum overflows,
    and eps scaled by 4**-e underflows) still gives y = beta and rstd = 1/sqrt(eps)."""
    x = np.full((2, 64), 1e307)
    x[1, ::2] = -1e307
    g, b = _affine(64)
    y, cache = ln.layer_norm_forward(x, g, b, eps=1e-5)
    np.testing.assert_array_equal(y[0], b)
    assert cache.rstd[0] == 1 / np.sqrt(1e-5)  # var = 0 exactly
    assert_close(y[1], g * np.tile([-1.0, 1.0], 32) + b)


def test_dtype_policy():
    """Protects: float64 stays float64, float32 stays float32, half computes in float32."""
    for dt, stat in [(np.float64, np.float64), (np.float32, np.float32), (np.float16, np.float32)]:
        x = RNG.standard_normal((3, 5)).astype(dt)
        y, cache = ln.layer_norm_forward(x)
        assert y.dtype == dt and cache.rstd.dtype == stat and cache.xhat.dtype == stat


def test_bfloat16_when_available():
    """Protects bfloat16 (ml_dtypes): computed in float32, returned in bfloat16."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    x = (50 + RNG.standard_normal((4, 48))).astype(bf16)
    g, b = (a.astype(bf16) for a in _affine(48))
    dy = RNG.standard_normal((4, 48)).astype(bf16)
    got = _fwd_bwd(x, g, b, dy)
    assert all(a.dtype == bf16 for a in got)
    want = _fwd_bwd(*(a.astype(np.float64) for a in (x, g, b, dy)))
    assert_close(got[0], want[0], "bfloat16")
    assert_close(got[1], want[1], "bfloat16")
    assert_close(got[2], want[2], "bfloat16", "param")


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    lead=hnp.array_shapes(min_dims=0, max_dims=3, max_side=5),
    d=st.integers(1, 70),
    dtype=st.sampled_from(["float32", "float64"]),
)
def test_property_against_float64_oracle(data, lead, d, dtype):
    """Protects every shape and value range: float32/64 results match the float64 reference
    on the same rounded inputs, and y without affine has zero mean and var/(var+eps)."""
    shape = (*lead, d)
    scale = data.draw(st.sampled_from([1e-2, 1.0, 1e3]))
    offset = data.draw(st.sampled_from([0.0, 1.0, -50.0]))
    elems = st.floats(-1, 1, allow_nan=False, width=32)
    x = (data.draw(hnp.arrays(np.float64, shape, elements=elems)) * scale + offset).astype(dtype)
    dy = data.draw(hnp.arrays(np.float64, shape, elements=elems)).astype(dtype)
    g = data.draw(hnp.arrays(np.float64, (d,), elements=elems)).astype(dtype)
    got = _fwd_bwd(x, g, None, dy)
    # the oracle runs in long double (64-bit mantissa on x86) so its own rounding is negligible
    ld = np.longdouble
    want = staged_chain_rule(x.reshape(-1, d).astype(ld), g.astype(ld), ld(0), ld(1e-5),
                             dy.reshape(-1, d).astype(ld))
    want = [w.astype(np.float64) for w in want]
    # x of moderate scale keeps the condition number moderate, so the table's bounds apply
    assert_close(got[0].reshape(-1, d), want[0], dtype)
    # dx cancels when g is near span{1, xhat}: bound its error by the size of the terms,
    # rstd·(|g| + |mean(g)| + |xhat|·mean|g·xhat|), not by |dx| (docs/numerics.md)
    x64 = x.reshape(-1, d).astype(np.float64)
    g64 = dy.reshape(-1, d).astype(np.float64) * g.astype(np.float64)
    rstd = 1 / np.sqrt(x64.var(axis=1, keepdims=True) + 1e-5)
    xhat = (x64 - x64.mean(axis=1, keepdims=True)) * rstd
    terms = rstd * (np.abs(g64) + np.abs(g64.mean(1, keepdims=True))
                    + np.abs(xhat) * np.abs(g64 * xhat).mean(1, keepdims=True))
    tol = tolerance(dtype, "out")
    assert np.all(np.abs(got[1].reshape(-1, d) - want[1]) <= tol.atol + tol.rtol * terms)
    # dgamma is a sum over rows that may cancel: bound its error by the sum of |terms|
    tol = tolerance(dtype, "param")
    terms = np.abs(dy.reshape(-1, d).astype(np.float64) * want[0] / np.where(g == 0, 1, g))
    assert np.all(np.abs(got[2] - want[2]) <= tol.atol + tol.rtol * terms.sum(0))
    y0, _ = ln.layer_norm_forward(x.astype(np.float64))
    y0 = y0.reshape(-1, d)
    xc = x.reshape(-1, d).astype(np.float64)
    var = xc.var(axis=1)
    assert_close(y0.mean(1), np.zeros(y0.shape[0]))
    assert_close((y0**2).mean(1), var / (var + 1e-5))


def test_layer_norm_module():
    """Protects the stateful module: ones/zeros init, cached forward, stored dgamma/dbeta."""
    m = ln.LayerNorm(16, eps=1e-6)
    assert np.all(m.gamma == 1) and np.all(m.beta == 0) and m.gamma.shape == (16,)
    m.gamma = RNG.standard_normal(16)
    x = RNG.standard_normal((4, 16))
    dy = RNG.standard_normal((4, 16))
    y = m.forward(x)
    dx = m.backward(dy)
    want = _fwd_bwd(x, m.gamma, m.beta, dy, eps=1e-6)
    for got, w in zip((y, dx, m.dgamma, m.dbeta), want, strict=True):
        np.testing.assert_array_equal(got, w)
    with pytest.raises(RuntimeError, match="before forward"):
        ln.LayerNorm(3).backward(np.ones((1, 3)))
    with pytest.raises(ValueError, match="D must be >= 1"):
        ln.LayerNorm(0)
    with pytest.raises(TypeError, match="D must be an integer"):
        ln.LayerNorm(2.5)


def test_cross_check_against_pytorch_autograd():
    """Protects against a shared blind spot: PyTorch's autograd, an independent implementation."""
    torch = pytest.importorskip("torch")
    x = RNG.standard_normal((2, 7, 96)) * 4 + 2
    g, b = _affine(96)
    dy = RNG.standard_normal((2, 7, 96))
    got = _fwd_bwd(x, g, b, dy, eps=1e-5)
    xt, gt, bt = (torch.tensor(a, requires_grad=True) for a in (x, g, b))
    yt = torch.nn.functional.layer_norm(xt, (96,), gt, bt, eps=1e-5)
    yt.backward(torch.tensor(dy))
    for a, w in zip(got, (yt, xt.grad, gt.grad, bt.grad), strict=True):
        assert_close(a, w.detach().numpy())  # dgamma, dbeta too: "out", as y and dx
