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
recomputation. x, mean and var are not kept: xhat and rstd are what the formula reads.

Accuracy mechanism (measured in docs/numerics.md): the centred values get one correction
pass, x - mean - mean(x - mean), which removes the rounding error of the mean from every
centred value; sums over rows (dgamma, dbeta) accumulate in float64.

Only NumPy is used here: no autodiff, no other array library.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._validate import as_float_array, check_eps, check_param, compute_dtype

__all__ = ["LayerNorm", "LayerNormCache", "layer_norm_backward", "layer_norm_forward"]


@dataclass(frozen=True)
class LayerNormCache:
    """What the backward needs from the forward, and nothing else.

    Attributes:
        xhat: (M, D) normalized input in the compute dtype (float32 or float64).
        rstd: (M,) 1/sqrt(var + eps) in the compute dtype.
        gamma: (D,) the caller's gamma (a reference, not a copy), or None.
        beta_dtype: dtype of beta, or None when the forward had no beta (then dbeta is None).
        x_shape: shape of the forward's x; dy must have this shape.
        x_dtype: dtype of the forward's x; dx is returned in it.
    """

    xhat: np.ndarray
    rstd: np.ndarray
    gamma: np.ndarray | None
    beta_dtype: np.dtype | None
    x_shape: tuple[int, ...]
    x_dtype: np.dtype

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds of its own (xhat and rstd; gamma is the caller's)."""
        return self.xhat.nbytes + self.rstd.nbytes


def _check_x(x: object) -> np.ndarray:
    x = as_float_array(x, "x")
    if x.ndim == 0:
        raise ValueError("x must have at least one axis (the normalized axis D), got a scalar")
    if x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last axis (D >= 1), got shape {x.shape}")
    return x


def _normalize(x2: np.ndarray, cdt: np.dtype, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """xhat (M, D) and rstd (M,) of the rows of x2, computed in ``cdt``."""
    xc = x2.astype(cdt, copy=True)  # (M, D) working copy: the caller's x is never written
    xc -= xc.mean(axis=1, keepdims=True)  # (M, D) centred with the rounded mean
    # The rounded mean is off by up to half an ulp of |mean|, an error every centred value
    # carries; when |mean| >> std that error dominates. The mean of the centred values is that
    # error (small numbers, so computed accurately); subtracting it removes it.
    xc -= xc.mean(axis=1, keepdims=True)  # (M, D)
    var = np.mean(np.square(xc), axis=1)  # (M,)
    rstd = 1.0 / np.sqrt(var + cdt.type(eps))  # (M,)
    xc *= rstd[:, None]  # (M, D) xhat, in place
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
        gamma: (D,) scale, or None for no scale.
        beta: (D,) shift, or None for no shift.
        eps: finite positive number added to the variance.

    Returns:
        y: same shape and dtype as x. float16/bfloat16 inputs are computed in float32.
        cache: a :class:`LayerNormCache` for :func:`layer_norm_backward`.
    """
    x = _check_x(x)
    d = x.shape[-1]
    gamma = check_param(gamma, "gamma", d)
    beta = check_param(beta, "beta", d)
    eps = check_eps(eps)
    cdt = compute_dtype(x.dtype)

    xhat, rstd = _normalize(x.reshape(-1, d), cdt, eps)  # (M, D), (M,)
    if gamma is None:
        y = xhat.copy()  # (M, D): y must not alias the cache
    else:
        y = xhat * gamma.astype(cdt, copy=False)  # (M, D)
    if beta is not None:
        y += beta.astype(cdt, copy=False)
    cache = LayerNormCache(
        xhat=xhat,
        rstd=rstd,
        gamma=gamma,
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
    if not isinstance(cache, LayerNormCache):
        raise TypeError(
            f"cache must be the LayerNormCache returned by layer_norm_forward, "
            f"got {type(cache).__name__}"
        )
    dy = as_float_array(dy, "dy")
    if dy.shape != cache.x_shape:
        raise ValueError(
            f"dy must have the shape of the forward's x and y, {cache.x_shape}; got {dy.shape} "
            f"(is this cache from another call?)"
        )
    xhat, rstd, gamma = cache.xhat, cache.rstd, cache.gamma  # (M, D), (M,), (D,) | None
    cdt = xhat.dtype
    d = xhat.shape[1]
    dy2 = dy.reshape(-1, d).astype(cdt, copy=False)  # (M, D)

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
        dgamma = dyxhat.sum(axis=0, dtype=np.float64).astype(gamma.dtype)  # (D,)
        gamma_c = gamma.astype(cdt, copy=False)  # (D,)
        g = dy2 * gamma_c  # (M, D)
        gxhat = np.multiply(dyxhat, gamma_c, out=dyxhat)  # (M, D) g * xhat, in place
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
