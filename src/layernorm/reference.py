r"""NumPy reference for layer normalization: the oracle every other backend is checked against.

The maths (one row of length D; docs/derivation.md has every step):

    mean = (1/D) sum_j x_j
    var  = (1/D) sum_j (x_j - mean)^2
    rstd = 1 / sqrt(var + eps)
    xhat = (x - mean) * rstd
    y    = gamma * xhat + beta

and, with g = dy * gamma (g = dy without gamma),

    dbeta  = sum over rows of dy
    dgamma = sum over rows of dy * xhat
    dx     = rstd * (g - mean(g) - xhat * mean(g * xhat))

The backward needs only xhat (M, D) and rstd (M,) from the forward, plus gamma: that is
all the cache holds. Two row reductions, mean(g) and mean(g * xhat), and no forward
recomputation. x, mean and var are not kept: xhat and rstd are what the formula reads. gamma
is copied (D elements), so the backward differentiates the forward that ran even when the
caller changes gamma in place in between (an optimizer step): every backend follows this rule.

Accuracy mechanism (chosen by measurement: ``layernorm stability``, docs/numerics.md). All
arithmetic is in the compute dtype cdt: float64 for float64 inputs, float32 for float32,
float16 and bfloat16 inputs; u is its unit roundoff (2**-24 float32, 2**-53 float64).
Per row of length D:

1. Statistics, corrected two-pass: m = mean(x); d = x - m; d = d - mean(d); var = mean(d*d);
   rstd = 1/sqrt(var + eps); xhat = d * rstd. The second subtraction removes the rounding
   error of m (up to half an ulp of |m|, plus the sum's error) from every centred value;
   without it y is off by ~ u*|mean|/std, and a constant row gives xhat = ±1, not 0.
2. Every row sum is pairwise (NumPy's over a C-contiguous row, error ~ u*log2(D)), never
   sequential (error ~ u*D). A kernel uses a tree or blocked sum, or Chan's merge of
   per-block (count, mean, M2).
3. A row whose sum or sum of squares overflows cdt (|sum(x)| or D*(x - mean)**2 above the
   largest float: |x - mean| ~ 1.8e19/sqrt(D) in float32 and bfloat16, 1.3e154/sqrt(D) in
   float64) is normalized as x*2**-e with eps*4**-e in float64 (a power-of-two scaling is
   exact; max|x*2**-e| < 1) and its rstd scaled back by 2**-e. Other rows pay one isfinite
   test of var.
4. Backward: g = dy*gamma, mean(g), mean(g*xhat) and dx = rstd*((g - mean(g)) -
   xhat*mean(g*xhat)) in cdt with pairwise row sums. When g is close to span{1, xhat} the
   bracket cancels: dx's normwise error is 2.1 to 3.8 u*kappa as measured by `layernorm
   stability` (tests assert <= 6 u*kappa), kappa = max|g|*rstd/max|dx|, set by the rounding
   of the cached xhat and of g. Accumulating the two row sums in
   float64 gains nothing (measured); float64 arithmetic from a float32 cache reaches that
   cache's floor, 0.4 to 0.9 u*kappa, at 3.3 to 3.9 times the time, and is not used.
5. Sums over rows (dgamma, dbeta) accumulate in float64.

Only NumPy is used here: no autodiff, no other array library.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._validate import check_dy, check_eps, check_param, check_x
from .dtypes import compute_dtype

__all__ = ["LayerNorm", "LayerNormCache", "layer_norm_backward", "layer_norm_forward"]


@dataclass(frozen=True)
class LayerNormCache:
    """What the backward needs from the forward, and nothing else.

    Attributes:
        xhat: (M, D) normalized input in the compute dtype (float32 or float64).
        rstd: (M,) 1/sqrt(var + eps) in the compute dtype.
        gamma: (D,) a copy of the forward's gamma in the compute dtype, or None.
        gamma_dtype: dtype of the forward's gamma (dgamma is returned in it), or None.
        beta_dtype: dtype of beta, or None when the forward had no beta (then dbeta is None).
        x_shape: shape of the forward's x; dy must have this shape.
        x_dtype: dtype of the forward's x; dx is returned in it.
    """

    xhat: np.ndarray
    rstd: np.ndarray
    gamma: np.ndarray | None
    gamma_dtype: np.dtype | None
    beta_dtype: np.dtype | None
    x_shape: tuple[int, ...]
    x_dtype: np.dtype

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds: xhat, rstd and the copy of gamma."""
        return self.xhat.nbytes + self.rstd.nbytes + (0 if self.gamma is None else
                                                       self.gamma.nbytes)


def _centre(xc: np.ndarray) -> np.ndarray:
    """Centre the rows of xc (M, D) in place, corrected two-pass; returns their variance (M,)."""
    xc -= xc.mean(axis=1, keepdims=True)  # (M, D) centred with the rounded mean
    # The rounded mean is off by up to half an ulp of |mean|, an error every centred value
    # carries; when |mean| >> std that error dominates. The mean of the centred values is that
    # error (small numbers, so computed accurately); subtracting it removes it.
    xc -= xc.mean(axis=1, keepdims=True)  # (M, D)
    return np.mean(np.square(xc), axis=1)  # (M,)


def _normalize(x2: np.ndarray, cdt: np.dtype, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """xhat (M, D) and rstd (M,) of the rows of x2, computed in ``cdt``."""
    # C order keeps rows contiguous, so NumPy's row sums are pairwise; along a strided axis they
    # are sequential (float32, x = 1e4 + N(0, 1), D = 1e5: y error 1.6e-5 instead of 1.0e-7).
    xc = x2.astype(cdt, order="C")  # (M, D) working copy: the caller's x is never written
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        var = _centre(xc)  # (M,)
        rstd = 1.0 / np.sqrt(var + cdt.type(eps))  # (M,)
        xc *= rstd[:, None]  # (M, D) xhat, in place
        big = ~np.isfinite(var)  # (M,) the sum or the squares overflowed cdt
        if np.any(big):
            # y is unchanged by x -> x*2**-e, eps -> eps*4**-e, and the scaling is exact.
            xs = x2[big].astype(np.float64)  # (B, D)
            e = np.frexp(np.max(np.abs(xs), axis=1))[1]  # (B,) max|x| < 2**e
            xs = np.ldexp(xs, -e[:, None])  # (B, D) max|xs| < 1
            var_s = _centre(xs)  # (B,)
            rstd_s = 1.0 / np.sqrt(var_s + np.ldexp(eps, -2 * e))  # (B,)
            # A constant row: eps*4**-e may underflow to 0, but var = 0 means rstd = 1/sqrt(eps)
            # and xhat = 0 exactly, whatever the scale.
            zero = var_s == 0  # (B,)
            xc[big] = np.where(zero[:, None], 0.0, xs * rstd_s[:, None])  # (B, D)
            rstd[big] = np.where(zero, 1.0 / np.sqrt(eps), np.ldexp(rstd_s, -e))  # (B,)
    return xc, rstd


def layer_norm_forward(
    x: np.ndarray,
    gamma: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    eps: float = 1e-5,
) -> tuple[np.ndarray, LayerNormCache]:
    """Layer norm over the last axis of ``x``.

    Args:
        x: (..., D) floating array with at least one axis; never modified.
        gamma: (D,) scale, or None for no scale. The cache keeps a copy.
        beta: (D,) shift, or None for no shift.
        eps: finite positive number added to the variance.

    Returns:
        y: same shape and dtype as x. float16/bfloat16 inputs are computed in float32.
        cache: a :class:`LayerNormCache` for :func:`layer_norm_backward`.
    """
    x = check_x(x)
    d = x.shape[-1]
    gamma = check_param(gamma, "gamma", d)
    beta = check_param(beta, "beta", d)
    cdt = compute_dtype(x.dtype)
    eps = check_eps(eps, cdt)

    xhat, rstd = _normalize(x.reshape(-1, d), cdt, eps)  # (M, D), (M,)
    gamma_c = None if gamma is None else np.array(gamma, dtype=cdt)  # (D,) a copy, always
    y = xhat.copy() if gamma_c is None else xhat * gamma_c  # (M, D): y must not alias the cache
    if beta is not None:
        y += beta.astype(cdt, copy=False)
    cache = LayerNormCache(
        xhat=xhat,
        rstd=rstd,
        gamma=gamma_c,
        gamma_dtype=None if gamma is None else gamma.dtype,
        beta_dtype=None if beta is None else beta.dtype,
        x_shape=x.shape,
        x_dtype=x.dtype,
    )
    return y.astype(x.dtype, copy=False).reshape(x.shape), cache


def layer_norm_backward(
    dy: np.ndarray, cache: LayerNormCache
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Gradients of layer norm given dL/dy and the forward's cache.

    Args:
        dy: gradient of the loss w.r.t. y, same shape as the forward's x; never modified.
        cache: the cache returned by :func:`layer_norm_forward`.

    Returns:
        dx: same shape and dtype as x.
        dgamma: (D,) in gamma's dtype, or None when the forward had no gamma.
        dbeta: (D,) in beta's dtype, or None when the forward had no beta.
    """
    dy = check_dy(dy, cache, LayerNormCache, "layer_norm_forward")
    xhat, rstd, gamma = cache.xhat, cache.rstd, cache.gamma  # (M, D), (M,), (D,) | None
    cdt = xhat.dtype
    d = xhat.shape[1]
    dy2 = dy.reshape(-1, d).astype(cdt, order="C", copy=False)  # (M, D) rows contiguous

    # Sums over rows accumulate in float64: a float32 sum down a column is sequential and
    # its error grows with M (docs/numerics.md).
    dbeta = None
    if cache.beta_dtype is not None:
        dbeta = dy2.sum(axis=0, dtype=np.float64).astype(cache.beta_dtype)  # (D,)
    dyxhat = dy2 * xhat  # (M, D), reused for dgamma and mean(g * xhat)
    if gamma is None:
        dgamma = None
        g = dy2.copy()  # (M, D) working buffer for dx
        gxhat = dyxhat  # (M, D)
    else:
        dgamma = dyxhat.sum(axis=0, dtype=np.float64).astype(cache.gamma_dtype)  # (D,)
        g = dy2 * gamma  # (M, D)
        gxhat = np.multiply(dyxhat, gamma, out=dyxhat)  # (M, D) g * xhat, in place
    mean_g = g.mean(axis=1, keepdims=True)  # (M, 1)
    mean_gxhat = gxhat.mean(axis=1, keepdims=True)  # (M, 1)
    # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), built in g's buffer
    g -= mean_g
    g -= np.multiply(xhat, mean_gxhat, out=gxhat)
    g *= rstd[:, None]
    dx = g.astype(cache.x_dtype, copy=False).reshape(cache.x_shape)
    return dx, dgamma, dbeta


class LayerNorm:
    """A stateful layer norm for NumPy networks.

    ``gamma`` starts at ones and ``beta`` at zeros (float64, shape (D,)). ``forward`` keeps
    the cache; ``backward`` returns dx and stores ``dgamma`` and ``dbeta``.
    """

    def __init__(self, D: int, eps: float = 1e-5) -> None:
        if isinstance(D, bool) or not isinstance(D, (int, np.integer)):
            raise TypeError(f"D must be an integer, got {type(D).__name__}: {D!r}")
        if D < 1:
            raise ValueError(f"D must be >= 1, got {D}")
        self.D = int(D)
        self.eps = check_eps(eps)
        self.gamma = np.ones(self.D)
        self.beta = np.zeros(self.D)
        self.dgamma: np.ndarray | None = None
        self.dbeta: np.ndarray | None = None
        self._cache: LayerNormCache | None = None

    def forward(self, x: np.ndarray) -> np.ndarray:
        """y for x of shape (..., D); keeps the cache for :meth:`backward`."""
        y, self._cache = layer_norm_forward(x, self.gamma, self.beta, self.eps)
        return y

    __call__ = forward

    def backward(self, dy: np.ndarray) -> np.ndarray:
        """dx for the last :meth:`forward`; sets ``dgamma`` and ``dbeta``."""
        if self._cache is None:
            raise RuntimeError("LayerNorm.backward called before forward")
        dx, self.dgamma, self.dbeta = layer_norm_backward(dy, self._cache)
        return dx

    def __repr__(self) -> str:
        return f"LayerNorm(D={self.D}, eps={self.eps})"
