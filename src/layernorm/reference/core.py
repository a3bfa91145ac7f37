"""What the reference's norms share: the caches, the statistics and normalization, the scale,
and one forward, backward (from xhat or from y) and forward-mode derivative for every norm
(the maths and the accuracy mechanism: :mod:`layernorm.reference`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._validate import check_dtype, check_dy, check_eps, check_flag, check_param, check_shape
from ..dtypes import compute_dtype, widest_compute_dtype
from ..recovery import kept_channels, kept_rows


@dataclass(frozen=True)
class NormCache:
    """What the backward of a norm needs from its forward, and nothing else.

    Attributes:
        centred: True for LayerNorm (the row mean was subtracted), False for RMSNorm.
        xhat: (M, D) normalized input in the compute dtype (float32 or float64).
        rstd: (M,) 1/sqrt(var + eps) (LayerNorm) or 1/sqrt(mean(x**2) + eps) (RMSNorm), in
            the compute dtype.
        scale: (D,) gamma, or 1 + gamma with zero_centered_gamma, in the compute dtype: a copy
            made by the forward; None without gamma.
        gamma_dtype: dtype of the forward's gamma (dgamma is returned in it), or None.
        beta_dtype: dtype of beta, or None when the forward had no beta (then dbeta is None).
        x_shape: shape of the forward's x; dy must have this shape.
        x_dtype: dtype of the forward's x; dx is returned in it.
    """

    centred: bool
    xhat: np.ndarray
    rstd: np.ndarray
    scale: np.ndarray | None
    gamma_dtype: np.dtype | None
    beta_dtype: np.dtype | None
    x_shape: tuple[int, ...]
    x_dtype: np.dtype

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds: xhat, rstd and the copy of the scale."""
        return self.xhat.nbytes + self.rstd.nbytes + (0 if self.scale is None else
                                                       self.scale.nbytes)


@dataclass(frozen=True)
class OutputCache:
    """What the memory-efficient backward needs: the forward's output y instead of xhat.

    The backward recovers xhat = (y - shift) / scale on the channels :mod:`layernorm.recovery`
    recovers and reads ``xhat_kept`` on the others (docs/derivation.md, "Backward from y").

    Attributes:
        centred: True for LayerNorm, False for RMSNorm.
        y: (M, D) the forward's output as returned (x's dtype), read-only: the array the next
            layer keeps anyway, so it is not counted in ``nbytes``.
        rstd: (M,) as in :class:`NormCache`, in the compute dtype.
        scale: (D,) the scale in the compute dtype (a copy), or None without gamma.
        shift: (D,) beta in the compute dtype (a copy), or None (RMSNorm, or no beta).
        keep: (k,) int64, the channels whose xhat cannot be recovered from y.
        xhat_kept: (M, k) xhat of those channels, in the compute dtype.
        rows: (r,) int64, the rows kept whole (var < eps under a non-zero shift).
        xhat_rows: (r, D) xhat of those rows, in the compute dtype.
        gamma_dtype, beta_dtype, x_shape, x_dtype: as in :class:`NormCache`.
    """

    centred: bool
    y: np.ndarray
    rstd: np.ndarray
    scale: np.ndarray | None
    shift: np.ndarray | None
    keep: np.ndarray
    xhat_kept: np.ndarray
    rows: np.ndarray
    xhat_rows: np.ndarray
    gamma_dtype: np.dtype | None
    beta_dtype: np.dtype | None
    x_shape: tuple[int, ...]
    x_dtype: np.dtype

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds of its own: rstd, the kept channels and rows and the parameter
        copies (y is the caller's output)."""
        own = (self.rstd, self.keep, self.xhat_kept, self.rows, self.xhat_rows, self.scale,
               self.shift)
        return sum(0 if a is None else a.nbytes for a in own)

    def xhat(self) -> np.ndarray:
        """(M, D) xhat in the compute dtype: recovered from y, the kept channels as stored."""
        cdt = self.rstd.dtype
        d = self.x_shape[-1]
        xhat = self.y.reshape(-1, d).astype(cdt)  # (M, D) a new array
        if self.shift is not None:
            xhat -= self.shift
        if self.scale is not None:
            with np.errstate(divide="ignore", invalid="ignore"):  # kept channels: replaced
                xhat /= self.scale
        xhat[:, self.keep] = self.xhat_kept
        xhat[self.rows] = self.xhat_rows
        return xhat


@dataclass(frozen=True)
class AddNormCache:
    """What the backward of an add-norm needs: the norm's cache of h, and two dtypes.

    Attributes:
        norm: the :class:`NormCache` (or :class:`OutputCache`) of the norm of h (its x_dtype
            is h's dtype).
        dx_dtype: dtype of the forward's x; dx is returned in it.
        dresidual_dtype: dtype of the forward's residual; dresidual is returned in it.
    """

    norm: NormCache | OutputCache
    dx_dtype: np.dtype
    dresidual_dtype: np.dtype

    @property
    def x_shape(self) -> tuple[int, ...]:
        """Shape of x, residual, h, y, and so of dy and dh."""
        return self.norm.x_shape

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds: the norm's cache; h, x and residual are not kept."""
        return self.norm.nbytes


def _second_moment(xc: np.ndarray, centred: bool) -> np.ndarray:
    """Centre the rows of xc (M, D) in place when ``centred`` (corrected two-pass); returns
    their mean square (M,): the variance, or mean(x**2) uncentred."""
    if centred:
        xc -= xc.mean(axis=1, keepdims=True)  # (M, D) centred with the rounded mean
        # The rounded mean is off by up to half an ulp of |mean|, an error every centred value
        # carries; when |mean| >> std that error dominates. The mean of the centred values is
        # that error (small numbers, so computed accurately); subtracting it removes it.
        xc -= xc.mean(axis=1, keepdims=True)  # (M, D)
    return np.mean(np.square(xc), axis=1)  # (M,)


def _normalize(x2: np.ndarray, cdt: np.dtype, eps: float,
               centred: bool) -> tuple[np.ndarray, np.ndarray]:
    """xhat (M, D) and rstd (M,) of the rows of x2, computed in ``cdt``."""
    # C order keeps rows contiguous, so NumPy's row sums are pairwise; along a strided axis they
    # are sequential (float32, x = 1e4 + N(0, 1), D = 1e5: y error 1.6e-5 instead of 1.0e-7).
    xc = x2.astype(cdt, order="C")  # (M, D) working copy: the caller's x is never written
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        var = _second_moment(xc, centred)  # (M,)
        rstd = 1.0 / np.sqrt(var + cdt.type(eps))  # (M,)
        xc *= rstd[:, None]  # (M, D) xhat, in place
        big = ~np.isfinite(var)  # (M,) the sum or the squares overflowed cdt
        if np.any(big):
            # y is unchanged by x -> x*2**-e, eps -> eps*4**-e, and the scaling is exact.
            xs = x2[big].astype(np.float64)  # (B, D)
            e = np.frexp(np.max(np.abs(xs), axis=1))[1]  # (B,) max|x| < 2**e
            xs = np.ldexp(xs, -e[:, None])  # (B, D) max|xs| < 1
            var_s = _second_moment(xs, centred)  # (B,)
            eps_c = float(cdt.type(eps))  # eps as cdt's value, as the other rows add it
            rstd_s = 1.0 / np.sqrt(var_s + np.ldexp(eps_c, -2 * e))  # (B,)
            # A constant row (LayerNorm): eps*4**-e may underflow to 0, but var = 0 means
            # rstd = 1/sqrt(eps) and xhat = 0 exactly, whatever the scale (0 * inf = NaN where
            # eps is 0, as on every other row). An RMSNorm row that overflowed has
            # mean(xs**2) >= 1/(4 D), never 0.
            r0 = 1.0 / np.sqrt(eps_c)
            zero = var_s == 0  # (B,)
            xc[big] = np.where(zero[:, None], 0.0 * r0, xs * rstd_s[:, None])  # (B, D)
            rstd[big] = np.where(zero, r0, np.ldexp(rstd_s, -e))  # (B,)
    return xc, rstd


def form_scale(gamma: np.ndarray, cdt: np.dtype, zero_centered_gamma: bool) -> np.ndarray:
    """The scale, a new (D,) array in the compute dtype ``cdt``: a copy of gamma, or 1 + gamma
    formed in cdt, never rounded to a half dtype first. Every backend's cache keeps this copy,
    so the backward differentiates the forward that ran."""
    if zero_centered_gamma:
        return gamma.astype(cdt) + cdt.type(1)
    return np.array(gamma, dtype=cdt)


def _add_residual(x: np.ndarray, residual: object,
                  residual_dtype: object) -> tuple[np.ndarray, np.ndarray]:
    """(residual, h): the residual checked against x's shape, and h = x + residual formed in the
    widest compute dtype of x, residual and h, rounded once to h's dtype (``residual_dtype``,
    x's by default)."""
    residual = check_shape(residual, "residual", x.shape, "x")
    h_dtype = check_dtype(residual_dtype, "residual_dtype", x.dtype)
    adt = widest_compute_dtype(x.dtype, residual.dtype, h_dtype)
    # one rounding to h's dtype (none when it is the add's compute dtype)
    return residual, np.add(x, residual, dtype=adt).astype(h_dtype, copy=False)  # (..., D)


def _forward(x: np.ndarray, gamma: object, beta: object, eps: object, centred: bool,
             zero_centered_gamma: object, memory_efficient: object = False,
             y_dtype: np.dtype | None = None) -> tuple[np.ndarray, NormCache | OutputCache]:
    """y of x's shape in ``y_dtype`` (x's dtype by default) and the cache; x is checked, the
    rest is checked here. In memory-efficient mode y is read-only: the cache holds it."""
    d = x.shape[-1]
    gamma = check_param(gamma, "gamma", d)
    beta = check_param(beta, "beta", d)
    zero_centered_gamma = check_flag(zero_centered_gamma, "zero_centered_gamma")
    memory_efficient = check_flag(memory_efficient, "memory_efficient")
    cdt = compute_dtype(x.dtype)
    eps = check_eps(eps)
    y_dtype = x.dtype if y_dtype is None else y_dtype

    xhat, rstd = _normalize(x.reshape(-1, d), cdt, eps, centred)  # (M, D), (M,)
    scale = None if gamma is None else form_scale(gamma, cdt, zero_centered_gamma)  # (D,)
    shift = None if beta is None else beta.astype(cdt)  # (D,) a copy
    y = xhat.copy() if scale is None else xhat * scale  # (M, D): y must not alias the cache
    if shift is not None:
        y += shift
    y = y.astype(y_dtype, copy=False)  # (M, D) rounded once
    params = dict(gamma_dtype=None if gamma is None else gamma.dtype,
                  beta_dtype=None if beta is None else beta.dtype, x_shape=x.shape,
                  x_dtype=x.dtype)
    if not memory_efficient:
        return y.reshape(x.shape), NormCache(centred=centred, xhat=xhat, rstd=rstd, scale=scale,
                                             **params)
    y.flags.writeable = False  # the backward reads it: a change would go unnoticed
    keep = kept_channels(scale, shift, y_dtype, d)  # (k,)
    rows = kept_rows(rstd, eps, shift, keep)  # (r,)
    y = y.reshape(x.shape)
    return y, OutputCache(centred=centred, y=y, rstd=rstd, scale=scale, shift=shift, keep=keep,
                          xhat_kept=xhat[:, keep], rows=rows, xhat_rows=xhat[rows], **params)


def _backward(dy: np.ndarray, cache: NormCache | OutputCache, dtype: np.dtype
              ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """dx (M, D) in ``dtype``, dgamma and dbeta (in their dtypes, or None).

    dx = rstd * (g - [mean(g) if centred] - xhat * mean(g * xhat)), g = dy * scale, computed
    in the compute dtype and rounded once to ``dtype``.
    """
    if isinstance(cache, OutputCache):
        return _backward_from_y(dy, cache, dtype)
    xhat, rstd, scale = cache.xhat, cache.rstd, cache.scale  # (M, D), (M,), (D,) | None
    cdt = xhat.dtype
    d = xhat.shape[1]
    dy2 = dy.reshape(-1, d).astype(cdt, order="C", copy=False)  # (M, D) rows contiguous

    # Sums over rows accumulate in float64: a float32 sum down a column is sequential and
    # its error grows with M (docs/numerics.md).
    dbeta = None
    if cache.beta_dtype is not None:
        dbeta = dy2.sum(axis=0, dtype=np.float64).astype(cache.beta_dtype)  # (D,)
    dyxhat = dy2 * xhat  # (M, D), reused for dgamma and mean(g * xhat)
    if scale is None:
        dgamma = None
        g = dy2.copy()  # (M, D) working buffer for dx
        gxhat = dyxhat  # (M, D)
    else:
        # d scale/d gamma = 1 for scale = gamma and for scale = 1 + gamma alike
        dgamma = dyxhat.sum(axis=0, dtype=np.float64).astype(cache.gamma_dtype)  # (D,)
        g = dy2 * scale  # (M, D)
        gxhat = np.multiply(dyxhat, scale, out=dyxhat)  # (M, D) g * xhat, in place
    mean_gxhat = gxhat.mean(axis=1, keepdims=True)  # (M, 1)
    # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), built in g's buffer
    if cache.centred:
        g -= g.mean(axis=1, keepdims=True)  # (M, D)
    g -= np.multiply(xhat, mean_gxhat, out=gxhat)
    g *= rstd[:, None]
    return g.astype(dtype, copy=False), dgamma, dbeta


def _backward_from_y(dy: np.ndarray, cache: OutputCache, dtype: np.dtype
                     ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """:func:`_backward` from y (docs/derivation.md, "The backward from y").

    With t = y - shift, t = scale * xhat on the recovered channels, so g * xhat = dy * t and
    dgamma = sum(dy * t) / scale need no division per element; only xhat = t / scale in dx
    does. t and the products dy * t are formed in float64, where they are exact for 16- and
    32-bit data, so that the one rounding recovery adds (y's) is the only one: dgamma and
    mean(g * xhat) are then as accurate as the default mode's. The kept channels use their
    stored xhat.
    """
    rstd, scale, keep = cache.rstd, cache.scale, cache.keep  # (M,), (D,) | None, (k,)
    cdt = rstd.dtype
    d = cache.x_shape[-1]
    dy2 = dy.reshape(-1, d).astype(cdt, order="C", copy=False)  # (M, D)
    t = cache.y.reshape(-1, d).astype(np.float64)  # (M, D) a new array
    if cache.shift is not None:
        t -= cache.shift  # exact for 16- and 32-bit y and shift
    xk = cache.xhat_kept  # (M, k)
    rows = cache.rows  # (r,)
    t[rows] = cache.xhat_rows  # (r, D) to float64: scale * xhat on the rows kept whole
    if scale is not None:
        t[rows] *= scale
    gxhat = dy2 * t  # (M, D) float64: g * xhat on the recovered channels
    gk = dy2[:, keep] * xk.astype(np.float64)  # (M, k) dy * xhat on the kept ones
    dbeta = None
    if cache.beta_dtype is not None:
        dbeta = dy2.sum(axis=0, dtype=np.float64).astype(cache.beta_dtype)  # (D,)
    dgamma = None
    if scale is None:
        g = dy2.copy()  # (M, D) working buffer for dx
        gxhat[:, keep] = gk
    else:
        s64 = scale.astype(np.float64)  # (D,)
        with np.errstate(divide="ignore", invalid="ignore"):  # kept channels: replaced
            dg = gxhat.sum(axis=0) / s64  # (D,)
            t /= s64  # (M, D) xhat on the recovered channels
        dg[keep] = gk.sum(axis=0)
        dgamma = dg.astype(cache.gamma_dtype)
        g = dy2 * scale  # (M, D)
        gxhat[:, keep] = gk * s64[keep]
    xhat = t.astype(cdt)  # (M, D) rounded once
    xhat[:, keep] = xk
    xhat[rows] = cache.xhat_rows
    mean_gxhat = gxhat.mean(axis=1, keepdims=True).astype(cdt)  # (M, 1)
    if cache.centred:
        g -= g.mean(axis=1, keepdims=True)  # (M, D)
    g -= np.multiply(xhat, mean_gxhat, out=xhat)
    g *= rstd[:, None]
    return g.astype(dtype, copy=False), dgamma, dbeta


def _jvp(cache: NormCache, u: np.ndarray | None, tgamma: object, tbeta: object,
         dtype: np.dtype) -> np.ndarray:
    """t_y (M, D) in ``dtype``: the forward-mode derivative along the tangents u (M, D) of the
    normalized input (None: zero), tgamma and tbeta (None: zero), computed in the compute dtype
    and rounded once."""
    xhat, rstd, scale = cache.xhat, cache.rstd, cache.scale  # (M, D), (M,), (D,) | None
    cdt = xhat.dtype
    d = xhat.shape[1]
    tgamma = check_param(tgamma, "tgamma", d)
    tbeta = check_param(tbeta, "tbeta", d)
    if tgamma is not None and scale is None:
        raise ValueError("tgamma must be None: the forward had no gamma")
    if tbeta is not None and cache.beta_dtype is None:
        raise ValueError("tbeta must be None: the forward had no beta")
    if u is None:
        ty = np.zeros_like(xhat)  # (M, D)
    else:
        t = u.reshape(-1, d).astype(cdt, order="C")  # (M, D) a new array: t_xhat, built in it
        if cache.centred:
            t -= t.mean(axis=1, keepdims=True)
        t -= xhat * np.mean(xhat * t, axis=1, keepdims=True)
        t *= rstd[:, None]
        ty = t if scale is None else np.multiply(t, scale, out=t)
    if tgamma is not None:
        ty += xhat * tgamma.astype(cdt)  # d(1 + gamma) = tgamma too
    if tbeta is not None:
        ty += tbeta.astype(cdt)
    return ty.astype(dtype, copy=False)


def _check_jvp_cache(cache: object, centred: bool, producer: str,
                     cache_type: type = NormCache) -> None:
    """``cache`` must be a default-mode cache of ``producer`` (a norm of this kind)."""
    norm = cache.norm if isinstance(cache, AddNormCache) else cache
    if not isinstance(cache, cache_type) or not isinstance(norm, NormCache):
        raise TypeError(f"cache must be the {cache_type.__name__} returned by {producer} with "
                        f"memory_efficient=False (forward mode reads xhat), got "
                        f"{type(norm if isinstance(cache, cache_type) else cache).__name__}")
    if norm.centred != centred:
        raise ValueError(f"cache must be the {cache_type.__name__} returned by {producer}, got "
                         f"the cache of {'a layer norm' if norm.centred else 'an RMS norm'}")


def _tangent(t: object, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    return None if t is None else check_shape(t, name, shape, "the forward's x")


_NORM_CACHES = (NormCache, OutputCache)


def _check_cache(dy: object, cache: object, cache_type: type | tuple[type, ...],
                 centred: bool, producer: str) -> np.ndarray:
    """dy checked against ``cache``, which must come from ``producer`` (a norm of this kind)."""
    dy = check_dy(dy, cache, cache_type, producer)
    norm = cache.norm if isinstance(cache, AddNormCache) else cache
    if norm.centred != centred:
        types = cache_type if isinstance(cache_type, tuple) else (cache_type,)
        raise ValueError(f"cache must be the {' or '.join(t.__name__ for t in types)} returned "
                         f"by {producer}, "
                         f"got the cache of {'a layer norm' if norm.centred else 'an RMS norm'}")
    return dy
