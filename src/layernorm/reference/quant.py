"""The norms with their output quantized: the spec's executable form (docs/derivation.md,
"Quantized output").

For each row the norm's y is formed in the compute dtype (float32 for 16- and 32-bit input,
float64 for float64) and not rounded to the input's dtype; then, per token (the whole row) or
per group of ``group_size`` consecutive channels,

    a = max |y|                        over exactly the values quantized, in y's precision
    a = min(a, scale_ub)               (a finite a only; scale_ub's float32 value)
    s = float32(max(a / qmax, min_scale))     formed in y's precision, rounded once
    q = quantize(y / s)                a true division by s's float32 value, in y's precision

where quantize rounds half to even and saturates: to [-127, 127] for int8 (NaN gives 0), to
float8_e4m3fn's nearest value within +-448 (never inf; NaN stays NaN). A token or group whose
a is not finite gets that scale and q = 0 (int8) or NaN (float8) throughout; nothing else
changes. A static ``scale`` replaces s for every row: q = quantize(y / scale).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from .._validate import check_x
from ..dtypes import compute_dtype, float8_spacing
from .core import _add_residual, _forward


@dataclass(frozen=True)
class QuantDtype:
    """One quantized output dtype.

    Attributes:
        name: its name (NumPy's, or ml_dtypes' for float8_e4m3fn).
        qmax: the largest magnitude a scale maps max|y| to, and where q saturates.
        min_scale: the smallest scale: a row or group of zeros (or of values so small that
            a / qmax would underflow toward 0) gets this one, so y / s stays finite.
    """

    name: str
    qmax: float
    min_scale: float


QUANT_DTYPES: dict[str, QuantDtype] = {q.name: q for q in (
    QuantDtype("int8", 127.0, float(np.finfo(np.float32).eps)),
    QuantDtype("float8_e4m3fn", 448.0, 1.0 / (448.0 * 512.0)),
)}
"""The quantized dtypes by name: the one table the reference, the engine's operator and the
PyTorch API read qmax and min_scale from."""

GROUP_SIZES = (64, 128)
"""The channels of one scale with per-group scales (each must divide D)."""

def _float8_values(v: np.ndarray) -> np.ndarray:
    """v (any shape, float32 or float64) rounded once, to nearest even, to float8_e4m3fn's
    values, saturated to +-448, NaN kept: still in v's dtype (every result is exact in it)."""
    v = np.clip(v, -448.0, 448.0)  # NaN passes through
    quantum = float8_spacing(v)
    return np.rint(v / quantum) * quantum  # exact scalings by powers of two


def quantize(y: np.ndarray, s: np.ndarray, dtype: QuantDtype) -> np.ndarray:
    """q = y / s (s broadcast to y, float32 values), divided in y's dtype, rounded and
    saturated as ``dtype`` says; returns int8, or float8_e4m3fn (ml_dtypes)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        v = y / s.astype(y.dtype)  # a true division, not a multiply by 1 / s
    if dtype.name == "int8":
        v = np.clip(np.rint(v), -dtype.qmax, dtype.qmax)
        return np.where(np.isnan(v), 0.0, v).astype(np.int8)
    import ml_dtypes  # the float8 array type: needed only for float8 output

    return _float8_values(v).astype(ml_dtypes.float8_e4m3fn)  # exact: already its values


def dynamic_scales(y: np.ndarray, dtype: QuantDtype, scale_ub: float | None) -> np.ndarray:
    """(M, G) float32 scales of y (M, G, g), g channels a group, in y's precision."""
    cdt = y.dtype
    a = np.max(np.abs(y), axis=2)  # (M, G): NaN propagates, inf is kept
    if scale_ub is not None:
        finite = np.isfinite(a)
        a = np.where(finite, np.minimum(a, cdt.type(np.float32(scale_ub))), a)
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.maximum(a / cdt.type(dtype.qmax), cdt.type(dtype.min_scale))  # NaN stays
    return s.astype(np.float32)


def check_quant_dtype(dtype: object) -> QuantDtype:
    """``dtype`` (a name: int8 or float8_e4m3fn) as its row of :data:`QUANT_DTYPES`."""
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a dtype name ({' or '.join(QUANT_DTYPES)}), got "
                        f"{type(dtype).__name__}: {dtype!r}")
    if dtype not in QUANT_DTYPES:
        raise ValueError(f"dtype must be {' or '.join(QUANT_DTYPES)}, got {dtype!r}")
    return QUANT_DTYPES[dtype]


def check_group_size(group_size: object, d: int) -> int | None:
    """``group_size``: None (per token), or one of :data:`GROUP_SIZES` dividing ``d``; every
    path's rule (the PyTorch API, the ops' NumPy fallback and Triton launcher)."""
    if group_size is None:
        return None
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise TypeError(f"group_size must be None or an int, got {type(group_size).__name__}")
    if int(group_size) not in GROUP_SIZES or d % int(group_size):
        raise ValueError(f"group_size must be None or one of {GROUP_SIZES} dividing D = {d}, "
                         f"got {group_size}")
    return int(group_size)


def check_scale_ub(scale_ub: object) -> float | None:
    """``scale_ub``: None, or a finite real number > 0 (its float32 value is the bound)."""
    if scale_ub is None:
        return None
    if isinstance(scale_ub, np.ndarray):
        if scale_ub.shape not in ((), (1,)):
            raise ValueError(f"scale_ub must be a number or an array of shape () or (1,), got "
                             f"shape {scale_ub.shape}")
        scale_ub = scale_ub.reshape(())[()]
    if isinstance(scale_ub, bool) or not isinstance(scale_ub, (float, int, np.floating,
                                                               np.integer)):
        raise TypeError(f"scale_ub must be None or a real number, got "
                        f"{type(scale_ub).__name__}")
    value = float(np.float32(scale_ub))
    if not (np.isfinite(value) and value > 0.0):
        raise ValueError(f"scale_ub must be finite and > 0 as a float32, got {scale_ub!r}")
    return value


def check_static_alone(group_size: object, scale_ub: object) -> None:
    """A static scale comes without group_size and scale_ub (every path's rule)."""
    if group_size is not None or scale_ub is not None:
        raise ValueError("scale must be None with group_size or scale_ub: a static scale "
                         "is the one scale of every row")


def check_static_scale(scale: object, group_size: object, scale_ub: object) -> np.ndarray:
    """A static ``scale``: a float32 array of shape () or (1,), finite and > 0, given without
    group_size and scale_ub."""
    check_static_alone(group_size, scale_ub)
    if not isinstance(scale, (np.ndarray, np.float32)) or np.asarray(scale).dtype != np.float32:
        raise TypeError(f"scale must be a float32 array of shape () or (1,), got "
                        f"{type(scale).__name__} {getattr(scale, 'dtype', '')}".rstrip())
    scale = np.array(scale, dtype=np.float32)  # a copy: what is returned as the scales
    if scale.shape not in ((), (1,)):
        raise ValueError(f"scale must have shape () or (1,), got {scale.shape}")
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError(f"scale must be finite and > 0, got {scale.reshape(()).item()!r}")
    return scale


def _norm_quant(x: object, residual: object, residual_dtype: object, gamma: object,
                beta: object, eps: object, centred: bool, zero_centered_gamma: object,
                dtype: object, scale: object, group_size: object, scale_ub: object) -> tuple:
    x = check_x(x)
    qdt = check_quant_dtype(dtype)
    d = x.shape[-1]
    if scale is not None:
        scale = check_static_scale(scale, group_size, scale_ub)
    else:
        group_size = check_group_size(group_size, d)
        scale_ub = check_scale_ub(scale_ub)
    h = None
    src = x
    if residual is not None:
        _, h = _add_residual(x, residual, residual_dtype)
        src = h
    elif residual_dtype is not None:
        raise ValueError("residual_dtype must be None without a residual")
    cdt = compute_dtype(src.dtype)
    with np.errstate(over="ignore"):  # a y beyond cdt's range: its group's scale says so
        y, _cache = _forward(src, gamma, beta, eps, centred, zero_centered_gamma, y_dtype=cdt)
    q, s = quantize_rows(y.reshape(-1, d), qdt, scale, group_size, scale_ub)
    scales = scale if scale is not None else s.reshape(*x.shape[:-1], s.shape[1])
    q = q.reshape(x.shape)
    return (q, scales) if h is None else (q, scales, h)


def quantize_rows(y: np.ndarray, dtype: QuantDtype, scale: np.ndarray | None,
                  group_size: int | None, scale_ub: float | None
                  ) -> tuple[np.ndarray, np.ndarray | None]:
    """q (M, D) and the scales (M, D / group) of the rows y (M, D) in their compute dtype (the
    module docstring); the scales are None with a static ``scale`` (float32, one element)."""
    if scale is not None:
        return quantize(y, scale.reshape(()), dtype), None
    m, d = y.shape
    g = d if group_size is None else group_size
    yg = y.reshape(m, d // g, g)  # (M, G, g)
    s = dynamic_scales(yg, dtype, scale_ub)  # (M, G)
    q = quantize(yg, s[:, :, None], dtype)  # (M, G, g)
    bad = ~np.isfinite(s)  # a non-finite group: the fill throughout
    if bad.any():
        q[bad] = 0 if dtype.name == "int8" else np.nan
    return q.reshape(m, d), s


def rms_norm_quant(
    x: np.ndarray,
    gamma: np.ndarray | None = None,
    eps: float = 1e-6,
    *,
    dtype: str = "int8",
    scale: np.ndarray | None = None,
    group_size: int | None = None,
    scale_ub: float | None = None,
    residual: np.ndarray | None = None,
    residual_dtype: str | np.dtype | None = None,
    zero_centered_gamma: bool = False,
) -> tuple[np.ndarray, ...]:
    """RMS norm over the last axis of ``x`` with its output quantized (the module docstring).

    Args:
        x: (..., D) floating array; never modified.
        gamma, eps, zero_centered_gamma: as for :func:`layernorm.rms_norm_forward`.
        dtype: "int8" or "float8_e4m3fn", q's dtype.
        scale: a static scale, a float32 array of shape () or (1,), finite and > 0; None for
            scales from the data (dynamic).
        group_size: dynamic scales per group of 64 or 128 consecutive channels (dividing D);
            None: one scale per token.
        scale_ub: an upper bound on max|y| (a finite number > 0; its float32 value).
        residual: (..., D), added first: h = x + residual, rounded once to ``residual_dtype``
            (x's dtype by default), is normalized and returned.

    Returns:
        q of x's shape (int8, or ml_dtypes' float8_e4m3fn); scales, float32: (..., 1) per
        token, (..., D / group_size) per group, a copy of ``scale`` when static; and h with a
        residual.
    """
    return _norm_quant(x, residual, residual_dtype, gamma, None, eps, False,
                       zero_centered_gamma, dtype, scale, group_size, scale_ub)


def layer_norm_quant(
    x: np.ndarray,
    gamma: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    eps: float = 1e-5,
    *,
    dtype: str = "int8",
    scale: np.ndarray | None = None,
    group_size: int | None = None,
    scale_ub: float | None = None,
    residual: np.ndarray | None = None,
    residual_dtype: str | np.dtype | None = None,
    zero_centered_gamma: bool = False,
) -> tuple[np.ndarray, ...]:
    """Layer norm over the last axis of ``x`` with its output quantized: as
    :func:`rms_norm_quant`, with beta and the norm of :func:`layernorm.layer_norm_forward`."""
    return _norm_quant(x, residual, residual_dtype, gamma, beta, eps, True,
                       zero_centered_gamma, dtype, scale, group_size, scale_ub)
