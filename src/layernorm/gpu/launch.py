"""The launchers of the Triton kernels (:mod:`layernorm.gpu.kernels`): the plan of each pass per
row length, the argument checks, the allocation of the outputs, and the launches.

* :func:`forward`: the fused forward (plain and add-norms) of x's rows.
* :func:`backward`: dx (and dresidual) from what the forward normalized, dw and db by the
  two-stage reduction.
* :func:`backward_from_y`: the memory-efficient backward, xhat recovered from y.
* :func:`forward_quant`: the forward with y quantized to int8 or float8_e4m3fn.
* :func:`plan`: short rows (a tile of whole rows) or long rows (a loop over blocks), with the
  tile's size and warps, from the tuning constants below.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._validate import check_eps
from ..reference.quant import check_group_size, check_static_alone
from .kernels import (
    INTERPRET,
    _bwd_long_dx_kernel,
    _bwd_long_rowstats_kernel,
    _bwd_short_kernel,
    _fwd_long_kernel,
    _fwd_short_kernel,
    _quant_rows_kernel,
    _quant_short_kernel,
    _sum_partials_kernel,
)

__all__ = ["Plan", "backward", "backward_from_y", "forward", "forward_quant", "plan"]

# Tuning constants (chosen from the design, not yet measured on a GPU: docs/gpu-fusion.md).
# The two limits are the longest rows whose tiles compile for sm_90 without register spills in
# every variant (tests/gpu/test_gpu_compile.py checks it): the backward holds x, dy, weight and
# two accumulators per element, the forward x (x and the residual for add-norms) and the
# centred values. float64 data halves every size (two registers per value).
MAX_SHORT_D_FWD = 8192  # longest row the forward holds whole
MAX_SHORT_D_BWD = 4096  # longest row the backward holds whole
SHORT_TILE = 4096  # elements per program for short rows: small rows are packed several a tile
LONG_BLOCK = 4096  # elements of a long row handled per loop step
PROGRAMS_PER_SM = 4  # persistent programs per SM in the backward
INTERPRETER_SMS = 4  # "SMs" under TRITON_INTERPRET=1, where programs run one after another
REDUCE_BLOCK_P = 32  # partial rows summed per step by the second-stage reduction (16 float64)
REDUCE_BLOCK_N = 256  # columns per program of the second-stage reduction
REDUCE_NUM_WARPS = 8  # warps per program of the second-stage reduction (dw and db together)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Plan:
    """How a pass runs for one row length D.

    long: loop over each row in blocks of ``block`` (else whole rows, ``block`` >= D).
    block: columns per tile; rows: rows per tile (short rows only); num_warps: warps per program.
    """

    long: bool
    block: int
    rows: int
    num_warps: int


def _num_warps(values: int) -> int:
    # About 8 float32 values of each tile array per thread: one 16-byte load of 16-bit data.
    return max(1, min(32, values // 256))


def plan(pass_: str, D: int, wide: bool = False) -> Plan:
    """The plan of ``pass_`` (``"fwd"`` or ``"bwd"``) for rows of length ``D``; ``wide`` for
    float64 compute, whose values take two registers, so every tile is half as long."""
    div = 2 if wide else 1
    max_short = (MAX_SHORT_D_FWD if pass_ == "fwd" else MAX_SHORT_D_BWD) // div
    if D > max_short:
        block = max(1, LONG_BLOCK // div)
        return Plan(long=True, block=block, rows=1, num_warps=_num_warps(block * div))
    block = triton.next_power_of_2(D)
    rows = max(1, SHORT_TILE // div // block)
    return Plan(long=False, block=block, rows=rows, num_warps=_num_warps(rows * block * div))


@functools.cache
def _sm_count(device: torch.device) -> int:
    if INTERPRET:
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _partial_rows(limit: int, programs_per_row: int, M: int, itemsize: int, part_itemsize: int,
                  device: torch.device) -> int:
    """Number P of row owners in the backward, so of partial rows of dw and db.

    At most ``limit``. At least one program (P * ``programs_per_row`` in all) per SM, and up to
    PROGRAMS_PER_SM per SM while writing and re-reading the (P, D) partials of dw and db
    (4 * P * D * part_itemsize bytes) stays within about 3% of the 3 * M * D * itemsize bytes
    the backward must move; small M gets parallelism at the price of a larger share of partial
    traffic.
    """
    sms = _sm_count(device)
    budget = (3 * M * itemsize) // (4 * part_itemsize * 32)
    fill = triton.cdiv(sms, programs_per_row)
    most = triton.cdiv(PROGRAMS_PER_SM * sms, programs_per_row)
    return max(1, min(limit, max(fill, min(most, budget))))


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Launch on ``device``: Triton launches on the current CUDA device, not the tensors'."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The compute dtype of data of ``dtype``: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_rows(t: torch.Tensor, name: str, M: int, D: int) -> None:
    """ValueError unless ``t`` is an (M, D) float tensor the kernels read in place."""
    if tuple(t.shape) != (M, D):
        raise ValueError(f"{name} must have shape {(M, D)}, got {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if M > 0 and D > 1 and t.stride(1) != 1:  # an empty tensor is never read
        raise ValueError(f"{name} must have unit column stride, got strides {t.stride()}")


def _check_param(p: torch.Tensor | None, name: str, D: int) -> None:
    """ValueError unless ``p`` is None or a contiguous (D,) float tensor."""
    if p is None:
        return
    if tuple(p.shape) != (D,) or not p.is_contiguous():
        raise ValueError(f"{name} must be a contiguous ({D},) tensor, got shape "
                         f"{tuple(p.shape)}, strides {p.stride()}")
    if p.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {p.dtype}")


def _forward_plan(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                  bias: torch.Tensor | None, eps: float, centred: bool,
                  zero_centered_gamma: bool, h_dtype: torch.dtype | None) -> tuple:
    """The forward's arguments checked (as :func:`forward` documents them), and what its
    launches need: (M, D, eps, h's dtype, the statistics' dtype, the plan, the kernels' flags)."""
    if bias is not None and not centred:
        raise ValueError("bias must be None for RMSNorm (centred=False)")
    if residual is None and h_dtype is not None:
        raise ValueError("h_dtype is only for add-norms (a residual)")
    if x.dim() != 2:
        raise ValueError(f"x must be (M, D), got shape {tuple(x.shape)}")
    M, D = x.shape
    if D < 1:
        raise ValueError(f"rows must have D >= 1 elements, got D = {D}")
    _check_rows(x, "x", M, D)
    if residual is not None:
        _check_rows(residual, "residual", M, D)
    _check_param(weight, "weight", D)
    _check_param(bias, "bias", D)
    eps = check_eps(eps)
    add = residual is not None
    h_dtype = x.dtype if h_dtype is None else h_dtype
    if h_dtype not in _DTYPES:
        raise TypeError(f"h_dtype must be float16, bfloat16, float32 or float64, got {h_dtype}")
    sdt = _stats_dtype(h_dtype if add else x.dtype)
    flags = {
        "CENTRED": centred,
        "HAS_RESIDUAL": add,
        "WIDE_ADD": add and torch.float64 in (x.dtype, residual.dtype, h_dtype),
        "HAS_W": weight is not None,
        "HAS_B": bias is not None,
        "ZERO_CENTERED": zero_centered_gamma,
    }
    return M, D, eps, h_dtype, sdt, plan("fwd", D, wide=sdt == torch.float64), flags


def forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    centred: bool,
    zero_centered_gamma: bool = False,
    h_dtype: torch.dtype | None = None,
    y_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Fused forward of a norm of the family over the rows of ``x``.

    Args:
        x: (M, D), D >= 1, float16/bfloat16/float32/float64, unit column stride (any row stride).
        residual: (M, D) of any of those dtypes, unit column stride, or None. With it this is
            the add-norm: h = x + residual in the widest compute dtype of x, residual and h,
            rounded once to ``h_dtype``, is what is normalized.
        weight, bias: (D,) contiguous, any of the four dtypes, or None; bias only when centred.
        eps: float >= 0 added to var (mean(x**2) for RMSNorm); with eps = 0 a constant row
            gives xhat = 0 (y = bias) and rstd = inf (:mod:`layernorm.gpu.kernels`, item 1).
        centred: LayerNorm (True) or RMSNorm (False).
        zero_centered_gamma: scale by 1 + weight, formed in the compute dtype.
        h_dtype: h's dtype (default x's); only with a residual.
        y_dtype: y's dtype (default x's): the compute dtype keeps y unrounded.

    Returns:
        y: (M, D) contiguous, in y_dtype.
        h: (M, D) contiguous in h_dtype, or None without a residual.
        mean, rstd: (M,) in the compute dtype of what was normalized (float64 for float64,
            else float32), what :func:`backward` reads: the mean (zeros for RMSNorm) and
            1 / sqrt(var + eps); on a rescaled row (:mod:`layernorm.gpu.kernels`, item 3)
            the statistics of xn * s, with rstd negated as the mark.
    """
    M, D, eps, h_dtype, sdt, p, flags = _forward_plan(x, residual, weight, bias, eps, centred,
                                                      zero_centered_gamma, h_dtype)
    add = residual is not None
    dev = x.device
    y = torch.empty((M, D), dtype=y_dtype or x.dtype, device=dev)
    h = torch.empty((M, D), dtype=h_dtype, device=dev) if add else None
    mean = torch.empty(M, dtype=sdt, device=dev)
    rstd = torch.empty(M, dtype=sdt, device=dev)
    if M == 0:
        return y, h, mean, rstd
    stride_r = residual.stride(0) if add else 0
    with _on_device(dev):
        if p.long:
            _fwd_long_kernel[(M,)](
                x, residual, h, y, weight, bias, mean, rstd, x.stride(0), stride_r, D, eps,
                **flags, BLOCK=p.block, num_warps=p.num_warps,
            )
        else:
            _fwd_short_kernel[(triton.cdiv(M, p.rows),)](
                x, residual, h, y, weight, bias, mean, rstd, x.stride(0), stride_r, M, D, eps,
                **flags, ROWS=p.rows, BLOCK_D=p.block, num_warps=p.num_warps,
            )
    return y, h, mean, rstd


def forward_quant(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    centred: bool,
    zero_centered_gamma: bool = False,
    h_dtype: torch.dtype | None = None,
    float8: bool,
    scale: torch.Tensor | None = None,
    group_size: int | None = None,
    scale_ub: torch.Tensor | None = None,
    qmax: float,
    min_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The norm of :func:`forward` with its y quantized (:mod:`layernorm.gpu.quant`).

    Args:
        x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype: as for
            :func:`forward`.
        float8: q in float8_e4m3fn, else int8.
        scale: a static scale, a one-element float32 tensor on x's device, or None (dynamic);
            its value is not read here (no synchronization): the caller checks it.
        group_size: channels per dynamic scale (one of reference.quant.GROUP_SIZES, dividing
            D), or None: one per row.
        scale_ub: a one-element float32 tensor bounding a group's max|y|, or None.
        qmax, min_scale: the dtype's (layernorm.reference.quant.QUANT_DTYPES).

    Returns:
        q (M, D) int8 or float8_e4m3fn; scales: (M, D / group_size) float32 (per row: (M, 1)),
        or a copy of ``scale``; h as :func:`forward`'s.
    """
    M, D, eps, h_dtype, sdt, p, flags = _forward_plan(x, residual, weight, bias, eps, centred,
                                                      zero_centered_gamma, h_dtype)
    check_group_size(group_size, D)
    if scale is not None:
        check_static_alone(group_size, scale_ub)
    for t, name in ((scale, "scale"), (scale_ub, "scale_ub")):
        if t is not None and (t.numel() != 1 or t.dtype != torch.float32
                              or t.device != x.device):
            raise ValueError(f"{name} must be a one-element float32 tensor on x's device, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    dev = x.device
    g = group_size or D
    q = torch.empty((M, D), dtype=torch.float8_e4m3fn if float8 else torch.int8, device=dev)
    static = scale is not None
    scales = scale.clone() if static else torch.empty((M, D // g), dtype=torch.float32,
                                                      device=dev)
    codes = q.view(torch.uint8) if float8 else q
    quant = {"FLOAT8": float8, "QMAX": qmax, "MIN_SCALE": min_scale, "STATIC": static,
             "HAS_UB": scale_ub is not None}
    add = residual is not None
    if p.long or M == 0:  # the long forward keeps y in the compute dtype; then q from it
        y, h, _mean, _rstd = forward(x, residual, weight, bias, eps, centred=centred,
                                     zero_centered_gamma=zero_centered_gamma,
                                     h_dtype=h_dtype if add else None, y_dtype=sdt)
        if M:
            block = max(p.block, group_size) if group_size else p.block  # whole groups
            with _on_device(dev):
                _quant_rows_kernel[(M,)](
                    y, codes, scales, scale, scale_ub, D, **quant,
                    PER_TOKEN=group_size is None, G_SIZE=g if group_size else block,
                    BLOCK=block, num_warps=p.num_warps)
        return q, scales, h
    h = torch.empty((M, D), dtype=h_dtype, device=dev) if add else None
    with _on_device(dev):
        _quant_short_kernel[(triton.cdiv(M, p.rows),)](
            x, residual, h, codes, scales, scale, scale_ub, weight, bias, x.stride(0),
            residual.stride(0) if add else 0, M, D, D // g if group_size else 1, eps,
            CDT=tl.float64 if sdt == torch.float64 else tl.float32, **flags, **quant,
            G_SIZE=g if group_size else p.block, ROWS=p.rows, BLOCK_D=p.block,
            num_warps=p.num_warps)
    return q, scales, h


def _check_backward(dy: torch.Tensor, dh: torch.Tensor | None, src: torch.Tensor, name: str,
                    weight: torch.Tensor | None, bias: torch.Tensor | None, centred: bool,
                    residual_dtype: torch.dtype | None) -> tuple[int, int]:
    """The checks both backwards make of the rows they read (``src``, named ``name``: xn, or
    y from the memory-efficient forward), dy, dh and the parameters; returns (M, D)."""
    if bias is not None and not centred:
        raise ValueError("bias must be None for RMSNorm (centred=False)")
    if src.dim() != 2:
        raise ValueError(f"{name} must be (M, D), got shape {tuple(src.shape)}")
    M, D = src.shape
    if dh is not None and residual_dtype is None:
        raise ValueError("dh is only for add-norms (residual_dtype given)")
    for t, what in ((dy, "dy"), (src, name), (dh, "dh")):
        if t is not None:
            _check_rows(t, what, M, D)
    _check_param(weight, "weight", D)
    _check_param(bias, "bias", D)
    return M, D


def backward(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    xn: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    *,
    centred: bool,
    zero_centered_gamma: bool = False,
    x_dtype: torch.dtype | None = None,
    residual_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Fused backward: dx (and dresidual), and dw/db by the two-stage reduction.

    Args:
        dy: (M, D), unit column stride (any row stride), any of the four dtypes.
        dh: (M, D) gradient reaching h from the residual stream, unit column stride, or None;
            add-norms only.
        xn: (M, D) what the forward normalized: x for a plain norm, h for an add-norm.
        weight: (D,) contiguous or None; bias: (D,) or None (only its dtype is used).
        mean, rstd: (M,) from :func:`forward`.
        centred, zero_centered_gamma: as for the forward.
        x_dtype: x's dtype for an add-norm (default xn's).
        residual_dtype: the residual's dtype; given, this is an add-norm's backward.

    Returns:
        dx: (M, D) contiguous: xn's dtype for a plain norm, x_dtype for an add-norm.
        dresidual: (M, D) contiguous in residual_dtype (the same sum as dx, rounded once to
            each), or None for a plain norm.
        dw: (D,) in weight's dtype, or None without weight.
        db: (D,) in bias's dtype, or None without bias.
    """
    M, D = _check_backward(dy, dh, xn, "xn", weight, bias, centred, residual_dtype)
    add = residual_dtype is not None
    sdt = _stats_dtype(xn.dtype)
    if mean.dtype != sdt or rstd.dtype != sdt or mean.shape != (M,) or rstd.shape != (M,):
        raise ValueError(f"mean and rstd must be ({M},) {sdt}, as the forward returns them")
    x_dtype = xn.dtype if x_dtype is None or not add else x_dtype
    wide_add = add and torch.float64 in (x_dtype, residual_dtype, xn.dtype)
    return _run_backward(dy, dh, xn, weight, bias, mean, rstd, None, None, None, None, sdt,
                         centred=centred, zero_centered_gamma=zero_centered_gamma,
                         x_dtype=x_dtype, residual_dtype=residual_dtype, wide_add=wide_add)


def backward_from_y(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    y: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rstd: torch.Tensor,
    keep: torch.Tensor,
    kept: torch.Tensor,
    *,
    centred: bool,
    zero_centered_gamma: bool = False,
    x_dtype: torch.dtype | None = None,
    residual_dtype: torch.dtype | None = None,
    rows: torch.Tensor | None = None,
    xhat_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The memory-efficient backward: :func:`backward` with xhat recovered from the forward's
    output y instead of rebuilt from xn.

    xhat_j = (y_j - shift_j) / scale_j in the compute dtype T (y widened exactly, then one
    correctly rounded subtraction and one division: no reciprocal), scale = weight, or
    1 + weight with zero_centered_gamma, formed in T (no division without weight), shift = bias
    (no subtraction without bias); on the k channels ``keep`` names, xhat is read from ``kept``
    instead (:mod:`layernorm.recovery` chooses them: where the recovery would lose xhat); on
    the r rows ``rows`` names (kept whole: var < eps under a non-zero shift, recovery's "Rows"),
    xhat is read from ``xhat_rows`` on every channel, y not used. The rest is
    :func:`backward`'s: g = dy * scale, dx = rstd * (g - [mean(g)] - xhat * mean(g * xhat))
    [+ dh], dw = sum over rows of dy * xhat, db = sum of dy, by the same kernels and the same
    two-stage reduction (the reference's memory-efficient ``*_backward`` is the definition).

    Args:
        dy: (M, D), unit column stride (any row stride), any of the four dtypes.
        dh: (M, D) gradient reaching h from the residual stream, unit column stride, or None;
            add-norms only.
        y: (M, D) the forward's output (x's dtype, also for an add-norm), unit column stride.
        weight: (D,) contiguous or None. bias: (D,) contiguous or None: its values are the
            shift (LayerNorm only).
        rstd: (M,) in T: each row's 1 / sqrt(var + eps), the forward's rstd. On a row the
            forward rescaled (a negative rstd, the statistics of xn * s;
            :mod:`layernorm.gpu.kernels`, item 3) y does not give s: pass s * |rstd| there (a
            negative rstd gives that row NaN dx; its dw and db terms do not use rstd).
        keep: (k,) int64, the kept channels in ascending order, on y's device (k may be 0).
        kept: (M, k) in T, unit column stride: xhat of those channels. T is float64 for an h
            (x) of float64, else float32; for an add-norm the norm computes in h's T, so T is
            taken from ``kept`` (also when k = 0).
        centred, zero_centered_gamma: as for the forward.
        x_dtype: x's dtype (default y's, which is x's).
        residual_dtype: the residual's dtype; given, this is an add-norm's backward.
        rows: (r,) int64, the rows kept whole, distinct, in ascending order, in [0, M), on
            y's device (r may be 0), or None (none kept); given with ``xhat_rows``.
        xhat_rows: (r, D) in T (``kept``'s dtype), unit column stride: xhat of those rows; or
            None with ``rows``. With r = 0 the kernels are compiled without the row branch.

    Returns:
        As :func:`backward`: dx (M, D) contiguous in x_dtype; dresidual (M, D) contiguous in
        residual_dtype (add-norms, else None); dw in weight's dtype and db in bias's (or None).
    """
    M, D = _check_backward(dy, dh, y, "y", weight, bias, centred, residual_dtype)
    add = residual_dtype is not None
    if keep.dim() != 1 or keep.dtype != torch.int64 or keep.device != y.device:
        raise ValueError(f"keep must be a (k,) int64 tensor on {y.device}, got shape "
                         f"{tuple(keep.shape)}, {keep.dtype} on {keep.device}")
    k = keep.shape[0]
    if k > D:
        raise ValueError(f"keep names {k} channels, more than D = {D}")
    sdt = kept.dtype
    if sdt not in (torch.float32, torch.float64):
        raise TypeError(f"kept must be float32 or float64 (the compute dtype), got {sdt}")
    if tuple(kept.shape) != (M, k) or (M > 0 and k > 1 and kept.stride(1) != 1):
        raise ValueError(f"kept must be ({M}, {k}) with unit column stride, got shape "
                         f"{tuple(kept.shape)}, strides {kept.stride()}")
    if rstd.dtype != sdt or rstd.shape != (M,):
        raise ValueError(f"rstd must be ({M},) {sdt}, kept's dtype (the compute dtype)")
    r = _check_rows_kept(rows, xhat_rows, M, D, sdt, y.device)
    x_dtype = y.dtype if x_dtype is None else x_dtype
    wide_add = add and torch.float64 in (x_dtype, residual_dtype, sdt)
    kmap = None
    if k > 0 and M > 0:  # channel -> its column in kept, -1 where recovered: O(D)
        kmap = torch.full((D,), -1, dtype=torch.int32, device=y.device)
        kmap[keep] = torch.arange(k, dtype=torch.int32, device=y.device)
    rmap = None
    if r > 0 and M > 0:  # row -> its row in xhat_rows, -1 where recovered: O(M)
        rmap = torch.full((M,), -1, dtype=torch.int32, device=y.device)
        rmap[rows] = torch.arange(r, dtype=torch.int32, device=y.device)
    return _run_backward(dy, dh, y, weight, bias, None, rstd, kmap, kept, rmap, xhat_rows, sdt,
                         centred=centred, zero_centered_gamma=zero_centered_gamma,
                         x_dtype=x_dtype, residual_dtype=residual_dtype, wide_add=wide_add)


def _check_rows_kept(rows: torch.Tensor | None, xhat_rows: torch.Tensor | None, M: int,
                     D: int, sdt: torch.dtype, device: torch.device) -> int:
    """r, the number of rows kept whole, after checking :func:`backward_from_y`'s ``rows``
    and ``xhat_rows`` (0 when both are None); an error naming the argument otherwise. The
    values of ``rows`` are not read (that would wait for the device)."""
    if rows is None and xhat_rows is None:
        return 0
    if rows is None or xhat_rows is None:
        missing = "rows" if rows is None else "xhat_rows"
        raise ValueError(f"rows and xhat_rows are given together: {missing} is None")
    if rows.dim() != 1 or rows.dtype != torch.int64 or rows.device != device:
        raise ValueError(f"rows must be a (r,) int64 tensor on {device}, got shape "
                         f"{tuple(rows.shape)}, {rows.dtype} on {rows.device}")
    r = rows.shape[0]
    if r > M:
        raise ValueError(f"rows names {r} rows, more than M = {M}")
    if xhat_rows.dtype != sdt:
        raise TypeError(f"xhat_rows must be {sdt}, kept's dtype (the compute dtype), got "
                        f"{xhat_rows.dtype}")
    if xhat_rows.device != device:
        raise ValueError(f"xhat_rows must be on {device}, got {xhat_rows.device}")
    if tuple(xhat_rows.shape) != (r, D) or (r > 0 and D > 1 and xhat_rows.stride(1) != 1):
        raise ValueError(f"xhat_rows must be ({r}, {D}) with unit column stride, got shape "
                         f"{tuple(xhat_rows.shape)}, strides {xhat_rows.stride()}")
    return r


def _run_backward(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    xn: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    kmap: torch.Tensor | None,
    kept: torch.Tensor | None,
    rmap: torch.Tensor | None,
    xhat_rows: torch.Tensor | None,
    sdt: torch.dtype,
    *,
    centred: bool,
    zero_centered_gamma: bool,
    x_dtype: torch.dtype,
    residual_dtype: torch.dtype | None,
    wide_add: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The launches of :func:`backward` (``mean`` given: xn is what the forward normalized) and
    of :func:`backward_from_y` (``mean`` None: xn is y, ``kmap`` and ``kept`` the kept
    channels' columns and xhat, or None when k = 0; ``rmap`` and ``xhat_rows`` the rows kept
    whole, their rows and xhat, or None when r = 0), on checked arguments; T is ``sdt``."""
    M, D = xn.shape
    add = residual_dtype is not None
    from_y = mean is None
    dev = xn.device
    dx = torch.empty((M, D), dtype=x_dtype, device=dev)
    dr = torch.empty((M, D), dtype=residual_dtype, device=dev) if add else None
    dw = None if weight is None else torch.empty(D, dtype=weight.dtype, device=dev)
    db = None if bias is None else torch.empty(D, dtype=bias.dtype, device=dev)
    if M == 0:
        return dx, dr, None if dw is None else dw.zero_(), None if db is None else db.zero_()
    p = plan("bwd", D, wide=sdt == torch.float64)
    has_w, has_b = weight is not None, bias is not None
    part_size = torch.empty((), dtype=sdt).element_size()
    if p.long:  # P chunks of consecutive rows times col_blocks column blocks
        col_blocks = triton.cdiv(D, p.block)
        owners = _partial_rows(M, col_blocks, M, xn.element_size(), part_size, dev)
        rows_per_chunk = triton.cdiv(M, owners)
        chunks = triton.cdiv(M, rows_per_chunk)
    else:  # P persistent programs, each owning every P-th tile of rows
        chunks = _partial_rows(triton.cdiv(M, p.rows), 1, M, xn.element_size(), part_size, dev)
    dw_part = torch.empty((chunks, D), dtype=sdt, device=dev) if has_w else None
    db_part = torch.empty((chunks, D), dtype=sdt, device=dev) if has_b else None
    has_kept = kmap is not None
    shift = bias if from_y else None  # the default backward reads only bias's dtype
    kmap, kept = (kmap, kept) if has_kept else (None, None)
    stride_kept = kept.stride(0) if has_kept else 0
    has_rows = rmap is not None
    rmap, xhat_rows = (rmap, xhat_rows) if has_rows else (None, None)
    stride_rows = xhat_rows.stride(0) if has_rows else 0
    from_y_flags = {"FROM_Y": from_y, "HAS_KEPT": has_kept, "HAS_ROWS": has_rows}
    flags = {
        "CENTRED": centred,
        "IS_ADD": add,
        "HAS_DH": dh is not None,
        "WIDE_ADD": wide_add,
        "HAS_W": has_w,
        "HAS_B": has_b,
        "ZERO_CENTERED": zero_centered_gamma,
        **from_y_flags,
    }
    stride_dh = 0 if dh is None else dh.stride(0)
    with _on_device(dev):
        if p.long:
            coef = torch.empty((4, M), dtype=sdt, device=dev)
            _bwd_long_rowstats_kernel[(M,)](
                dy, xn, weight, shift, mean, rstd, kmap, kept, rmap, xhat_rows, coef,
                dy.stride(0), xn.stride(0), stride_kept, stride_rows, M, D,
                CENTRED=centred, HAS_W=has_w, HAS_B=has_b and from_y,
                ZERO_CENTERED=zero_centered_gamma, **from_y_flags,
                BLOCK=p.block, num_warps=p.num_warps,
            )
            # from y, each element holds more values than from x (the shift, the kept
            # channels' xhat): twice the warps keep a thread's share within 64 registers
            # without a spill under ptxas 12.8 and 12.9 (at 16 warps, 12.8 spills the
            # bfloat16 add-norm's in its loop); float64's plan is left as it is
            dx_warps = min(32, 2 * p.num_warps) if from_y and sdt != torch.float64 else (
                p.num_warps)
            _bwd_long_dx_kernel[(chunks, col_blocks)](
                dy, dh, xn, dx, dr, weight, shift, mean, rstd, kmap, kept, rmap, xhat_rows,
                coef, dw_part, db_part, dy.stride(0), stride_dh, xn.stride(0), stride_kept,
                stride_rows, M, D, rows_per_chunk, **flags, BLOCK=p.block, num_warps=dx_warps,
            )
        else:
            _bwd_short_kernel[(chunks,)](
                dy, dh, xn, dx, dr, weight, shift, mean, rstd, kmap, kept, rmap, xhat_rows,
                dw_part, db_part, dy.stride(0), stride_dh, xn.stride(0), stride_kept,
                stride_rows, M, D,
                **flags, ROWS=p.rows, BLOCK_D=p.block, num_warps=p.num_warps,
            )
        if has_w or has_b:
            _sum_partials_kernel[(triton.cdiv(D, REDUCE_BLOCK_N),)](
                dw_part, db_part, dw, db, chunks, D,
                HAS_W=has_w, HAS_B=has_b, BLOCK_P=REDUCE_BLOCK_P * 4 // part_size,
                BLOCK_N=REDUCE_BLOCK_N, num_warps=REDUCE_NUM_WARPS,
            )
    return dx, dr, dw, db
