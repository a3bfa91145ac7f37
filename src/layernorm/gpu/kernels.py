r"""Fused layer-norm kernels in Triton, and the launchers that pick a plan for each row length.

The maths, for one row x of length D (the NumPy oracle, :mod:`layernorm.reference`, computes
the same; docs/gpu-fusion.md explains the design):

    m      = (1/D) sum_j x_j                   first-pass mean
    c      = (1/D) sum_j (x_j - m)             correction: the rounding error of m
    xc_j   = (x_j - m) - c                     centred values, accurate even when |m| >> std
    MEAN   = m + c rounded to float32          saved (exactly x_j on a constant row)
    rstd   = 1 / sqrt((1/D) sum_j xc_j^2 + eps)   saved as RSTD (float32)
    xhat_j = xc_j * rstd
    y_j    = w_j * xhat_j + b_j

    g_j    = dy_j * w_j                        (g = dy without weight)
    dx_j   = rstd * (g_j - mean(g) - xhat_j * mean(g * xhat))
    dw_j   = sum over rows of dy_j * xhat_j
    db_j   = sum over rows of dy_j

This is the reference's accuracy mechanism in float32:

1. Corrected two-pass statistics: subtracting c, the mean of the centred values, removes the
   rounding error of m from every centred value.
2. Row sums are tree sums (tl.sum) or blocked sums; long rows merge per-block statistics with
   Chan's formula.
3. A row whose sum or sum of squares overflows float32 is recomputed as x * 2**-e (exact;
   max |x * 2**-e| < 1, or < 4 when max|x| >= 2**126 so that 2**-e stays a normal float32)
   with eps * 4**-e, and MEAN and RSTD are scaled back; a constant row keeps
   RSTD = 1/sqrt(eps) even where eps * 4**-e underflows.

The backward rebuilds xhat from x, MEAN and RSTD as u - mean(u) with u = (x - MEAN) * rstd:
the same correction, recomputed in the pass the backward already makes over the row, on
values of order one (no overflow). The forward saves two floats per row, nothing of size (M, D).

Every load is cast to float32; statistics and sums are float32 whatever the input dtype;
y and dx are rounded once, to x's dtype. Rows are short or long:

* short rows (D <= MAX_SHORT_D_FWD forward, MAX_SHORT_D_BWD backward): a program holds whole
  rows in registers, so x (and dy) are read from memory once.
* long rows: a program loops over the row in blocks of LONG_BLOCK and never holds it whole;
  the row is read twice (statistics, then the elementwise pass), the second time from L2
  when the rows in flight fit there. Registers stay bounded whatever D is.

dw and db are reduced in two stages: each program of the backward adds its rows into float32
partial sums and writes them to its own row of a (P, D) buffer; a second kernel sums the P
rows in a fixed order. No atomics and no locks, so results are bit-identical run to run.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["INTERPRET", "Plan", "backward", "forward", "plan"]

# Tuning constants (chosen from the design, not yet measured on a GPU: docs/gpu-fusion.md).
# The two limits are the longest rows whose tiles compile for sm_90 without register spills
# (tests/gpu/test_gpu_compile.py checks it): the backward holds x, dy, weight and two float32
# accumulators per element, the forward x and the centred values.
MAX_SHORT_D_FWD = 8192  # longest row the forward holds whole
MAX_SHORT_D_BWD = 4096  # longest row the backward holds whole
SHORT_TILE = 4096  # elements per program for short rows: small rows are packed several a tile
LONG_BLOCK = 4096  # elements of a long row handled per loop step
PROGRAMS_PER_SM = 4  # persistent programs per SM in the backward
INTERPRETER_SMS = 4  # "SMs" under TRITON_INTERPRET=1, where programs run one after another
REDUCE_BLOCK_P = 32  # partial rows summed per step by the second-stage reduction
REDUCE_BLOCK_N = 256  # columns per program of the second-stage reduction
REDUCE_NUM_WARPS = 4  # warps per program of the second-stage reduction

FLT_MAX = tl.constexpr(3.4028234663852886e38)  # var above this (or NaN): the sums overflowed


@triton.jit
def _inv_pow2_above(
    a,  # float32 > 0, any shape
):
    """2**(126 - E) for a with biased exponent E, so 1/2 <= a * 2**(126 - E) < 1: an exact
    scale that brings a below one (built from the exponent bits, no division). E is capped at
    252 so the scale stays a normal float32 (2**-126 at the least; a subnormal would flush to
    zero): for a >= 2**126 that leaves a * scale in [1, 4), still far from overflow."""
    e = tl.minimum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 252)
    return ((253 - e) << 23).to(tl.float32, bitcast=True)


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _centre_rows(
    x,  # (ROWS, BLOCK_D) float32, zero where not mask
    mask,  # (ROWS, BLOCK_D) bool: valid entries
    D,  # row length
):
    """Corrected mean (ROWS,), centred values with the correction (ROWS, BLOCK_D), variance.

    The mean returned is m + corr rounded to float32: for a constant row it is the row's value
    exactly, so the backward's x - MEAN is 0 there (the first-pass m can be an ulp off, and
    for values near 1e37 that ulp times rstd overflows the backward's products).
    """
    mean = tl.sum(x, axis=1) / D  # (ROWS,)
    xc = tl.where(mask, x - mean[:, None], 0.0)  # (ROWS, BLOCK_D)
    corr = tl.sum(xc, axis=1) / D  # (ROWS,) the rounding error of mean
    xc = tl.where(mask, xc - corr[:, None], 0.0)  # (ROWS, BLOCK_D)
    return mean + corr, xc, tl.sum(xc * xc, axis=1) / D


@triton.jit
def _fwd_short_kernel(
    X,  # *x.dtype (M, D): input rows, row stride stride_x, unit column stride
    Y,  # *x.dtype (M, D) contiguous: output
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    B,  # *b.dtype (D,): bias, or None when HAS_B is False
    MEAN,  # *float32 (M,): output, the corrected mean rounded to float32
    RSTD,  # *float32 (M,): output, 1 / sqrt(var + eps)
    stride_x,  # elements between consecutive rows of X
    M,  # number of rows
    D,  # row length
    eps,  # added to the variance
    HAS_W: tl.constexpr,  # weight present
    HAS_B: tl.constexpr,  # bias present
    ROWS: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # power of two >= D: a whole row per tile row
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    row_ok = rows < M  # (ROWS,)
    col_ok = cols < D  # (BLOCK_D,)
    mask = row_ok[:, None] & col_ok[None, :]  # (ROWS, BLOCK_D)
    rows64 = rows.to(tl.int64)  # offsets of large tensors overflow int32
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)  # (ROWS, BLOCK_D)

    mean, xc, var = _centre_rows(x, mask, D)  # (ROWS,), (ROWS, BLOCK_D), (ROWS,)
    scale = tl.full((ROWS,), 1.0, tl.float32)  # the rows are x * scale
    if tl.sum(tl.where(var <= FLT_MAX, 0, 1), axis=0) > 0:  # rare: a row's sums overflowed
        scale = tl.where(var <= FLT_MAX, 1.0, _inv_pow2_above(tl.max(tl.abs(x), axis=1)))
        mean, xc, var = _centre_rows(x * scale[:, None], mask, D)
    rstd = 1.0 / tl.sqrt(var + eps * scale * scale)  # (ROWS,) of the scaled rows
    # A constant row has xc = 0 exactly; eps * scale**2 may underflow to 0 on the scaled path,
    # so its rstd is 1/sqrt(eps) by definition rather than 1/sqrt(0).
    const = var == 0  # (ROWS,)
    y = xc * tl.where(const, 0.0, rstd)[:, None]  # (ROWS, BLOCK_D) xhat
    if HAS_W:
        y = y * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64[:, None] * D + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean / scale, mask=row_ok)  # exact: scale is a power of two
    tl.store(RSTD + rows, tl.where(const, 1.0 / tl.sqrt(eps), rstd * scale), mask=row_ok)


@triton.jit
def _block_stats(
    d,  # (BLOCK,) float32: values of one block, zero where not ok
    ok,  # (BLOCK,) bool: valid entries
    n,  # float32: number of valid entries
):
    """Mean and sum of squared deviations of one block, the reference's way: first-pass mean,
    then the correction pass."""
    m = tl.sum(d, axis=0) / n
    e = tl.where(ok, d - m, 0.0)
    corr = tl.sum(e, axis=0) / n
    e = tl.where(ok, e - corr, 0.0)
    return m + corr, tl.sum(e * e, axis=0)


@triton.jit
def _long_row_stats(
    x_row,  # *x.dtype: start of the row
    D,  # row length
    scale,  # float32 power of two: statistics of x * scale
    BLOCK: tl.constexpr,  # elements per loop step
):
    """shift, mean and M2 (sum of squared deviations) of x * scale, one pass over the row.

    Each block gets the reference's corrected two-pass treatment, on x * scale - shift with
    shift the mean of block 0 (so the running mean stays small, and its rounding error), and
    blocks are merged with Chan's formula:
        n = na + nb,  delta = mean_b - mean_a,
        mean = mean_a + delta * nb / n,  M2 = M2_a + M2_b + delta^2 * na * nb / n.
    """
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    ok = cols < D
    x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32) * scale  # (BLOCK,) block 0
    n = tl.minimum(D, BLOCK).to(tl.float32)
    shift = tl.sum(x, axis=0) / n
    mean, m2 = _block_stats(tl.where(ok, x - shift, 0.0), ok, n)
    for start in tl.range(BLOCK, D, BLOCK):
        ok = start + cols < D
        x = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32) * scale
        nb = tl.minimum(D - start, BLOCK).to(tl.float32)
        mean_b, m2_b = _block_stats(tl.where(ok, x - shift, 0.0), ok, nb)
        n_new = n + nb
        delta = mean_b - mean
        mean += delta * (nb / n_new)
        m2 += m2_b + delta * delta * (n / n_new * nb)
        n = n_new
    return shift, mean, m2


@triton.jit
def _long_row_absmax(
    x_row,  # *x.dtype: start of the row
    D,  # row length
    BLOCK: tl.constexpr,  # elements per loop step
):
    """max |x| over the row."""
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    big = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in tl.range(0, D, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < D, other=0.0).to(tl.float32)
        big = tl.maximum(big, tl.abs(x))
    return tl.max(big, axis=0)


@triton.jit
def _fwd_long_kernel(
    X,  # *x.dtype (M, D): input rows, row stride stride_x, unit column stride
    Y,  # *x.dtype (M, D) contiguous: output
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    B,  # *b.dtype (D,): bias, or None when HAS_B is False
    MEAN,  # *float32 (M,): output, the mean rounded to float32
    RSTD,  # *float32 (M,): output, 1 / sqrt(var + eps)
    stride_x,  # elements between consecutive rows of X
    D,  # row length
    eps,  # added to the variance
    HAS_W: tl.constexpr,  # weight present
    HAS_B: tl.constexpr,  # bias present
    BLOCK: tl.constexpr,  # elements per loop step
):
    # One program per row: one pass for the statistics, one to normalize.
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * D
    cols = tl.arange(0, BLOCK)  # (BLOCK,)

    scale = tl.full([], 1.0, tl.float32)  # the row is x * scale
    shift, mean, m2 = _long_row_stats(x_row, D, scale, BLOCK)
    if not m2 <= FLT_MAX:  # rare: the sums overflowed; two more passes
        scale = _inv_pow2_above(_long_row_absmax(x_row, D, BLOCK))
        shift, mean, m2 = _long_row_stats(x_row, D, scale, BLOCK)
    rstd = 1.0 / tl.sqrt(m2 / D + eps * scale * scale)
    const = m2 == 0  # a constant row: rstd is 1/sqrt(eps) even where eps * scale**2 underflows
    # The mean is shift + mean. Rounded to float32 it is mean_f32; corr is what the rounding
    # lost (shift - mean_f32 is exact when the two are within a factor of two, when it matters).
    mean_f32 = shift + mean
    corr = (shift - mean_f32) + mean
    tl.store(MEAN + row, mean_f32 / scale)  # exact: scale is a power of two
    tl.store(RSTD + row, tl.where(const, 1.0 / tl.sqrt(eps), rstd * scale))
    rstd = tl.where(const, 0.0, rstd)  # its centred values are exactly 0: y = beta

    for start in tl.range(0, D, BLOCK):
        ok = start + cols < D
        x = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32) * scale
        y = ((x - mean_f32) - corr) * rstd  # (BLOCK,) xhat
        if HAS_W:
            y = y * tl.load(W + start + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + start + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_row + start + cols, y.to(Y.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _bwd_short_kernel(
    X,  # *x.dtype (M, D): forward input, row stride stride_x, unit column stride
    DY,  # *dy.dtype (M, D): gradient of y, row stride stride_dy, unit column stride
    DX,  # *x.dtype (M, D) contiguous: output, gradient of x
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    MEAN,  # *float32 (M,): the forward's MEAN
    RSTD,  # *float32 (M,): the forward's RSTD
    DW_PART,  # *float32 (P, D): output, row p = this program's sum of dy * xhat
    DB_PART,  # *float32 (P, D): output, row p = this program's sum of dy
    stride_x,  # elements between consecutive rows of X
    stride_dy,  # elements between consecutive rows of DY
    M,  # number of rows
    D,  # row length
    HAS_W: tl.constexpr,  # weight present: compute dw partial sums
    HAS_B: tl.constexpr,  # bias present: compute db partial sums
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_D: tl.constexpr,  # power of two >= D: a whole row per tile row
):
    # Persistent: P programs; program p owns row tiles p, p + P, p + 2P, ... and keeps its share
    # of dw and db in float32 registers until the end.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    col_ok = cols < D
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]  # (1, BLOCK_D)
    acc_dw = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    acc_db = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    for tile in tl.range(pid, tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)  # (ROWS,)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]  # (ROWS, BLOCK_D)
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)  # (ROWS, BLOCK_D)
        dy = dy.to(tl.float32)  # (ROWS, BLOCK_D)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)  # (ROWS,)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)  # (ROWS,)

        u = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)  # (ROWS, BLOCK_D)
        xhat = tl.where(mask, u - (tl.sum(u, axis=1) / D)[:, None], 0.0)  # corrected
        if HAS_W:
            g = dy * w
        else:
            g = dy
        mean_g = tl.sum(g, axis=1) / D  # (ROWS,)
        mean_gxhat = tl.sum(g * xhat, axis=1) / D  # (ROWS,)
        dx = (g - mean_g[:, None] - xhat * mean_gxhat[:, None]) * rstd[:, None]
        tl.store(DX + rows64[:, None] * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_W:
            acc_dw += dy * xhat
        if HAS_B:
            acc_db += dy
    if HAS_W:
        tl.store(DW_PART + pid * D + cols, tl.sum(acc_dw, axis=0), mask=col_ok)
    if HAS_B:
        tl.store(DB_PART + pid * D + cols, tl.sum(acc_db, axis=0), mask=col_ok)


@triton.jit
def _bwd_long_rowstats_kernel(
    X,  # *x.dtype (M, D): forward input, row stride stride_x, unit column stride
    DY,  # *dy.dtype (M, D): gradient of y, row stride stride_dy, unit column stride
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    MEAN,  # *float32 (M,): the forward's MEAN
    RSTD,  # *float32 (M,): the forward's RSTD
    COEF,  # *float32 (3, M): output, per row mean(u), mean(g), mean(g * xhat)
    stride_x,  # elements between consecutive rows of X
    stride_dy,  # elements between consecutive rows of DY
    M,  # number of rows
    D,  # row length
    HAS_W: tl.constexpr,  # weight present
    BLOCK: tl.constexpr,  # elements per loop step
):
    # One program per long row, one pass over it for the three row reductions dx needs.
    # With u = (x - MEAN) * rstd and xhat = u - mean(u):
    #     sum(g * xhat) = sum(g * u) - mean(u) * sum(g).
    row = tl.program_id(0).to(tl.int64)
    mean = tl.load(MEAN + row)
    rstd = tl.load(RSTD + row)
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    sum_u = tl.zeros((BLOCK,), dtype=tl.float32)  # blocked sums: one lane per column mod BLOCK
    sum_g = tl.zeros((BLOCK,), dtype=tl.float32)
    sum_gu = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in tl.range(0, D, BLOCK):
        ok = start + cols < D
        x = tl.load(X + row * stride_x + start + cols, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(DY + row * stride_dy + start + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            g = g * tl.load(W + start + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.where(ok, (x - mean) * rstd, 0.0)  # (BLOCK,)
        sum_u += u
        sum_g += g
        sum_gu += g * u
    mean_u = tl.sum(sum_u, axis=0) / D
    total_g = tl.sum(sum_g, axis=0)
    tl.store(COEF + row, mean_u)
    tl.store(COEF + M + row, total_g / D)
    tl.store(COEF + 2 * M + row, (tl.sum(sum_gu, axis=0) - mean_u * total_g) / D)


@triton.jit
def _bwd_long_dx_kernel(
    X,  # *x.dtype (M, D): forward input, row stride stride_x, unit column stride
    DY,  # *dy.dtype (M, D): gradient of y, row stride stride_dy, unit column stride
    DX,  # *x.dtype (M, D) contiguous: output, gradient of x
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    MEAN,  # *float32 (M,): the forward's MEAN
    RSTD,  # *float32 (M,): the forward's RSTD
    COEF,  # *float32 (3, M): per row mean(u), mean(g), mean(g * xhat) from the row-stats kernel
    DW_PART,  # *float32 (P, D): output, row p = chunk p's sum of dy * xhat
    DB_PART,  # *float32 (P, D): output, row p = chunk p's sum of dy
    stride_x,  # elements between consecutive rows of X
    stride_dy,  # elements between consecutive rows of DY
    M,  # number of rows
    D,  # row length
    rows_per_chunk,  # rows owned by one program along axis 0
    HAS_W: tl.constexpr,  # weight present: compute dw partial sums
    HAS_B: tl.constexpr,  # bias present: compute db partial sums
    BLOCK: tl.constexpr,  # columns owned by one program along axis 1
):
    # Program (p, j) owns the rows of chunk p and the columns of block j: it writes their dx and
    # row p, block j of the partial sums.
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    ok = cols < D
    if HAS_W:
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)  # (BLOCK,)
    acc_dw = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_db = tl.zeros((BLOCK,), dtype=tl.float32)
    first = chunk.to(tl.int64) * rows_per_chunk  # int64: row offsets of large tensors
    for row in tl.range(first, tl.minimum(first + rows_per_chunk, M)):
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        mean_u = tl.load(COEF + row)
        mean_g = tl.load(COEF + M + row)
        mean_gxhat = tl.load(COEF + 2 * M + row)
        xhat = tl.where(ok, (x - mean) * rstd - mean_u, 0.0)  # (BLOCK,)
        if HAS_W:
            g = dy * w
        else:
            g = dy
        dx = (g - mean_g - xhat * mean_gxhat) * rstd
        tl.store(DX + row * D + cols, dx.to(DX.dtype.element_ty), mask=ok)
        if HAS_W:
            acc_dw += dy * xhat
        if HAS_B:
            acc_db += dy
    if HAS_W:
        tl.store(DW_PART + chunk * D + cols, acc_dw, mask=ok)
    if HAS_B:
        tl.store(DB_PART + chunk * D + cols, acc_db, mask=ok)


@triton.jit
def _sum_partials_kernel(
    DW_PART,  # *float32 (P, D): partial sums of dw, or None when HAS_W is False
    DB_PART,  # *float32 (P, D): partial sums of db, or None when HAS_B is False
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
    # rows, then one tree sum), so the result does not depend on scheduling.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    col_ok = cols < D
    if HAS_W:
        acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        for p0 in tl.range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
            mask = (p < P)[:, None] & col_ok[None, :]
            acc += tl.load(DW_PART + p[:, None] * D + cols[None, :], mask=mask, other=0.0)
        tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=col_ok)
    if HAS_B:
        acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        for p0 in tl.range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
            mask = (p < P)[:, None] & col_ok[None, :]
            acc += tl.load(DB_PART + p[:, None] * D + cols[None, :], mask=mask, other=0.0)
        tl.store(DB + cols, tl.sum(acc, axis=0).to(DB.dtype.element_ty), mask=col_ok)


# ---------------------------------------------------------------------------------------------
# Plans and launchers
# ---------------------------------------------------------------------------------------------

INTERPRET: bool = isinstance(_fwd_short_kernel, InterpretedFunction)
"""True when Triton runs kernels in its interpreter (TRITON_INTERPRET=1 at import), on CPU."""


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


def _num_warps(elements: int) -> int:
    # About 8 float32 values of each tile array per thread: one 16-byte load of 16-bit data.
    return max(1, min(32, elements // 256))


def plan(pass_: str, D: int) -> Plan:
    """The plan of ``pass_`` (``"fwd"`` or ``"bwd"``) for rows of length ``D``."""
    max_short = MAX_SHORT_D_FWD if pass_ == "fwd" else MAX_SHORT_D_BWD
    if D > max_short:
        return Plan(long=True, block=LONG_BLOCK, rows=1, num_warps=_num_warps(LONG_BLOCK))
    block = triton.next_power_of_2(D)
    rows = max(1, SHORT_TILE // block)
    return Plan(long=False, block=block, rows=rows, num_warps=_num_warps(rows * block))


@functools.cache
def _sm_count(device: torch.device) -> int:
    if INTERPRET:
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _partial_rows(limit: int, programs_per_row: int, M: int, itemsize: int,
                  device: torch.device) -> int:
    """Number P of row owners in the backward, so of float32 partial rows of dw and db.

    At most ``limit``. At least one program (P * ``programs_per_row`` in all) per SM, and up to
    PROGRAMS_PER_SM per SM while writing and re-reading the (P, D) partials of dw and db
    (16 * P * D bytes) stays within about 3% of the 3 * M * D * itemsize bytes the backward
    must move; small M gets parallelism at the price of a larger share of partial traffic.
    """
    sms = _sm_count(device)
    budget = (3 * M * itemsize) // (16 * 32)
    fill = triton.cdiv(sms, programs_per_row)
    most = triton.cdiv(PROGRAMS_PER_SM * sms, programs_per_row)
    return max(1, min(limit, max(fill, min(most, budget))))


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Launch on ``device``: Triton launches on the current CUDA device, not the tensors'."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def forward(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused forward over the rows of ``x``.

    Args:
        x: (M, D) float16/bfloat16/float32 with unit column stride (any row stride).
        weight, bias: (D,) contiguous, any of the three float dtypes, or None.
        eps: positive float added to the variance.

    Returns:
        y: (M, D) contiguous, x's dtype.
        mean: (M,) float32, the float32 mean the backward starts from.
        rstd: (M,) float32, 1 / sqrt(var + eps).
    """
    M, D = x.shape
    y = torch.empty((M, D), dtype=x.dtype, device=x.device)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    if M == 0:
        return y, mean, rstd
    p = plan("fwd", D)
    flags = {"HAS_W": weight is not None, "HAS_B": bias is not None}
    with _on_device(x.device):
        if p.long:
            _fwd_long_kernel[(M,)](
                x, y, weight, bias, mean, rstd, x.stride(0), D, eps,
                **flags, BLOCK=p.block, num_warps=p.num_warps,
            )
        else:
            _fwd_short_kernel[(triton.cdiv(M, p.rows),)](
                x, y, weight, bias, mean, rstd, x.stride(0), M, D, eps,
                **flags, ROWS=p.rows, BLOCK_D=p.block, num_warps=p.num_warps,
            )
    return y, mean, rstd


def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Fused backward: dx, and dw/db by the two-stage reduction.

    Args:
        dy: (M, D) with unit column stride (any row stride), any of the three float dtypes.
        x: (M, D) the forward's input, unit column stride.
        weight: (D,) contiguous or None; bias: (D,) or None (only its dtype is used).
        mean, rstd: (M,) float32 from :func:`forward`.

    Returns:
        dx: (M, D) contiguous, x's dtype.
        dw: (D,) in weight's dtype, or None without weight.
        db: (D,) in bias's dtype, or None without bias.
    """
    M, D = x.shape
    dev = x.device
    dx = torch.empty((M, D), dtype=x.dtype, device=dev)
    dw = None if weight is None else torch.empty(D, dtype=weight.dtype, device=dev)
    db = None if bias is None else torch.empty(D, dtype=bias.dtype, device=dev)
    if M == 0:
        return dx, None if dw is None else dw.zero_(), None if db is None else db.zero_()
    p = plan("bwd", D)
    has_w, has_b = weight is not None, bias is not None
    if p.long:  # P chunks of consecutive rows times col_blocks column blocks
        col_blocks = triton.cdiv(D, p.block)
        rows_per_chunk = triton.cdiv(M, _partial_rows(M, col_blocks, M, x.element_size(), dev))
        chunks = triton.cdiv(M, rows_per_chunk)
    else:  # P persistent programs, each owning every P-th tile of rows
        chunks = _partial_rows(triton.cdiv(M, p.rows), 1, M, x.element_size(), dev)
    dw_part = torch.empty((chunks, D), dtype=torch.float32, device=dev) if has_w else None
    db_part = torch.empty((chunks, D), dtype=torch.float32, device=dev) if has_b else None
    with _on_device(dev):
        if p.long:
            coef = torch.empty((3, M), dtype=torch.float32, device=dev)
            _bwd_long_rowstats_kernel[(M,)](
                x, dy, weight, mean, rstd, coef, x.stride(0), dy.stride(0), M, D,
                HAS_W=has_w, BLOCK=p.block, num_warps=p.num_warps,
            )
            _bwd_long_dx_kernel[(chunks, col_blocks)](
                x, dy, dx, weight, mean, rstd, coef, dw_part, db_part,
                x.stride(0), dy.stride(0), M, D, rows_per_chunk,
                HAS_W=has_w, HAS_B=has_b, BLOCK=p.block, num_warps=p.num_warps,
            )
        else:
            _bwd_short_kernel[(chunks,)](
                x, dy, dx, weight, mean, rstd, dw_part, db_part, x.stride(0), dy.stride(0), M, D,
                HAS_W=has_w, HAS_B=has_b, ROWS=p.rows, BLOCK_D=p.block, num_warps=p.num_warps,
            )
        if has_w or has_b:
            _sum_partials_kernel[(triton.cdiv(D, REDUCE_BLOCK_N),)](
                dw_part, db_part, dw, db, chunks, D,
                HAS_W=has_w, HAS_B=has_b, BLOCK_P=REDUCE_BLOCK_P, BLOCK_N=REDUCE_BLOCK_N,
                num_warps=REDUCE_NUM_WARPS,
            )
    return dx, dw, db
