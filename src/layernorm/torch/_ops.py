"""The family as two ``torch.library`` custom ops, with fake tensors, autograd and a device switch.

``layernorm::fwd`` and ``layernorm::bwd`` serve every norm (``centred`` picks LayerNorm or
RMSNorm, a residual makes it an add-norm). They take 2-D (M, D) tensors; the functions of
:mod:`layernorm.torch` check and flatten the caller's arguments first. Each op runs

* on CPU tensors, the fused Numba kernels (:mod:`._cpu`), reading the tensors' memory;
* on CUDA tensors, the Triton kernels (:mod:`layernorm.gpu.kernels`).

``torch.compile`` sees each op as one opaque node (no graph break); the fake implementations
give the outputs' shapes without running anything. The statistics the backward reads are two
tensors whose layout is the backend's own: on CPU ``stats`` (M, NSTATS) float64 and a checksum
(M,) int64; on CUDA mean (M,) and rstd (M,) in the statistics dtype. Both have rows first, so
a row-sharded input gives row-sharded statistics.

Autograd saves what the backward reads through ``save_for_backward`` (x, or h for an add-norm,
and the parameters), so changing one of them in place before the backward raises torch's own
version-counter error. The first backward is the fused ``layernorm::bwd``; a backward that is
itself differentiated (``create_graph=True``, double backward) is computed from torch
operations (:func:`composite_backward`), which autograd differentiates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from . import _cpu

__all__ = ["bwd", "composite_backward", "fwd", "triton_on_cpu"]

_TRITON_ON_CPU = False


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Run the ops' CPU tensors through the Triton kernels in Triton's interpreter.

    For tests: the CUDA code path (launchers, statistics layout) on a machine without a GPU.
    Needs TRITON_INTERPRET=1 set before triton is first imported.
    """
    from ..gpu import kernels

    if not kernels.INTERPRET:
        raise RuntimeError("triton_on_cpu needs TRITON_INTERPRET=1 set before triton is imported")
    global _TRITON_ON_CPU
    old, _TRITON_ON_CPU = _TRITON_ON_CPU, True
    try:
        yield
    finally:
        _TRITON_ON_CPU = old


def _uses_triton(t: Tensor) -> bool:
    return t.device.type != "cpu" or _TRITON_ON_CPU


@torch.library.custom_op("layernorm::fwd", mutates_args=())
def fwd(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    centred: bool,
    zero_centered_gamma: bool,
    h_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """y (M, D) in x's dtype; h (M, D) in ``h_dtype`` for an add-norm, else an empty (0,);
    and the two statistics tensors the backward reads (layout: see the module docstring)."""
    h_dtype = x.dtype if h_dtype is None else h_dtype
    if _uses_triton(x):
        from ..gpu import kernels

        y, h, mean, rstd = kernels.forward(
            x, residual, weight, bias, eps, centred=centred,
            zero_centered_gamma=zero_centered_gamma,
            h_dtype=None if residual is None else h_dtype,
        )
        return y, x.new_empty((0,)) if h is None else h, mean, rstd
    return _cpu.forward(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype)


@fwd.register_fake
def _fwd_fake(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype):
    m, d = x.shape
    y = x.new_empty((m, d))
    h = x.new_empty((0,)) if residual is None else x.new_empty((m, d), dtype=h_dtype or x.dtype)
    if _uses_triton(x):
        sdt = _cpu.compute_dtype(x.dtype if residual is None else h_dtype or x.dtype)
        return y, h, x.new_empty((m,), dtype=sdt), x.new_empty((m,), dtype=sdt)
    s, c = _cpu.stats_shapes(m)
    return y, h, x.new_empty(s, dtype=torch.float64), x.new_empty(c, dtype=torch.int64)


@torch.library.custom_op("layernorm::bwd", mutates_args=())
def bwd(
    dy: Tensor,
    dh: Tensor | None,
    xn: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    stats0: Tensor,
    stats1: Tensor,
    centred: bool,
    zero_centered_gamma: bool,
    x_dtype: torch.dtype | None,
    residual_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dx (M, D) in ``x_dtype`` (xn's dtype when None); dresidual (M, D) in ``residual_dtype``
    for an add-norm, else an empty (0,); dweight and dbias in their parameters' dtypes, or an
    empty (0,) for an absent one (a custom op returns neither None nor aliases)."""
    if _uses_triton(xn):
        from ..gpu import kernels

        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        if dh is not None and dh.stride(-1) != 1:
            dh = dh.contiguous()
        dx, dres, dw, db = kernels.backward(
            dy, dh, xn, weight, bias, stats0, stats1, centred=centred,
            zero_centered_gamma=zero_centered_gamma, x_dtype=x_dtype,
            residual_dtype=residual_dtype,
        )
        # a custom op returns no None and no two outputs that share memory: one empty each
        return tuple(xn.new_empty((0,)) if t is None else t for t in (dx, dres, dw, db))
    return _cpu.backward(dy, dh, xn, weight, bias, stats0, stats1, centred, zero_centered_gamma,
                         x_dtype, residual_dtype)


@bwd.register_fake
def _bwd_fake(dy, dh, xn, weight, bias, stats0, stats1, centred, zero_centered_gamma, x_dtype,
              residual_dtype):
    return (
        xn.new_empty(xn.shape, dtype=x_dtype or xn.dtype),
        xn.new_empty((0,)) if residual_dtype is None else xn.new_empty(xn.shape,
                                                                       dtype=residual_dtype),
        xn.new_empty((0,)) if weight is None else torch.empty_like(weight),
        xn.new_empty((0,)) if bias is None else torch.empty_like(bias),
    )


def composite_backward(
    dy: Tensor | None, dh: Tensor | None, xn: Tensor, weight: Tensor | None,
    bias: Tensor | None, eps: float, centred: bool, zero_centered_gamma: bool,
    x_dtype: torch.dtype, residual_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The backward from torch operations, differentiable by autograd (double backward).

    Recomputes the statistics from ``xn`` (so their dependence on x is part of the graph) in
    the compute dtype, then the family's formulas: g = dy·scale, dnorm = rstd·(g − mean(g) −
    xhat·mean(g·xhat)) (no mean(g) for RMSNorm), dweight = Σ dy·xhat, dbias = Σ dy, and
    dx = dresidual = dh + dnorm for an add-norm.
    """
    cdt = _cpu.compute_dtype(xn.dtype)
    x = xn.to(cdt)
    xc = x - x.mean(-1, keepdim=True) if centred else x
    rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)
    xhat = xc * rstd
    g = torch.zeros_like(x) if dy is None else dy.to(cdt)
    dyc = g
    if weight is not None:
        g = g * (weight.to(cdt) + 1 if zero_centered_gamma else weight.to(cdt))
    proj = xhat * (g * xhat).mean(-1, keepdim=True)
    dnorm = rstd * ((g - g.mean(-1, keepdim=True) if centred else g) - proj)
    dw = None if weight is None else (dyc * xhat).sum(0).to(weight.dtype)
    db = None if bias is None else dyc.sum(0).to(bias.dtype)
    if residual_dtype is None:
        return dnorm.to(x_dtype), None, dw, db
    total = dnorm if dh is None else dnorm + dh.to(cdt)
    return total.to(x_dtype), total.to(residual_dtype), dw, db


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype = inputs
    _y, h, s0, s1 = output
    add = residual is not None
    ctx.save_for_backward(h if add else x, weight, bias, s0, s1)
    ctx.flags = (eps, centred, zero_centered_gamma, x.dtype,
                 (residual.dtype if add else None))
    ctx.set_materialize_grads(False)  # an unused y or h costs nothing in the backward


def _backward(ctx: Any, dy: Tensor | None, dh: Tensor | None, _ds0: Any, _ds1: Any) -> tuple:
    # The statistics are outputs only so the backward can read them: their gradients are
    # ignored (they are functions of x, which the backward differentiates through).
    xn, weight, bias, s0, s1 = ctx.saved_tensors
    eps, centred, zcg, x_dtype, residual_dtype = ctx.flags
    if residual_dtype is None:
        dh = None
    if dy is None and dh is None:
        return None, None, None, None, None, None, None, None
    if torch.is_grad_enabled():  # the backward is being differentiated: torch operations
        dx, dres, dw, db = composite_backward(dy, dh, xn, weight, bias, eps, centred, zcg,
                                              x_dtype, residual_dtype)
    else:
        if dy is None:
            dy = torch.zeros_like(xn)
        dx, dres, dw, db = bwd(dy, dh, xn, weight, bias, s0, s1, centred, zcg, x_dtype,
                               residual_dtype)
    return (dx, None if residual_dtype is None else dres, None if weight is None else dw,
            None if bias is None else db, None, None, None, None)


fwd.register_autograd(_backward, setup_context=_setup_context)
