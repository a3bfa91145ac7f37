"""The forward kernels of the family (:mod:`layernorm.gpu.kernels` states the maths): a tile of
whole rows held in registers (``_fwd_short_kernel``), or a row in blocks, its statistics merged
block by block before y is written (``_fwd_long_kernel``). Launched by :mod:`layernorm.gpu.launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .elements import (
    INF,
    _below_normal,
    _div,
    _load_scale,
    _pow2_scale,
    _residual_add,
    _rsqrt,
    _to,
)

__all__: list[str] = []


@triton.jit
def _moments(
    x,  # (ROWS, BLOCK_D) compute dtype, zero where not mask
    mask,  # (ROWS, BLOCK_D) valid entries
    n,  # D in the compute dtype
    CENTRED: tl.constexpr,  # LayerNorm: centre the rows
):
    """(ROWS,) mean, (ROWS, BLOCK_D) centred values, (ROWS,) var; uncentred (RMSNorm): 0, x
    and mean(x**2).

    The mean returned is m + c, the first-pass mean plus the mean of the centred values (its
    rounding error), which the correction removes from every centred value.
    """
    if CENTRED:
        m = _div(tl.sum(x, axis=1), n)  # (ROWS,)
        xc = tl.where(mask, x - m[:, None], 0.0)  # (ROWS, BLOCK_D)
        c = _div(tl.sum(xc, axis=1), n)  # (ROWS,) the rounding error of m
        xc = tl.where(mask, xc - c[:, None], 0.0)  # (ROWS, BLOCK_D)
        return m + c, xc, _div(tl.sum(xc * xc, axis=1), n)
    else:
        return tl.zeros((x.shape[0],), x.dtype), x, _div(tl.sum(x * x, axis=1), n)


@triton.jit
def _short_rows(
    X,  # *x.dtype (M, D): input rows, row stride stride_x, unit column stride
    R,  # *r.dtype (M, D): residual, row stride stride_r; None unless HAS_RESIDUAL
    H,  # *h.dtype (M, D) contiguous: output h = x + r; None unless HAS_RESIDUAL
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    B,  # *b.dtype (D,): bias, or None when HAS_B is False
    stride_x,  # elements between consecutive rows of X
    stride_r,  # elements between consecutive rows of R
    M,  # number of rows
    D,  # row length
    eps,  # float64: added to var, unrounded for float64
    CDT: tl.constexpr,  # the compute dtype
    CENTRED: tl.constexpr,  # LayerNorm, else RMSNorm
    HAS_RESIDUAL: tl.constexpr,  # add-norm: normalize h = x + r
    WIDE_ADD: tl.constexpr,  # the add computes in float64
    HAS_W: tl.constexpr,  # weight present
    HAS_B: tl.constexpr,  # bias present
    ZERO_CENTERED: tl.constexpr,  # scale = 1 + w
    ROWS: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # power of two >= D: a whole row per tile row
):
    """The tile of whole rows of this program: (rows64, row_ok, cols, mask, y, mean, rstd),
    y (ROWS, BLOCK_D) in CDT (zero where not mask), mean and rstd (ROWS,) as the forward
    stores them (h stored on the way for an add-norm)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    row_ok = rows < M  # (ROWS,)
    col_ok = cols < D  # (BLOCK_D,)
    mask = row_ok[:, None] & col_ok[None, :]  # (ROWS, BLOCK_D)
    rows64 = rows.to(tl.int64)  # offsets of large tensors overflow int32
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        h = _residual_add(x, r, H.dtype.element_ty, WIDE_ADD)  # (ROWS, BLOCK_D) rounded once
        tl.store(H + rows64[:, None] * D + cols[None, :], h, mask=mask)
        xn = h.to(CDT)  # (ROWS, BLOCK_D) the norm reads h as rounded
    else:
        xn = x.to(CDT)  # (ROWS, BLOCK_D)
    eps_t = (tl.zeros([], tl.float64) + eps).to(CDT)
    n = tl.zeros([], CDT) + D  # D in the compute dtype (D may be the constant 1)

    mean, xc, var = _moments(xn, mask, n, CENTRED)  # (ROWS,), (ROWS, BLOCK_D), (ROWS,)
    # Exact facts of each row: its largest magnitude, and whether it is constant. A NaN counts
    # as +inf in the maximum (the GPU's max ignores NaN, the interpreter's propagates it).
    if CENTRED:
        top = tl.max(tl.where(mask, tl.where(xn == xn, xn, INF), -INF), axis=1)  # (ROWS,)
        bot = tl.min(tl.where(mask, xn, INF), axis=1)  # (ROWS,)
        const = (top == bot) & (tl.abs(top) < INF)
        big = tl.maximum(tl.abs(top), tl.abs(bot))  # (ROWS,) max|xn|
    else:
        big = tl.max(tl.where(xn == xn, tl.abs(xn), INF), axis=1)  # (ROWS,) max|xn|
        const = big == 0.0
    scaled = row_ok & ~const & (~(var < INF) | _below_normal(var + eps_t))  # (ROWS,)
    s = tl.full((ROWS,), 1.0, CDT)  # the rows are xn * s
    eps_s = tl.zeros((ROWS,), CDT) + eps_t  # eps * s**2
    if tl.sum(scaled.to(tl.int32), axis=0) > 0:  # rare: recompute those rows as xn * s
        s = tl.where(scaled, _pow2_scale(big), 1.0)
        mean_s, xc_s, var_s = _moments(xn * s[:, None], mask, n, CENTRED)
        mean = tl.where(scaled, mean_s, mean)
        xc = tl.where(scaled[:, None], xc_s, xc)
        var = tl.where(scaled, var_s, var)
        eps_s = tl.where(scaled, eps_t * s * s, eps_s)
    rstd = _rsqrt(var + eps_s)  # (ROWS,)
    y = tl.where(const[:, None], 0.0, xc * rstd[:, None])  # (ROWS, BLOCK_D) xhat
    if HAS_W:
        y = y * _load_scale(W, cols, col_ok, CDT, ZERO_CENTERED)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(CDT)[None, :]
    if CENTRED:
        mean = tl.where(const, top, mean)  # the row's value, exactly
    rstd = tl.where(const, _rsqrt(eps_t), tl.where(scaled, -rstd, rstd))
    return rows64, row_ok, cols, mask, y, mean, rstd


@triton.jit
def _fwd_short_kernel(
    X,  # *x.dtype (M, D): input rows, row stride stride_x, unit column stride
    R,  # *r.dtype (M, D): residual, row stride stride_r; None unless HAS_RESIDUAL
    H,  # *h.dtype (M, D) contiguous: output h = x + r; None unless HAS_RESIDUAL
    Y,  # *x.dtype (M, D) contiguous: output
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    B,  # *b.dtype (D,): bias, or None when HAS_B is False
    MEAN,  # *T (M,): output, MEAN (0 for RMSNorm); T, the compute dtype, is MEAN's dtype
    RSTD,  # *T (M,): output, RSTD (negated on rescaled rows)
    stride_x,  # elements between consecutive rows of X
    stride_r,  # elements between consecutive rows of R
    M,  # number of rows
    D,  # row length
    eps: "fp64",  # noqa: F821, UP037 (Triton type string) added to var, unrounded for float64
    CENTRED: tl.constexpr,  # LayerNorm, else RMSNorm
    HAS_RESIDUAL: tl.constexpr,  # add-norm: normalize h = x + r
    WIDE_ADD: tl.constexpr,  # the add computes in float64
    HAS_W: tl.constexpr,  # weight present
    HAS_B: tl.constexpr,  # bias present
    ZERO_CENTERED: tl.constexpr,  # scale = 1 + w
    ROWS: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # power of two >= D: a whole row per tile row
):
    CDT: tl.constexpr = MEAN.dtype.element_ty
    rows64, row_ok, cols, mask, y, mean, rstd = _short_rows(
        X, R, H, W, B, stride_x, stride_r, M, D, eps, CDT, CENTRED, HAS_RESIDUAL, WIDE_ADD,
        HAS_W, HAS_B, ZERO_CENTERED, ROWS, BLOCK_D)
    tl.store(Y + rows64[:, None] * D + cols[None, :], _to(y, Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows64, mean, mask=row_ok)
    tl.store(RSTD + rows64, rstd, mask=row_ok)


@triton.jit
def _load_xn(
    x_ptrs,  # pointers into the row of x (of h when not HAS_RESIDUAL and reading it back)
    r_ptrs,  # pointers into the row of the residual
    h_ptrs,  # pointers into the row of h, written here when HAS_RESIDUAL
    ok,  # valid entries
    CDT: tl.constexpr,  # compute dtype
    HAS_RESIDUAL: tl.constexpr,  # form h = x + r, store it, return it
    WIDE_ADD: tl.constexpr,  # the add computes in float64
):
    """A block of the normalized row in the compute dtype: x, or h = x + r (stored)."""
    x = tl.load(x_ptrs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        h = _residual_add(x, tl.load(r_ptrs, mask=ok, other=0.0), h_ptrs.dtype.element_ty,
                          WIDE_ADD)
        tl.store(h_ptrs, h, mask=ok)
        return h.to(CDT)
    else:
        return x.to(CDT)


@triton.jit
def _block_stats(
    d,  # (BLOCK,) values of one block, zero where not ok
    ok,  # (BLOCK,) valid entries
    n,  # number of valid entries, compute dtype
):
    """Mean and sum of squared deviations of one block, the reference's way: first-pass mean,
    then the correction pass."""
    m = _div(tl.sum(d, axis=0), n)
    e = tl.where(ok, d - m, 0.0)
    c = _div(tl.sum(e, axis=0), n)
    e = tl.where(ok, e - c, 0.0)
    return m + c, tl.sum(e * e, axis=0)


@triton.jit
def _long_row_stats(
    x_row,  # *: start of the row of x (of h, when reading h back)
    r_row,  # *: start of the row of the residual (HAS_RESIDUAL)
    h_row,  # *: start of the row of h, written here (HAS_RESIDUAL)
    D,  # row length
    scale,  # power of two: statistics of xn * scale
    CDT: tl.constexpr,  # compute dtype
    CENTRED: tl.constexpr,  # LayerNorm statistics, else the sum of squares
    HAS_RESIDUAL: tl.constexpr,  # form and store h on the way
    WIDE_ADD: tl.constexpr,  # the add computes in float64
    BLOCK: tl.constexpr,  # elements per loop step
):
    """One pass over a long row xn: (shift, mean, m2, top, bot).

    LayerNorm: mean and m2 (sum of squared deviations) of xn * scale - shift, shift the mean of
    block 0 (so the running mean stays small, and its rounding error); each block gets the
    corrected two-pass treatment and blocks merge with Chan's formula
        n = na + nb,  delta = mean_b - mean_a,
        mean = mean_a + delta * nb / n,  M2 = M2_a + M2_b + delta^2 * na * nb / n.
    RMSNorm: shift = mean = 0, m2 = sum of (xn * scale)^2 (blocked).
    top and bot: max and min of xn (NaN as +inf in the max); RMSNorm: top = max|xn|.
    """
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    ok = cols < D
    xn = _load_xn(x_row + cols, r_row + cols, h_row + cols, ok, CDT, HAS_RESIDUAL, WIDE_ADD)
    if CENTRED:
        top = tl.where(ok, tl.where(xn == xn, xn, INF), -INF)  # (BLOCK,) running max
        bot = tl.where(ok, xn, INF)  # (BLOCK,) running min
        xs = xn * scale
        n = tl.minimum(D, BLOCK).to(CDT)
        shift = _div(tl.sum(xs, axis=0), n)
        mean, m2 = _block_stats(tl.where(ok, xs - shift, 0.0), ok, n)
    else:
        top = tl.where(xn == xn, tl.abs(xn), INF)  # (BLOCK,) running max|xn|
        bot = top
        sq = (xn * scale) * (xn * scale)  # (BLOCK,) blocked sum of squares
    for start in tl.range(BLOCK, D, BLOCK):
        ok = start + cols < D
        xn = _load_xn(x_row + start + cols, r_row + start + cols, h_row + start + cols, ok, CDT,
                      HAS_RESIDUAL, WIDE_ADD)
        if CENTRED:
            top = tl.maximum(top, tl.where(ok, tl.where(xn == xn, xn, INF), -INF))
            bot = tl.minimum(bot, tl.where(ok, xn, INF))
            nb = tl.minimum(D - start, BLOCK).to(CDT)
            mean_b, m2_b = _block_stats(tl.where(ok, xn * scale - shift, 0.0), ok, nb)
            n_new = n + nb
            delta = mean_b - mean
            mean += delta * _div(nb, n_new)
            m2 += m2_b + delta * delta * (_div(n, n_new) * nb)
            n = n_new
        else:
            top = tl.maximum(top, tl.where(xn == xn, tl.abs(xn), INF))
            sq += (xn * scale) * (xn * scale)
    if CENTRED:
        return shift, mean, m2, tl.max(top, axis=0), tl.min(bot, axis=0)
    else:
        zero = tl.zeros([], CDT)
        big = tl.max(top, axis=0)
        return zero, zero, tl.sum(sq, axis=0), big, big


@triton.jit
def _fwd_long_kernel(
    X,  # *x.dtype (M, D): input rows, row stride stride_x, unit column stride
    R,  # *r.dtype (M, D): residual, row stride stride_r; None unless HAS_RESIDUAL
    H,  # *h.dtype (M, D) contiguous: output h = x + r; None unless HAS_RESIDUAL
    Y,  # *x.dtype (M, D) contiguous: output
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    B,  # *b.dtype (D,): bias, or None when HAS_B is False
    MEAN,  # *T (M,): output, MEAN (0 for RMSNorm); T, the compute dtype, is MEAN's dtype
    RSTD,  # *T (M,): output, RSTD (negated on rescaled rows)
    stride_x,  # elements between consecutive rows of X
    stride_r,  # elements between consecutive rows of R
    D,  # row length
    eps: "fp64",  # noqa: F821, UP037 (Triton type string) added to var, unrounded for float64
    CENTRED: tl.constexpr,  # LayerNorm, else RMSNorm
    HAS_RESIDUAL: tl.constexpr,  # add-norm: normalize h = x + r
    WIDE_ADD: tl.constexpr,  # the add computes in float64
    HAS_W: tl.constexpr,  # weight present
    HAS_B: tl.constexpr,  # bias present
    ZERO_CENTERED: tl.constexpr,  # scale = 1 + w
    BLOCK: tl.constexpr,  # elements per loop step
):
    # One program per row: one pass for the statistics (forming and storing h for add-norms),
    # one to normalize (reading h back).
    CDT: tl.constexpr = MEAN.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    if HAS_RESIDUAL:
        r_row = R + row * stride_r
        h_row = H + row * D
        xn_row = h_row
    else:
        r_row = x_row
        h_row = x_row
        xn_row = x_row
    y_row = Y + row * D
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    eps_t = (tl.zeros([], tl.float64) + eps).to(CDT)
    n = tl.zeros([], CDT) + D  # D in the compute dtype (D may be the constant 1)

    s = tl.full([], 1.0, CDT)  # the row is xn * s
    shift, mean, m2, top, bot = _long_row_stats(x_row, r_row, h_row, D, s, CDT, CENTRED,
                                                HAS_RESIDUAL, WIDE_ADD, BLOCK)
    var = _div(m2, n)
    if CENTRED:
        const = (top == bot) & (tl.abs(top) < INF)
        big = tl.maximum(tl.abs(top), tl.abs(bot))  # max|xn|
    else:
        const = top == 0.0
        big = top
    scaled = ~const & (~(var < INF) | _below_normal(var + eps_t))
    eps_s = eps_t  # eps * s**2
    if scaled:  # rare: one more pass, on xn * s
        if HAS_RESIDUAL:
            tl.debug_barrier()  # h, stored by every thread, is read back
        s = _pow2_scale(big)
        shift, mean, m2, _, _ = _long_row_stats(xn_row, xn_row, xn_row, D, s, CDT, CENTRED,
                                                False, WIDE_ADD, BLOCK)
        var = _div(m2, n)
        eps_s = eps_t * s * s
    rstd = _rsqrt(var + eps_s)
    # The mean is shift + mean. Rounded it is hi; lo is what the rounding lost (shift - hi is
    # exact when the two are within a factor of two, when it matters). A constant row's mean
    # is its value, exactly, so its centred values are exactly 0.
    hi = shift + mean
    lo = (shift - hi) + mean
    if CENTRED:
        hi = tl.where(const, top, hi)
        lo = tl.where(const, 0.0, lo)
    tl.store(MEAN + row, hi)
    tl.store(RSTD + row, tl.where(const, _rsqrt(eps_t), tl.where(scaled, -rstd, rstd)))
    rstd = tl.where(const, 0.0, rstd)  # xhat = 0 on a constant row (and never 0 * inf)

    if HAS_RESIDUAL:
        tl.debug_barrier()  # h, stored by every thread, is read back
    for start in tl.range(0, D, BLOCK):
        ok = start + cols < D
        xn = tl.load(xn_row + start + cols, mask=ok, other=0.0).to(CDT) * s
        if CENTRED:
            y = ((xn - hi) - lo) * rstd  # (BLOCK,) xhat
        else:
            y = xn * rstd  # (BLOCK,) xhat
        if HAS_W:
            y = y * _load_scale(W, start + cols, ok, CDT, ZERO_CENTERED)
        if HAS_B:
            y = y + tl.load(B + start + cols, mask=ok, other=0.0).to(CDT)
        tl.store(y_row + start + cols, _to(y, Y.dtype.element_ty), mask=ok)
