"""The ops' CPU kernels registered from Python: where the C++ operator cannot be built.

The same compiled kernels as the C++ operator (:mod:`layernorm.cpu.entry`), on the tensors' own
memory, with the same outputs; the rows are split over ``torch.get_num_threads()`` threads by
:func:`layernorm.cpu.entry.run`. Only the cost of a call differs (a few tens of microseconds of
Python). Statistics: ``stats`` (M, NSTATS) float64 per row; the second statistics tensor of the
ops is an (M, 0) placeholder on the CPU.

The memory-efficient backward (:func:`backward_y`) reads y instead of x: the forward is
:func:`forward` as it is, then :func:`kept` forms the xhat of the channels that
:func:`layernorm.recovery.kept_channels` says y cannot give back, and of the rows
:func:`layernorm.recovery.kept_rows` keeps whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..cpu import entry, kernels
from ..cpu.kernels import HI, LO, NSTATS, RSTD, SCALE
from ..recovery import kept_channels, kept_rows

__all__ = ["backward", "backward_y", "compute_dtype", "forward", "kept"]

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


def _shift(p: Tensor | None, d: int, cdt: torch.dtype) -> Tensor:
    """(D,) the shift in the compute dtype: bias, or zeros without it (read only)."""
    if p is None:
        return torch.zeros(d, dtype=cdt)
    if p.dtype == cdt and p.is_contiguous():
        return p.detach()
    return p.detach().to(cdt, copy=True).contiguous()


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
    dy, dh, dx, dres, names = _outputs(xn, dy, dh, cdt, x_dtype, residual_dtype)
    flags = kernels.CENTRED if centred else 0
    dw, db = _run(entry.backward_key(*names), lambda partial, c: (
        _p(xn), _p(dy), _p(dh), _p(dx), _p(dres), 0, _p(scale), _p(stats), 0, flags,
        _p(partial), 0, m, d, 0 if dh is None else d, d if add else 0, 0, c), m, d, weight, bias,
        xn)
    return dx, dres, dw, db


def _outputs(src: Tensor, dy: Tensor, dh: Tensor | None, cdt: torch.dtype,
             x_dtype: torch.dtype | None, residual_dtype: torch.dtype | None,
             ) -> tuple[Tensor, Tensor | None, Tensor, Tensor, tuple[str | None, ...]]:
    """What both backwards set up: dy in the compute dtype, dh in the add's, dx (``x_dtype``,
    src's dtype when None) and dresidual (empty without ``residual_dtype``), and the dtype
    names of the kernel's roles (:func:`layernorm.cpu.entry.backward_key`'s order)."""
    dy = _in(dy, cdt)
    dx = torch.empty(src.shape, dtype=src.dtype if x_dtype is None else x_dtype)
    dres = src.new_empty((0,))
    adt = compute_dtype(dx.dtype, residual_dtype or dx.dtype, cdt)  # the dtype dh joins dx in
    if residual_dtype is not None:
        dres = torch.empty(src.shape, dtype=residual_dtype)
    dh = None if dh is None else _in(dh, adt)
    names = (_NAMES[src.dtype], _NAMES[dy.dtype], None if dh is None else _NAMES[dh.dtype],
             _NAMES[dx.dtype], None if residual_dtype is None else _NAMES[residual_dtype],
             _NAMES[cdt], _NAMES[adt])
    return dy, dh, dx, dres, names


def _run(key: str, args: Callable[[Tensor, int], tuple], m: int, d: int, weight: Tensor | None,
         bias: Tensor | None, src: Tensor) -> tuple[Tensor, Tensor]:
    """The backward named ``key`` over the row chunks (``args(partial, C)`` its arguments
    before the chunk range), then the chunks' partials summed: (dweight, dbias), each an
    empty (0,) of src's dtype where its parameter is absent."""
    c = kernels.n_chunks(m)
    partial = torch.empty((c, 2, d), dtype=torch.float64)
    sums = torch.zeros((2, d), dtype=torch.float64)
    if m:
        entry.run(entry.ctypes_fn(key), args(partial, c), c, m * d, torch.get_num_threads())
        entry.ctypes_fn("reduce")(_p(partial), _p(sums), c, d)
    dw = src.new_empty((0,)) if weight is None else sums[0].to(weight.dtype, copy=True)
    db = src.new_empty((0,)) if bias is None else sums[1].to(bias.dtype, copy=True)
    return dw, db




def kept(xn: Tensor, weight: Tensor | None, bias: Tensor | None, stats: Tensor, eps: float,
         centred: bool, zero_centered_gamma: bool, y_dtype: torch.dtype,
         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(keep, kept, rows, xrows): what the forward keeps besides y for the backward from y.

    keep (k,) int64, the channels whose xhat y (stored in ``y_dtype``) cannot give back
    (:func:`layernorm.recovery.kept_channels` of the kernel's scale and shift), and kept (M, k)
    their xhat in the compute dtype T; rows (r,) int64, the rows kept whole
    (:func:`layernorm.recovery.kept_rows` of rstd = RSTD * SCALE, ``eps``, the shift and keep:
    var < eps where the shift is non-zero on a recovered channel), and xrows (r, D) their xhat
    in T. Both xhat are ((x * SCALE - HI) - LO) * RSTD per row, formed in float64 from the
    forward's ``stats`` (M, NSTATS) and rounded once, as the kernels define xhat. xn is what
    the forward normalized: x, or h for an add-norm; bias is ignored without ``centred``
    (RMSNorm has no shift)."""
    d = xn.shape[-1]
    m = xn.numel() // d
    for t, name, shape in ((xn, "xn", None), (weight, "weight", d), (bias, "bias", d),
                           (stats, "stats0", (m, NSTATS))):
        _check(t, name, shape)
    cdt = compute_dtype(xn.dtype)
    scale = _scale(weight, d, cdt, zero_centered_gamma)
    shift = _shift(bias if centred else None, d, cdt)
    keep = kept_channels(scale.numpy(), shift.numpy(), _NAMES[y_dtype], d)
    s = stats.detach().reshape(m, NSTATS)
    rows = kept_rows((s[:, RSTD] * s[:, SCALE]).numpy(), eps, shift.numpy(), keep)
    keep, rows = torch.from_numpy(keep), torch.from_numpy(rows)
    xs = xn.detach().reshape(m, d)
    return keep, _xhat(xs[:, keep], s, cdt), rows, _xhat(xs[rows], s[rows], cdt)


def _xhat(xs: Tensor, s: Tensor, cdt: torch.dtype) -> Tensor:
    """(n, c) xhat of xs (n, c), values of n rows of what was normalized, with their
    statistics s (n, NSTATS): ((x * SCALE - HI) - LO) * RSTD in float64, rounded once to
    ``cdt``; contiguous."""
    x = xs.to(torch.float64)
    xhat = ((x * s[:, SCALE:SCALE + 1] - s[:, HI:HI + 1]) - s[:, LO:LO + 1]) * s[:, RSTD:RSTD + 1]
    return xhat.to(cdt).contiguous()


def backward_y(dy: Tensor, dh: Tensor | None, y: Tensor, weight: Tensor | None,
               bias: Tensor | None, stats: Tensor, keep: Tensor, kept: Tensor, rows: Tensor,
               xrows: Tensor, centred: bool, zero_centered_gamma: bool,
               x_dtype: torch.dtype | None, residual_dtype: torch.dtype | None,
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The memory-efficient backward, from the forward's y instead of x: dx, dresidual (an
    empty (0,) without ``residual_dtype``), dweight, dbias (empty without them), as
    :func:`backward`.

    y is the forward's output (x's dtype); keep (k,) int64, kept (M, k), rows (r,) int64 and
    xrows (r, D) come from :func:`kept`, whose dtype is the compute dtype T; stats is the
    forward's. dx comes back in ``x_dtype`` (y's dtype when None) with dh added where given,
    and dresidual, the same sum, in ``residual_dtype`` where that is given.
    """
    d = y.shape[-1]
    m = y.numel() // d
    k = keep.numel()
    r = rows.numel()
    add = residual_dtype is not None
    for t, name, shape in ((y, "y", None), (dy, "dy", tuple(y.shape)), (dh, "dh", tuple(y.shape)),
                           (weight, "weight", d), (bias, "bias", d),
                           (stats, "stats0", (m, NSTATS)), (kept, "kept", (m, k)),
                           (xrows, "xrows", (r, d))):
        _check(t, name, shape)
    for t, name, top in ((keep, "keep", d), (rows, "rows", m)):
        _check_index(t, name, top)
    if xrows.dtype != kept.dtype:
        raise ValueError(f"layernorm: xrows must be in kept's dtype {kept.dtype}, got "
                         f"{xrows.dtype}")
    y = y.contiguous()
    stats = stats.contiguous()
    cdt = kept.dtype
    scale = _scale(weight, d, cdt, zero_centered_gamma)
    shift = _shift(bias if centred else None, d, cdt)
    keep = keep.contiguous()
    kept = kept.contiguous()
    rows = rows.contiguous()
    xrows = xrows.contiguous()
    dy, dh, dx, dres, names = _outputs(y, dy, dh, cdt, x_dtype, residual_dtype)
    flags = kernels.CENTRED if centred else 0
    dw, db = _run(entry.backward_y_key(*names), lambda partial, c: (
        _p(y), _p(dy), _p(dh), _p(dx), _p(dres), 0, _p(scale), _p(shift), _p(keep), _p(kept),
        _p(rows), _p(xrows), _p(stats), flags, _p(partial), m, d, 0 if dh is None else d,
        d if add else 0, k, r, c), m, d, weight, bias, y)
    return dx, dres, dw, db


def _check_index(t: Tensor, name: str, top: int) -> None:
    """As the C++ operator checks keep and rows: (n,) int64, ascending, in [0, ``top``)."""
    if t.dtype != torch.int64 or t.dim() != 1:
        raise ValueError(f"layernorm: {name} must be a 1-dimensional int64 tensor, got "
                         f"{t.dtype} of shape {tuple(t.shape)}")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= top or
                      bool((t[1:] <= t[:-1]).any())):
        raise ValueError(f"layernorm: {name} must hold ascending indices in [0, {top})")
