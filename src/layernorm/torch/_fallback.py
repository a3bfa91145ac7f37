"""The ops' CPU kernels where the C++ engine cannot be built: the NumPy fallback behind them.

The same outputs as the engine's operator, in the same layout (statistics as
:mod:`layernorm.cpu.statistics`, an (M, 0) placeholder for the second statistics tensor), from
:mod:`layernorm.cpu.fallback` on the tensors' memory seen as NumPy arrays (bfloat16 through
ml_dtypes): the reference's arithmetic, on one thread. The kept channels and rows of the
memory-efficient mode come from the rule the NumPy API applies
(:func:`layernorm.cpu.api.kept_xhat`). Only registered where the engine is missing.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..cpu import api, fallback
from ..cpu.statistics import NSTATS
from ..reference.core import form_scale
from ._dtypes import compute_dtype

__all__ = ["register"]


def _np(t: Tensor | None) -> np.ndarray | None:
    """``t`` (contiguous) as a NumPy array on the same memory, or None: through DLPack, which
    leaves the storage resizable (``Tensor.numpy()`` marks it not, for good, and FSDP2 frees
    gathered parameters by resizing their storage)."""
    if t is None:
        return None
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return np.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)
    return np.from_dlpack(t)


def _rows(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().contiguous().reshape(-1, t.shape[-1])


def _check(t: Tensor | None, name: str, shape: tuple[int, ...] | int | None) -> None:
    """As the C++ operator checks a direct call: a CPU tensor of ``shape`` (or D elements)."""
    if t is None:
        return
    if t.device.type != "cpu":
        raise ValueError(f"layernorm: {name} must be a CPU tensor")
    if isinstance(shape, int) and t.numel() != shape:
        raise ValueError(f"layernorm: {name} must have D = {shape} elements, got shape "
                         f"{tuple(t.shape)}")
    if isinstance(shape, tuple) and tuple(t.shape) != shape:
        raise ValueError(f"layernorm: {name} must have shape {shape}, got {tuple(t.shape)}")


def _check_index(t: Tensor, name: str, top: int) -> None:
    """As the C++ operator checks keep and rows: (n,) int64, ascending, in [0, ``top``)."""
    if t.dtype != torch.int64 or t.dim() != 1:
        raise ValueError(f"layernorm: {name} must be a 1-dimensional int64 tensor, got "
                         f"{t.dtype} of shape {tuple(t.shape)}")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= top or
                      bool((t[1:] <= t[:-1]).any())):
        raise ValueError(f"layernorm: {name} must hold ascending indices in [0, {top})")


def _params(weight: Tensor | None, bias: Tensor | None, centred: bool, zero_centered_gamma: bool,
            cdt: torch.dtype, d: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, shift) (D,) in the compute dtype: weight (or 1 + weight), ones without it; bias,
    zeros without it or for RMSNorm."""
    npdt = np.dtype(str(cdt).removeprefix("torch."))
    w, b = _np(_rows(weight)), _np(_rows(bias))
    scale = np.ones(d, npdt) if w is None else form_scale(w.reshape(d), npdt, zero_centered_gamma)
    shift = np.zeros(d, npdt) if b is None or not centred else b.reshape(d).astype(npdt)
    return scale, shift


def _forward(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype,
             y_dtype=None):
    """y (in ``y_dtype``, x's by default: the compute dtype keeps it unrounded), h, the
    statistics and (scale, shift) of the forward, as the C++ operator's."""
    if x.dim() == 0 or x.shape[-1] == 0:  # as the C++ operator refuses it
        raise ValueError(f"layernorm: x must be (..., D) with D >= 1, got {tuple(x.shape)}")
    d = x.shape[-1]
    m = x.numel() // d
    for t, name, shape in ((x, "x", None), (residual, "residual", tuple(x.shape)),
                           (weight, "weight", d), (bias, "bias", d)):
        _check(t, name, shape)
    add = residual is not None
    h_dtype = x.dtype if h_dtype is None else h_dtype
    cdt = compute_dtype(h_dtype if add else x.dtype)
    scale, shift = _params(weight, bias, centred, zero_centered_gamma, cdt, d)
    y = torch.empty(x.shape, dtype=y_dtype or x.dtype)
    h = torch.empty(x.shape, dtype=h_dtype) if add else x.new_empty((0,))
    stats = torch.empty((m, NSTATS), dtype=torch.float64)
    if m:
        fallback.forward_into(_np(_rows(x)), _np(_rows(residual)), scale, shift, eps, centred,
                              _np(y.view(m, d)), _np(h.view(m, d)) if add else None,
                              _np(stats), None)
    return y, h, stats, (scale, shift)


def _fwd(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype):
    y, h, stats, _ = _forward(x, residual, weight, bias, eps, centred, zero_centered_gamma,
                              h_dtype)
    return y, h, stats, x.new_empty((stats.shape[0], 0), dtype=torch.int64)


def _norm(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype):
    y, h, _, _ = _forward(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype)
    return y, h


def _fwd_y(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype):
    y, h, stats, (scale, shift) = _forward(x, residual, weight, bias, eps, centred,
                                           zero_centered_gamma, h_dtype)
    xn = _np(_rows(x if residual is None else h))
    keep, kept, rows, xrows = map(torch.from_numpy, api.kept_xhat(
        xn, _np(stats), scale, shift, eps, y.dtype))
    return (y, h, stats, x.new_empty((stats.shape[0], 0), dtype=torch.int64), keep, kept, rows,
            xrows)


def _add_norm_quant(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype,
                    float8, scale, group_size, scale_ub):
    from ..reference.quant import (
        QUANT_DTYPES,
        check_group_size,
        check_static_alone,
        quantize_rows,
    )

    dtype = torch.float8_e4m3fn if float8 else torch.int8
    check_group_size(group_size, x.shape[-1] if x.dim() else 0)
    if scale is not None:
        check_static_alone(group_size, scale_ub)
    for t, name in ((scale, "scale"), (scale_ub, "scale_ub")):
        if t is not None and (t.numel() != 1 or t.dtype != torch.float32):
            raise ValueError(f"layernorm: {name} must be a one-element float32 tensor, got "
                             f"{tuple(t.shape)} {t.dtype}")
        if t is not None and not (bool(torch.isfinite(t).all()) and bool((t > 0).all())):
            raise ValueError(f"layernorm: {name} must be finite and > 0, got {float(t)}")
    cdt = compute_dtype(x.dtype if residual is None else h_dtype or x.dtype)
    y, h, _, _ = _forward(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype,
                          y_dtype=cdt)
    qdt = QUANT_DTYPES[str(dtype).removeprefix("torch.")]
    q, s = quantize_rows(_np(_rows(y)), qdt, None if scale is None else _np(scale.float()),
                         group_size, None if scale_ub is None else float(scale_ub))
    q = torch.from_numpy(q.view(np.uint8 if q.dtype != np.int8 else np.int8)).view(dtype)
    scales = scale.clone() if scale is not None else torch.from_numpy(s).reshape(
        *x.shape[:-1], s.shape[1])
    return q.reshape(x.shape), scales, h


def _norm_quant(x, weight, bias, eps, centred, zero_centered_gamma, float8, scale, group_size,
                scale_ub):
    return _add_norm_quant(x, None, weight, bias, eps, centred, zero_centered_gamma, None,
                           float8, scale, group_size, scale_ub)[:2]


def _backward(dy, dh, src, weight, bias, stats, centred, zero_centered_gamma, x_dtype,
              residual_dtype, cdt, recovery=None):
    d = src.shape[-1]
    m = src.numel() // d
    for t, name, shape in ((src, "src", None), (dy, "dy", tuple(src.shape)),
                           (dh, "dh", tuple(src.shape)), (weight, "weight", d),
                           (bias, "bias", d), (stats, "stats0", (m, NSTATS))):
        _check(t, name, shape)
    scale, shift = _params(weight, bias, centred, zero_centered_gamma, cdt, d)
    dx = torch.empty(src.shape, dtype=src.dtype if x_dtype is None else x_dtype)
    add = residual_dtype is not None
    dres = torch.empty(src.shape, dtype=residual_dtype) if add else src.new_empty((0,))
    sums = np.zeros((2, d))
    rec = (None,) * 5 if recovery is None else (shift, *(_np(t.contiguous()) for t in recovery))
    if m:
        fallback.backward_into(_np(_rows(src)), _np(_rows(dy)), _np(_rows(dh)), scale,
                               _np(stats.contiguous()), None, *rec, centred, _np(dx.view(m, d)),
                               _np(dres.view(m, d)) if add else None, sums, None)
    sums = torch.from_numpy(sums)
    dw = src.new_empty((0,)) if weight is None else sums[0].to(weight.dtype, copy=True)
    db = src.new_empty((0,)) if bias is None else sums[1].to(bias.dtype, copy=True)
    return dx, dres, dw, db


def _bwd(dy, dh, xn, weight, bias, stats0, stats1, centred, zero_centered_gamma, x_dtype,
         residual_dtype):
    return _backward(dy, dh, xn, weight, bias, stats0, centred, zero_centered_gamma, x_dtype,
                     residual_dtype, compute_dtype(xn.dtype))


def _bwd_y(dy, dh, y, weight, bias, stats0, stats1, keep, kept, rows, xrows, centred,
           zero_centered_gamma, x_dtype, residual_dtype):
    d = y.shape[-1]
    m = y.numel() // d
    for t, name, top in ((keep, "keep", d), (rows, "rows", m)):
        _check_index(t, name, top)
    _check(kept, "kept", (m, keep.numel()))
    _check(xrows, "xrows", (rows.numel(), d))
    if xrows.dtype != kept.dtype:
        raise ValueError(f"layernorm: xrows must be in kept's dtype {kept.dtype}, got "
                         f"{xrows.dtype}")
    return _backward(dy, dh, y, weight, bias, stats0, centred, zero_centered_gamma, x_dtype,
                     residual_dtype, kept.dtype, (keep, kept, rows, xrows))


def register(lib: torch.library.Library) -> None:
    """Register the fallback as the CPU kernels of the ops ``lib`` defines."""
    for name, fn in (("fwd", _fwd), ("norm", _norm), ("bwd", _bwd), ("fwd_y", _fwd_y),
                     ("bwd_y", _bwd_y), ("norm_quant", _norm_quant),
                     ("add_norm_quant", _add_norm_quant)):
        lib.impl(name, fn, "CPU")
