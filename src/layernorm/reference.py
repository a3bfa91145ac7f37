r"""NumPy reference for the normalization family: the oracle every other backend is checked against.

The maths (one row of length D; docs/derivation.md has every step). LayerNorm centres the row;
RMSNorm does not, and has no shift:

    LayerNorm                              RMSNorm
    mean = (1/D) sum_j x_j
    var  = (1/D) sum_j (x_j - mean)^2      ms   = (1/D) sum_j x_j^2
    rstd = 1 / sqrt(var + eps)             rstd = 1 / sqrt(ms + eps)
    xhat = (x - mean) * rstd               xhat = x * rstd
    y    = scale * xhat + beta             y    = scale * xhat

scale is gamma, or 1 + gamma with ``zero_centered_gamma`` (no scale without gamma). With
g = dy * scale,

    dbeta  = sum over rows of dy
    dgamma = sum over rows of dy * xhat     (also with zero_centered_gamma: d(1 + gamma)/dgamma = 1)
    dx     = rstd * (g - mean(g) - xhat * mean(g * xhat))     LayerNorm: two row reductions
    dx     = rstd * (g - xhat * mean(g * xhat))               RMSNorm: one

The add-norms form h = x + residual, rounded once to ``residual_dtype``, and normalize h. x and
residual each enter h with derivative 1, so with dh the gradient reaching h from the residual
stream (h feeds the next block as well as the norm),

    dx = dresidual = dh + (the norm's dx with respect to h)

Forward mode (the Jacobian-vector product, docs/derivation.md "Forward mode"): with tangents
u of x, tgamma and tbeta,

    t_xhat = rstd * (u - mean(u) - xhat * mean(xhat * u))     LayerNorm (RMSNorm: no mean(u))
    t_y    = scale * t_xhat + tgamma * xhat + tbeta

the backward's operator applied to u: d xhat / dx is symmetric, so the same two (one) row
reductions give both products. An add-norm's tangent of h is tx + tresidual; t_y is the norm's
of it. The ``*_jvp`` functions read the same cache as the backward.

Both kinds share one statistics routine (centring optional), one backward core and one cache
class, :class:`NormCache`: xhat (M, D), rstd (M,) and a copy of the scale (D,). That is all
the formula reads: two (one) row reductions and no forward recomputation. x, mean and var are
not kept. The scale is copied, so the backward differentiates the forward that ran even when
the caller changes gamma in place in between (an optimizer step): every backend follows this
rule. The add-norms keep nothing more (:class:`AddNormCache`): not h, not x, not residual.

Accuracy mechanism (chosen by measurement: ``layernorm stability``, docs/numerics.md). All
arithmetic is in the compute dtype cdt: float64 for float64 inputs, float32 for float32,
float16 and bfloat16 inputs; u is its unit roundoff (2**-24 float32, 2**-53 float64).
Per row of length D:

1. LayerNorm statistics, corrected two-pass: m = mean(x); d = x - m; d = d - mean(d);
   var = mean(d*d); rstd = 1/sqrt(var + eps); xhat = d * rstd. The second subtraction removes
   the rounding error of m (up to half an ulp of |m|, plus the sum's error) from every centred
   value; without it y is off by ~ u*|mean|/std, and a constant row gives xhat = ±1, not 0.
   RMSNorm has no mean to subtract: ms = mean(x*x), a sum of non-negative terms, is accurate
   to ~ u*log2(D) relative with nothing to cancel.
2. Every row sum is pairwise (NumPy's over a C-contiguous row, error ~ u*log2(D)), never
   sequential (error ~ u*D). A kernel uses a tree or blocked sum, or Chan's merge of
   per-block (count, mean, M2).
3. A row whose sum or sum of squares overflows cdt (|sum(x)| or D*(x - mean)**2, D*x**2 for
   RMSNorm, above the largest float: |x - mean| or |x| ~ 1.8e19/sqrt(D) in float32 and
   bfloat16, 1.3e154/sqrt(D) in float64) is normalized as x*2**-e with eps*4**-e in float64
   (a power-of-two scaling is exact; max|x*2**-e| < 1) and its rstd scaled back by 2**-e.
   Other rows pay one isfinite test of var (ms).
4. Backward: g = dy*scale, the row means and dx in cdt with pairwise row sums. When g is
   close to span{1, xhat} (span{xhat} for RMSNorm) the bracket cancels: dx's normwise error
   is a few u*kappa, kappa = max|g|*rstd/max|dx|, set by the rounding of the cached xhat and
   of g (docs/numerics.md has the measurements, and why float64 sums are not used).
5. Sums over rows (dgamma, dbeta) accumulate in float64.
6. scale = 1 + gamma is formed in cdt, never in a half dtype: bfloat16 holds 1 + gamma only to
   2**-8, so a small gamma (a zero-centred gamma starts at 0 and stays near it) would round
   away, and its training with it.
7. Add-norms: h = x + residual is formed in the widest compute dtype of x, residual and
   residual_dtype, then rounded once to residual_dtype (x's dtype by default; float32 keeps a
   bfloat16 model's residual stream in float32). The norm reads that rounded h and computes in
   h's compute dtype, so y is layer_norm_forward(h) (rms_norm_forward(h)), rounded once to x's
   dtype. The backward adds dh to the norm's dx in the add's compute dtype, before that dx is
   rounded, and rounds the total once to x's dtype (dx) and once to residual's (dresidual).

Only NumPy is used here: no autodiff, no other array library.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._validate import (
    check_dtype,
    check_dy,
    check_eps,
    check_flag,
    check_module_input,
    check_param,
    check_shape,
    check_x,
)
from .dtypes import compute_dtype, widest_compute_dtype
from .recovery import kept_channels, kept_rows

__all__ = [
    "AddNormCache",
    "LayerNorm",
    "NormCache",
    "OutputCache",
    "RMSNorm",
    "add_layer_norm_backward",
    "add_layer_norm_forward",
    "add_layer_norm_jvp",
    "add_rms_norm_backward",
    "add_rms_norm_forward",
    "add_rms_norm_jvp",
    "layer_norm_backward",
    "layer_norm_forward",
    "layer_norm_jvp",
    "rms_norm_backward",
    "rms_norm_forward",
    "rms_norm_jvp",
]


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


def layer_norm_forward(
    x: np.ndarray,
    gamma: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    eps: float = 1e-5,
    *,
    zero_centered_gamma: bool = False,
    memory_efficient: bool = False,
) -> tuple[np.ndarray, NormCache | OutputCache]:
    """Layer norm over the last axis of ``x``.

    Args:
        x: (..., D) floating array with at least one axis; never modified.
        gamma: (D,) scale, or None for no scale. The cache keeps a copy of the scale.
        beta: (D,) shift, or None for no shift.
        eps: finite number >= 0 added to the variance.
        zero_centered_gamma: scale by 1 + gamma (formed in the compute dtype) instead of gamma.
        memory_efficient: keep y (returned read-only) instead of xhat; the backward recovers
            xhat from it (:mod:`layernorm.recovery` has the rule and its error).

    Returns:
        y: same shape and dtype as x. float16/bfloat16 inputs are computed in float32.
        cache: a :class:`NormCache` (an :class:`OutputCache` when memory-efficient) for
            :func:`layer_norm_backward`.
    """
    x = check_x(x)
    return _forward(x, gamma, beta, eps, True, zero_centered_gamma, memory_efficient)


def layer_norm_backward(
    dy: np.ndarray, cache: NormCache
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Gradients of layer norm given dL/dy and the forward's cache (either kind).

    Args:
        dy: gradient of the loss w.r.t. y, same shape as the forward's x; never modified.
        cache: the cache returned by :func:`layer_norm_forward`.

    Returns:
        dx: same shape and dtype as x.
        dgamma: (D,) in gamma's dtype, or None when the forward had no gamma.
        dbeta: (D,) in beta's dtype, or None when the forward had no beta.
    """
    dy = _check_cache(dy, cache, _NORM_CACHES, True, "layer_norm_forward")
    dx, dgamma, dbeta = _backward(dy, cache, cache.x_dtype)
    return dx.reshape(cache.x_shape), dgamma, dbeta


def rms_norm_forward(
    x: np.ndarray,
    gamma: np.ndarray | None = None,
    eps: float = 1e-6,
    *,
    zero_centered_gamma: bool = False,
    memory_efficient: bool = False,
) -> tuple[np.ndarray, NormCache | OutputCache]:
    """RMS norm over the last axis of ``x``: y = scale * x / sqrt(mean(x**2) + eps).

    Args:
        x: (..., D) floating array with at least one axis; never modified.
        gamma: (D,) scale, or None for no scale. The cache keeps a copy of the scale.
        eps: finite number >= 0 added to mean(x**2).
        zero_centered_gamma: scale by 1 + gamma (formed in the compute dtype) instead of gamma.
        memory_efficient: as for :func:`layer_norm_forward`.

    Returns:
        y: same shape and dtype as x. float16/bfloat16 inputs are computed in float32.
        cache: a :class:`NormCache` (an :class:`OutputCache` when memory-efficient) for
            :func:`rms_norm_backward`.
    """
    x = check_x(x)
    return _forward(x, gamma, None, eps, False, zero_centered_gamma, memory_efficient)


def rms_norm_backward(dy: np.ndarray, cache: NormCache) -> tuple[np.ndarray, np.ndarray | None]:
    """Gradients of RMS norm given dL/dy and the forward's cache (either kind).

    Args:
        dy: gradient of the loss w.r.t. y, same shape as the forward's x; never modified.
        cache: the cache returned by :func:`rms_norm_forward`.

    Returns:
        dx: same shape and dtype as x.
        dgamma: (D,) in gamma's dtype, or None when the forward had no gamma.
    """
    dy = _check_cache(dy, cache, _NORM_CACHES, False, "rms_norm_forward")
    dx, dgamma, _ = _backward(dy, cache, cache.x_dtype)
    return dx.reshape(cache.x_shape), dgamma


def layer_norm_jvp(cache: NormCache, tx: np.ndarray | None, tgamma: np.ndarray | None = None,
                   tbeta: np.ndarray | None = None) -> np.ndarray:
    """The forward-mode derivative of layer norm: J·(tx, tgamma, tbeta) at the forward's point.

    Args:
        cache: the :class:`NormCache` returned by :func:`layer_norm_forward` (default mode).
        tx: the tangent of x, x's shape, or None (zero); never modified.
        tgamma, tbeta: (D,) tangents of gamma and beta, or None (zero); given only where the
            forward had the parameter.

    Returns:
        t_y: the tangent of y, x's shape and dtype (computed in the compute dtype).
    """
    _check_jvp_cache(cache, True, "layer_norm_forward")
    u = _tangent(tx, "tx", cache.x_shape)
    return _jvp(cache, u, tgamma, tbeta, cache.x_dtype).reshape(cache.x_shape)


def rms_norm_jvp(cache: NormCache, tx: np.ndarray | None,
                 tgamma: np.ndarray | None = None) -> np.ndarray:
    """The forward-mode derivative of RMS norm: as :func:`layer_norm_jvp`, without beta."""
    _check_jvp_cache(cache, False, "rms_norm_forward")
    u = _tangent(tx, "tx", cache.x_shape)
    return _jvp(cache, u, tgamma, None, cache.x_dtype).reshape(cache.x_shape)


def _add_forward(x: object, residual: object, gamma: object, beta: object, eps: object,
                 residual_dtype: object, zero_centered_gamma: object, centred: bool,
                 memory_efficient: object) -> tuple[np.ndarray, np.ndarray, AddNormCache]:
    """y, h and the cache of an add-norm (module docstring, item 7)."""
    x = check_x(x)
    residual = check_shape(residual, "residual", x.shape, "x")
    h_dtype = check_dtype(residual_dtype, "residual_dtype", x.dtype)
    adt = widest_compute_dtype(x.dtype, residual.dtype, h_dtype)
    # one rounding to h's dtype (none when it is the add's compute dtype)
    h = np.add(x, residual, dtype=adt).astype(h_dtype, copy=False)  # (..., D)
    y, norm = _forward(h, gamma, beta, eps, centred, zero_centered_gamma, memory_efficient,
                       x.dtype)
    return y, h, AddNormCache(norm=norm, dx_dtype=x.dtype, dresidual_dtype=residual.dtype)


def _add_backward(dy: object, dh: object, cache: object, centred: bool, producer: str
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """dx, dresidual, dgamma and dbeta of an add-norm (module docstring, item 7)."""
    dy = _check_cache(dy, cache, AddNormCache, centred, producer)
    if dh is not None:
        dh = check_shape(dh, "dh", cache.x_shape, "the forward's h")
    norm = cache.norm
    # the norm's dx in the add's compute dtype, exactly: it is as wide as h's
    adt = widest_compute_dtype(cache.dx_dtype, cache.dresidual_dtype, norm.x_dtype)
    total, dgamma, dbeta = _backward(dy, norm, adt)  # (M, D)
    if dh is not None:
        total += dh.reshape(total.shape)  # in the add's compute dtype; dh is not written
    total = total.reshape(cache.x_shape)
    # total is this call's own buffer, so dresidual may be it; dx is always a copy, so the two
    # never alias each other, the cache or the inputs
    dx = total.astype(cache.dx_dtype, copy=True)
    dresidual = total.astype(cache.dresidual_dtype, copy=False)
    return dx, dresidual, dgamma, dbeta


def add_layer_norm_forward(
    x: np.ndarray,
    residual: np.ndarray,
    gamma: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    eps: float = 1e-5,
    *,
    residual_dtype: str | np.dtype | None = None,
    zero_centered_gamma: bool = False,
    memory_efficient: bool = False,
) -> tuple[np.ndarray, np.ndarray, AddNormCache]:
    """The residual add and the layer norm of its result: h = x + residual, y = layer_norm(h).

    Args:
        x: (..., D) floating array (a sublayer's output); never modified.
        residual: floating array of x's shape, of any supported dtype; never modified.
        gamma, beta, eps, zero_centered_gamma: as for :func:`layer_norm_forward`.
        residual_dtype: h's dtype: None (x's dtype), a dtype name or a NumPy dtype, among
            float16, bfloat16, float32 and float64.
        memory_efficient: keep y (returned read-only) and the statistics, not h: the
            backward recovers xhat from y (:mod:`layernorm.recovery`).

    Returns:
        y: x's shape and dtype; equal to layer_norm_forward(h) rounded to x's dtype.
        h: x + residual in residual_dtype, rounded once from the widest compute dtype of x,
            residual and residual_dtype: the next block's residual.
        cache: an :class:`AddNormCache` for :func:`add_layer_norm_backward`.
    """
    return _add_forward(x, residual, gamma, beta, eps, residual_dtype, zero_centered_gamma, True,
                        memory_efficient)


def add_layer_norm_backward(
    dy: np.ndarray, dh: np.ndarray | None, cache: AddNormCache
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Gradients of :func:`add_layer_norm_forward`.

    Args:
        dy: gradient of the loss w.r.t. y, x's shape; never modified.
        dh: gradient reaching h from the residual stream, x's shape, or None (no such use);
            never modified.
        cache: the cache returned by :func:`add_layer_norm_forward`.

    Returns:
        dx: dh + the norm's dx w.r.t. h, in x's dtype.
        dresidual: the same sum in residual's dtype; a distinct array (both rounded once from
            the add's compute dtype).
        dgamma: (D,) in gamma's dtype, or None when the forward had no gamma.
        dbeta: (D,) in beta's dtype, or None when the forward had no beta.
    """
    return _add_backward(dy, dh, cache, True, "add_layer_norm_forward")


def add_rms_norm_forward(
    x: np.ndarray,
    residual: np.ndarray,
    gamma: np.ndarray | None = None,
    eps: float = 1e-6,
    *,
    residual_dtype: str | np.dtype | None = None,
    zero_centered_gamma: bool = False,
    memory_efficient: bool = False,
) -> tuple[np.ndarray, np.ndarray, AddNormCache]:
    """The residual add and the RMS norm of its result: h = x + residual, y = rms_norm(h).

    Arguments and results as for :func:`add_layer_norm_forward`, without beta; y equals
    rms_norm_forward(h) rounded to x's dtype.
    """
    return _add_forward(x, residual, gamma, None, eps, residual_dtype, zero_centered_gamma,
                        False, memory_efficient)


def add_rms_norm_backward(
    dy: np.ndarray, dh: np.ndarray | None, cache: AddNormCache
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Gradients of :func:`add_rms_norm_forward`: dx, dresidual and dgamma, as for
    :func:`add_layer_norm_backward`."""
    dx, dresidual, dgamma, _ = _add_backward(dy, dh, cache, False, "add_rms_norm_forward")
    return dx, dresidual, dgamma


def _add_jvp(cache: object, tx: object, tresidual: object, tgamma: object, tbeta: object,
             centred: bool, producer: str) -> tuple[np.ndarray, np.ndarray]:
    """t_y and t_h of an add-norm: t_h = tx + tresidual formed in the add's compute dtype; t_y
    the norm's derivative along it (not rounded first), each rounded once to its output's
    dtype."""
    _check_jvp_cache(cache, centred, producer, AddNormCache)
    norm = cache.norm
    shape = norm.x_shape
    ts = [t for t in (_tangent(tx, "tx", shape), _tangent(tresidual, "tresidual", shape))
          if t is not None]
    adt = widest_compute_dtype(cache.dx_dtype, cache.dresidual_dtype, norm.x_dtype)
    u = sum(t.astype(adt) for t in ts) if ts else None  # (..., D) the tangent of h
    ty = _jvp(norm, u, tgamma, tbeta, cache.dx_dtype).reshape(shape)
    th = np.zeros(shape, norm.x_dtype) if u is None else u.astype(norm.x_dtype, copy=False)
    return ty, th


def add_layer_norm_jvp(cache: AddNormCache, tx: np.ndarray | None,
                       tresidual: np.ndarray | None, tgamma: np.ndarray | None = None,
                       tbeta: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The forward-mode derivative of :func:`add_layer_norm_forward`.

    Args:
        cache: the :class:`AddNormCache` of :func:`add_layer_norm_forward` (default mode).
        tx, tresidual: tangents of x and residual (x's shape), or None (zero).
        tgamma, tbeta: as for :func:`layer_norm_jvp`.

    Returns:
        t_y: in x's dtype; t_h = tx + tresidual, in h's dtype.
    """
    return _add_jvp(cache, tx, tresidual, tgamma, tbeta, True, "add_layer_norm_forward")


def add_rms_norm_jvp(cache: AddNormCache, tx: np.ndarray | None, tresidual: np.ndarray | None,
                     tgamma: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The forward-mode derivative of :func:`add_rms_norm_forward`: as
    :func:`add_layer_norm_jvp`, without beta."""
    return _add_jvp(cache, tx, tresidual, tgamma, None, False, "add_rms_norm_forward")


class _Norm:
    """What the stateful modules share: D, eps, gamma and the cache of the last forward.

    ``gamma`` starts at ones, or at zeros with ``zero_centered_gamma`` (float64, shape (D,));
    both mean scale = 1. With ``memory_efficient`` the cache keeps y, not xhat, and the
    forward's y is read-only.
    """

    def __init__(self, D: int, eps: float, zero_centered_gamma: bool,
                 memory_efficient: bool = False) -> None:
        if isinstance(D, bool) or not isinstance(D, (int, np.integer)):
            raise TypeError(f"D must be an integer, got {type(D).__name__}: {D!r}")
        if D < 1:
            raise ValueError(f"D must be >= 1, got {D}")
        self.D = int(D)
        self.eps = check_eps(eps)
        self.zero_centered_gamma = check_flag(zero_centered_gamma, "zero_centered_gamma")
        self.memory_efficient = check_flag(memory_efficient, "memory_efficient")
        self.gamma = np.zeros(self.D) if self.zero_centered_gamma else np.ones(self.D)
        self.dgamma: np.ndarray | None = None
        self._cache: NormCache | OutputCache | None = None

    def _last_cache(self) -> NormCache | OutputCache:
        if self._cache is None:
            raise RuntimeError(f"{type(self).__name__}.backward called before forward")
        return self._cache

    def __repr__(self) -> str:
        zc = ", zero_centered_gamma=True" if self.zero_centered_gamma else ""
        zc += ", memory_efficient=True" if self.memory_efficient else ""
        return f"{type(self).__name__}(D={self.D}, eps={self.eps}{zc})"


class LayerNorm(_Norm):
    """A stateful layer norm for NumPy networks.

    ``gamma`` starts at ones (zeros with ``zero_centered_gamma``) and ``beta`` at zeros
    (float64, shape (D,)). ``forward`` keeps the cache; ``backward`` returns dx and stores
    ``dgamma`` and ``dbeta``.
    """

    def __init__(self, D: int, eps: float = 1e-5, *, zero_centered_gamma: bool = False,
                 memory_efficient: bool = False) -> None:
        super().__init__(D, eps, zero_centered_gamma, memory_efficient)
        self.beta = np.zeros(self.D)
        self.dbeta: np.ndarray | None = None

    def forward(self, x: np.ndarray) -> np.ndarray:
        """y for x of shape (..., D); keeps the cache for :meth:`backward`."""
        x = check_x(x)
        check_module_input(x, self.D, {"gamma": self.gamma, "beta": self.beta})
        y, self._cache = layer_norm_forward(x, self.gamma, self.beta, self.eps,
                                            zero_centered_gamma=self.zero_centered_gamma,
                                            memory_efficient=self.memory_efficient)
        return y

    __call__ = forward

    def backward(self, dy: np.ndarray) -> np.ndarray:
        """dx for the last :meth:`forward`; sets ``dgamma`` and ``dbeta``."""
        dx, self.dgamma, self.dbeta = layer_norm_backward(dy, self._last_cache())
        return dx


class RMSNorm(_Norm):
    """A stateful RMS norm for NumPy networks.

    ``gamma`` starts at ones (zeros with ``zero_centered_gamma``), float64, shape (D,).
    ``forward`` keeps the cache; ``backward`` returns dx and stores ``dgamma``.
    """

    def __init__(self, D: int, eps: float = 1e-6, *, zero_centered_gamma: bool = False,
                 memory_efficient: bool = False) -> None:
        super().__init__(D, eps, zero_centered_gamma, memory_efficient)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """y for x of shape (..., D); keeps the cache for :meth:`backward`."""
        x = check_x(x)
        check_module_input(x, self.D, {"gamma": self.gamma})
        y, self._cache = rms_norm_forward(x, self.gamma, self.eps,
                                          zero_centered_gamma=self.zero_centered_gamma,
                                          memory_efficient=self.memory_efficient)
        return y

    __call__ = forward

    def backward(self, dy: np.ndarray) -> np.ndarray:
        """dx for the last :meth:`forward`; sets ``dgamma``."""
        dx, self.dgamma = rms_norm_backward(dy, self._last_cache())
        return dx
