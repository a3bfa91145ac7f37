"""The ops' CPU kernels registered from Python: where the C++ operator cannot be built.

The same compiled kernels as the C++ operator (:mod:`layernorm.cpu.entry`), on the tensors' own
memory, with the same outputs; the rows are split over ``torch.get_num_threads()`` threads by
:func:`layernorm.cpu.entry.run`. Only the cost of a call differs (a few tens of microseconds of
Python). Statistics: ``stats`` (M, NSTATS) float64 per row; the second statistics tensor of the
ops is an (M, 0) placeholder on the CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cpu import entry, kernels
from ..cpu.kernels import NSTATS

__all__ = ["backward", "compute_dtype", "forward"]

_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
          torch.float64: "float64"}


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any of ``dtypes`` is float64, else float32: where every backend's kernels
    compute, and the dtype of their statistics."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _scale(p: Tensor | None, d: int, cdt: torch.dtype, plus_one: bool) -> Tensor:
    """(D,) the backward's scale in the compute dtype: weight (plus one when zero-centred), or
    ones without it; read only: the weight itself where it already is one."""
    if p is None:
        return torch.ones(d, dtype=cdt)
    if p.dtype == cdt and not plus_one and p.is_contiguous():
        return p.detach()
    s = p.detach().to(cdt, copy=True).contiguous()
    return s.add_(1) if plus_one else s


def _in(t: Tensor, cdt: torch.dtype) -> Tensor:
    return t.contiguous() if compute_dtype(t.dtype) == cdt else t.to(cdt).contiguous()


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


def _p(t: Tensor | None) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def forward(x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None,
            eps: float, centred: bool, zero_centered_gamma: bool, h_dtype: torch.dtype | None,
            keep: bool) -> tuple[Tensor, Tensor, Tensor]:
    """y in x's shape and dtype, h in x's shape and ``h_dtype`` (an empty (0,) without
    residual) and stats (M, NSTATS) float64, or (0, NSTATS) without ``keep``; x (..., D) is
    M = numel / D rows."""
    d = x.shape[-1]
    m = x.numel() // d
    add = residual is not None
    for t, name, shape in ((x, "x", None), (residual, "residual", tuple(x.shape)),
                           (weight, "weight", d), (bias, "bias", d)):
        _check(t, name, shape)
    h_dtype = x.dtype if h_dtype is None else h_dtype
    cdt = compute_dtype(h_dtype if add else x.dtype)
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype)
    if add:
        residual = residual.contiguous()
        h = torch.empty(x.shape, dtype=h_dtype)
        adt = compute_dtype(x.dtype, residual.dtype, h_dtype)
    else:
        h = x.new_empty((0,))
        adt = cdt
    # the kernels read gamma and beta as they are stored
    weight = None if weight is None else weight.detach().contiguous()
    bias = None if bias is None else bias.detach().contiguous()
    stats = torch.empty((m if keep else 0, NSTATS), dtype=torch.float64)
    key = entry.forward_key(_NAMES[x.dtype], _NAMES[residual.dtype] if add else None,
                            _NAMES[h_dtype] if add else None, _NAMES[cdt], _NAMES[adt],
                            None if weight is None else _NAMES[weight.dtype],
                            None if bias is None else _NAMES[bias.dtype])
    fn = entry.ctypes_fn(key)
    flags = ((kernels.CENTRED if centred else 0)
             | (kernels.ZERO_CENTERED if zero_centered_gamma and weight is not None else 0))
    if m:
        entry.run(fn, (_p(x), _p(residual), _p(h), _p(y), 0, 0, _p(weight), _p(bias), eps,
                       flags, _p(stats), 0, m, d, d if add else 0,
                       0 if weight is None else d, 0 if bias is None else d,
                       m if keep else 0, 0),
                  m, m * d, torch.get_num_threads())
    return y, h, stats


def backward(dy: Tensor, dh: Tensor | None, xn: Tensor, weight: Tensor | None,
             bias: Tensor | None, stats: Tensor, centred: bool, zero_centered_gamma: bool,
             x_dtype: torch.dtype | None, residual_dtype: torch.dtype | None,
             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dx, dresidual (an empty (0,) without ``residual_dtype``), dweight, dbias (empty without
    them).

    xn is what the forward normalized: x, or h for an add-norm; dx comes back in ``x_dtype``
    (xn's dtype when None) with dh added where given, and dresidual, the same sum, in
    ``residual_dtype`` where that is given.
    """
    d = xn.shape[-1]
    m = xn.numel() // d
    add = residual_dtype is not None
    for t, name, shape in ((xn, "xn", None), (dy, "dy", tuple(xn.shape)),
                           (dh, "dh", tuple(xn.shape)), (weight, "weight", d), (bias, "bias", d),
                           (stats, "stats0", (m, NSTATS))):
        _check(t, name, shape)
    xn = xn.contiguous()
    stats = stats.contiguous()
    cdt = compute_dtype(xn.dtype)
    scale = _scale(weight, d, cdt, zero_centered_gamma)
    dy = _in(dy, cdt)
    dx = torch.empty(xn.shape, dtype=xn.dtype if x_dtype is None else x_dtype)
    dres = xn.new_empty((0,))
    adt = compute_dtype(dx.dtype, residual_dtype or dx.dtype, cdt)  # the dtype dh joins dx in
    if add:
        dres = torch.empty(xn.shape, dtype=residual_dtype)
    dh = None if dh is None else _in(dh, adt)
    c = kernels.n_chunks(m)
    partial = torch.empty((c, 2, d), dtype=torch.float64)
    key = entry.backward_key(_NAMES[xn.dtype], _NAMES[dy.dtype],
                             None if dh is None else _NAMES[dh.dtype], _NAMES[dx.dtype],
                             _NAMES[residual_dtype] if add else None, _NAMES[cdt], _NAMES[adt])
    sums = torch.zeros((2, d), dtype=torch.float64)
    if m:
        flags = kernels.CENTRED if centred else 0
        entry.run(entry.ctypes_fn(key),
                  (_p(xn), _p(dy), _p(dh), _p(dx), _p(dres), 0, _p(scale), _p(stats), 0, flags,
                   _p(partial), 0, m, d, 0 if dh is None else d, d if add else 0, 0, c),
                  c, m * d, torch.get_num_threads())
        entry.ctypes_fn("reduce")(_p(partial), _p(sums), c, d)
    dw = xn.new_empty((0,)) if weight is None else sums[0].to(weight.dtype, copy=True)
    db = xn.new_empty((0,)) if bias is None else sums[1].to(bias.dtype, copy=True)
    return dx, dres, dw, db


