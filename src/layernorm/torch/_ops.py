"""The family as ``torch.library`` ops, with fake tensors, autograd and a device switch.

``layernorm::fwd`` and ``layernorm::bwd`` serve every norm in training (``centred`` picks
LayerNorm or RMSNorm, a residual makes it an add-norm); ``layernorm::norm`` is the forward of
inference, which keeps no statistics. ``layernorm::fwd_y`` and ``layernorm::bwd_y`` are the
memory-efficient pair: the forward's autograd keeps y (the norm's output, which the next layer
keeps anyway) instead of x or h, and the backward recovers xhat from it. They normalize
x (..., D) over its last axis, as M rows; the functions of :mod:`layernorm.torch` check the
caller's arguments first. Each op runs

* on CPU tensors, the C++ engine through its operator (:mod:`layernorm.engine`), or
  where it cannot be built the NumPy fallback (:mod:`._fallback`);
* on CUDA tensors, the Triton kernels (:mod:`layernorm.gpu.kernels`).

``torch.compile`` sees each op as one opaque node (no graph break); the fake implementations
give the outputs' shapes without running anything. The statistics the backward reads are two
tensors whose layout is the backend's own: on CPU ``stats`` (M, NSTATS) float64, its columns
named and defined in :mod:`layernorm.cpu.statistics`, and an (M, 0) placeholder; on CUDA mean
(M,) and rstd (M,) in the statistics dtype, a negative rstd marking a row the kernel rescaled.
The two layouts stay apart while no GPU can test a change to the CUDA one. Both have rows
first, so a row-sharded input gives row-sharded statistics.

Autograd saves what the backward reads through ``save_for_backward`` (x, or h for an add-norm,
and the parameters), so changing one of them in place before the backward raises torch's own
version-counter error. It is registered here for every device, and in C++ by the CPU operator
for CPU tensors (the same saves and formulas, without Python in a training step's call).
The first backward is the fused ``layernorm::bwd``; a backward that is
itself differentiated (``create_graph=True``, double backward) is computed from torch
operations (:func:`composite_backward`), which autograd differentiates.

Memory-efficient mode (``fwd_y``): autograd saves y (the output itself, so no copy), the
parameters, the statistics and, for the k channels :func:`layernorm.recovery.kept_channels`
names (where (y - shift) / scale would lose xhat), ``kept`` (M, k) = xhat of those channels in
the compute dtype T, with ``keep`` (k,) int64 their indices; and for the r rows
:func:`layernorm.recovery.kept_rows` keeps whole (var < eps under a shift that is non-zero on a
recovered channel: recovery would lose their relative accuracy), ``xrows`` (r, D) = their xhat
in T, with ``rows`` (r,) int64 their indices. ``bwd_y`` recovers
xhat_j = (y_j - shift_j) / scale_j on the other channels and rows and runs the usual formulas. y
changed in place before the backward raises torch's version-counter error, as x does for
``fwd``. Its backward cannot itself be differentiated: the second derivative needs the
dependence of rstd and of the kept xhat on x, which are not in the graph (x is not kept), so
a backward run with ``create_graph=True`` (double backward) raises
:data:`DOUBLE_BACKWARD` rather than return a wrong second derivative.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import recovery
from ..cpu import memory
from ..cpu.statistics import NSTATS
from ..engine import loader
from ..recovery import recovered_of, whole_rows
from ..reference.quant import QUANT_DTYPES
from . import _fallback
from ._dtypes import compute_dtype

__all__ = ["DOUBLE_BACKWARD", "NATIVE", "bwd", "bwd_y", "composite_backward", "fwd", "fwd_y",
           "fwd_shapes", "fwd_y_shapes", "kept_channels", "kept_rows", "norm", "norm_quant",
           "add_norm_quant",
           "statistics",
           "triton_kernels",
           "wide_residual_warning"]

_LIB = torch.library.Library("layernorm", "DEF")
_LIB.define(
    "fwd(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, bool centred, "
    "bool zero_centered_gamma, ScalarType? h_dtype) -> (Tensor, Tensor, Tensor, Tensor)")
_LIB.define(
    "norm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, bool centred, "
    "bool zero_centered_gamma, ScalarType? h_dtype) -> (Tensor, Tensor)")
_LIB.define(
    "bwd(Tensor dy, Tensor? dh, Tensor xn, Tensor? weight, Tensor? bias, Tensor stats0, "
    "Tensor stats1, bool centred, bool zero_centered_gamma, ScalarType? x_dtype, "
    "ScalarType? residual_dtype) -> (Tensor, Tensor, Tensor, Tensor)")
_LIB.define(
    "fwd_y(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, bool centred, "
    "bool zero_centered_gamma, ScalarType? h_dtype) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_LIB.define(
    "bwd_y(Tensor dy, Tensor? dh, Tensor y, Tensor? weight, Tensor? bias, Tensor stats0, "
    "Tensor stats1, Tensor keep, Tensor kept, Tensor rows, Tensor xrows, bool centred, "
    "bool zero_centered_gamma, ScalarType? x_dtype, ScalarType? residual_dtype) "
    "-> (Tensor, Tensor, Tensor, Tensor)")

_LIB.define(
    "norm_quant(Tensor x, Tensor? weight, Tensor? bias, float eps, bool centred, "
    "bool zero_centered_gamma, bool float8, Tensor? scale, int? group_size, Tensor? scale_ub) "
    "-> (Tensor, Tensor)")
_LIB.define(
    "add_norm_quant(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, "
    "bool centred, bool zero_centered_gamma, ScalarType? h_dtype, bool float8, "
    "Tensor? scale, int? group_size, Tensor? scale_ub) -> (Tensor, Tensor, Tensor)")

fwd = torch.ops.layernorm.fwd.default
"""y (M, D) in x's dtype; h (M, D) in ``h_dtype`` for an add-norm, else an empty (0,); and the
two statistics tensors the backward reads (layout: see the module docstring)."""
norm = torch.ops.layernorm.norm.default
"""y and h as :data:`fwd`, without statistics: the forward when nothing needs a gradient."""
norm_quant = torch.ops.layernorm.norm_quant.default
"""q and scales of the norm of x with its y quantized to float8_e4m3fn (``float8``) or int8 and
never stored (:mod:`layernorm.reference.quant` states it, with the dtype's qmax and min_scale
from its table): q in x's shape; scales float32, (..., D / group_size) of the data (group_size
None: per token, (..., 1)), or a copy of the static ``scale`` (a one-element float32 tensor).
``scale_ub`` is None or a one-element float32 tensor. Inference only: no autograd. (A flag, not
a dtype argument: torch converted a dtype argument in about a microsecond on the development
machine, a tenth of a decode step's call.)"""
add_norm_quant = torch.ops.layernorm.add_norm_quant.default
"""q, scales and h of the norm of h = x + residual (h in ``h_dtype``, as :data:`norm`'s) with its
y quantized, as :data:`norm_quant`. (Its own op, not an optional residual: a decode step's call
pays torch's dispatch for every argument and output.)"""
bwd = torch.ops.layernorm.bwd.default
"""dx (M, D) in ``x_dtype`` (xn's dtype when None), dh added where given; dresidual (M, D), the
same sum in ``residual_dtype`` where that is given, else an empty (0,); dweight and dbias in
their parameters' dtypes, or an empty (0,) for an absent one (an op returns neither None nor
aliases). An add-norm's autograd on the CPU passes no ``residual_dtype`` where the residual
shares x's dtype, and returns dx for both."""
fwd_y = torch.ops.layernorm.fwd_y.default
"""y, h and the two statistics tensors as :data:`fwd` (on CUDA, a row the forward rescaled gets
its own mean and rstd, not those of the rescaled row: the backward from y could not undo the
scaling), then ``keep`` (k,) int64, the channels
whose xhat cannot be recovered from y (:func:`layernorm.recovery.kept_channels` of the scale
and shift in the compute dtype T, y's dtype and D), and ``kept`` (M, k) in T, xhat of those
channels; then ``rows`` (r,) int64, the rows kept whole (:func:`layernorm.recovery.kept_rows`
of each row's rstd, eps, the shift in T and keep), and ``xrows`` (r, D) in T, xhat of those
rows. k depends on the parameters' values and r on the data: dynamic sizes to
torch.compile."""
bwd_y = torch.ops.layernorm.bwd_y.default
"""dx, dresidual, dweight and dbias as :data:`bwd`, from y (in x's dtype), the statistics,
``keep``, ``kept``, ``rows`` and ``xrows`` of :data:`fwd_y`; T is ``kept``'s dtype.
``x_dtype`` None means y's."""

DOUBLE_BACKWARD = (
    "layernorm: the backward of a memory_efficient=True norm cannot be differentiated "
    "(create_graph=True, double backward): it keeps y, not the input whose "
    "statistics the second derivative differentiates; use memory_efficient=False")
"""The message of the RuntimeError a differentiated memory-efficient backward raises."""


def wide_residual_warning(x_dtype: torch.dtype, h_dtype: torch.dtype | None) -> str | None:
    """The warning for a memory-efficient add-norm whose residual stream h (``h_dtype``; None:
    x's) is more precise than x (``x_dtype``, y's dtype), else None.

    The backward recovers xhat from y, rounded to x's dtype, so dresidual, which the default
    mode gives at h's precision, carries y's rounding (docs/numerics.md measures both). The
    cure, keeping h, would undo the mode's saving: h is the activation the mode does not keep.
    """
    if h_dtype is None or torch.finfo(h_dtype).eps >= torch.finfo(x_dtype).eps:
        return None
    x_name, h_name = str(x_dtype).removeprefix("torch."), str(h_dtype).removeprefix("torch.")
    return (f"layernorm: memory_efficient=True with residual_dtype={h_name}, more precise than "
            f"x's {x_name}: the backward recovers xhat from y, rounded to {x_name}, and the "
            "residual's gradient carries that rounding (docs/numerics.md measures it); use "
            f"memory_efficient=False to keep the residual stream's gradient at {h_name}'s "
            "precision")


def kept_channels(weight: Tensor | None, bias: Tensor | None, zero_centered_gamma: bool,
                  compute: torch.dtype, y_dtype: torch.dtype, d: int,
                  device: torch.device | str = "cpu") -> Tensor:
    """(k,) int64, ascending, on ``device``: :func:`layernorm.recovery.kept_channels` from torch
    operations, of the scale (weight, or 1 + weight, formed in ``compute``; ones without it)
    and shift (bias in ``compute``; zeros without it), for y stored in ``y_dtype``."""
    f64 = torch.float64
    if weight is None:
        s = torch.ones(d, dtype=f64, device=device)
    else:
        s = weight.detach().to(compute)
        s = (s + 1 if zero_centered_gamma else s).to(f64).abs()
    b = (torch.zeros(d, dtype=f64, device=device) if bias is None
         else bias.detach().to(compute).to(f64).abs())
    fi = torch.finfo(y_dtype)
    return torch.nonzero(~recovered_of(s, b, fi.tiny, fi.max, d)).view(-1)


# --- CUDA: the Triton kernels ---------------------------------------------------------------

def _rows(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.reshape(-1, t.shape[-1])


def _fwd_triton(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype):
    from ..gpu import launch as launchers

    h_dtype = x.dtype if h_dtype is None else h_dtype
    y, h, mean, rstd = launchers.forward(
        _rows(x), _rows(residual), weight, bias, eps, centred=centred,
        zero_centered_gamma=zero_centered_gamma, h_dtype=None if residual is None else h_dtype)
    return y.view(x.shape), x.new_empty((0,)) if h is None else h.view(x.shape), mean, rstd


def _norm_triton(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype):
    y, h, _mean, _rstd = _fwd_triton(x, residual, weight, bias, eps, centred,
                                     zero_centered_gamma, h_dtype)
    return y, h


def _triton_backward(launch, dy, dh, src, x_dtype, residual_dtype):
    """Either Triton backward as an op returns it: ``launch(dy, dh, src, residual_dtype)``
    on (M, D) views with unit column stride, ``src`` the rows it reads (xn, or y)."""
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    if dh is not None and dh.stride(-1) != 1:
        dh = dh.contiguous()
    # dh without residual_dtype: the launcher adds dh only for an add-norm, so it runs as one
    # whose dresidual, in dx's dtype, is dropped
    keep = dh is None or residual_dtype is not None
    dx, dres, dw, db = launch(_rows(dy), _rows(dh), _rows(src),
                              residual_dtype if keep else x_dtype or src.dtype)
    dx = dx.view(src.shape)
    dres = None if dres is None or not keep else dres.view(src.shape)
    # an op returns no None and no two outputs that share memory: one empty each
    return tuple(src.new_empty((0,)) if t is None else t for t in (dx, dres, dw, db))


def _bwd_triton(dy, dh, xn, weight, bias, stats0, stats1, centred, zero_centered_gamma,
                x_dtype, residual_dtype):
    from ..gpu import launch as launchers

    def launch(dy, dh, xn, residual_dtype):
        return launchers.backward(dy, dh, xn, weight, bias, stats0, stats1, centred=centred,
                                  zero_centered_gamma=zero_centered_gamma, x_dtype=x_dtype,
                                  residual_dtype=residual_dtype)

    return _triton_backward(launch, dy, dh, xn, x_dtype, residual_dtype)


def _pow2_scale(a: Tensor) -> Tensor:
    """The Triton kernels' rescaling of a row from its max|xn| ``a`` (M,) in T: 2**(126 - E) for
    a float32 of biased exponent E capped at 252 (float64: 2**(1022 - E), E capped at 2044),
    built from the bits as the kernels build it."""
    if a.dtype == torch.float64:
        e = ((a.view(torch.int64) >> 52) & 0x7FF).clamp(max=2044)
        return ((2045 - e) << 52).view(torch.float64)
    e = ((a.view(torch.int32) >> 23) & 0xFF).clamp(max=252)
    return ((253 - e) << 23).view(torch.float32)


def kept_rows(rstd: Tensor, eps: float, bias: Tensor | None, keep: Tensor,
              compute: torch.dtype) -> Tensor:
    """(r,) int64, ascending, on rstd's device: :func:`layernorm.recovery.kept_rows` from torch
    operations, of each row's true rstd (M,), ``eps``, the shift (bias in ``compute``; none
    without it) and the kept channels ``keep``: the rows with rstd**2 * eps > 1/2 in float64,
    where the shift is non-zero on a channel not in ``keep``; none otherwise."""
    none = torch.empty(0, dtype=torch.int64, device=rstd.device)
    if bias is None:
        return none
    # a copy: for a float64 bias both conversions return the caller's tensor itself
    live = bias.detach().to(compute).to(torch.float64, copy=True)
    live[keep] = 0.0
    if not bool((live != 0).any()):
        return none
    return torch.nonzero(whole_rows(rstd.to(torch.float64), eps)).view(-1)


def _xhat64(v: Tensor, mean: Tensor, rstd: Tensor, s: Tensor | None,
            cdt: torch.dtype) -> Tensor:
    """(n, c) xhat of v (n, c) float64, values of n rows with their mean and rstd (n,) in T
    (s (n,): the forward's rescaling of each row, or None): (v - mean)·rstd in float64
    (on v·s where a row was rescaled, as the forward computed its statistics), 0 where v
    equals the mean (a constant row, as the kernels have it), rounded once to ``cdt``."""
    f64 = torch.float64
    if s is None:
        xc = v - mean.to(f64)[:, None]
        xhat = xc * rstd.to(f64)[:, None]
    else:
        s64 = s.to(f64)[:, None]
        xc = v * s64 - (mean.to(f64)[:, None] * s64)
        xhat = xc * (rstd.to(f64)[:, None] / s64)
    return torch.where(xc == 0, 0.0, xhat).to(cdt)


def _recovery_triton(xn: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor,
                     rstd: Tensor, eps: float, zero_centered_gamma: bool, y_dtype: torch.dtype,
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(mean, rstd, keep, kept, rows, xrows) for the backward from y, from the Triton
    forward's statistics.

    On a row the forward rescaled (rstd < 0: the statistics of xn·s, s from max|xn|) the
    statistics become the row's own, mean(xn·s)/s and s·|rstd| = 1/sqrt(var + eps): y does not
    give s, so the backward could not. keep (k,) and kept (M, k) in T (the statistics' dtype):
    xhat = (xn - mean)·rstd of the kept channels, in float64 rounded to T, 0 where xn equals
    the mean (a constant row, as the kernels have it); rows (r,) (:func:`kept_rows` of the
    true rstd) and xrows (r, D), the xhat of those rows, formed in the same way.
    """
    d = xn.shape[-1]
    xs = xn.reshape(-1, d)
    cdt = mean.dtype
    scaled = rstd < 0
    s = None
    if bool(scaled.any()):
        s = torch.where(scaled, _pow2_scale(xs.abs().amax(-1).to(cdt)), 1.0).to(cdt)
        mean, rstd = mean / s, rstd.abs() * s  # exact: s is a power of two
    keep = kept_channels(weight, bias, zero_centered_gamma, cdt, y_dtype, d, xn.device)
    rows = kept_rows(rstd, eps, bias, keep, cdt)
    f64 = torch.float64
    kept = (_xhat64(xs[:, keep].to(f64), mean, rstd, s, cdt) if keep.numel()
            else xs.new_empty((xs.shape[0], 0), dtype=cdt))
    xrows = (_xhat64(xs[rows].to(f64), mean[rows], rstd[rows], None if s is None else s[rows],
                     cdt) if rows.numel() else xs.new_empty((0, d), dtype=cdt))
    return mean, rstd, keep, kept, rows, xrows


def _fwd_y_triton(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype):
    y, h, mean, rstd = _fwd_triton(x, residual, weight, bias, eps, centred,
                                   zero_centered_gamma, h_dtype)
    mean, rstd, keep, kept, rows, xrows = _recovery_triton(
        x if residual is None else h, weight, bias, mean, rstd, eps, zero_centered_gamma,
        x.dtype)
    return y, h, mean, rstd, keep, kept, rows, xrows


def _bwd_y_triton(dy, dh, y, weight, bias, stats0, stats1, keep, kept, rows, xrows, centred,
                  zero_centered_gamma, x_dtype, residual_dtype):
    from ..gpu import launch as launchers

    def launch(dy, dh, y, residual_dtype):
        return launchers.backward_from_y(
            dy, dh, y, weight, bias, stats1, keep, kept, rows=rows, xhat_rows=xrows,
            centred=centred, zero_centered_gamma=zero_centered_gamma, x_dtype=x_dtype,
            residual_dtype=residual_dtype)

    return _triton_backward(launch, dy, dh, y, x_dtype, residual_dtype)


def _add_norm_quant_triton(x, residual, weight, bias, eps, centred, zero_centered_gamma,
                           h_dtype, float8, scale, group_size, scale_ub):
    from ..gpu import launch as launchers
    from ..reference.quant import QUANT_DTYPES

    limits = QUANT_DTYPES["float8_e4m3fn" if float8 else "int8"]
    q, scales, h = launchers.forward_quant(
        _rows(x), _rows(residual), weight, bias, eps, centred=centred,
        zero_centered_gamma=zero_centered_gamma, h_dtype=None if residual is None else h_dtype,
        float8=float8, scale=scale, group_size=group_size, scale_ub=scale_ub,
        qmax=limits.qmax, min_scale=limits.min_scale)
    if scale is None:
        scales = scales.view(*x.shape[:-1], scales.shape[-1])
    return q.view(x.shape), scales, x.new_empty((0,)) if h is None else h.view(x.shape)


def _norm_quant_triton(x, weight, bias, eps, centred, zero_centered_gamma, float8, scale,
                       group_size, scale_ub):
    return _add_norm_quant_triton(x, None, weight, bias, eps, centred, zero_centered_gamma,
                                  None, float8, scale, group_size, scale_ub)[:2]


triton_kernels = (("fwd", _fwd_triton), ("norm", _norm_triton), ("bwd", _bwd_triton),
                  ("fwd_y", _fwd_y_triton), ("bwd_y", _bwd_y_triton),
                  ("norm_quant", _norm_quant_triton),
                  ("add_norm_quant", _add_norm_quant_triton))
"""The ops' CUDA kernels by name: the Triton launchers (registered for CUDA tensors here)."""
for _name, _fn in triton_kernels:
    _LIB.impl(_name, _fn, "CUDA")


# --- CPU: the C++ operator, or the NumPy fallback ---------------------------------------

NATIVE = loader.load()
"""Whether the ops' CPU kernels are the C++ operator's (else the NumPy fallback's)."""
if NATIVE:
    # the output pool's cap, the recovery rule's margin, the quantized dtypes' limits
    _quant = [QUANT_DTYPES[name] for name in ("int8", "float8_e4m3fn")]
    torch.ops.layernorm_cpu._setup(memory.CAP_BYTES, recovery.MARGIN, [q.qmax for q in _quant],
                                   [q.min_scale for q in _quant])
else:
    _fallback.register(_LIB)


# --- shapes without data ------------------------------------------------------------------

def _stats_fake(x: Tensor, residual: Tensor | None, h_dtype: torch.dtype | None,
                cuda: bool) -> tuple[Tensor, Tensor]:
    """The two statistics tensors of the forward, in the CUDA kernels' layout or the CPU's."""
    m = x.numel() // x.shape[-1]
    if not cuda:
        return (x.new_empty((m, NSTATS), dtype=torch.float64),
                x.new_empty((m, 0), dtype=torch.int64))
    sdt = compute_dtype(x.dtype if residual is None else h_dtype or x.dtype)
    return x.new_empty((m,), dtype=sdt), x.new_empty((m,), dtype=sdt)


def _outputs_fake(x, residual, h_dtype):
    h = x.new_empty((0,)) if residual is None else x.new_empty(x.shape, dtype=h_dtype or x.dtype)
    return x.new_empty(x.shape), h


def fwd_shapes(x: Tensor, residual: Tensor | None, h_dtype: torch.dtype | None,
               cuda: bool) -> tuple[Tensor, ...]:
    """What :data:`fwd` returns, without data: its outputs in the CUDA layout or the CPU's."""
    return (*_outputs_fake(x, residual, h_dtype), *_stats_fake(x, residual, h_dtype, cuda))


@torch.library.register_fake("layernorm::fwd")
def _fwd_fake(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype):
    return fwd_shapes(x, residual, h_dtype, x.device.type != "cpu")


@torch.library.register_fake("layernorm::norm")
def _norm_fake(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype):
    return _outputs_fake(x, residual, h_dtype)


def _quant_fake(x, float8, scale, group_size):
    d = x.shape[-1]
    scales = (scale.new_empty(scale.shape) if scale is not None else
              x.new_empty((*x.shape[:-1], d // (group_size or d)), dtype=torch.float32))
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn if float8 else torch.int8), scales


@torch.library.register_fake("layernorm::norm_quant")
def _norm_quant_fake(x, weight, bias, eps, centred, zero_centered_gamma, float8, scale,
                     group_size, scale_ub):
    return _quant_fake(x, float8, scale, group_size)


@torch.library.register_fake("layernorm::add_norm_quant")
def _add_norm_quant_fake(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype,
                         float8, scale, group_size, scale_ub):
    return (*_quant_fake(x, float8, scale, group_size),
            _outputs_fake(x, residual, h_dtype)[1])


@torch.library.register_fake("layernorm::bwd")
def _bwd_fake(dy, dh, xn, weight, bias, stats0, stats1, centred, zero_centered_gamma, x_dtype,
              residual_dtype):
    return (
        xn.new_empty(xn.shape, dtype=x_dtype or xn.dtype),
        xn.new_empty((0,)) if residual_dtype is None else xn.new_empty(xn.shape,
                                                                       dtype=residual_dtype),
        xn.new_empty((0,)) if weight is None else torch.empty_like(weight),
        xn.new_empty((0,)) if bias is None else torch.empty_like(bias),
    )


def fwd_y_shapes(x: Tensor, residual: Tensor | None, h_dtype: torch.dtype | None,
                 cuda: bool) -> tuple[Tensor, ...]:
    """What :data:`fwd_y` returns, without data: its outputs in the CUDA layout or the CPU's,
    the kept channels' and rows' counts dynamic sizes."""
    s0, s1 = _stats_fake(x, residual, h_dtype, cuda)
    ctx = torch.library.get_ctx()
    k = ctx.new_dynamic_size()  # how many channels the parameters' values keep
    r = ctx.new_dynamic_size()  # how many rows the data keeps whole
    cdt = compute_dtype(x.dtype if residual is None else h_dtype or x.dtype)
    d = x.shape[-1]
    m = x.numel() // d
    return (*_outputs_fake(x, residual, h_dtype), s0, s1,
            x.new_empty((k,), dtype=torch.int64), x.new_empty((m, k), dtype=cdt),
            x.new_empty((r,), dtype=torch.int64), x.new_empty((r, d), dtype=cdt))


@torch.library.register_fake("layernorm::fwd_y")
def _fwd_y_fake(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype):
    return fwd_y_shapes(x, residual, h_dtype, x.device.type != "cpu")


@torch.library.register_fake("layernorm::bwd_y")
def _bwd_y_fake(dy, dh, y, weight, bias, stats0, stats1, keep, kept, rows, xrows, centred,
                zero_centered_gamma, x_dtype, residual_dtype):
    return _bwd_fake(dy, dh, y, weight, bias, stats0, stats1, centred, zero_centered_gamma,
                     x_dtype, residual_dtype)


def statistics(src: Tensor, eps: float, centred: bool) -> tuple[Tensor, Tensor]:
    """xhat (..., D) and rstd (..., 1) of the rows of ``src`` in its compute dtype, from torch
    operations (differentiable): rstd = 1/sqrt(var + eps), var centred or the mean square."""
    v = src.to(compute_dtype(src.dtype))
    xc = v - v.mean(-1, keepdim=True) if centred else v
    rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)
    return xc * rstd, rstd


def composite_backward(
    dy: Tensor, dh: Tensor | None, xn: Tensor, weight: Tensor | None,
    bias: Tensor | None, eps: float, centred: bool, zero_centered_gamma: bool,
    x_dtype: torch.dtype, residual_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The backward from torch operations, differentiable by autograd (double backward).

    Recomputes the statistics from ``xn`` (so their dependence on x is part of the graph) in
    the compute dtype, then the family's formulas: g = dy·scale, dnorm = rstd·(g − mean(g) −
    xhat·mean(g·xhat)) (no mean(g) for RMSNorm), dweight = Σ dy·xhat, dbias = Σ dy, and
    dx = dresidual = dh + dnorm for an add-norm.
    """
    xhat, rstd = statistics(xn, eps, centred)
    cdt = xhat.dtype
    g = dyc = dy.to(cdt)
    if weight is not None:
        g = g * (weight.to(cdt) + 1 if zero_centered_gamma else weight.to(cdt))
    proj = xhat * (g * xhat).mean(-1, keepdim=True)
    dnorm = rstd * ((g - g.mean(-1, keepdim=True) if centred else g) - proj)
    d = xhat.shape[-1]
    dw = None if weight is None else (dyc * xhat).reshape(-1, d).sum(0).to(weight.dtype)
    db = None if bias is None else dyc.reshape(-1, d).sum(0).to(bias.dtype)
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
    ctx.mark_non_differentiable(s0, s1)
    ctx.set_materialize_grads(False)  # an unused y or h costs nothing in the backward


def _h_only(dh: Tensor, x_dtype: torch.dtype, residual_dtype: torch.dtype) -> tuple:
    """The gradients of an add-norm whose y is unused (no dy): h = x + residual is all that is
    differentiated, so dx = dresidual = dh in their dtypes and the parameters get none. No
    kernel runs: a zero dy through the norm would form 0 * inf on a row whose rstd is inf
    (eps = 0, var = 0), where torch's x + r then F.layer_norm passes dh through."""
    return (dh.to(x_dtype), dh.to(residual_dtype), None, None, None, None, None, None)


def _backward(ctx: Any, dy: Tensor | None, dh: Tensor | None, _ds0: Any, _ds1: Any) -> tuple:
    # The statistics are outputs only so the backward can read them: their gradients are
    # ignored (they are functions of x, which the backward differentiates through).
    xn, weight, bias, s0, s1 = ctx.saved_tensors
    eps, centred, zcg, x_dtype, residual_dtype = ctx.flags
    if residual_dtype is None:
        dh = None
    if dy is None and dh is None:
        return None, None, None, None, None, None, None, None
    if dy is None:
        return _h_only(dh, x_dtype, residual_dtype)
    # on the CPU, an add-norm's dresidual equals dx where the two share a dtype: one tensor
    # serves both (as autograd's own x + residual does), and the kernel writes one gradient
    shared = residual_dtype == x_dtype and xn.device.type == "cpu"
    if torch.is_grad_enabled():  # the backward is being differentiated: torch operations
        dx, dres, dw, db = composite_backward(dy, dh, xn, weight, bias, eps, centred, zcg,
                                              x_dtype, residual_dtype)
    else:
        dx, dres, dw, db = bwd(dy, dh, xn, weight, bias, s0, s1, centred, zcg, x_dtype,
                               None if shared else residual_dtype)
        if shared:
            dres = dx
    return (dx, None if residual_dtype is None else dres, None if weight is None else dw,
            None if bias is None else db, None, None, None, None)


torch.library.register_autograd("layernorm::fwd", _backward, setup_context=_setup_context)


def _setup_context_y(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, residual, weight, bias, _eps, centred, zero_centered_gamma, _h_dtype = inputs
    y, _h, s0, s1, keep, kept, rows, xrows = output
    # y is an output: saved as itself (no copy), and its version counter is watched
    ctx.save_for_backward(y, weight, bias, s0, s1, keep, kept, rows, xrows)
    ctx.flags = (centred, zero_centered_gamma, x.dtype,
                 None if residual is None else residual.dtype)
    ctx.mark_non_differentiable(s0, s1, keep, kept, rows, xrows)
    ctx.set_materialize_grads(False)


def _backward_y(ctx: Any, dy: Tensor | None, dh: Tensor | None, *_stats: Any) -> tuple:
    y, weight, bias, s0, s1, keep, kept, rows, xrows = ctx.saved_tensors
    centred, zcg, x_dtype, residual_dtype = ctx.flags
    if residual_dtype is None:
        dh = None
    if dy is None and dh is None:
        return None, None, None, None, None, None, None, None
    if dy is None:  # no norm term: its derivative, dh's, is exact, so no DOUBLE_BACKWARD
        return _h_only(dh, x_dtype, residual_dtype)
    if torch.is_grad_enabled():
        raise RuntimeError(DOUBLE_BACKWARD)
    shared = residual_dtype == x_dtype and y.device.type == "cpu"  # as in _backward
    dx, dres, dw, db = bwd_y(dy, dh, y, weight, bias, s0, s1, keep, kept, rows, xrows, centred,
                             zcg, x_dtype, None if shared else residual_dtype)
    if shared:
        dres = dx
    return (dx, None if residual_dtype is None else dres, None if weight is None else dw,
            None if bias is None else db, None, None, None, None)


torch.library.register_autograd("layernorm::fwd_y", _backward_y, setup_context=_setup_context_y)
