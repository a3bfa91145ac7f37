"""The kernels as ``torch.library`` custom ops, with a fake (meta) implementation and autograd.

``layernorm::triton_fwd`` and ``layernorm::triton_bwd`` are opaque to ``torch.compile``: Dynamo
records each as one node (no graph break, no silent fallback), the fake implementations give
output shapes without running anything, and the forward's autograd formula calls the backward.
Both ops take 2-D (M, D) tensors with unit column stride; :func:`layernorm.gpu.api.layer_norm`
flattens and checks the caller's arguments first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import kernels

__all__ = ["bwd", "fwd"]


@torch.library.custom_op("layernorm::triton_fwd", mutates_args=())
def fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """y (M, D) in x's dtype, mean (M,) and rstd (M,) float32; see :func:`kernels.forward`."""
    return kernels.forward(x, weight, bias, eps)


@fwd.register_fake
def _fwd_fake(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    M, D = x.shape
    stats = x.new_empty((M,), dtype=torch.float32)
    return x.new_empty((M, D)), stats, torch.empty_like(stats)


@torch.library.custom_op("layernorm::triton_bwd", mutates_args=())
def bwd(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """dx (M, D), dweight (D,), dbias (D,); an absent parameter's gradient is an empty (0,)."""
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    dx, dw, db = kernels.backward(dy, x, weight, bias, mean, rstd)
    # A custom op cannot return None, nor two outputs that alias: one empty tensor for each.
    return dx, x.new_empty((0,)) if dw is None else dw, x.new_empty((0,)) if db is None else db


@bwd.register_fake
def _bwd_fake(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    return (
        x.new_empty(x.shape),
        x.new_empty((0,)) if weight is None else torch.empty_like(weight),
        x.new_empty((0,)) if bias is None else torch.empty_like(bias),
    )


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, bias, _eps = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)


def _backward(
    ctx: Any, dy: Tensor, _dmean: Tensor, _drstd: Tensor
) -> tuple[Tensor, Tensor | None, Tensor | None, None]:
    # mean and rstd are outputs only so the backward can read them; their gradients are ignored.
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = bwd(dy, x, weight, bias, mean, rstd)
    return dx, None if weight is None else dw, None if bias is None else db, None


fwd.register_autograd(_backward, setup_context=_setup_context)
