r"""Variance algorithms and an exact oracle: where the norms lose accuracy, measured.

Layer norm needs, per row x of length D, the mean and the population variance
var = (1/D) sum_j (x_j - mean)^2. Five ways to compute them, each in a chosen arithmetic dtype
(u below is that dtype's unit roundoff, 2**-24 for float32):

    naive       var = mean(x*x) - mean(x)**2. One pass, but the subtraction cancels: the
                relative error of var is ~ u*(mean/std)**2, and var can come out negative.
    two-pass    m = mean(x); var = mean((x - m)**2). var is accurate, but every centred value
                x - m carries m's rounding error (~ u*|mean|): y is off by ~ u*|mean|/std.
    corrected   m as above; c = mean(x - m) is m's rounding error, computed accurately from the
    two-pass    small centred values; centred values (x - m) - c and var = mean((x - m)**2) - c**2
                (the corrected two-pass formula of Chan, Golub and LeVeque).
    Welford     one pass, element by element: n += 1; delta = x_j - mean; mean += delta/n;
                M2 += delta*(x_j - mean); var = M2/D. Sequential, so errors grow with D.
    Chan        per-block moments (count, mean, M2) merged: for blocks a and b, n = n_a + n_b,
                delta = mean_b - mean_a, mean = mean_a + delta*n_b/n,
                M2 = M2_a + M2_b + delta**2*n_a*n_b/n. What a chunked row (very large D), a
                multi-threaded kernel or a sharded row computes; the blocks here use two-pass.

Each returns :class:`RowStats`, the mean as an unevaluated sum ``mean + mean_lo`` (``mean_lo``
is the corrected two-pass's c, zero for the others: rounded into ``mean`` it would vanish)
and ``var``. :func:`normalize` turns them into xhat = ((x - mean) - mean_lo)/sqrt(var + eps)
in the same dtype. Sums are NumPy's: pairwise along a contiguous row, except that NumPy sums
float16 with float32 partial sums and bfloat16 (ml_dtypes) sequentially in bfloat16.

The exact oracle, :func:`exact_norm` (LayerNorm, RMSNorm, and the add-norms given the rounded
h and dh; :func:`exact_layer_norm` is its LayerNorm), takes the float inputs as exact binary
values. Every finite float is an integer times a power of two, so with one exponent per array
the sum S of a row, the scaled centred values D*x_j - S and the sum Q of their squares are
exact Python integers, and var + eps = Q*4**e/D**3 + eps is an exact rational (RMSNorm: the
same with S = 0, so Q/D**3 is mean(x**2)). rstd = 1/sqrt(var + eps) is the one irrational
number: it is computed to 160 bits with ``math.isqrt``. The backward's bracket
g - mean(g) - xhat*mean(g*xhat) equals g - mean(g) - (x - mean)*mean(g*(x - mean))/(var + eps),
a rational, so it is exact (RMSNorm: no mean(g), and x for x - mean); xhat, y and dx are one
product with rstd away, and an add-norm's dh is added to dx before the one rounding. Each
result is rounded once, correctly, to float64 (Python's int/int division is correctly
rounded), so errors below 2**-53 of a value are not resolved. NumPy and the standard library
only: about ten big-integer operations per element (four rows of D = 1e5 take about half a
second).

Errors are reported normwise, :func:`relative_error` = max|got - exact|/max|exact|, and in
units of the output dtype's ulp at max|exact| (:func:`ulp_error`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from ._validate import as_float_array, check_eps, check_param
from .dtypes import DTYPES
from .reference import NormCache, layer_norm_backward, layer_norm_forward, rms_norm_forward

__all__ = [
    "BACKWARD_MECHANISMS",
    "VARIANCE_ALGORITHMS",
    "Exact",
    "Moments",
    "RowStats",
    "cancellation_inputs",
    "chan_merge",
    "exact_layer_norm",
    "exact_norm",
    "float32_backward",
    "float64_param_grads",
    "moments",
    "normalize",
    "relative_error",
    "ulp",
    "ulp_error",
    "unit_roundoff",
    "variance_chan",
    "variance_corrected_two_pass",
    "variance_naive",
    "variance_two_pass",
    "variance_welford",
]


def _significand_bits(dtype: DTypeLike) -> int:
    name = np.dtype(dtype).name
    try:
        return DTYPES[name].significand_bits
    except KeyError:
        raise TypeError(
            f"dtype must be float16, bfloat16, float32 or float64, got {name}"
        ) from None


def unit_roundoff(dtype: DTypeLike) -> float:
    """u = 2**-p for a dtype with p significand bits: the largest relative rounding error."""
    return 2.0 ** -_significand_bits(dtype)


def ulp(value: float, dtype: DTypeLike) -> float:
    """The spacing of ``dtype``'s floats at |value|, e.g. 2**-23 at 1 in float32 (the subnormal
    spacing below the normal range)."""
    value = abs(float(value))
    if value == 0.0 or not math.isfinite(value):
        raise ValueError(f"value must be finite and nonzero, got {value!r}")
    spacing = math.ldexp(1.0, math.frexp(value)[1] - _significand_bits(dtype))
    return max(spacing, DTYPES[np.dtype(dtype).name].subnormal)  # below the normal range: constant


def relative_error(got: np.ndarray, exact: np.ndarray) -> float:
    """max|got - exact| / max|exact|, the error relative to the largest exact magnitude.

    ``inf`` when ``got`` has a non-finite element; the absolute error max|got - exact| when
    ``exact`` is all zeros. Both arrays have the same shape; any float dtype.
    """
    got = np.asarray(got, dtype=np.float64)
    exact = np.asarray(exact, dtype=np.float64)
    if got.shape != exact.shape:
        raise ValueError(f"got has shape {got.shape} but exact has shape {exact.shape}")
    if not np.all(np.isfinite(got)):
        return math.inf
    if got.size == 0:
        return 0.0
    err = float(np.max(np.abs(got - exact)))
    scale = float(np.max(np.abs(exact)))
    return err / scale if scale > 0 else err


def ulp_error(got: np.ndarray, exact: np.ndarray, dtype: DTypeLike) -> float:
    """max|got - exact| in ulps of ``dtype`` at max|exact|; ``inf`` for non-finite ``got``.

    A result correctly rounded to ``dtype`` scores at most 0.5. ``exact`` must not be all zeros.
    """
    exact = np.asarray(exact, dtype=np.float64)
    scale = float(np.max(np.abs(exact)))
    err = relative_error(got, exact) * scale
    return err / ulp(scale, dtype) if math.isfinite(err) else math.inf


# --- variance algorithms -----------------------------------------------------------------


@dataclass(frozen=True)
class RowStats:
    """Mean and variance of each row, as computed by one algorithm in one dtype.

    Attributes:
        mean: (...,) the rounded mean.
        mean_lo: (...,) what the mean lacks: the correction of the corrected two-pass, zeros
            for the other algorithms. The centred values are (x - mean) - mean_lo.
        var: (...,) population variance (divided by D). May be negative (naive) or inf.
    """

    mean: np.ndarray
    mean_lo: np.ndarray
    var: np.ndarray


@dataclass(frozen=True)
class Moments:
    """Moments of a block of each row: what Chan's merge combines.

    Attributes:
        count: number of elements per row in the block.
        mean: (...,) block mean.
        m2: (...,) sum of squared deviations from the block mean.
    """

    count: int
    mean: np.ndarray
    m2: np.ndarray


def _rows(x: object, dtype: DTypeLike) -> np.ndarray:
    """x (..., D) as a C-contiguous array of the arithmetic dtype (x's own if None)."""
    arr = as_float_array(x, "x")
    if arr.ndim == 0 or arr.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last axis (D >= 1), got shape {arr.shape}")
    dt = arr.dtype if dtype is None else np.dtype(dtype)
    _significand_bits(dt)
    return np.ascontiguousarray(arr.astype(dt, copy=False))


def variance_naive(x: np.ndarray, dtype: DTypeLike = None) -> RowStats:
    """E[x^2] - E[x]^2 over the last axis of x (..., D), in ``dtype`` (default x's)."""
    x = _rows(x, dtype)
    mean = x.mean(axis=-1)  # (...,)
    var = np.mean(x * x, axis=-1) - mean * mean  # (...,) cancels when |mean| >> std
    return RowStats(mean, np.zeros_like(mean), var)


def variance_two_pass(x: np.ndarray, dtype: DTypeLike = None) -> RowStats:
    """mean, then the mean of squared deviations, over the last axis of x (..., D)."""
    x = _rows(x, dtype)
    mean = x.mean(axis=-1)  # (...,)
    d = x - mean[..., None]  # (..., D)
    var = np.mean(d * d, axis=-1)  # (...,)
    return RowStats(mean, np.zeros_like(mean), var)


def variance_corrected_two_pass(x: np.ndarray, dtype: DTypeLike = None) -> RowStats:
    """Two-pass plus the correction c = mean(x - m), over the last axis of x (..., D)."""
    x = _rows(x, dtype)
    mean = x.mean(axis=-1)  # (...,)
    d = x - mean[..., None]  # (..., D)
    c = d.mean(axis=-1)  # (...,) the rounding error of mean
    var = np.mean(d * d, axis=-1) - c * c  # (...,)
    return RowStats(mean, c, var)


def variance_welford(x: np.ndarray, dtype: DTypeLike = None) -> RowStats:
    """Welford's one-pass update, element by element along the last axis of x (..., D).

    The count is held in ``dtype`` as a kernel computing in that dtype would divide by it.
    """
    x = _rows(x, dtype)
    t = x.dtype.type
    mean = np.zeros(x.shape[:-1], x.dtype)  # (...,)
    m2 = np.zeros(x.shape[:-1], x.dtype)  # (...,)
    for j in range(x.shape[-1]):
        xj = x[..., j]  # (...,)
        delta = xj - mean
        mean = mean + delta / t(j + 1)
        m2 = m2 + delta * (xj - mean)
    return RowStats(mean, np.zeros_like(mean), m2 / t(x.shape[-1]))


def moments(x: np.ndarray, dtype: DTypeLike = None) -> Moments:
    """(count, mean, M2) of x (..., D) over its last axis, two-pass, in ``dtype``."""
    x = _rows(x, dtype)
    mean = x.mean(axis=-1)  # (...,)
    d = x - mean[..., None]  # (..., D)
    return Moments(x.shape[-1], mean, np.sum(d * d, axis=-1))


def chan_merge(a: Moments, b: Moments) -> Moments:
    """The moments of the concatenation of two blocks, from theirs (dtype of ``a.mean``)."""
    if a.mean.shape != b.mean.shape:
        raise ValueError(f"a and b must have the same rows, got {a.mean.shape} and {b.mean.shape}")
    n = a.count + b.count
    t = a.mean.dtype.type
    delta = b.mean - a.mean  # (...,)
    mean = a.mean + delta * t(b.count / n)
    m2 = a.m2 + b.m2 + delta * delta * t(a.count * b.count / n)
    return Moments(n, mean, m2)


def variance_chan(x: np.ndarray, dtype: DTypeLike = None, block: int = 128) -> RowStats:
    """Moments of consecutive blocks of ``block`` elements, merged left to right (Chan)."""
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block must be a positive integer, got {block!r}")
    x = _rows(x, dtype)
    acc = moments(x[..., :block])
    for start in range(block, x.shape[-1], block):
        acc = chan_merge(acc, moments(x[..., start : start + block]))
    return RowStats(acc.mean, np.zeros_like(acc.mean), acc.m2 / x.dtype.type(acc.count))


# name -> algorithm(x, dtype); the names are the columns of `layernorm stability`.
VARIANCE_ALGORITHMS: dict[str, Callable[[np.ndarray, DTypeLike], RowStats]] = {
    "naive": variance_naive,
    "two-pass": variance_two_pass,
    "corrected two-pass": variance_corrected_two_pass,
    "Welford": variance_welford,
    "Chan (blocks of 128)": variance_chan,
}


def normalize(x: np.ndarray, stats: RowStats, eps: float = 1e-5) -> np.ndarray:
    """xhat (..., D) = ((x - mean) - mean_lo) / sqrt(var + eps) in the dtype of ``stats``.

    NaN where var + eps < 0 (the naive algorithm), as a kernel without a clamp would give;
    NumPy warns of it, and of overflow, as for any array expression.
    """
    x = _rows(x, stats.var.dtype)
    t = x.dtype.type
    rstd = t(1) / np.sqrt(stats.var + t(check_eps(eps)))  # (...,)
    return ((x - stats.mean[..., None]) - stats.mean_lo[..., None]) * rstd[..., None]


# --- the exact oracle --------------------------------------------------------------------

_RSTD_BITS = 160


@dataclass(frozen=True)
class Exact:
    """Exact norm of given float inputs, each value correctly rounded to float64.

    Attributes:
        mean, var, rstd: x.shape[:-1]; for RMSNorm mean = 0 and var = mean(x**2).
        xhat, y: x.shape; y = scale*xhat + beta (scale = 1, beta = 0 where not given).
        dx: x.shape (dh + the norm's dx for an add-norm), or None without dy.
        dgamma: (D,) the sum over all rows of dy*xhat, or None without dy.
        dbeta: (D,) the sum over all rows of dy, or None without dy or for RMSNorm.
    """

    mean: np.ndarray
    var: np.ndarray
    rstd: np.ndarray
    xhat: np.ndarray
    y: np.ndarray
    dx: np.ndarray | None
    dgamma: np.ndarray | None
    dbeta: np.ndarray | None


def _as_fixed(a: np.ndarray) -> tuple[np.ndarray, int]:
    """Exact integers n (an object array of a's shape) and an exponent e with a == n * 2**e."""
    frac, exp = np.frexp(a.astype(np.float64))  # exact for every float dtype we take
    mant = (frac * 2.0**53).astype(np.int64)  # exact: |mant| < 2**53
    exp = exp.astype(np.int64) - 53
    nonzero = mant != 0
    e = int(exp[nonzero].min()) if np.any(nonzero) else 0
    shift = np.where(nonzero, exp - e, 0)
    return mant.astype(object) << shift.astype(object), e


def _divide(num: int, den: int) -> float:
    try:
        return num / den
    except OverflowError:  # beyond the largest float64: rounds to inf
        return math.inf if num > 0 else -math.inf


_DIVIDE = np.frompyfunc(_divide, 2, 1)


def _round(num: np.ndarray | int, den: int, e: int) -> np.ndarray:
    """float64 of num * 2**e / den, elementwise, each correctly rounded."""
    if e >= 0:
        num = num * (1 << e)
    else:
        den = den << -e
    return np.asarray(_DIVIDE(num, den), dtype=np.float64)


def _finite(a: np.ndarray | None, name: str) -> None:
    if a is not None and not np.all(np.isfinite(a.astype(np.float64))):
        raise ValueError(f"{name} must be finite for the exact oracle")


def _plus_one(ints: np.ndarray, e: int) -> tuple[np.ndarray, int]:
    """(ints * 2**e + 1) as integers and an exponent: 1 + gamma, exactly."""
    if e > 0:
        return ints * (1 << e) + 1, 0
    return ints + (1 << -e), e


def exact_norm(
    x: np.ndarray,
    gamma: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    eps: float = 1e-5,
    dy: np.ndarray | None = None,
    *,
    centred: bool = True,
    zero_centered_gamma: bool = False,
    dh: np.ndarray | None = None,
) -> Exact:
    """A norm of the family and its gradients for the inputs as given, exactly (module doc).

    LayerNorm with ``centred``, RMSNorm without: the RMSNorm row is the LayerNorm row with the
    mean taken as 0 (D*x = c * 2**ex, mean(x**2) + eps = v/w) and no mean(g) in the bracket,
    g - x*mean(g*x)/(mean(x**2) + eps). An add-norm is the norm of h = x + residual as the
    forward rounded it: pass that h as ``x`` and the residual stream's gradient as ``dh``;
    dx (= dresidual) is then dh + the norm's dx, summed exactly and rounded once.

    Args:
        x: (..., D) finite floats of any float dtype, taken as exact values (h for an add-norm).
        gamma: (D,) or None. With ``zero_centered_gamma`` the scale is 1 + gamma, exactly.
        beta: (D,) or None; LayerNorm only.
        eps: finite float >= 0, taken as its exact binary value.
        dy: x.shape, or None for the forward only.
        centred: True for LayerNorm, False for RMSNorm.
        zero_centered_gamma: scale by 1 + gamma.
        dh: x.shape or None: added to dx (needs dy).

    Returns:
        An :class:`Exact`, every array float64; for RMSNorm ``mean`` is 0, ``var`` is
        mean(x**2) and ``dbeta`` is None.
    """
    x = as_float_array(x, "x")
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last axis (D >= 1), got shape {x.shape}")
    d = x.shape[-1]
    gamma = check_param(gamma, "gamma", d)
    beta = check_param(beta, "beta", d)
    if beta is not None and not centred:
        raise ValueError("beta must be None for RMSNorm (centred=False)")
    eps = check_eps(eps)
    for name, a in (("dy", dy), ("dh", dh)):
        if a is not None and as_float_array(a, name).shape != x.shape:
            raise ValueError(f"{name} must have the shape of x, {x.shape}; got {np.shape(a)}")
    if dh is not None and dy is None:
        raise ValueError("dh needs dy: pass dy as well")
    dy = None if dy is None else as_float_array(dy, "dy")
    dh = None if dh is None else as_float_array(dh, "dh")
    for a, name in ((x, "x"), (gamma, "gamma"), (beta, "beta"), (dy, "dy"), (dh, "dh")):
        _finite(a, name)

    xi, ex = _as_fixed(x.reshape(-1, d))  # (M, D) x = xi * 2**ex
    g_int, eg = _as_fixed(gamma) if gamma is not None else (np.zeros(d, object), 0)  # (D,)
    if gamma is None and not zero_centered_gamma:
        g_int = np.ones(d, object)  # no gamma: scale 1
    elif zero_centered_gamma:
        g_int, eg = _plus_one(g_int, eg)  # scale = 1 + gamma = g_int * 2**eg
    b_int, eb = _as_fixed(beta) if beta is not None else (np.zeros(d, object), 0)  # (D,)
    s = xi.sum(axis=1) if centred else np.zeros(xi.shape[0], object)  # (M,) D*mean = s*2**ex
    c = d * xi - s[:, None]  # (M, D) D*(x - mean) = c * 2**ex
    q = (c * c).sum(axis=1)  # (M,) D**3 * var (D**3 * mean(x**2)) = q * 4**ex
    # var + eps = v / w with integers: 4**ex = a_num/a_den and eps = p_eps/q_eps.
    a_num, a_den = (1 << 2 * ex, 1) if ex >= 0 else (1, 1 << -2 * ex)
    p_eps, q_eps = eps.as_integer_ratio()
    v = q * (a_num * q_eps) + p_eps * d**3 * a_den  # (M,)
    w = d**3 * a_den * q_eps
    if dy is not None:
        dyi, edy = _as_fixed(dy.reshape(-1, d))  # (M, D) dy = dyi * 2**edy
        gi = dyi * g_int  # (M, D) g = dy*scale = gi * 2**(edy + eg)
        if dh is not None:
            dhi, edh = _as_fixed(dh.reshape(-1, d))  # (M, D) dh = dhi * 2**edh

    m = xi.shape[0]
    xhat, y, dx = (np.empty((m, d)) for _ in range(3))
    rstd = np.empty(m)
    dgamma_terms = []
    for r in range(m):
        vr = int(v[r])
        if vr == 0:  # eps = 0 and a constant row: 1/sqrt(var + eps) has no value
            raise ValueError(f"row {r} is constant and eps = 0: var + eps = 0, so rstd and the "
                             f"results have no exact value (every backend gives NaN there)")
        # rstd = sqrt(w/v) ~ rr * 2**-t, rr >= 2**(_RSTD_BITS + 1), so relative error < 2**-160
        t = max(0, _RSTD_BITS + (vr.bit_length() - w.bit_length() + 5) // 2)
        rr = math.isqrt((w << 2 * t) // vr)
        rstd[r] = _round(rr, 1, -t)
        xhat[r] = _round(c[r] * rr, d, ex - t)
        # y = scale*xhat + beta over the common exponent f
        f = min(eg + ex - t, eb)
        num = g_int * c[r] * rr * (1 << (eg + ex - t - f)) + b_int * d * (1 << (eb - f))
        y[r] = _round(num, d, f)
        if dy is not None:
            sg = gi[r].sum() if centred else 0
            cg = (gi[r] * c[r]).sum()
            # g - mean(g) - (x - mean)*mean(g*(x - mean))/(var + eps), over D**3 * v * a_den
            den = d**3 * vr * a_den
            bracket = gi[r] * den - sg * (den // d) - c[r] * (cg * a_num * w)  # (D,)
            e_dx = edy + eg - t  # the norm's dx = bracket * rr * 2**e_dx / den
            if dh is None:
                dx[r] = _round(bracket * rr, den, e_dx)
            else:
                f = min(e_dx, edh)
                num = bracket * rr * (1 << (e_dx - f)) + dhi[r] * den * (1 << (edh - f))
                dx[r] = _round(num, den, f)
            dgamma_terms.append((dyi[r] * c[r] * rr, t))

    lead = x.shape[:-1]
    dx_out = dgamma = dbeta = None
    if dy is not None:
        # sum over rows of dy*xhat = dyi*c*rr * 2**(edy + ex - t_r) / D, on the largest t
        t_max = max((t for _, t in dgamma_terms), default=0)
        total = sum((term * (1 << (t_max - t)) for term, t in dgamma_terms), np.zeros(d, object))
        dgamma = _round(total, d, edy + ex - t_max)
        dbeta = _round(dyi.sum(axis=0), 1, edy) if centred else None
        dx_out = dx.reshape(x.shape)
    return Exact(
        mean=_round(s, d, ex).reshape(lead),
        var=_round(q, d**3, 2 * ex).reshape(lead),
        rstd=rstd.reshape(lead),
        xhat=xhat.reshape(x.shape),
        y=y.reshape(x.shape),
        dx=dx_out,
        dgamma=dgamma,
        dbeta=dbeta,
    )


def exact_layer_norm(
    x: np.ndarray,
    gamma: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    eps: float = 1e-5,
    dy: np.ndarray | None = None,
) -> Exact:
    """Layer norm exactly: :func:`exact_norm` with ``centred=True`` (the arguments are its)."""
    return exact_norm(x, gamma, beta, eps, dy)


def float64_param_grads(
    x: np.ndarray, dy: np.ndarray, eps: float = 1e-5, *, centred: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """dgamma and dbeta (D,) for many rows, to about 1e-15 relative: the oracle where
    :func:`exact_norm` would be slow (millions of rows).

    xhat comes from the float64 reference on the given values (layer norm with ``centred``,
    corrected two-pass; RMS norm without; relative error ~1e-16), each product dy*xhat is
    rounded once to float64, and each column is summed exactly and rounded once by
    ``math.fsum``. x, dy: (M, D) of any float dtype.
    """
    x = as_float_array(x, "x")
    dy = as_float_array(dy, "dy")
    if x.ndim != 2 or dy.shape != x.shape:
        raise ValueError(f"x and dy must both be (M, D), got {x.shape} and {dy.shape}")
    forward = layer_norm_forward if centred else rms_norm_forward
    _, cache = forward(x.astype(np.float64), eps=eps)
    dy64 = dy.astype(np.float64)  # (M, D)
    prod = dy64 * cache.xhat  # (M, D)
    dgamma = np.array([math.fsum(col) for col in prod.T.tolist()])  # (D,)
    dbeta = np.array([math.fsum(col) for col in dy64.T.tolist()])  # (D,)
    return dgamma, dbeta


# --- the backward's cancellation: mechanisms compared ------------------------------------

# How a float32 layer norm can compute dx; the reference uses the first.
BACKWARD_MECHANISMS = (
    "float32 (the reference)",
    "float32, float64 row sums",
    "float64 arithmetic, float32 cache",
)


def float32_backward(
    x: np.ndarray, gamma: np.ndarray | None, dy: np.ndarray, eps: float, mechanism: str
) -> np.ndarray:
    """dx (M, D) float32 of a float32 layer norm, by one of :data:`BACKWARD_MECHANISMS`.

    - ``"float32 (the reference)"``: :func:`layer_norm_forward` and
      :func:`layer_norm_backward` on the float32 inputs.
    - ``"float32, float64 row sums"``: the same forward; in the backward, mean(g) and
      mean(g*xhat) are accumulated in float64, the rest in float32.
    - ``"float64 arithmetic, float32 cache"``: the forward in float64, its xhat and rstd
      rounded to a float32 cache, the backward in float64 from that cache, dx rounded once.

    x, dy: (M, D) float32; gamma: (D,) float32 or None.
    """
    if mechanism not in BACKWARD_MECHANISMS:
        raise ValueError(f"mechanism must be one of {BACKWARD_MECHANISMS}, got {mechanism!r}")
    x = as_float_array(x, "x")
    dy = as_float_array(dy, "dy")
    if mechanism == BACKWARD_MECHANISMS[0]:
        return layer_norm_backward(dy, layer_norm_forward(x, gamma, eps=eps)[1])[0]
    if mechanism == BACKWARD_MECHANISMS[1]:
        cache = layer_norm_forward(x, gamma, eps=eps)[1]
        g = dy if gamma is None else dy * gamma  # (M, D) float32
        mean_g = g.mean(axis=1, keepdims=True, dtype=np.float64).astype(np.float32)  # (M, 1)
        mean_gxhat = (g * cache.xhat).mean(axis=1, keepdims=True, dtype=np.float64)  # (M, 1)
        dx = (g - mean_g) - cache.xhat * mean_gxhat.astype(np.float32)  # (M, D)
        return dx * cache.rstd[:, None]
    gamma64 = None if gamma is None else gamma.astype(np.float64)
    cache64 = layer_norm_forward(x.astype(np.float64), gamma64, eps=eps)[1]
    rounded = NormCache(
        centred=True,
        xhat=cache64.xhat.astype(np.float32).astype(np.float64),
        rstd=cache64.rstd.astype(np.float32).astype(np.float64),
        scale=gamma64,
        gamma_dtype=None if gamma64 is None else gamma64.dtype,
        beta_dtype=None,
        x_shape=cache64.x_shape,
        x_dtype=np.dtype(np.float32),
    )
    return layer_norm_backward(dy.astype(np.float64), rounded)[0]


def cancellation_inputs(rng: np.random.Generator, m: int, d: int, rho: float, offset: float
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 x (m, d), gamma (d,), dy (m, d) with g = dy*gamma = 0.7 + 1.3*xhat + rho*N(0, 1).

    The smaller rho, the closer g is to span{1, xhat}, the smaller dx and the larger kappa.
    """
    x = (offset + rng.standard_normal((m, d))).astype(np.float32)
    xhat = exact_layer_norm(x).xhat  # (m, d)
    gamma = rng.uniform(0.5, 1.5, d).astype(np.float32)
    g = 0.7 + 1.3 * xhat + rho * rng.standard_normal((m, d))  # (m, d)
    return x, gamma, (g / gamma).astype(np.float32)
