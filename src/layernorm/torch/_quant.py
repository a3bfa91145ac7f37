"""The norms with their output quantized, for the Linear layers that follow them: int8 or
float8_e4m3fn, with static, per-token or per-group scales, the residual add fused in.

The numerics are :mod:`layernorm.reference.quant`'s (docs/derivation.md, "Quantized output"):
y in the compute dtype, never rounded to the input's dtype, then q = y / s rounded to nearest
even and saturated. Two ops, ``layernorm::norm_quant`` and ``layernorm::add_norm_quant``, on the
CPU (the C++ engine) and CUDA
(Triton); ``torch.compile(fullgraph=True)`` and ``torch.export`` see it as one node. Inference
only: an argument that needs a gradient is refused.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from ..reference.quant import QUANT_DTYPES, check_group_size, check_static_alone
from ._functional import _checked, _is_compiling, _is_exporting, _tracing_state
from ._ops import add_norm_quant, norm_quant

__all__ = ["layer_norm_quant", "rms_norm_quant"]

QUANT = {getattr(torch, name): row for name, row in QUANT_DTYPES.items()}
"""The quantized dtypes as torch dtypes, each with its row of the one table."""


def _check_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be torch.int8 or torch.float8_e4m3fn, got "
                        f"{type(dtype).__name__}: {dtype!r}")
    if dtype not in QUANT:
        raise ValueError(f"dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
    return dtype


def _checking_values() -> bool:
    """Whether a tensor argument's values may be read here: not while compiling, exporting or
    tracing, where a value is data the graph does not hold."""
    return not (_is_compiling() or _is_exporting() or _tracing_state() is not None)


def _check_scale_tensor(t: object, name: str, x: Tensor) -> Tensor:
    """A one-element float32 tensor on x's device, finite and > 0 (its value checked where it
    can be read: on the CPU at once, on CUDA by an assertion queued on the stream)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a float32 tensor of shape () or (1,), got "
                        f"{type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 tensor of shape () or (1,), got dtype "
                        f"{t.dtype}")
    if tuple(t.shape) not in ((), (1,)):
        raise ValueError(f"{name} must be a float32 tensor of shape () or (1,), got shape "
                         f"{tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on the input's device {x.device}, got {t.device}")
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad: the quantized norms are inference only")
    if _checking_values():
        good = torch.isfinite(t).all() & (t > 0).all()
        if t.is_cpu:
            if not bool(good):
                raise ValueError(f"{name} must be finite and > 0, got {t.reshape(()).item()!r}")
        elif t.is_cuda:
            torch._assert_async(good, f"{name} must be finite and > 0")
    return t


def _scale_ub(scale_ub: object, x: Tensor) -> Tensor | None:
    if scale_ub is None or isinstance(scale_ub, Tensor):
        return None if scale_ub is None else _check_scale_tensor(scale_ub, "scale_ub", x)
    if isinstance(scale_ub, bool) or not isinstance(scale_ub, numbers.Real):
        raise TypeError(f"scale_ub must be None, a real number or a one-element float32 "
                        f"tensor, got {type(scale_ub).__name__}")
    # its float32 value through torch, not the reference's NumPy check: under torch.compile
    # Dynamo traces NumPy as tensors, and the check's branch would stop it
    value = float(torch.tensor(float(scale_ub), dtype=torch.float32))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale_ub must be finite and > 0 as a float32, got {scale_ub!r}")
    return torch.full((), value, dtype=torch.float32, device=x.device)


def _refuse_grad(x: Tensor, residual: Tensor | None, weight: Tensor | None,
                 bias: Tensor | None) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in (("input", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        if t is not None and t.requires_grad:
            raise ValueError(f"{name} requires grad: the quantized norms are inference only "
                             "(no gradient flows through the rounding); call them under "
                             "torch.no_grad() or torch.inference_mode(), or detach")


def _norm_quant(centred: bool, input: object, normalized_shape: object, weight: object,
                bias: object, eps: object, dtype: object, scale: object, group_size: object,
                scale_ub: object, residual: object, residual_dtype: object,
                zero_centered_gamma: object) -> tuple[Tensor, ...]:
    if centred and eps is None:
        eps = 1e-5  # layer_norm's own default; None for RMSNorm is rms_norm's rule (_checked)
    if residual is None and residual_dtype is not None:
        raise ValueError("residual_dtype must be None without a residual")
    x, residual, shape, weight, bias, eps, zcg, h_dtype, _ = _checked(
        input, residual, normalized_shape, weight, bias, eps, zero_centered_gamma,
        residual_dtype, False, "input")
    float8 = _check_dtype(dtype) is torch.float8_e4m3fn
    _refuse_grad(x, residual, weight, bias)
    add = residual is not None
    d = shape[0] if len(shape) == 1 else math.prod(shape)
    if scale is not None:
        check_static_alone(group_size, scale_ub)
        scale = _check_scale_tensor(scale, "scale", x)
    elif group_size is not None or scale_ub is not None:
        group_size = check_group_size(group_size, d)
        scale_ub = _scale_ub(scale_ub, x)
    if len(shape) == 1 and x.dim() == 2 and d:  # (M, D) already: a decode step's call
        if add:
            return add_norm_quant(x, residual, weight, bias, eps, centred, zcg, h_dtype, float8,
                                  scale, group_size, scale_ub)
        return norm_quant(x, weight, bias, eps, centred, zcg, float8, scale, group_size,
                          scale_ub)
    lead = x.shape[:x.dim() - len(shape)]
    if d == 0:  # nothing to normalize: empty q, and the scales of empty groups
        q = torch.empty(x.shape, dtype=dtype, device=x.device)
        scales = (scale.clone() if scale is not None else
                  torch.full((*lead, 0 if group_size else 1), QUANT[dtype].min_scale,
                             dtype=torch.float32, device=x.device))
        if not add:
            return q, scales
        return q, scales, (x.to(h_dtype) + residual.to(h_dtype))
    x2 = x.reshape(-1, d)  # (M, D): a view where the strides allow it
    r2 = residual.reshape(-1, d) if add else None
    if len(shape) > 1:
        weight, bias = (None if p is None else p.reshape(-1) for p in (weight, bias))
    if add:
        q, scales, h = add_norm_quant(x2, r2, weight, bias, eps, centred, zcg, h_dtype, float8,
                                      scale, group_size, scale_ub)
    else:
        q, scales = norm_quant(x2, weight, bias, eps, centred, zcg, float8, scale, group_size,
                               scale_ub)
    q = q.view(x.shape)
    if scale is None:
        scales = scales.view(*lead, scales.shape[-1])
    return (q, scales, h.view(x.shape)) if add else (q, scales)


def rms_norm_quant(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    dtype: torch.dtype = torch.int8,
    scale: Tensor | None = None,
    group_size: int | None = None,
    scale_ub: float | Tensor | None = None,
    residual: Tensor | None = None,
    residual_dtype: torch.dtype | None = None,
    zero_centered_gamma: bool = False,
) -> tuple[Tensor, ...]:
    """RMS norm with its output quantized, fused: the input of a W8A8 or FP8 Linear.

    Args:
        input: (..., *normalized_shape) float16, bfloat16, float32 or float64, CPU or CUDA.
        normalized_shape, weight, eps, zero_centered_gamma: as for
            :func:`layernorm.torch.rms_norm` (eps None: the compute dtype's machine epsilon).
        dtype: ``torch.int8`` (q in [-127, 127]) or ``torch.float8_e4m3fn`` (|q| <= 448).
        scale: a static scale, a float32 tensor of shape () or (1,), finite and > 0, on the
            input's device; None: scales from the data.
        group_size: 64 or 128 (dividing D): one dynamic scale per group of that many
            consecutive channels; None: one per token.
        scale_ub: an upper bound on a token's (or group's) max|y| for the dynamic scales: a
            finite number > 0 or a one-element float32 tensor.
        residual: added first (h = input + residual, rounded once to ``residual_dtype``, by
            default input's dtype); h is normalized and returned.

    Returns:
        (q, scales), or (q, scales, h) with a residual. q has input's shape and ``dtype``;
        scales are float32: (..., 1) per token, (..., D / group_size) per group, a copy of
        ``scale`` when static. A token or group holding inf or NaN gets a non-finite scale
        and q = 0 (int8) or NaN (float8). The numerics: docs/derivation.md, "Quantized output".
    """
    return _norm_quant(False, input, normalized_shape, weight, None, eps, dtype, scale,
                       group_size, scale_ub, residual, residual_dtype, zero_centered_gamma)


def layer_norm_quant(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float | None = None,
    *,
    dtype: torch.dtype = torch.int8,
    scale: Tensor | None = None,
    group_size: int | None = None,
    scale_ub: float | Tensor | None = None,
    residual: Tensor | None = None,
    residual_dtype: torch.dtype | None = None,
    zero_centered_gamma: bool = False,
) -> tuple[Tensor, ...]:
    """Layer norm with its output quantized, fused: as :func:`rms_norm_quant`, with bias, and
    eps None meaning layer_norm's default 1e-5."""
    return _norm_quant(True, input, normalized_shape, weight, bias, eps, dtype, scale,
                       group_size, scale_ub, residual, residual_dtype, zero_centered_gamma)
