"""The reference's functions: each norm's forward, backward and forward-mode derivative, and
the add-norms' (the maths: :mod:`layernorm.reference`)."""

from __future__ import annotations

import numpy as np

from .._validate import check_shape, check_x
from ..dtypes import widest_compute_dtype
from .core import (
    _NORM_CACHES,
    AddNormCache,
    NormCache,
    OutputCache,
    _add_residual,
    _backward,
    _check_cache,
    _check_jvp_cache,
    _forward,
    _jvp,
    _tangent,
)


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
    """y, h and the cache of an add-norm (the package's docstring, item 7)."""
    x = check_x(x)
    residual, h = _add_residual(x, residual, residual_dtype)  # h (..., D)
    y, norm = _forward(h, gamma, beta, eps, centred, zero_centered_gamma, memory_efficient,
                       x.dtype)
    return y, h, AddNormCache(norm=norm, dx_dtype=x.dtype, dresidual_dtype=residual.dtype)


def _add_backward(dy: object, dh: object, cache: object, centred: bool, producer: str
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """dx, dresidual, dgamma and dbeta of an add-norm (the package's docstring, item 7)."""
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
