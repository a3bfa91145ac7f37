"""The backward kernels of the family (:mod:`layernorm.gpu.kernels` states the maths): a tile of
whole rows (``_bwd_short_kernel``); for long rows the row statistics (``_bwd_long_rowstats_kernel``)
then dx on a grid of row chunks and column blocks (``_bwd_long_dx_kernel``); the memory-efficient
mode's recovery of xhat from y in each; and the fixed-order sum of dweight's and dbias's partial
rows (``_sum_partials_kernel``). Launched by :mod:`layernorm.gpu.launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .elements import INF, NAN, _div, _load_scale, _pow2_scale, _to

__all__: list[str] = []


@triton.jit
def _store_dx(
    dn,  # dnorm, the norm's gradient w.r.t. xn, in the compute dtype
    dh,  # dh (loaded, its own dtype), ignored unless HAS_DH
    DX,  # *dx.dtype: gradient of x
    DR,  # *dr.dtype: gradient of the residual; None unless IS_ADD
    offs,  # offsets of dn's elements in DX and DR
    mask,  # valid entries
    IS_ADD: tl.constexpr,  # add-norm: dx = dresidual = dn + dh
    HAS_DH: tl.constexpr,  # dh present
    WIDE_ADD: tl.constexpr,  # the add's compute dtype is float64
):
    """Store dx (and dresidual): dn rounded once, or dn + dh formed in the add's compute dtype
    and rounded once to each output's dtype."""
    if IS_ADD:
        if WIDE_ADD:
            t = dn.to(tl.float64)
            if HAS_DH:
                t = t + dh.to(tl.float64)
        else:
            t = dn.to(tl.float32)
            if HAS_DH:
                t = t + dh.to(tl.float32)
        tl.store(DX + offs, _to(t, DX.dtype.element_ty), mask=mask)
        tl.store(DR + offs, _to(t, DR.dtype.element_ty), mask=mask)
    else:
        tl.store(DX + offs, _to(dn, DX.dtype.element_ty), mask=mask)


@triton.jit
def _from_y_params(
    B,  # *b.dtype (D,): bias; None unless HAS_B
    KMAP,  # *int32 (D,): column of each channel in KEPT, -1 where recovered; None unless HAS_KEPT
    offs,  # channels
    ok,  # valid channels
    CDT: tl.constexpr,  # compute dtype
    HAS_B: tl.constexpr,  # bias present
    HAS_KEPT: tl.constexpr,  # some channels are kept
):
    """The recovery's values at ``offs``: the shift in the compute dtype (0 without bias) and
    each channel's column in KEPT (-1: recovered from y)."""
    shift = tl.zeros(offs.shape, CDT)
    if HAS_B:
        shift = tl.load(B + offs, mask=ok, other=0.0).to(CDT)
    kcol = tl.full(offs.shape, -1, tl.int32)
    if HAS_KEPT:
        kcol = tl.load(KMAP + offs, mask=ok, other=-1)
    return shift, kcol


@triton.jit
def _xhat_from_y(
    y,  # y in the compute dtype, any shape
    shift,  # the shift (bias) in the compute dtype, broadcast to y; ignored unless HAS_B
    scale,  # the scale in the compute dtype, broadcast to y; ignored unless HAS_W
    kcol,  # int32, broadcast to y: column of each channel in KEPT, -1 where recovered
    KEPT,  # *T: xhat of the kept channels; None unless HAS_KEPT
    kept_offs,  # offsets of the rows' starts in KEPT, broadcast to y
    ok,  # valid entries
    HAS_W: tl.constexpr,  # divide by the scale
    HAS_B: tl.constexpr,  # subtract the shift
    HAS_KEPT: tl.constexpr,  # some channels are kept
):
    """xhat recovered from y: (y - shift) / scale, each operation correctly rounded (a
    division, not a reciprocal's product), the kept channels' xhat read from KEPT instead;
    0 where not ok."""
    xhat = y
    if HAS_B:
        xhat = xhat - shift
    if HAS_W:
        xhat = _div(xhat, scale)
    if HAS_KEPT:
        is_kept = kcol >= 0
        kept = tl.load(KEPT + kept_offs + kcol, mask=ok & is_kept, other=0.0)
        xhat = tl.where(is_kept, kept, xhat)  # never a blend: a zero scale gives inf or NaN
    return tl.where(ok, xhat, 0.0)


@triton.jit
def _whole_rows(
    xhat,  # (ROWS, BLOCK_D) xhat recovered from y (_xhat_from_y)
    XROWS,  # *T (r, D): xhat of the rows kept whole, row stride stride_rows
    ridx,  # (ROWS, 1) int32: each row's row in XROWS, -1 where recovered
    stride_rows,  # elements between consecutive rows of XROWS
    offs,  # (1, BLOCK_D) channels
    ok,  # (ROWS, BLOCK_D) valid entries
):
    """xhat with the rows kept whole read from XROWS on every channel (their y is not used:
    recovery through the shift would lose their relative accuracy); 0 where not ok."""
    whole = ridx >= 0
    stored = tl.load(XROWS + tl.maximum(ridx, 0).to(tl.int64) * stride_rows + offs,
                     mask=ok & whole, other=0.0)
    return tl.where(whole, stored, xhat)


@triton.jit
def _bwd_short_kernel(
    DY,  # *dy.dtype (M, D): gradient of y, row stride stride_dy, unit column stride
    DH,  # *dh.dtype (M, D): gradient of h, row stride stride_dh; None unless HAS_DH
    XN,  # *xn.dtype (M, D): what the forward normalized (x, or h), row stride stride_xn;
    #      y (x's dtype) when FROM_Y
    DX,  # *dx.dtype (M, D) contiguous: output, gradient of x
    DR,  # *dr.dtype (M, D) contiguous: output, gradient of the residual; None unless IS_ADD
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    B,  # *b.dtype (D,): bias, the shift y is recovered with; None unless FROM_Y and HAS_B
    MEAN,  # *T (M,): the forward's MEAN; None when FROM_Y
    RSTD,  # *T (M,): the forward's RSTD (negative: a rescaled row); T, the compute dtype, is
    #        RSTD's dtype. FROM_Y: the row's 1 / sqrt(var + eps), never negative
    KMAP,  # *int32 (D,): column of each channel in KEPT, -1 if recovered; None unless HAS_KEPT
    KEPT,  # *T (M, k): xhat of the kept channels, row stride stride_kept; None unless HAS_KEPT
    ROWMAP,  # *int32 (M,): row of each row in XROWS, -1 if recovered; None unless HAS_ROWS
    XROWS,  # *T (r, D): xhat of the rows kept whole, row stride stride_rows; None unless HAS_ROWS
    DW_PART,  # *T (P, D): output, row p = this program's sum of dy * xhat
    DB_PART,  # *T (P, D): output, row p = this program's sum of dy
    stride_dy,  # elements between consecutive rows of DY
    stride_dh,  # elements between consecutive rows of DH
    stride_xn,  # elements between consecutive rows of XN
    stride_kept,  # elements between consecutive rows of KEPT
    stride_rows,  # elements between consecutive rows of XROWS
    M,  # number of rows
    D,  # row length
    CENTRED: tl.constexpr,  # LayerNorm, else RMSNorm
    IS_ADD: tl.constexpr,  # add-norm: write dx and dresidual
    HAS_DH: tl.constexpr,  # dh present
    WIDE_ADD: tl.constexpr,  # the add's compute dtype is float64
    HAS_W: tl.constexpr,  # weight present: compute dw partial sums
    HAS_B: tl.constexpr,  # bias present: compute db partial sums (and, FROM_Y, shift by it)
    ZERO_CENTERED: tl.constexpr,  # scale = 1 + w
    FROM_Y: tl.constexpr,  # XN is y: xhat = (y - shift) / scale, or KEPT on kept channels,
    #                        or XROWS on rows kept whole
    HAS_KEPT: tl.constexpr,  # FROM_Y with k > 0 kept channels
    HAS_ROWS: tl.constexpr,  # FROM_Y with r > 0 rows kept whole
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_D: tl.constexpr,  # power of two >= D: a whole row per tile row
):
    # Persistent: P programs; program p owns row tiles p, p + P, p + 2P, ... and keeps its share
    # of dw and db in registers until the end.
    CDT: tl.constexpr = RSTD.dtype.element_ty
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    col_ok = cols < D
    n = tl.zeros([], CDT) + D  # D in the compute dtype (D may be the constant 1)
    if HAS_W:
        scale = _load_scale(W, cols, col_ok, CDT, ZERO_CENTERED)[None, :]  # (1, BLOCK_D)
    if FROM_Y:  # the recovery's per-channel values, each (1, BLOCK_D)
        if not HAS_W:
            scale = tl.zeros((1, BLOCK_D), CDT)  # a placeholder: no scale
        shift, kcol = _from_y_params(B, KMAP, cols, col_ok, CDT, HAS_B, HAS_KEPT)
        shift = shift[None, :]
        kcol = kcol[None, :]
    acc_dw = tl.zeros((ROWS, BLOCK_D), dtype=CDT)
    acc_db = tl.zeros((ROWS, BLOCK_D), dtype=CDT)
    for tile in tl.range(pid, tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)  # (ROWS,)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]  # (ROWS, BLOCK_D)
        rows64 = rows.to(tl.int64)
        xn = tl.load(XN + rows64[:, None] * stride_xn + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        xn = xn.to(CDT)  # (ROWS, BLOCK_D) y when FROM_Y
        dy = dy.to(CDT)  # (ROWS, BLOCK_D)
        if FROM_Y:
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)  # (ROWS,)
            xhat = _xhat_from_y(xn, shift, scale, kcol, KEPT, rows64[:, None] * stride_kept,
                                mask, HAS_W, HAS_B, HAS_KEPT)  # (ROWS, BLOCK_D)
            if HAS_ROWS:
                ridx = tl.load(ROWMAP + rows, mask=row_ok, other=-1)  # (ROWS,)
                if tl.max(ridx, axis=0) >= 0:  # rare: a row of the tile is kept whole
                    xhat = _whole_rows(xhat, XROWS, ridx[:, None], stride_rows, cols[None, :],
                                       mask)
            rstd = tl.where(rstd < 0, NAN, rstd)  # a rescaled row's mark: y cannot give s
        else:
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)  # (ROWS,)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)  # (ROWS,)
            scaled = rstd < 0  # (ROWS,) rows the forward computed as xn * s
            s = tl.full((ROWS,), 1.0, CDT)
            if tl.sum(scaled.to(tl.int32), axis=0) > 0:  # rare
                s = tl.where(scaled, _pow2_scale(tl.max(tl.abs(xn), axis=1)), 1.0)
                xn = xn * s[:, None]
            rstd = tl.abs(rstd)
            r_x = tl.where(rstd < INF, rstd, 0.0)  # inf only on a constant row with eps = 0
            if CENTRED:
                u = tl.where(mask, (xn - mean[:, None]) * r_x[:, None], 0.0)  # (ROWS, BLOCK_D)
                xhat = tl.where(mask, u - _div(tl.sum(u, axis=1), n)[:, None], 0.0)  # corrected
            else:
                xhat = xn * r_x[:, None]  # (ROWS, BLOCK_D)
        if HAS_W:
            g = dy * scale
        else:
            g = dy
        mean_gxhat = _div(tl.sum(g * xhat, axis=1), n)  # (ROWS,)
        if CENTRED:
            dn = g - _div(tl.sum(g, axis=1), n)[:, None] - xhat * mean_gxhat[:, None]
        else:
            dn = g - xhat * mean_gxhat[:, None]
        dn = dn * rstd[:, None]  # (ROWS, BLOCK_D)
        if not FROM_Y:
            dn = dn * s[:, None]
        if HAS_DH:
            dh = tl.load(DH + rows64[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0)
        else:
            dh = dn
        _store_dx(dn, dh, DX, DR, rows64[:, None] * D + cols[None, :], mask, IS_ADD, HAS_DH,
                  WIDE_ADD)
        if HAS_W:
            acc_dw += dy * xhat
        if HAS_B:
            acc_db += dy
    part = pid.to(tl.int64) * D + cols
    if HAS_W:
        tl.store(DW_PART + part, tl.sum(acc_dw, axis=0), mask=col_ok)
    if HAS_B:
        tl.store(DB_PART + part, tl.sum(acc_db, axis=0), mask=col_ok)


@triton.jit
def _long_row_absmax(
    x_row,  # *: start of the row
    D,  # row length
    CDT: tl.constexpr,  # compute dtype
    BLOCK: tl.constexpr,  # elements per loop step
):
    """max |x| over the row."""
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    big = tl.zeros((BLOCK,), dtype=CDT)
    for start in tl.range(0, D, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < D, other=0.0).to(CDT)
        big = tl.maximum(big, tl.abs(x))
    return tl.max(big, axis=0)


@triton.jit
def _bwd_long_rowstats_kernel(
    DY,  # *dy.dtype (M, D): gradient of y, row stride stride_dy, unit column stride
    XN,  # *xn.dtype (M, D): what the forward normalized, row stride stride_xn; y when FROM_Y
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    B,  # *b.dtype (D,): bias, the shift y is recovered with; None unless FROM_Y and HAS_B
    MEAN,  # *T (M,): the forward's MEAN; None when FROM_Y
    RSTD,  # *T (M,): the forward's RSTD (negative: a rescaled row); T, the compute dtype, is
    #        RSTD's dtype
    KMAP,  # *int32 (D,): column of each channel in KEPT, -1 if recovered; None unless HAS_KEPT
    KEPT,  # *T (M, k): xhat of the kept channels, row stride stride_kept; None unless HAS_KEPT
    ROWMAP,  # *int32 (M,): row of each row in XROWS, -1 if recovered; None unless HAS_ROWS
    XROWS,  # *T (r, D): xhat of the rows kept whole, row stride stride_rows; None unless HAS_ROWS
    COEF,  # *T (4, M): output, per row mean(u), mean(g), mean(g * xhat) and s
    stride_dy,  # elements between consecutive rows of DY
    stride_xn,  # elements between consecutive rows of XN
    stride_kept,  # elements between consecutive rows of KEPT
    stride_rows,  # elements between consecutive rows of XROWS
    M,  # number of rows
    D,  # row length
    CENTRED: tl.constexpr,  # LayerNorm, else RMSNorm (mean(u) = mean(g) = 0)
    HAS_W: tl.constexpr,  # weight present
    HAS_B: tl.constexpr,  # FROM_Y: bias present, the shift
    ZERO_CENTERED: tl.constexpr,  # scale = 1 + w
    FROM_Y: tl.constexpr,  # XN is y: xhat = (y - shift) / scale, or KEPT on kept channels,
    #                        or XROWS on rows kept whole
    HAS_KEPT: tl.constexpr,  # FROM_Y with k > 0 kept channels
    HAS_ROWS: tl.constexpr,  # FROM_Y with r > 0 rows kept whole
    BLOCK: tl.constexpr,  # elements per loop step
):
    # One program per long row, one pass over it for the row reductions dx needs (one more,
    # for max|xn|, on a rescaled row). With u = (xn * s - MEAN) * rstd and xhat = u - mean(u):
    #     sum(g * xhat) = sum(g * u) - mean(u) * sum(g).
    # FROM_Y: u = xhat, recovered from y (mean(u) = 0, s = 1).
    CDT: tl.constexpr = RSTD.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    xn_row = XN + row * stride_xn
    dy_row = DY + row * stride_dy
    s = tl.full([], 1.0, CDT)
    if HAS_ROWS:
        ridx = tl.load(ROWMAP + row)  # the row's row in XROWS, -1: recovered
    if not FROM_Y:
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        if rstd < 0:  # rare: the forward computed the row as xn * s
            s = _pow2_scale(_long_row_absmax(xn_row, D, CDT, BLOCK))
        rstd = tl.abs(rstd)
        r_x = tl.where(rstd < INF, rstd, 0.0)  # inf only on a constant row with eps = 0
    n = tl.zeros([], CDT) + D  # D in the compute dtype (D may be the constant 1)
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    sum_u = tl.zeros((BLOCK,), dtype=CDT)  # blocked sums: one lane per column mod BLOCK
    sum_g = tl.zeros((BLOCK,), dtype=CDT)
    sum_gu = tl.zeros((BLOCK,), dtype=CDT)
    for start in tl.range(0, D, BLOCK):
        ok = start + cols < D
        if FROM_Y:
            y = tl.load(xn_row + start + cols, mask=ok, other=0.0).to(CDT)
        else:
            xn = tl.load(xn_row + start + cols, mask=ok, other=0.0).to(CDT) * s
        g = tl.load(dy_row + start + cols, mask=ok, other=0.0).to(CDT)
        if HAS_W:
            w = _load_scale(W, start + cols, ok, CDT, ZERO_CENTERED)
            g = g * w
        if FROM_Y:
            if not HAS_W:
                w = g  # a placeholder: no scale
            shift, kcol = _from_y_params(B, KMAP, start + cols, ok, CDT, HAS_B, HAS_KEPT)
            u = _xhat_from_y(y, shift, w, kcol, KEPT, row * stride_kept, ok, HAS_W, HAS_B,
                             HAS_KEPT)  # (BLOCK,) xhat
            if HAS_ROWS:
                if ridx >= 0:  # rare: the row is kept whole, its xhat stored
                    u = tl.load(XROWS + ridx.to(tl.int64) * stride_rows + start + cols,
                                mask=ok, other=0.0)
            if CENTRED:
                sum_g += g
        else:
            if CENTRED:
                u = tl.where(ok, (xn - mean) * r_x, 0.0)  # (BLOCK,)
                sum_u += u
                sum_g += g
            else:
                u = xn * r_x  # (BLOCK,) xhat
        sum_gu += g * u
    if CENTRED and FROM_Y:
        mean_u = tl.zeros([], CDT)
        total_g = tl.sum(sum_g, axis=0)
        mean_g = _div(total_g, n)
        mean_gxhat = _div(tl.sum(sum_gu, axis=0), n)
    elif CENTRED:
        mean_u = _div(tl.sum(sum_u, axis=0), n)
        total_g = tl.sum(sum_g, axis=0)
        mean_g = _div(total_g, n)
        mean_gxhat = _div(tl.sum(sum_gu, axis=0) - mean_u * total_g, n)
    else:
        mean_u = tl.zeros([], CDT)
        mean_g = mean_u
        mean_gxhat = _div(tl.sum(sum_gu, axis=0), n)
    tl.store(COEF + row, mean_u)
    tl.store(COEF + M + row, mean_g)
    tl.store(COEF + 2 * M + row, mean_gxhat)
    tl.store(COEF + 3 * M + row, s)


@triton.jit
def _bwd_long_dx_kernel(
    DY,  # *dy.dtype (M, D): gradient of y, row stride stride_dy, unit column stride
    DH,  # *dh.dtype (M, D): gradient of h, row stride stride_dh; None unless HAS_DH
    XN,  # *xn.dtype (M, D): what the forward normalized, row stride stride_xn; y when FROM_Y
    DX,  # *dx.dtype (M, D) contiguous: output, gradient of x
    DR,  # *dr.dtype (M, D) contiguous: output, gradient of the residual; None unless IS_ADD
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    B,  # *b.dtype (D,): bias, the shift y is recovered with; None unless FROM_Y and HAS_B
    MEAN,  # *T (M,): the forward's MEAN; None when FROM_Y
    RSTD,  # *T (M,): the forward's RSTD (negative: a rescaled row); T, the compute dtype, is
    #        RSTD's dtype. FROM_Y: the row's 1 / sqrt(var + eps), never negative
    KMAP,  # *int32 (D,): column of each channel in KEPT, -1 if recovered; None unless HAS_KEPT
    KEPT,  # *T (M, k): xhat of the kept channels, row stride stride_kept; None unless HAS_KEPT
    ROWMAP,  # *int32 (M,): row of each row in XROWS, -1 if recovered; None unless HAS_ROWS
    XROWS,  # *T (r, D): xhat of the rows kept whole, row stride stride_rows; None unless HAS_ROWS
    COEF,  # *T (4, M): per row mean(u), mean(g), mean(g * xhat), s from the row-stats kernel
    DW_PART,  # *T (P, D): output, row p = chunk p's sum of dy * xhat
    DB_PART,  # *T (P, D): output, row p = chunk p's sum of dy
    stride_dy,  # elements between consecutive rows of DY
    stride_dh,  # elements between consecutive rows of DH
    stride_xn,  # elements between consecutive rows of XN
    stride_kept,  # elements between consecutive rows of KEPT
    stride_rows,  # elements between consecutive rows of XROWS
    M,  # number of rows
    D,  # row length
    rows_per_chunk,  # rows owned by one program along axis 0
    CENTRED: tl.constexpr,  # LayerNorm, else RMSNorm
    IS_ADD: tl.constexpr,  # add-norm: write dx and dresidual
    HAS_DH: tl.constexpr,  # dh present
    WIDE_ADD: tl.constexpr,  # the add's compute dtype is float64
    HAS_W: tl.constexpr,  # weight present: compute dw partial sums
    HAS_B: tl.constexpr,  # bias present: compute db partial sums (and, FROM_Y, shift by it)
    ZERO_CENTERED: tl.constexpr,  # scale = 1 + w
    FROM_Y: tl.constexpr,  # XN is y: xhat = (y - shift) / scale, or KEPT on kept channels,
    #                        or XROWS on rows kept whole
    HAS_KEPT: tl.constexpr,  # FROM_Y with k > 0 kept channels
    HAS_ROWS: tl.constexpr,  # FROM_Y with r > 0 rows kept whole
    BLOCK: tl.constexpr,  # columns owned by one program along axis 1
):
    # Program (p, j) owns the rows of chunk p and the columns of block j: it writes their dx and
    # row p, block j of the partial sums.
    CDT: tl.constexpr = RSTD.dtype.element_ty
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    ok = cols < D
    if HAS_W:
        scale = _load_scale(W, cols, ok, CDT, ZERO_CENTERED)  # (BLOCK,)
    if FROM_Y:  # the recovery's per-channel values, each (BLOCK,)
        if not HAS_W:
            scale = tl.zeros((BLOCK,), CDT)  # a placeholder: no scale
        shift, kcol = _from_y_params(B, KMAP, cols, ok, CDT, HAS_B, HAS_KEPT)
    acc_dw = tl.zeros((BLOCK,), dtype=CDT)
    acc_db = tl.zeros((BLOCK,), dtype=CDT)
    first = chunk.to(tl.int64) * rows_per_chunk  # int64: row offsets of large tensors
    for row in tl.range(first, tl.minimum(first + rows_per_chunk, M)):
        xn = tl.load(XN + row * stride_xn + cols, mask=ok, other=0.0).to(CDT)  # y when FROM_Y
        dy = tl.load(DY + row * stride_dy + cols, mask=ok, other=0.0).to(CDT)
        if FROM_Y:
            rstd = tl.load(RSTD + row)
            rstd = tl.where(rstd < 0, NAN, rstd)  # a rescaled row's mark: y cannot give s
            mean_g = tl.load(COEF + M + row)
            mean_gxhat = tl.load(COEF + 2 * M + row)
            xhat = _xhat_from_y(xn, shift, scale, kcol, KEPT, row * stride_kept, ok, HAS_W,
                                HAS_B, HAS_KEPT)  # (BLOCK,)
            if HAS_ROWS:
                ridx = tl.load(ROWMAP + row)
                if ridx >= 0:  # rare: the row is kept whole, its xhat stored
                    xhat = tl.load(XROWS + ridx.to(tl.int64) * stride_rows + cols, mask=ok,
                                   other=0.0)
        else:
            mean = tl.load(MEAN + row)
            rstd = tl.abs(tl.load(RSTD + row))
            r_x = tl.where(rstd < INF, rstd, 0.0)  # inf only on a constant row with eps = 0
            mean_u = tl.load(COEF + row)
            mean_g = tl.load(COEF + M + row)
            mean_gxhat = tl.load(COEF + 2 * M + row)
            s = tl.load(COEF + 3 * M + row)
            if CENTRED:
                xhat = tl.where(ok, (xn * s - mean) * r_x - mean_u, 0.0)  # (BLOCK,)
            else:
                xhat = (xn * s) * r_x  # (BLOCK,)
        if HAS_W:
            g = dy * scale
        else:
            g = dy
        dn = (g - mean_g - xhat * mean_gxhat) * rstd  # (BLOCK,)
        if not FROM_Y:
            dn = dn * s
        if HAS_DH:
            dh = tl.load(DH + row * stride_dh + cols, mask=ok, other=0.0)
        else:
            dh = dn
        _store_dx(dn, dh, DX, DR, row * D + cols, ok, IS_ADD, HAS_DH, WIDE_ADD)
        if HAS_W:
            acc_dw += dy * xhat
        if HAS_B:
            acc_db += dy
    part = chunk.to(tl.int64) * D + cols
    if HAS_W:
        tl.store(DW_PART + part, acc_dw, mask=ok)
    if HAS_B:
        tl.store(DB_PART + part, acc_db, mask=ok)


@triton.jit
def _sum_partials_kernel(
    DW_PART,  # *T (P, D): partial sums of dw, or None when HAS_W is False
    DB_PART,  # *T (P, D): partial sums of db, or None when HAS_B is False
    DW,  # *w.dtype (D,): output, dw
    DB,  # *b.dtype (D,): output, db
    P,  # number of partial rows
    D,  # row length
    HAS_W: tl.constexpr,  # reduce DW_PART into DW
    HAS_B: tl.constexpr,  # reduce DB_PART into DB
    BLOCK_P: tl.constexpr,  # partial rows per step
    BLOCK_N: tl.constexpr,  # columns per program
):
    # Second stage: column sums of the partial rows, always in the same order (steps of BLOCK_P
    # rows, then one tree sum), so the result does not depend on scheduling. dw and db are
    # summed in one sweep: the mask and offsets are computed once per step.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    col_ok = cols < D
    if HAS_W:
        acc_w = tl.zeros((BLOCK_P, BLOCK_N), dtype=DW_PART.dtype.element_ty)
    if HAS_B:
        acc_b = tl.zeros((BLOCK_P, BLOCK_N), dtype=DB_PART.dtype.element_ty)
    for p0 in tl.range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
        mask = (p < P)[:, None] & col_ok[None, :]  # (BLOCK_P, BLOCK_N)
        offs = p.to(tl.int64)[:, None] * D + cols[None, :]  # (BLOCK_P, BLOCK_N)
        if HAS_W:
            acc_w += tl.load(DW_PART + offs, mask=mask, other=0.0)
        if HAS_B:
            acc_b += tl.load(DB_PART + offs, mask=mask, other=0.0)
    if HAS_W:
        tl.store(DW + cols, _to(tl.sum(acc_w, axis=0), DW.dtype.element_ty), mask=col_ok)
    if HAS_B:
        tl.store(DB + cols, _to(tl.sum(acc_b, axis=0), DB.dtype.element_ty), mask=col_ok)
