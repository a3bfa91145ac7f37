r"""The family under ``torch.func`` transforms and forward-mode AD: one Python autograd Function.

The ops' autograd (``torch.library.register_autograd``, and the C++ Function of the CPU
operator) serves eager training and ``torch.compile`` at the least cost per call, but has no
forward-mode derivative and no batching rule: under ``torch.func.jvp`` a library op's tangent
would come back as zeros, and functorch refuses a C++ Function. So a call made while a
transform or a forward-AD level is active (:func:`active`) takes :class:`Norm` instead:

* forward: the inference op ``layernorm::norm`` (y, and h for an add-norm; no statistics),
  so y has the same bits as an eager call's;
* backward: :func:`layernorm.torch._ops.composite_backward` from the saved input (x, or h):
  torch operations that recompute the statistics, so that a transform of the backward
  (``hessian``, ``grad`` of ``grad``, ``jacfwd`` of ``jacrev``) differentiates them too;
  reading the forward's statistics as constants would give a silently wrong Hessian;
* jvp: the forward-mode derivative derived in docs/derivation.md ("Forward mode"), from the
  saved input, in torch operations (so it is differentiable in turn). With u the tangent of
  the normalized input (of h: tx + tresidual for an add-norm) and xhat, rstd its statistics,

      t_xhat = rstd·(u − mean(u) − xhat·mean(xhat·u))      (RMSNorm: no mean(u))
      t_y    = scale·t_xhat + t_weight·xhat + t_bias         (d(1 + weight) = t_weight);

* vmap: generated from the three above (``generate_vmap_rule``); the op ``layernorm::norm``
  has a batching rule (:func:`_norm_vmap`): the vmapped axis folds into the rows, or, where
  the weight or bias itself is batched, one call per batch element.

``memory_efficient=True`` has no effect here: the Function keeps the input, as the default
mode's autograd does (the backward from y cannot be differentiated again).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

from ._dtypes import compute_dtype
from ._ops import composite_backward, norm, statistics

__all__ = ["Norm", "active", "apply"]

_functorch_active = torch._C._are_functorch_transforms_active


def active() -> bool:
    """A ``torch.func`` transform (grad, vmap, jvp, jacrev, jacfwd, hessian) or a forward-AD
    level (``torch.autograd.forward_ad.dual_level``) is active: about 0.1 µs. Under
    torch.compile (Dynamo refuses a custom jvp) the functions then take torch's standard
    operations instead of :class:`Norm`."""
    return _functorch_active() or _forward_ad._current_level >= 0


def _tangent(*ts: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The sum of the tangents that are given, in ``dtype``; None when none is."""
    given = [t.to(dtype) for t in ts if t is not None]
    if not given:
        return None
    return given[0] if len(given) == 1 else given[0] + given[1]


class Norm(torch.autograd.Function):
    """y (and h) of a family member, differentiable in both modes and batchable.

    Arguments as the op ``layernorm::fwd``: x (..., D), residual (..., D) or None, weight and bias
    (D,) or None, eps, centred, zero_centered_gamma, h_dtype. Returns y alone without a
    residual, else (y, h).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, residual: Tensor | None, weight: Tensor | None,
                bias: Tensor | None, eps: float, centred: bool, zero_centered_gamma: bool,
                h_dtype: torch.dtype | None) -> Tensor | tuple[Tensor, Tensor]:
        y, h = norm(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype)
        return y if residual is None else (y, h)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        x, residual, weight, bias, eps, centred, zero_centered_gamma, _h_dtype = inputs
        add = residual is not None
        src = output[1] if add else x  # the tensor normalized: x, or h as rounded
        ctx.save_for_backward(src, weight, bias)
        ctx.save_for_forward(src, weight, bias)
        ctx.flags = (eps, centred, zero_centered_gamma, x.dtype,
                     residual.dtype if add else None)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, dy: Tensor | None, dh: Tensor | None = None) -> tuple:
        src, weight, bias = ctx.saved_tensors
        eps, centred, zcg, x_dtype, residual_dtype = ctx.flags
        none = (None,) * 4
        if dy is None:  # y unused: the norm contributes nothing, dh passes to x and residual
            if residual_dtype is None or dh is None:
                return (None,) * 8
            return (dh.to(x_dtype), dh.to(residual_dtype), None, None, *none)
        dx, dres, dw, db = composite_backward(dy, dh, src, weight, bias, eps, centred, zcg,
                                              x_dtype, residual_dtype)
        return dx, dres, dw, db, *none

    @staticmethod
    def jvp(ctx: Any, tx: Tensor | None, tresidual: Tensor | None, tweight: Tensor | None,
            tbias: Tensor | None, *_flags: Any) -> Tensor | tuple[Tensor, Tensor]:
        src, weight, bias = ctx.saved_tensors
        eps, centred, zcg, x_dtype, residual_dtype = ctx.flags
        add = residual_dtype is not None
        cdt = compute_dtype(src.dtype)
        xhat, rstd = statistics(src, eps, centred)
        # the tangent of h: tx + tresidual, formed in the add's compute dtype
        wide = compute_dtype(x_dtype, residual_dtype or x_dtype, src.dtype)
        u = _tangent(tx, tresidual if add else None, dtype=wide)
        if u is None:
            ty = torch.zeros_like(xhat)
        else:
            uc = u.to(cdt)
            if centred:
                uc = uc - uc.mean(-1, keepdim=True)
            t_xhat = rstd * (uc - xhat * (xhat * uc).mean(-1, keepdim=True))
            ty = t_xhat if weight is None else t_xhat * (
                weight.to(cdt) + 1 if zcg else weight.to(cdt))
        if tweight is not None:
            ty = ty + tweight.to(cdt) * xhat
        if tbias is not None:
            ty = ty + tbias.to(cdt)
        ty = ty.to(x_dtype)
        if not add:
            return ty
        th = torch.zeros_like(src) if u is None else u.to(src.dtype)
        return ty, th


def apply(x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None,
          eps: float, centred: bool, zero_centered_gamma: bool, h_dtype: torch.dtype | None,
          ) -> tuple[Tensor, Tensor | None]:
    """(y, h) through :class:`Norm`, h None without a residual."""
    out = Norm.apply(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype)
    return (out, None) if residual is None else out


def _batch(t: Tensor | None, dim: int | None, size: int) -> Tensor | None:
    """``t`` with its vmapped axis first (expanded where it has none), or None."""
    if t is None:
        return None
    return t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)


@torch.library.register_vmap("layernorm::norm")
def _norm_vmap(info: Any, in_dims: tuple, x: Tensor, residual: Tensor | None,
               weight: Tensor | None, bias: Tensor | None, eps: float, centred: bool,
               zero_centered_gamma: bool, h_dtype: torch.dtype | None) -> tuple:
    """The inference op under vmap: the vmapped axis is one more leading axis of rows; where
    the weight or bias is batched (per-sample parameters), one call per batch element."""
    xd, rd, wd, bd = in_dims[:4]
    n = info.batch_size
    add = residual is not None
    xs, rs = _batch(x, xd, n), _batch(residual, rd, n)
    if n == 0 and (wd is not None or bd is not None):  # no sample: empty outputs, no weight
        weight = bias = None
        wd = bd = None
    if wd is None and bd is None:
        y, h = norm(xs.contiguous(), None if rs is None else rs.contiguous(), weight, bias, eps,
                    centred, zero_centered_gamma, h_dtype)
        return (y, h), (0, 0 if add else None)
    ws, bs = _batch(weight, wd, n), _batch(bias, bd, n)
    outs = [norm(xs[i], None if rs is None else rs[i], None if ws is None else ws[i],
                 None if bs is None else bs[i], eps, centred, zero_centered_gamma, h_dtype)
            for i in range(n)]
    y = torch.stack([o[0] for o in outs])
    h = torch.stack([o[1] for o in outs]) if add else outs[0][1]
    return (y, h), (0, 0 if add else None)
