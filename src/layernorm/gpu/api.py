"""The PyTorch API: ``layer_norm`` (as ``torch.nn.functional.layer_norm``) and ``LayerNorm``.

Arguments are checked and flattened to (M, D) here, once, at the boundary; the kernels see
2-D tensors with unit column stride (any row stride, so row slices are not copied).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .._validate import check_eps
from . import kernels, ops

__all__ = ["LayerNorm", "layer_norm"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_dtype(t: Tensor, name: str) -> None:
    if t.dtype not in _DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16 or float32 (the kernels compute in float32), "
            f"got {t.dtype}"
        )


def _check_device(x: Tensor) -> None:
    if x.device.type == "cuda" or (x.device.type == "cpu" and kernels.INTERPRET):
        return
    raise ValueError(
        f"x must be on a CUDA device (or on the CPU with TRITON_INTERPRET=1 set before triton "
        f"is imported), got device {x.device}"
    )


def _normalized_shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    scalar = isinstance(normalized_shape, numbers.Integral)
    dims = (normalized_shape,) if scalar else normalized_shape
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or not all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in dims
    ):
        raise TypeError(
            f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
        )
    if len(dims) == 0 or any(d < 1 for d in dims):
        raise ValueError(
            f"normalized_shape must be non-empty with every size >= 1, got {tuple(dims)}"
        )
    return tuple(int(d) for d in dims)


def _check_param(p: Tensor | None, name: str, shape: tuple[int, ...], x: Tensor) -> Tensor | None:
    """``p`` flattened to a contiguous (D,) tensor, or None."""
    if p is None:
        return None
    if not isinstance(p, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(p).__name__}")
    _check_dtype(p, name)
    if tuple(p.shape) != shape:
        raise ValueError(
            f"{name} must have shape normalized_shape = {shape}, got {tuple(p.shape)}"
        )
    if p.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {p.device}")
    return p.reshape(-1).contiguous()


def layer_norm(
    x: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Layer norm over the trailing ``normalized_shape`` axes of ``x``, with fused kernels.

    Same signature and results as ``torch.nn.functional.layer_norm``; differentiable through
    our own backward, and usable inside ``torch.compile(fullgraph=True)``.

    Args:
        x: (..., *normalized_shape) float16, bfloat16 or float32, on a CUDA device.
        normalized_shape: the trailing shape normalized over, flattened to D = prod(shape).
        weight: normalized_shape-shaped scale, or None; bias: shift, or None. Either may have
            any of the three dtypes; their gradients come back in their own dtype.
        eps: finite positive number added to the variance.

    Returns:
        y with x's shape and dtype. Statistics are float32 whatever the dtype.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_dtype(x, "x")
    _check_device(x)
    shape = _normalized_shape(normalized_shape)
    if x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(
            f"normalized_shape {shape} must equal the trailing axes of x, got x of shape "
            f"{tuple(x.shape)}"
        )
    weight = _check_param(weight, "weight", shape, x)
    bias = _check_param(bias, "bias", shape, x)
    eps = check_eps(eps, np.dtype(np.float32))  # the kernels add eps in float32

    x2 = x.reshape(-1, math.prod(shape))  # (M, D), a view when the strides allow it
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y, _mean, _rstd = ops.fwd(x2, weight, bias, eps)
    return y.reshape(x.shape)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by the fused kernels.

    A subclass: same constructor, parameters, state dict and ``repr`` fields, so it loads a
    ``torch.nn.LayerNorm``'s state dict and takes its place in a model unchanged.
    """

    def forward(self, input: Tensor) -> Tensor:
        """Normalized ``input`` (..., *normalized_shape), same shape and dtype."""
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
