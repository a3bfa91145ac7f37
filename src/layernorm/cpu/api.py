"""The NumPy-facing API of the fused CPU kernels: argument checks, caches, ``out=``.

The kernels are the C++ engine's (:func:`_engine`: ``forward_into`` and ``backward_into`` on
the arrays as tensors on the same memory, torch's threads); where torch or the engine is
missing, the same two entry points in NumPy (:mod:`.fallback`, the reference's arithmetic),
with one warning.

Same maths, signatures and results as :mod:`layernorm.reference` (within the tolerance table);
only the caches differ. Each function checks its arguments, makes each array C-contiguous, runs
one kernel and hands back arrays of the caller's dtypes. The caller's arrays are never written;
``out=`` arrays must not overlap them.

Two caches: :class:`CpuNormCache` (the default) refers to x and the backward recomputes xhat
from it; :class:`CpuOutputCache` (``memory_efficient=True``) keeps y, returned read-only, and
the backward recovers xhat = (y - shift) / scale from it, reading the xhat the forward kept
for the channels :func:`layernorm.recovery.kept_channels` names and for the rows
:func:`layernorm.recovery.kept_rows` keeps whole.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import numpy as np

from .._validate import (
    Region,
    check_dtype,
    check_dy,
    check_eps,
    check_flag,
    check_out,
    check_param,
    check_shape,
    check_x,
    region,
)
from ..dtypes import compute_dtype, widest_compute_dtype
from ..family import NORMS, Norm
from ..recovery import kept_channels, kept_rows
from ..reference.core import form_scale
from . import fallback, memory, statistics
from .statistics import NSTATS

__all__ = [
    "CpuNormCache",
    "CpuOutputCache",
    "add_layer_norm_backward",
    "add_layer_norm_forward",
    "add_rms_norm_backward",
    "add_rms_norm_forward",
    "layer_norm_backward",
    "layer_norm_forward",
    "rms_norm_backward",
    "rms_norm_forward",
]


class _RowStats:
    """The per-row statistics both caches keep (:mod:`.statistics`), read as the reference's."""

    stats: np.ndarray

    @property
    def mean(self) -> np.ndarray:
        """(M,) float64 row means (HI + LO rounded to float64, unscaled; 0 for RMSNorm)."""
        return statistics.mean(self.stats)

    @property
    def rstd(self) -> np.ndarray:
        """(M,) float64 1/sqrt(var + eps) (LayerNorm) or 1/sqrt(mean(x²) + eps) (RMSNorm)."""
        return statistics.rstd(self.stats)


@dataclass(frozen=True)
class CpuNormCache(_RowStats):
    """What the fused backward needs from the forward.

    Attributes:
        norm: the family member (:data:`layernorm.family.NORMS`) that ran.
        x: (M, D) the normalized input: the caller's own memory when x was C-contiguous (h,
            the forward's output, for an add-norm), else a copy.
        stats: (M, NSTATS) float64 per row (:mod:`.statistics`): the mean as HI + LO (0 for
            RMSNorm), RSTD and SCALE.
        check: (M,) uint64 per row: a checksum of x's bits. The backward recomputes it and
            raises ValueError if x changed in between, rather than differentiate a forward
            that did not run (``out=`` arrays may be partly written by then). (0,) for a
            forward called with ``checksum=False``: nothing is verified.
        scale: (D,) gamma (or 1 + gamma) in the compute dtype, a copy taken by the forward
            (ones without gamma): changing gamma afterwards does not change the backward.
        gamma_dtype: dtype of gamma, or None without gamma (then dgamma is None).
        beta_dtype: dtype of beta, or None without beta (then dbeta is None).
        x_shape: shape of the forward's x; dy must have this shape.
        x_dtype: dtype of the forward's x; dx is returned in it.
        residual_dtype: dtype of the add-norm's residual (dresidual is returned in it), or None.
        owns_x: True when ``x`` is a copy made by the forward (counted in ``nbytes``).
        inputs: where the caller's arrays live, so that the backward's ``out=`` is refused
            when it overlaps them.
    """

    norm: Norm
    x: np.ndarray
    stats: np.ndarray
    check: np.ndarray
    scale: np.ndarray
    gamma_dtype: np.dtype | None
    beta_dtype: np.dtype | None
    x_shape: tuple[int, ...]
    x_dtype: np.dtype
    residual_dtype: np.dtype | None
    owns_x: bool
    inputs: tuple[Region, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds of its own: stats, checksums and scale, and x when a copy."""
        own = self.stats.nbytes + self.check.nbytes + self.scale.nbytes
        return own + (self.x.nbytes if self.owns_x else 0)


@dataclass(frozen=True)
class CpuOutputCache(_RowStats):
    """What the memory-efficient fused backward needs from the forward: y instead of x.

    The backward recovers xhat_j = (y_j - shift_j) / scale_j in the compute dtype T and reads
    ``kept`` on the channels :func:`layernorm.recovery.kept_channels` names and ``xrows`` on
    the rows :func:`layernorm.recovery.kept_rows` keeps whole (the reference's
    :class:`layernorm.reference.OutputCache`, with the fused statistics).

    Attributes:
        norm: the family member (:data:`layernorm.family.NORMS`) that ran.
        y: (M, D) a read-only view of the forward's output y: the array the next layer keeps
            anyway, so it is not counted in ``nbytes``.
        stats: (M, NSTATS) float64 per row, as in :class:`CpuNormCache` (rstd = RSTD * SCALE).
        scale: (D,) gamma (or 1 + gamma) in T, a copy (ones without gamma).
        shift: (D,) beta in T, a copy (zeros for RMSNorm or without beta).
        keep: (k,) int64, ascending: the channels whose xhat cannot be recovered from y.
        kept: (M, k) xhat of those channels in T, ((x * SCALE - HI) - LO) * RSTD formed in
            float64 from the statistics and rounded once (x is h for an add-norm).
        rows: (r,) int64, ascending: the rows kept whole, var < eps where the shift is
            non-zero on a recovered channel (:func:`layernorm.recovery.kept_rows` of
            :attr:`rstd`, eps, ``shift`` and ``keep``).
        xrows: (r, D) xhat of those rows in T, formed as ``kept`` is.
        gamma_dtype, beta_dtype, x_shape, x_dtype, residual_dtype: as in
            :class:`CpuNormCache`.
        inputs: where the caller's arrays live, so that the backward's ``out=`` is refused
            when it overlaps them.
    """

    norm: Norm
    y: np.ndarray
    stats: np.ndarray
    scale: np.ndarray
    shift: np.ndarray
    keep: np.ndarray
    kept: np.ndarray
    rows: np.ndarray
    xrows: np.ndarray
    gamma_dtype: np.dtype | None
    beta_dtype: np.dtype | None
    x_shape: tuple[int, ...]
    x_dtype: np.dtype
    residual_dtype: np.dtype | None
    inputs: tuple[Region, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds of its own: stats, the kept channels (keep and kept), the
        rows kept whole (rows and xrows) and the copies of scale and shift; not y, the
        caller's output."""
        return sum(a.nbytes for a in (self.stats, self.keep, self.kept, self.rows, self.xrows,
                                      self.scale, self.shift))


_CACHES = (CpuNormCache, CpuOutputCache)


@functools.cache
def _name(dtype: np.dtype) -> str:
    """``dtype.name``, which NumPy forms anew on every access (microseconds a call)."""
    return dtype.name


def _contiguous(a: np.ndarray, dtype: np.dtype | None = None) -> tuple[np.ndarray, bool]:
    """``a`` as a native C-contiguous array (of ``dtype`` when given), and whether it was
    copied."""
    dtype = a.dtype if dtype is None else dtype
    if a.dtype == dtype and a.flags.c_contiguous:
        return a, False
    return np.ascontiguousarray(a, dtype=dtype), True


@functools.cache
def _engine():
    """The C++ engine's entry points (``torch.ops.layernorm_cpu``), or None where torch or the
    engine is missing: then :mod:`.fallback` runs, and one warning says so (where torch is
    present but no engine fits, :mod:`layernorm.engine.loader` warned).
    Imported at the first call: importing torch costs a second or so, and ``import layernorm``
    needs NumPy alone."""
    global _torch
    try:
        import torch

        from ..torch import _ops
    except ImportError as exc:
        warnings.warn(f"layernorm.cpu: the C++ engine needs torch ({exc.name or exc} could not "
                      "be imported): the NumPy fallback computes instead, on one thread and "
                      "many times slower; pip install 'layernorm[fast]' for the engine",
                      RuntimeWarning, stacklevel=4)
        return None
    if not _ops.NATIVE:
        return None
    _torch = torch
    return torch.ops.layernorm_cpu


_torch = None  # the torch module, once _engine() found the engine


def engine_runs() -> bool:
    """Whether the C++ engine computes this API's results here (else the NumPy fallback, the
    reference's arithmetic); asks without warning where torch is not installed."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None and _engine() is not None


# A call with fewer elements runs on the calling thread (the engine's threads wake in a few
# microseconds; a row of 4096 float32 is half a microsecond of arithmetic).
SERIAL_ELEMENTS = 1 << 14


def _tensor(a: np.ndarray | None):
    """``a`` as a tensor on the same memory, or None."""
    if a is None:
        return None
    if not a.flags.writeable:  # read by the engine only; torch warns of any read-only array
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _from_numpy(a)
    return _from_numpy(a)


def _from_numpy(a: np.ndarray):
    if _name(a.dtype) == "bfloat16":  # ml_dtypes' bfloat16, which torch does not know: its bits
        return _torch.from_numpy(a.view(np.int16)).view(_torch.bfloat16)
    return _torch.from_numpy(a)


def _regions(callers: tuple[object, ...]) -> tuple[Region, ...]:
    """The :class:`Region` of each distinct array among ``callers`` (each object once)."""
    seen: dict[int, object] = {}
    for a in callers:
        seen.setdefault(id(a), a)
    return tuple(r for r in map(region, seen.values()) if r is not None)


def _output(out: object, name: str, shape: tuple[int, ...], dtype: np.dtype,
            callers: tuple[object, ...], why: str) -> np.ndarray:
    """``out`` checked, or a fresh array, of ``shape`` and ``dtype``."""
    if out is None:
        return memory.empty(shape, dtype)
    return check_out(out, shape, dtype, name, callers, why)


_OVERLAP = "(the caller's arrays are never written, and the backward reads x)"


def _forward(norm: Norm, x: object, residual: object, gamma: object, beta: object, eps: object,
             zero_centered_gamma: bool, residual_dtype: object, out: object, out_h: object,
             checksum: object = True, memory_efficient: object = False,
             ) -> tuple[np.ndarray, np.ndarray | None, CpuNormCache | CpuOutputCache]:
    given = (x, residual, gamma, beta)  # the caller's objects, before any conversion
    x = check_x(x)
    d = x.shape[-1]
    gamma = check_param(gamma, "gamma", d)
    beta = check_param(beta, "beta", d) if norm.centred else None
    zero_centered_gamma = check_flag(zero_centered_gamma, "zero_centered_gamma")
    checksum = check_flag(checksum, "checksum")
    memory_efficient = check_flag(memory_efficient, "memory_efficient")
    if memory_efficient and out is not None:
        raise ValueError("out= cannot be combined with memory_efficient=True: the cache reads "
                         "y, and a caller's out array could be changed before the backward")
    if norm.residual:
        residual = check_shape(residual, "residual", x.shape, "x")
        h_dtype = check_dtype(residual_dtype, "residual_dtype", x.dtype)
    cdt = compute_dtype(h_dtype if norm.residual else x.dtype)
    eps = check_eps(eps)
    checksum = checksum and not memory_efficient  # x is not kept: nothing to verify
    # the caller's objects, and the arrays made of them (an array-like's memory is only
    # visible through its array)
    callers = (*given, x, residual, gamma, beta)
    y = _output(out, "out", x.shape, x.dtype, callers, _OVERLAP)
    xc, copied = _contiguous(x)
    m = xc.size // d
    x2 = xc.reshape(m, d)  # (M, D)
    scale = np.ones(d, cdt) if gamma is None else form_scale(gamma, cdt, zero_centered_gamma)
    beta_c = np.zeros(d, cdt) if beta is None else _contiguous(beta, cdt)[0]  # (D,)
    h = r2 = h2 = None
    if norm.residual:
        h = _output(out_h, "out_h", x.shape, h_dtype, (*callers, y), _OVERLAP)
        r2 = _contiguous(residual)[0].reshape(m, d)  # (M, D)
        h2 = h.reshape(m, d)  # (M, D)
    stats = np.empty((m, NSTATS))  # (M, NSTATS) float64
    check = np.empty(m if checksum else 0, np.uint64)  # (M,), or (0,) without checksums
    y2 = y.reshape(m, d)
    ops = _engine()
    if m and ops is not None:
        t = _tensor
        ops.forward_into(t(x2), t(r2), t(scale), t(beta_c), eps, norm.centred, t(y2), t(h2),
                         t(stats), t(check) if checksum else None, SERIAL_ELEMENTS)
    elif m:
        fallback.forward_into(x2, r2, scale, beta_c, eps, norm.centred, y2, h2, stats,
                              check if checksum else None)
    params = dict(
        norm=norm, stats=stats, scale=scale,
        gamma_dtype=None if gamma is None else gamma.dtype,
        beta_dtype=None if beta is None else beta.dtype,
        x_shape=x.shape, x_dtype=x.dtype,
        residual_dtype=residual.dtype if norm.residual else None,
        inputs=_regions(callers),
    )
    if memory_efficient:
        xn = (h if norm.residual else xc).reshape(m, d)  # (M, D) what was normalized
        keep, kept, rows, xrows = kept_xhat(xn, stats, scale, beta_c, eps, x.dtype)
        y.flags.writeable = False  # the backward reads it: a change would go unnoticed
        y2.flags.writeable = False
        return y, h, CpuOutputCache(y=y2, shift=beta_c.copy() if beta_c is beta else beta_c,
                                    keep=keep, kept=kept, rows=rows, xrows=xrows, **params)
    cache = CpuNormCache(x=h2 if norm.residual else x2, check=check,
                         owns_x=copied and not norm.residual, **params)
    return y, h, cache


def kept_xhat(xn: np.ndarray, stats: np.ndarray, scale: np.ndarray, shift: np.ndarray,
              eps: float, y_dtype: object) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                    np.ndarray]:
    """What the memory-efficient mode keeps beside y: (keep, kept, rows, xrows).

    keep (k,) int64, the channels whose xhat y (stored in ``y_dtype``) cannot give back
    (:func:`layernorm.recovery.kept_channels` of the scale and shift (D,) in the compute dtype
    T), and kept (M, k) their xhat in T; rows (r,) int64, the rows kept whole
    (:func:`layernorm.recovery.kept_rows` of each row's rstd, eps, the shift and keep), and
    xrows (r, D) their xhat in T; both xhat from the forward's statistics (M, NSTATS) as
    :func:`layernorm.cpu.statistics.xhat` forms it. xn (M, D) is what the forward normalized:
    x, or h for an add-norm.
    """
    keep = kept_channels(scale, shift, y_dtype, xn.shape[1])  # (k,) int64
    rows = kept_rows(statistics.rstd(stats), eps, shift, keep)  # (r,) int64
    cdt = scale.dtype
    return (keep, statistics.xhat(xn[:, keep], stats, cdt), rows,
            statistics.xhat(xn[rows], stats[rows], cdt))


def _backward(norm: Norm, dy: object, dh: object, cache: object, out: object,
              out_dresidual: object) -> tuple[np.ndarray, np.ndarray | None,
                                              np.ndarray | None, np.ndarray | None]:
    given = (dy, dh)
    producer = f"layernorm.cpu.{norm.name}_forward"
    dy = check_dy(dy, cache, _CACHES, producer)
    if cache.norm != norm:
        raise ValueError(f"cache must come from {producer}, got one from "
                         f"layernorm.cpu.{cache.norm.name}_forward")
    if dh is not None:
        dh = check_shape(dh, "dh", cache.x_shape, "h")
    from_y = isinstance(cache, CpuOutputCache)
    src = cache.y if from_y else cache.x  # (M, D) what the backward reads xhat from
    m, d = src.shape
    kept = (cache.shift, cache.kept, cache.xrows) if from_y else ()
    avoid = (*given, dy, dh, src, cache.scale, *kept, *cache.inputs)
    dx = _output(out, "out", cache.x_shape, cache.x_dtype, avoid, _OVERLAP)
    dres = None
    if norm.residual:
        dres = _output(out_dresidual, "out_dresidual", cache.x_shape, cache.residual_dtype,
                       (*avoid, dx), _OVERLAP)
    # dy as it is where it computes in the norm's compute dtype, else converted to it; dh
    # likewise in the add's dtype (the widest of x's, residual's and h's compute dtypes), where
    # the norm's dx and dh are summed
    cdt = cache.scale.dtype
    dy2 = _contiguous(dy, dy.dtype if compute_dtype(dy.dtype) == cdt else cdt)[0].reshape(m, d)
    adt = widest_compute_dtype(cache.x_dtype, cache.residual_dtype, cdt) if norm.residual else cdt
    dh2 = None
    if dh is not None:
        dh2 = _contiguous(dh, dh.dtype if compute_dtype(dh.dtype) == adt else adt)[0]
        dh2 = dh2.reshape(m, d)
    dx2 = dx.reshape(m, d)
    dres2 = None if dres is None else dres.reshape(m, d)
    verify = not from_y and cache.check.shape[0] > 0  # (0,): a forward without checksums
    check = cache.check if verify else None
    ok = np.ones(m if verify else 0, np.bool_)  # (M,) or (0,): the rows that matched
    recovery = ((cache.shift, cache.keep, cache.kept, cache.rows, cache.xrows) if from_y
                else (None,) * 5)
    sums = np.zeros((2, d))  # (2, D) float64: dgamma, dbeta
    ops = _engine()
    if m and ops is not None:
        t = _tensor
        ops.backward_into(t(src), t(dy2), t(dh2), t(cache.scale), t(cache.stats), t(check),
                          *map(t, recovery), norm.centred, t(dx2), t(dres2), t(sums),
                          t(ok) if verify else None, SERIAL_ELEMENTS)
    elif m:
        fallback.backward_into(src, dy2, dh2, cache.scale, cache.stats, check, *recovery,
                               norm.centred, dx2, dres2, sums, ok if verify else None)
    if not ok.all():
        what = "h (the forward's output)" if norm.residual else "x"
        raise ValueError(f"{what} changed between the forward and the backward (row "
                         f"{int(np.argmin(ok))} first): the backward would differentiate a "
                         f"forward that did not run; keep it unchanged until the backward, or "
                         f"pass a copy to the forward")
    dgamma = None if cache.gamma_dtype is None else sums[0].astype(cache.gamma_dtype)  # (D,)
    dbeta = None if cache.beta_dtype is None else sums[1].astype(cache.beta_dtype)  # (D,)
    return dx, dres, dgamma, dbeta


_LN, _RMS = NORMS["layer_norm"], NORMS["rms_norm"]
_ADD_LN, _ADD_RMS = NORMS["add_layer_norm"], NORMS["add_rms_norm"]


def layer_norm_forward(
    x: np.ndarray,
    gamma: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    eps: float = 1e-5,
    *,
    zero_centered_gamma: bool = False,
    out: np.ndarray | None = None,
    checksum: bool = True,
    memory_efficient: bool = False,
) -> tuple[np.ndarray, CpuNormCache | CpuOutputCache]:
    """Layer norm over the last axis of ``x``, fused: one parallel pass over the rows.

    Args:
        x: (..., D) floating array with at least one axis; never modified. The cache refers to
            it (no copy when C-contiguous): the backward raises ValueError if it changed.
        gamma: (D,) scale, or None. The cache keeps a copy (of 1 + gamma with
            ``zero_centered_gamma``, formed in the compute dtype).
        beta: (D,) shift, or None.
        eps: finite number >= 0 added to the variance.
        zero_centered_gamma: scale by 1 + gamma instead of gamma.
        out: optional C-contiguous array of x's shape and dtype that receives y; it must not
            overlap x, gamma or beta. Without it, a large y reuses memory freed by earlier
            outputs (:mod:`layernorm.cpu.memory`).
        checksum: record a checksum of each row of x, which the backward verifies (it raises
            ValueError if x changed in between). False saves its cost (about 40% of the
            forward on rows out of cache), and then a change to x goes unseen.
        memory_efficient: keep y instead of x: y comes back read-only and the cache, a
            :class:`CpuOutputCache`, holds it with the statistics and the xhat of the channels
            and rows whose xhat y cannot give back (:mod:`layernorm.recovery`); the backward
            recovers the rest from y. x is then free once the forward returns, and no checksum is
            taken. Cannot be combined with ``out`` (ValueError).

    Returns:
        y: x's shape and dtype (``out`` when given; read-only when memory-efficient); cache:
        for :func:`layer_norm_backward`.
    """
    y, _, cache = _forward(_LN, x, None, gamma, beta, eps, zero_centered_gamma, None, out, None,
                           checksum, memory_efficient)
    return y, cache


def layer_norm_backward(
    dy: np.ndarray, cache: CpuNormCache | CpuOutputCache, *, out: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """dx, dgamma, dbeta of layer norm given dL/dy and the forward's cache (either kind), fused.

    ``out`` (optional, x's shape and dtype, C-contiguous) receives dx; it must not overlap dy
    nor the forward's arrays. dgamma and dbeta are None where the forward had no gamma, beta.
    """
    dx, _, dgamma, dbeta = _backward(_LN, dy, None, cache, out, None)
    return dx, dgamma, dbeta


def rms_norm_forward(
    x: np.ndarray,
    gamma: np.ndarray | None = None,
    eps: float = 1e-6,
    *,
    zero_centered_gamma: bool = False,
    out: np.ndarray | None = None,
    checksum: bool = True,
    memory_efficient: bool = False,
) -> tuple[np.ndarray, CpuNormCache | CpuOutputCache]:
    """RMSNorm over the last axis of ``x``, fused: y = scale * x / sqrt(mean(x²) + eps).

    Arguments and results as :func:`layer_norm_forward`, without beta.
    """
    y, _, cache = _forward(_RMS, x, None, gamma, None, eps, zero_centered_gamma, None, out, None,
                           checksum, memory_efficient)
    return y, cache


def rms_norm_backward(
    dy: np.ndarray, cache: CpuNormCache | CpuOutputCache, *, out: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """dx, dgamma of RMSNorm given dL/dy and the forward's cache (either kind), fused (``out``
    as in :func:`layer_norm_backward`)."""
    dx, _, dgamma, _ = _backward(_RMS, dy, None, cache, out, None)
    return dx, dgamma


def add_layer_norm_forward(
    x: np.ndarray,
    residual: np.ndarray,
    gamma: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    eps: float = 1e-5,
    *,
    residual_dtype: object = None,
    zero_centered_gamma: bool = False,
    out: np.ndarray | None = None,
    out_h: np.ndarray | None = None,
    checksum: bool = True,
    memory_efficient: bool = False,
) -> tuple[np.ndarray, np.ndarray, CpuNormCache | CpuOutputCache]:
    """h = x + residual (rounded once to ``residual_dtype``, default x's dtype), then layer
    norm of h, fused in one pass.

    Returns y (x's dtype; ``out`` when given), h (``out_h`` when given) and the cache, which
    refers to h: the backward raises ValueError if h changed in between. With
    ``memory_efficient`` the cache keeps y (read-only) and the statistics, never h, as in
    :func:`layer_norm_forward`; ``out_h`` may still be given.
    """
    return _forward(_ADD_LN, x, residual, gamma, beta, eps, zero_centered_gamma,
                    residual_dtype, out, out_h, checksum, memory_efficient)


def add_layer_norm_backward(
    dy: np.ndarray, dh: np.ndarray | None, cache: CpuNormCache | CpuOutputCache, *,
    out: np.ndarray | None = None, out_dresidual: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """dx, dresidual, dgamma, dbeta of :func:`add_layer_norm_forward`: dx = dresidual = dh +
    the norm's gradient, in x's and residual's dtypes (dh may be None)."""
    return _backward(_ADD_LN, dy, dh, cache, out, out_dresidual)


def add_rms_norm_forward(
    x: np.ndarray,
    residual: np.ndarray,
    gamma: np.ndarray | None = None,
    eps: float = 1e-6,
    *,
    residual_dtype: object = None,
    zero_centered_gamma: bool = False,
    out: np.ndarray | None = None,
    out_h: np.ndarray | None = None,
    checksum: bool = True,
    memory_efficient: bool = False,
) -> tuple[np.ndarray, np.ndarray, CpuNormCache | CpuOutputCache]:
    """h = x + residual, then RMSNorm of h, fused (as :func:`add_layer_norm_forward`)."""
    return _forward(_ADD_RMS, x, residual, gamma, None, eps, zero_centered_gamma,
                    residual_dtype, out, out_h, checksum, memory_efficient)


def add_rms_norm_backward(
    dy: np.ndarray, dh: np.ndarray | None, cache: CpuNormCache | CpuOutputCache, *,
    out: np.ndarray | None = None, out_dresidual: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """dx, dresidual, dgamma of :func:`add_rms_norm_forward` (as
    :func:`add_layer_norm_backward`)."""
    dx, dres, dgamma, _ = _backward(_ADD_RMS, dy, dh, cache, out, out_dresidual)
    return dx, dres, dgamma


_FORWARD = {"layer_norm": layer_norm_forward, "rms_norm": rms_norm_forward}
_BACKWARD = {"layer_norm": layer_norm_backward, "rms_norm": rms_norm_backward}
