r"""Fused CPU kernels for layer normalization (Numba): one parallel pass over rows each way.

Same maths, signatures and results as :mod:`layernorm.reference`; only the cache differs.
For one row of length D, with T the compute dtype (float32, or float64 for float64 input):

Forward, three sweeps over a row that stays in L1/L2 after the first (x is read from memory
once, y written once):

    A   m0   = T(sum_j x_j / D)                          rough mean, rounded to T
    B   s1   = sum_j (x_j - m0),   s2 = sum_j (x_j - m0)^2
        c    = s1 / D                                    the rounding error of m0
        hi + lo = m0 + c       (two T numbers: the corrected mean, unevaluated)
        var  = s2 / D - c^2    (= mean((x - m0 - c)^2), the variance of the corrected centring)
        rstd = 1 / sqrt(var + eps)
    C   xhat_j = ((x_j - hi) - lo) * rstd,   y_j = gamma_j * xhat_j + beta_j

where m0 + c is formed exactly (two-sum in float64) and split into hi = T(m0 + c) and lo, the
rest, so the centring keeps the corrected mean's accuracy in float32 and in float64 alike (a
float64 mean rounded to one number would lose c, which is below its ulp). This is the
reference's accuracy mechanism (two passes, then one correction pass that subtracts the mean
of the centred values) folded into scalars: the correction c is the mean of the centred
values, and subtracting it from every centred value is the same as centring on m0 + c.

Backward, two sweeps; with t_j = x_j - hi and u_j = dy_j * gamma_j (u = dy without gamma):

    1   su = sum_j u_j,   sut = sum_j u_j * t_j
        mean(g) = su / D,   mean(g * xhat) = rstd * (sut - lo * su) / D
    2   xhat_j = (t_j - lo) * rstd
        dx_j = rstd * ((u_j - mean(g)) - xhat_j * mean(g * xhat))
        dgamma_j += dy_j * xhat_j,   dbeta_j += dy_j        (partial sums, see below)

dx keeps the reference's form: expanding it into rstd * u_j + a * t_j + b saves two operations
but leaves an error of an ulp of rstd * |u| where the reference has an ulp of |u - mean(g)| (for
D = 1, exactly zero against 2e-5 * |u| with eps = 1e-5).

The cache holds what makes that backward cheapest: per row hi, lo, rstd and a scale (float64,
32 bytes a row; the scale is 1 except on rows whose sums overflow, below), a copy of gamma (D
elements: the backward differentiates the forward that ran, whatever happens to the caller's
gamma), and a reference to x itself (no copy when x is already a C-contiguous float32 or
float64 array). The backward recomputes xhat from x on the fly, so it reads x and dy and
writes dx: the minimal 3·M·D·itemsize bytes. **x must not be modified between the forward and the
backward**, exactly as PyTorch's saved tensors. (The reference keeps its own xhat instead.)

Summation order and determinism. Every row sum above accumulates in blocks of BLOCK elements
in T, each block total added to a float64 scalar. Inside a block the sum is vectorised by LLVM
with ``fastmath={"reassoc"}`` applied to the reduction helpers only: with 256-bit vectors the
vectoriser keeps 4 x 8 = 32 independent float32 lanes, adds them in a fixed tree at the end of
the block, then adds the block's remainder (4 lanes, then one by one). The order is fixed by the
compiled code and D, not by the data's address or the thread schedule: results are
bit-identical run to run, at any alignment and for any thread count on one machine (tests check
all three), but a CPU with other vector widths may round differently in the last place.
An explicit fixed-order lane accumulator (LANES partial sums in a small array, the same order
on every machine) was measured against this choice, on a 768-element float32 row in L1
(1 thread, ns per element): sequential float64 sum 0.58, explicit 64-lane float64 accumulator
0.16, explicit 64-lane float32 accumulator 0.09, LLVM's reassociated block sum 0.026-0.05 (Numba
turns off LLVM's SLP vectoriser, so explicit lanes stay in memory). In the whole forward on
(4096, 768) that was 58-61% of copy bandwidth with explicit lanes against 70% with the
reassociated sums (before prefetching). Speed won: the order is fixed per machine, not across
machines. Each float32 lane sums at most 32 terms of a block before the float64 total, so the
error stays at a few float32 ulps of the block's sum of magnitudes.

dgamma and dbeta: rows are split into ``n_chunks(M)`` chunks, fixed by M alone (a power of two,
at most MAX_CHUNKS, at least ROWS_PER_CHUNK rows each), never by the thread count. Each chunk
adds its rows in order into float64 partials (the products dy * xhat rounded to T first, as in
the reference), and the partials are added chunk 0, 1, ... in a final pass: no atomics, no
locks, bit-identical across thread counts. A chunk's rows go TILE = 4 at a time: sweep 1 for
the four rows, then one second sweep over the four, each column's partials loaded once, given
the four rows' terms in row order and stored once (the same additions in the same order as row
by row, so the same bits; a chunk's last M % 4 rows, and tiles with a non-finite row, go row
by row). Measured (backward alone, medians of 7 interleaved rounds, 1 thread, float32): no
change on (4096, 768), whose partials stay in L1 anyway; 5% faster on (4096, 4096); 1.5x on
(64, 65536), whose 1 MB of partials per chunk went out to L3 every row (2 threads: 1.08x,
1.05x, 1.4x). Prefetching the next tile's rows in the second sweep measured 6-19% slower on
all three, so the tiled sweep leaves it to the hardware prefetcher. The float64 accumulation
stays the backward's main cost: LLVM vectorises the second sweep 4 lanes wide (the width of
float64 in 256-bit vectors), so its float32 arithmetic runs at half width; without it the
backward measured 1.6x faster on (4096, 768). Splitting the sweep into a full-width float32
loop (dx and the products into an L1 scratch) and a float64 loop measured 9-17% slower.
Summing the tile's terms in float32 before the float64 partials measured 1.1x faster on
(4096, 768) (1.03x on the others), but earlier 8-row float32 groups gave a dbeta error at M =
4096 of 0.4 of the float32 tolerance against 0.01 here, and at M = 16384 beyond it (1.02):
float64 row by row it is. Over 10^6 rows of (10^6, 8) float32 the result is within 1.1e-7
(dgamma) and 2.2e-8 (dbeta) of an fsum over float64 products, relative norm-wise (tested).

Memory. The output sweep of each row prefetches (``prefetcht1``) the next row's x (the
backward's row-by-row path also its dy; its tiles do not, see above), span by span, so the
memory system works while the core sweeps the current row in cache. Measured here (with the
backward still row by row): 3-4% faster on (4096, 768), 20% on the backward of (4096, 4096),
but 9% slower on the backward of (64, 65536), whose 256 KB rows it partly evicts from L2
(prefetching into L1, or only the first 32 KB of a row, measured no better within the noise).
Reuse outputs (``out=``, or :class:`LayerNorm`, which keeps its buffers): a fresh output over
32 MB is mmapped and page-faulted on every call, which alone costs 1.3-3.5x. A call also costs about
60 us besides the arithmetic (argument checks and dispatch, run with the interpreter's data
evicted from the caches by the previous kernel), against about 33 us for PyTorch's
``layer_norm``: 5-10% of a forward on (4096, 768).

FMA. The forward's output sweep is compiled with ``fastmath={"contract"}``: xhat = (x - hi) *
rstd + (-lo * rstd) and y = xhat * gamma + beta become fused multiply-adds (one rounding each,
fixed by the compiled code). The backward's is not: fusing dy * gamma - mean(g) would subtract
mean(g), a sum of rounded products, from an unrounded product (for D = 1, dx would not be 0).

float16 and bfloat16 inputs are converted to float32 with NumPy at the boundary and the
results converted back; Numba has no half-precision type on the CPU. The conversions are
single-threaded NumPy passes and dominate the time (see ``layernorm bench --dtype float16``).

Kernels are compiled on first use for each compute dtype and cached on disk (``cache=True``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import reference
from ._validate import (
    Region,
    as_float_array,
    check_dy,
    check_eps,
    check_out,
    check_param,
    check_x,
    overlaps,
    region,
)
from .dtypes import compute_dtype

try:
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError as exc:  # pragma: no cover - exercised only without numba
    raise ImportError(
        "layernorm.cpu needs numba: install the `fast` extra, pip install 'layernorm[fast]'"
    ) from exc

__all__ = [
    "CpuLayerNormCache",
    "LayerNorm",
    "copy",
    "layer_norm_backward",
    "layer_norm_forward",
    "n_chunks",
]

BLOCK = 1024  # elements summed in T before the block total joins a float64 sum
SPAN = 256  # elements of the output sweep between prefetch bursts (16 cache lines of float32)
LINE_BYTES = 64  # cache line; prefetches are issued one per line
ROWS_PER_CHUNK = 32  # fewest rows in a backward chunk
MAX_CHUNKS = 16  # most chunks: float64 partial traffic stays ~1% of the bytes for M >= 4096
TILE = 4  # rows of a backward tile: its dgamma/dbeta terms join the float64 partials together


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Prefetch the cache line holding ``arr[idx]`` (a hint: never faults)."""
    if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]],
                                       wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch.p0i8")
        # read (0), locality 2 (prefetcht1: L2 and outward), data cache (1)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(2), i32(1)])
        return context.get_dummy_value()

    return types.none(arr, idx), codegen


@njit(cache=True)
def _prefetch_span(row, j0, j1):
    """Prefetch the lines of ``row[j0:j1]`` (row: (D,))."""
    step = max(1, LINE_BYTES // row.itemsize)
    for k in range(j0, j1, step):
        _prefetch(row, k)


# Reductions. Loops index views from 0 (``blk[j]``, j in range(n)) so Numba can prove the
# index non-negative and drop its negative-index wraparound, which blocks vectorisation.


@njit(fastmath={"reassoc"}, cache=True)
def _sum(row):
    """sum_j row_j: T sums of BLOCK elements added in float64 (row: (D,) T)."""
    s = 0.0
    for j0 in range(0, row.shape[0], BLOCK):
        blk = row[j0:j0 + BLOCK]  # (<= BLOCK,)
        b = blk.dtype.type(0.0)
        for j in range(blk.shape[0]):
            b += blk[j]
        s += b
    return s


@njit(fastmath={"reassoc"}, cache=True)
def _sum_centred(row, m0):
    """(sum_j d_j, sum_j d_j^2) with d = row - m0 computed in T (row: (D,) T; m0: T)."""
    s1 = 0.0
    s2 = 0.0
    for j0 in range(0, row.shape[0], BLOCK):
        blk = row[j0:j0 + BLOCK]  # (<= BLOCK,)
        b1 = blk.dtype.type(0.0)
        b2 = blk.dtype.type(0.0)
        for j in range(blk.shape[0]):
            d = blk[j] - m0
            b1 += d
            b2 += d * d
        s1 += b1
        s2 += b2
    return s1, s2


@njit(fastmath={"reassoc"}, cache=True)
def _sum_grad(xr, dyr, gamma, hi):
    """(sum_j u_j, sum_j u_j (x_j - hi)) with u = dy * gamma (xr, dyr, gamma: (D,) T)."""
    s1 = 0.0
    s2 = 0.0
    for j0 in range(0, xr.shape[0], BLOCK):
        xb = xr[j0:j0 + BLOCK]  # (<= BLOCK,)
        db = dyr[j0:j0 + BLOCK]  # (<= BLOCK,)
        gb = gamma[j0:j0 + BLOCK]  # (<= BLOCK,)
        b1 = xb.dtype.type(0.0)
        b2 = xb.dtype.type(0.0)
        for j in range(xb.shape[0]):
            u = db[j] * gb[j]
            b1 += u
            b2 += u * (xb[j] - hi)
        s1 += b1
        s2 += b2
    return s1, s2


# Element-wise sweeps, SPAN elements at a time, prefetching the next row's matching lines.


@njit(fastmath={"contract"}, cache=True)
def _write_y(xr, hi, lo, rc, gamma, beta, yr, nxt):
    """y = xhat * gamma + beta, xhat = (x - hi) * rstd - lo * rstd (all (D,) T).

    Prefetches the next row ``nxt`` (D,).
    """
    D = xr.shape[0]
    nlr = -lo * rc
    for j0 in range(0, D, SPAN):
        xb = xr[j0:j0 + SPAN]  # (<= SPAN,)
        gb = gamma[j0:j0 + SPAN]
        bb = beta[j0:j0 + SPAN]
        yb = yr[j0:j0 + SPAN]
        for j in range(xb.shape[0]):
            yb[j] = ((xb[j] - hi) * rc + nlr) * gb[j] + bb[j]
        _prefetch_span(nxt, j0, min(D, j0 + SPAN))


@njit(cache=True)
def _write_dx(xr, dyr, gamma, hi, lo, rc, mg, mgx, dxr, pg, pb, nx, ndy):
    """dx = rstd * ((u - mean_g) - xhat * mean_gxhat); pg += dy * xhat; pb += dy.

    xr, dyr, gamma, dxr: (D,) T; pg, pb: (D,) float64. Prefetches the next row's x and dy
    (``nx``, ``ndy``: (D,)). No FMA contraction here: fusing dy * gamma - mean_g would use
    the unrounded product where mean_g summed the rounded one (for D = 1, dx != 0).
    """
    D = xr.shape[0]
    for j0 in range(0, D, SPAN):
        xb = xr[j0:j0 + SPAN]  # (<= SPAN,)
        db = dyr[j0:j0 + SPAN]
        gb = gamma[j0:j0 + SPAN]
        ob = dxr[j0:j0 + SPAN]
        pgb = pg[j0:j0 + SPAN]
        pbb = pb[j0:j0 + SPAN]
        for j in range(xb.shape[0]):
            xhat = ((xb[j] - hi) - lo) * rc
            ob[j] = rc * ((db[j] * gb[j] - mg) - xhat * mgx)
            pgb[j] += db[j] * xhat  # the product rounded to T, as in the reference
            pbb[j] += db[j]
        _prefetch_span(nx, j0, min(D, j0 + SPAN))
        _prefetch_span(ndy, j0, min(D, j0 + SPAN))


@njit(cache=True)
def _write_dx_tile(xt, dyt, gamma, st, dxt, pg, pb):
    """dx for TILE rows at once, and their dgamma/dbeta terms added to pg, pb row by row.

    xt, dyt, dxt: (TILE, D) T; gamma: (D,) T; st: (TILE, 5) T, per row (hi, lo, rstd, mean_g,
    mean_gxhat); pg, pb: (D,) float64. Each partial is loaded once, gets the TILE rows' terms
    added in row order (the same additions, in the same order, as TILE calls of _write_dx) and
    is stored once. The rows are unrolled by hand so that LLVM vectorises over j.
    """
    D = xt.shape[1]
    h0, l0, r0, g0, q0 = st[0, 0], st[0, 1], st[0, 2], st[0, 3], st[0, 4]
    h1, l1, r1, g1, q1 = st[1, 0], st[1, 1], st[1, 2], st[1, 3], st[1, 4]
    h2, l2, r2, g2, q2 = st[2, 0], st[2, 1], st[2, 2], st[2, 3], st[2, 4]
    h3, l3, r3, g3, q3 = st[3, 0], st[3, 1], st[3, 2], st[3, 3], st[3, 4]
    for j0 in range(0, D, SPAN):
        j1 = min(D, j0 + SPAN)
        a0, a1, a2, a3 = xt[0, j0:j1], xt[1, j0:j1], xt[2, j0:j1], xt[3, j0:j1]  # (<= SPAN,)
        b0, b1, b2, b3 = dyt[0, j0:j1], dyt[1, j0:j1], dyt[2, j0:j1], dyt[3, j0:j1]
        c0, c1, c2, c3 = dxt[0, j0:j1], dxt[1, j0:j1], dxt[2, j0:j1], dxt[3, j0:j1]
        gb = gamma[j0:j1]
        pgb = pg[j0:j1]
        pbb = pb[j0:j1]
        for j in range(a0.shape[0]):
            g = gb[j]
            sg = pgb[j]
            sb = pbb[j]
            xhat = ((a0[j] - h0) - l0) * r0
            c0[j] = r0 * ((b0[j] * g - g0) - xhat * q0)
            sg += b0[j] * xhat  # the product rounded to T, as in _write_dx
            sb += b0[j]
            xhat = ((a1[j] - h1) - l1) * r1
            c1[j] = r1 * ((b1[j] * g - g1) - xhat * q1)
            sg += b1[j] * xhat
            sb += b1[j]
            xhat = ((a2[j] - h2) - l2) * r2
            c2[j] = r2 * ((b2[j] * g - g2) - xhat * q2)
            sg += b2[j] * xhat
            sb += b2[j]
            xhat = ((a3[j] - h3) - l3) * r3
            c3[j] = r3 * ((b3[j] * g - g3) - xhat * q3)
            sg += b3[j] * xhat
            sb += b3[j]
            pgb[j] = sg
            pbb[j] = sb


# Per-row statistics, one row of ``stats`` (M, NSTATS) float64 per row of x: the mean as an
# unevaluated sum HI + LO of two T numbers (so that centring keeps the corrected mean's accuracy
# in float64 as in float32), RSTD, and SCALE, the power of two the row was scaled by before
# its statistics were taken (1 for every row but those whose T sums overflow, see below).
HI, LO, RSTD, SCALE = 0, 1, 2, 3
NSTATS = 4


@njit(cache=True)
def _split_mean(m0, c, T):
    """(hi, lo), two T numbers with hi + lo = m0 + c to about u_T**2 (m0, c: float64).

    m0 + c is formed exactly as s + err (Knuth's two-sum) before rounding to T: for float64
    T, rounding m0 + c to one float64 would lose the correction c, which is below an ulp of m0.
    """
    s = m0 + c
    bb = s - m0
    err = (m0 - (s - bb)) + (c - bb)
    hi = T(s)
    return hi, T((s - hi) + err)


@njit(cache=True)
def _row_stats(xr, eps):
    """(hi, lo, rstd) of one row (xr: (D,)), corrected two-pass with blocked sums."""
    D = xr.shape[0]
    T = xr.dtype.type
    m0 = T(_sum(xr) / D)
    s1, s2 = _sum_centred(xr, m0)
    c = s1 / D
    var = max(s2 / D - c * c, 0.0)  # a variance: rounding must not take it below 0
    hi, lo = _split_mean(np.float64(m0), c, T)
    return hi, lo, 1.0 / np.sqrt(var + eps), np.isfinite(m0 + c) and np.isfinite(var)


# Rows whose T sums overflow (|x - mean| above ~1.8e19/sqrt(D) in float32, ~1.3e154/sqrt(D)
# in float64), or hold inf or NaN, are normalized as xs = x * 2**-e in float64, max|xs| < 1,
# with eps * 4**-e: a power-of-two scaling is exact and leaves xhat unchanged. Their statistics
# (HI, LO, RSTD) belong to xs, and xhat = ((x * SCALE - HI) - LO) * RSTD; the true rstd is
# RSTD * SCALE. Constant rows are caught first: xhat = 0 exactly and rstd = 1/sqrt(eps),
# whatever the scale, so they keep SCALE = 1 and the T paths. Other rows pay one isfinite test.


@njit(cache=True)
def _scaled_row(xr, scale):
    """x * scale as a new float64 row (exact for a power of two, unless it underflows)."""
    xs = np.empty(xr.shape[0])
    for j in range(xr.shape[0]):
        xs[j] = np.float64(xr[j]) * scale
    return xs


@njit(cache=True)
def _scaled_stats(xr, eps, stats):
    """Fill ``stats`` (NSTATS,) for a row whose T sums overflow (xr: (D,) T); return the
    scaled row (D,) float64, or an empty row for a constant row (it keeps the T paths)."""
    x0 = np.float64(xr[0])
    amax = 0.0
    constant = True
    for j in range(xr.shape[0]):
        v = np.float64(xr[j])
        amax = max(amax, abs(v))
        constant = constant and v == x0
    if constant and np.isfinite(x0):
        stats[HI], stats[LO], stats[RSTD], stats[SCALE] = x0, 0.0, 1.0 / math.sqrt(eps), 1.0
        return np.empty(0)
    e = math.frexp(amax)[1] if np.isfinite(amax) else 0
    scale = math.ldexp(1.0, -e)
    xs = _scaled_row(xr, scale)
    hi, lo, r, _ = _row_stats(xs, math.ldexp(eps, -2 * e))
    stats[HI], stats[LO], stats[RSTD], stats[SCALE] = hi, lo, r, scale
    return xs


@njit(parallel=True, cache=True)
def _forward_kernel(x, gamma, beta, eps, y, stats):
    """Fill y (M, D) T and stats (M, NSTATS) float64 from x (M, D) T.

    gamma, beta: (D,) T (ones and zeros stand in for absent parameters).
    """
    M = x.shape[0]
    T = x.dtype.type
    for i in prange(M):
        xr = x[i]  # (D,)
        st = stats[i]  # (NSTATS,)
        hi, lo, r, finite = _row_stats(xr, eps)
        if finite:
            st[HI], st[LO], st[RSTD], st[SCALE] = hi, lo, r, 1.0
            _write_y(xr, T(hi), T(lo), T(r), gamma, beta, y[i], x[min(i + 1, M - 1)])
            continue
        xs = _scaled_stats(xr, eps, st)
        if xs.shape[0] == 0:  # constant row: xhat = 0
            _write_y(xr, T(st[HI]), T(0.0), T(st[RSTD]), gamma, beta, y[i], xr)
        else:  # float64 arithmetic on the scaled row, y rounded once to T
            _write_y(xs, st[HI], st[LO], st[RSTD], gamma, beta, y[i], xs)


@njit(cache=True)
def _backward_row_f64(xr, dyr, gamma, st, dxr, pg, pb):
    """Row dx and its dgamma/dbeta terms in float64, on x * SCALE (all (D,); st: (NSTATS,)).

    For scaled rows, and for rows whose T sums of the backward overflow (dy near the top of
    the range: the sums here run on a power-of-two scaling of dy).
    """
    D = xr.shape[0]
    hi, lo, r, scale = st[HI], st[LO], st[RSTD], st[SCALE]
    xs = _scaled_row(xr, scale)  # (D,) float64
    gs = _scaled_row(gamma, 1.0)
    # dx is linear in dy: dy is scaled by 2**-k so that max|dy * gamma| < 1 and no sum of the
    # row overflows (float64 dy near its top would), and dx by 2**k (and SCALE) at the end
    umax = 0.0
    for j in range(D):
        umax = max(umax, abs(np.float64(dyr[j]) * gs[j]))
    k = max(0, math.frexp(umax)[1]) if np.isfinite(umax) else 0
    dys = _scaled_row(dyr, math.ldexp(1.0, -k))
    su, sut = _sum_grad(xs, dys, gs, hi)
    mg = su / D
    mgx = r * (sut - lo * su) / D
    shift = k + math.frexp(scale)[1] - 1  # scale = 2**(frexp exponent - 1)
    for j in range(D):
        xhat = ((xs[j] - hi) - lo) * r
        # the powers of two last, in one exact step: r * SCALE may be subnormal, 2**k overflow
        dxr[j] = math.ldexp(r * ((dys[j] * gs[j] - mg) - xhat * mgx), shift)
        pg[j] += dyr[j] * xhat
        pb[j] += dyr[j]


@njit(cache=True)
def _backward_row(x, dy, gamma, stats, dx, pg, pb, i):
    """Row i of the backward alone: dx[i], and its terms added to pg, pb (x, dy, dx: (M, D) T)."""
    M, D = x.shape
    T = x.dtype.type
    st = stats[i]
    hi = T(st[HI])
    lo = T(st[LO])
    if st[SCALE] == 1.0:
        su, sut = _sum_grad(x[i], dy[i], gamma, hi)
        if np.isfinite(su) and np.isfinite(sut):
            r = st[RSTD]
            nxt = min(i + 1, M - 1)
            _write_dx(x[i], dy[i], gamma, hi, lo, T(r), T(su / D), T(r * (sut - lo * su) / D),
                      dx[i], pg, pb, x[nxt], dy[nxt])
            return
    _backward_row_f64(x[i], dy[i], gamma, st, dx[i], pg, pb)


@njit(parallel=True, cache=True)
def _backward_kernel(x, dy, gamma, stats, dx, partial):
    """Fill dx (M, D) T and partial (C, 2, D) float64 with each chunk's (dgamma, dbeta).

    x, dy: (M, D) T; gamma: (D,) T; stats: (M, NSTATS) float64; C = partial.shape[0].
    Rows go TILE at a time (the chunk's last M % TILE rows, and a tile holding a scaled row or
    a row whose T sums are not finite, one at a time): the partials get the same additions in
    the same row order either way.
    """
    M, D = x.shape
    T = x.dtype.type
    C = partial.shape[0]
    for c in prange(C):
        pg = partial[c, 0]  # (D,) float64
        pb = partial[c, 1]  # (D,) float64
        pg[:] = 0.0
        pb[:] = 0.0
        st = np.empty((TILE, 5), x.dtype)  # per row of a tile: hi, lo, rstd, mean_g, mean_gxhat
        i = c * M // C
        end = (c + 1) * M // C
        while i + TILE <= end:
            fast = True
            for k in range(TILE):
                s = stats[i + k]
                r = s[RSTD]
                hi = T(s[HI])
                lo = T(s[LO])
                su, sut = _sum_grad(x[i + k], dy[i + k], gamma, hi)
                fast = fast and s[SCALE] == 1.0 and np.isfinite(su) and np.isfinite(sut)
                st[k, 0] = hi
                st[k, 1] = lo
                st[k, 2] = T(r)
                st[k, 3] = T(su / D)
                st[k, 4] = T(r * (sut - lo * su) / D)
            if fast:
                _write_dx_tile(x[i:i + TILE], dy[i:i + TILE], gamma, st, dx[i:i + TILE], pg, pb)
            else:
                for k in range(TILE):
                    _backward_row(x, dy, gamma, stats, dx, pg, pb, i + k)
            i += TILE
        for k in range(i, end):
            _backward_row(x, dy, gamma, stats, dx, pg, pb, k)


@njit(parallel=True, cache=True)
def _reduce_chunks(partial, out):
    """out (2, D) float64 = sum over c of partial (C, 2, D), added in chunk order."""
    C, _, D = partial.shape
    for k in prange(2):
        acc = out[k]  # (D,)
        acc[:] = 0.0
        for c in range(C):
            p = partial[c, k]  # (D,)
            for j in range(D):
                acc[j] += p[j]


@njit(parallel=True, cache=True)
def _copy_kernel(src, dst):
    M = src.shape[0]
    for i in prange(M):
        s = src[i]  # (D,)
        d = dst[i]  # (D,)
        for j in range(s.shape[0]):
            d[j] = s[j]


def copy(src: np.ndarray, dst: np.ndarray) -> None:
    """dst[...] = src with Numba's threads: the yardstick for memory bandwidth.

    Args:
        src, dst: C-contiguous arrays of one shape and dtype (any number of axes).
    """
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"src and dst must match: {src.shape} {src.dtype} vs {dst.shape} "
                         f"{dst.dtype}")
    if not (src.flags.c_contiguous and dst.flags.c_contiguous):
        raise ValueError("src and dst must be C-contiguous")
    # One kernel per item size: the bits move as unsigned integers of the same width.
    bits = np.dtype(f"u{src.itemsize}")
    d = src.shape[-1] if src.ndim else 1
    view = src.reshape(-1, d).view(bits)  # (M, D)
    _copy_kernel(view, dst.reshape(view.shape).view(bits))


def n_chunks(M: int) -> int:
    """Number of row chunks of the backward's dgamma/dbeta partials: a function of M only.

    A power of two (so 2, 4, 8, 16 threads share them evenly), at most MAX_CHUNKS, each with
    at least ROWS_PER_CHUNK rows when M allows.
    """
    c = 1
    while c * 2 <= MAX_CHUNKS and c * 2 * ROWS_PER_CHUNK <= M:
        c *= 2
    return c


@dataclass(frozen=True)
class CpuLayerNormCache:
    """What the fused backward needs from the forward.

    Attributes:
        x: (M, D) the forward's input in the compute dtype: the caller's own memory when x was
            a C-contiguous float32/float64 array (then it must not change before the backward),
            else a converted copy.
        stats: (M, NSTATS) float64 per row: the mean as HI + LO (two compute-dtype numbers),
            RSTD and SCALE (module docstring).
        gamma_c: (D,) gamma in the compute dtype, a copy taken by the forward (ones when gamma
            is None): changing gamma afterwards does not change the backward.
        gamma_dtype: dtype of gamma, or None when the forward had no gamma (then dgamma is None).
        beta_dtype: dtype of beta, or None when the forward had no beta (then dbeta is None).
        x_shape: shape of the forward's x; dy must have this shape.
        x_dtype: dtype of the forward's x; dx is returned in it.
        owns_x: True when ``x`` is a copy made by the forward (counted in ``nbytes``).
        inputs: where the caller's x, gamma and beta live, so that the backward's ``out=`` is
            refused when it overlaps them.
    """

    x: np.ndarray
    stats: np.ndarray
    gamma_c: np.ndarray
    gamma_dtype: np.dtype | None
    beta_dtype: np.dtype | None
    x_shape: tuple[int, ...]
    x_dtype: np.dtype
    owns_x: bool
    inputs: tuple[Region, ...] = ()

    @property
    def mean(self) -> np.ndarray:
        """(M,) float64 row means (HI + LO rounded to float64, unscaled)."""
        s = self.stats
        return (s[:, HI] + s[:, LO]) / s[:, SCALE]

    @property
    def rstd(self) -> np.ndarray:
        """(M,) float64 1/sqrt(var + eps) of each row (unscaled)."""
        return self.stats[:, RSTD] * self.stats[:, SCALE]

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds of its own: stats and gamma, and x when it is a copy."""
        own = self.stats.nbytes + self.gamma_c.nbytes
        return own + (self.x.nbytes if self.owns_x else 0)


def _deliver(r2: np.ndarray, out: np.ndarray | None, direct: bool, dtype: np.dtype,
             shape: tuple[int, ...]) -> np.ndarray:
    """The (M, D) compute-dtype result r2 as the caller's array: in ``out`` when given
    (``direct``: the kernel already wrote into it), else cast to ``dtype`` and reshaped."""
    if out is None:
        return r2.astype(dtype, copy=False).reshape(shape)
    if not direct:
        out.reshape(r2.shape)[...] = r2
    return out


def _as_compute(a: np.ndarray, cdt: np.dtype) -> tuple[np.ndarray, bool]:
    """``a`` as a C-contiguous array of the native compute dtype, and whether it was copied."""
    if a.dtype == cdt and a.dtype.isnative and a.flags.c_contiguous:
        return a, False
    return np.ascontiguousarray(a, dtype=cdt.newbyteorder("=")), True


_OVERLAP = "(the caller's arrays are never written, and the backward reads x)"


def _forward(x: object, gamma: object, beta: object, eps: object, out: np.ndarray | None,
             stats: np.ndarray | None) -> tuple[np.ndarray, CpuLayerNormCache]:
    given = (x, gamma, beta)  # the caller's objects, before any conversion
    x = check_x(x)
    d = x.shape[-1]
    gamma = check_param(gamma, "gamma", d)
    beta = check_param(beta, "beta", d)
    cdt = compute_dtype(x.dtype)
    eps = check_eps(eps, cdt)
    # the caller's objects, and the arrays made of them (an array-like's memory is only
    # visible through its array)
    callers = (*given, x, gamma, beta)
    if out is not None:
        out = check_out(out, x.shape, x.dtype, "out", callers, _OVERLAP)
    xc, owns_x = _as_compute(x, cdt)
    x2 = xc.reshape(-1, d)  # (M, D)
    m = x2.shape[0]
    # A copy of gamma, always: the backward differentiates the forward that ran.
    gamma_c = np.ones(d, cdt) if gamma is None else np.array(gamma, dtype=cdt)  # (D,)
    beta_c = np.zeros(d, cdt) if beta is None else _as_compute(beta, cdt)[0]  # (D,)
    if stats is None:
        stats = np.empty((m, NSTATS))  # (M, NSTATS) float64
    direct = out is not None and x2.dtype == out.dtype
    y2 = out.reshape(m, d) if direct else np.empty((m, d), x2.dtype)  # (M, D)
    _forward_kernel(x2, gamma_c, beta_c, eps, y2, stats)
    y = _deliver(y2, out, direct, x.dtype, x.shape)
    cache = CpuLayerNormCache(
        x=x2, stats=stats, gamma_c=gamma_c,
        gamma_dtype=None if gamma is None else gamma.dtype,
        beta_dtype=None if beta is None else beta.dtype,
        x_shape=x.shape, x_dtype=x.dtype, owns_x=owns_x,
        inputs=tuple(r for r in map(region, callers) if r is not None),
    )
    return y, cache


def layer_norm_forward(
    x: np.ndarray,
    gamma: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    eps: float = 1e-5,
    *,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, CpuLayerNormCache]:
    """Layer norm over the last axis of ``x``, fused: one parallel pass over the rows.

    Args:
        x: (..., D) floating array with at least one axis; never modified, and kept by
            reference in the cache: do not modify it before the backward.
        gamma: (D,) scale, or None for no scale. The cache keeps a copy.
        beta: (D,) shift, or None for no shift.
        eps: finite positive number added to the variance.
        out: optional C-contiguous array of x's shape and dtype that receives y (reuse it
            across calls: fresh outputs over 32 MB page-fault on every call). It must not
            overlap x, gamma or beta.

    Returns:
        y: same shape and dtype as x (``out`` when given). float16/bfloat16 are computed in
            float32.
        cache: a :class:`CpuLayerNormCache` for :func:`layer_norm_backward`.
    """
    return _forward(x, gamma, beta, eps, out, None)


def _backward(dy: object, cache: object, out: np.ndarray | None,
              partial: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None,
                                                   np.ndarray | None]:
    given = dy
    dy = check_dy(dy, cache, CpuLayerNormCache, "layernorm.cpu.layer_norm_forward")
    if out is not None:
        out = check_out(out, cache.x_shape, cache.x_dtype, "out",
                        (given, dy, cache.x, cache.gamma_c, *cache.inputs), _OVERLAP)
    x2 = cache.x  # (M, D)
    m, d = x2.shape
    dy2 = _as_compute(dy, x2.dtype)[0].reshape(m, d)  # (M, D)
    direct = out is not None and x2.dtype == out.dtype
    dx2 = out.reshape(m, d) if direct else np.empty((m, d), x2.dtype)  # (M, D)
    if partial is None:
        partial = np.empty((n_chunks(m), 2, d))  # (C, 2, D) float64
    _backward_kernel(x2, dy2, cache.gamma_c, cache.stats, dx2, partial)
    sums = np.empty((2, d))  # (2, D) float64: dgamma, dbeta
    _reduce_chunks(partial, sums)
    dgamma = None if cache.gamma_dtype is None else sums[0].astype(cache.gamma_dtype)  # (D,)
    dbeta = None if cache.beta_dtype is None else sums[1].astype(cache.beta_dtype)  # (D,)
    dx = _deliver(dx2, out, direct, cache.x_dtype, cache.x_shape)
    return dx, dgamma, dbeta


def layer_norm_backward(
    dy: np.ndarray, cache: CpuLayerNormCache, *, out: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Gradients of layer norm given dL/dy and the forward's cache, fused.

    Args:
        dy: gradient of the loss w.r.t. y, same shape as the forward's x; never modified.
        cache: the cache returned by :func:`layer_norm_forward`.
        out: optional C-contiguous array of x's shape and dtype that receives dx. It must not
            overlap dy, nor the forward's x, gamma or beta.

    Returns:
        dx: same shape and dtype as x (``out`` when given).
        dgamma: (D,) in gamma's dtype, or None when the forward had no gamma.
        dbeta: (D,) in beta's dtype, or None when the forward had no beta.
    """
    return _backward(dy, cache, out, None)


class LayerNorm(reference.LayerNorm):
    """A stateful fused layer norm that reuses its output buffers between calls.

    As :class:`layernorm.LayerNorm` (``gamma`` ones, ``beta`` zeros, float64 (D,); ``forward``
    keeps the cache, ``backward`` returns dx and stores ``dgamma`` and ``dbeta``), except that
    the cache holds a reference to x: do not modify x before ``backward``. The returned y and
    dx are the module's own buffers, overwritten by the next call with the same shape and
    dtype: copy them to keep them.

    **In a network this reaches across modules**: a module fed this module's y keeps that
    buffer as its x, so calling this module again (another micro-batch, an evaluation pass)
    before the other module's backward silently corrupts its gradients. Use the functions
    (fresh outputs unless ``out=``) or :class:`layernorm.LayerNorm` where calls interleave.
    """

    def __init__(self, D: int, eps: float = 1e-5) -> None:
        super().__init__(D, eps)
        self._buffers: dict[str, np.ndarray] = {}

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: np.dtype,
                avoid: tuple[object, ...] = ()) -> np.ndarray:
        """The buffer ``name``, reallocated when its shape or dtype changes or it overlaps
        an array or Region in ``avoid`` (``forward(forward(x))`` passes the y buffer as x)."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype or overlaps(buf, avoid):
            buf = self._buffers[name] = np.empty(shape, dtype)
        return buf

    def forward(self, x: np.ndarray) -> np.ndarray:
        """y for x of shape (..., D), in a buffer reused by the next call."""
        x = check_x(x)
        m = x.size // x.shape[-1]
        y = self._buffer("y", x.shape, x.dtype, (x,))
        stats = self._buffer("stats", (m, NSTATS), np.dtype(np.float64))
        y, self._cache = _forward(x, self.gamma, self.beta, self.eps, y, stats)
        return y

    __call__ = forward

    def backward(self, dy: np.ndarray) -> np.ndarray:
        """dx for the last :meth:`forward`, in a reused buffer; sets ``dgamma`` and ``dbeta``."""
        if self._cache is None:
            raise RuntimeError("LayerNorm.backward called before forward")
        cache = self._cache
        m, d = cache.x.shape
        dy = as_float_array(dy, "dy")
        dx = self._buffer("dx", cache.x_shape, cache.x_dtype, (dy, cache.x, *cache.inputs))
        partial = self._buffer("partial", (n_chunks(m), 2, d), np.dtype(np.float64))
        dx, self.dgamma, self.dbeta = _backward(dy, cache, dx, partial)
        return dx

    def __repr__(self) -> str:
        return f"LayerNorm(D={self.D}, eps={self.eps}, fused CPU)"
