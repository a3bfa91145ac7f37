r"""Numba kernels for the family of norms: one pass over a range of rows each way.

For one row of length D, T the compute dtype (float32; float64 for float64 input), scale = gamma
or 1 + gamma, and centred = True for LayerNorm, False for RMSNorm (then hi = lo = c = 0):

    forward   [add]  h_j = x_j + r_j rounded once to h's dtype; the row below is h
              A  m0 = T(mean of the row's first SAMPLES elements)   (centred only)
              B  s1 = sum_j (x_j - m0), s2 = sum_j (x_j - m0)^2, c = s1 / D
                 if c^2 > RECENTRE * (s2 / D - c^2): m0 = T(m0 + c), B again
                 hi + lo = m0 + c (two T numbers), var = s2 / D - c^2, rstd = 1/sqrt(var + eps)
                 RMSNorm: s2 = sum_j x_j^2 (in float64 for float32 storage), var = s2 / D
              C  y_j = scale_j * ((x_j - hi) - lo) * rstd + beta_j
    backward  1  u_j = dy_j * scale_j, su = sum_j u_j, sut = sum_j u_j * (x_j - hi)
                 mean(g) = su / D (centred only), mean(g * xhat) = rstd * (sut - lo * su) / D
              2  dx_j = rstd * ((u_j - mean(g)) - xhat_j * mean(g * xhat)) [+ dh_j for add-norms]
                 dgamma_j += dy_j * xhat_j, dbeta_j += dy_j  (float64 partials per row chunk)
    backward  from y (memory-efficient), shift = beta (0 for RMSNorm), the kept channels K
              (layernorm.recovery.kept_channels) with their xhat from the forward:
              1  su = sum_j u_j, sut = sum_{j not in K} dy_j * (y_j - shift_j)
                 + sum_{j in K} u_j * xhat_j, mean(g * xhat) = sut / D
              2  as above with xhat_j = (y_j - shift_j) * r_j off K, r_j = 1 / scale_j rounded
                 to float32 (float64: xhat_j = (y_j - shift_j) / scale_j, a division); dx_j
                 and dgamma's term on K written from the kept xhat after the sweep; each
                 chunk's dgamma partial of channel j then times 1 / (scale_j * r_j) in float64
              the rows kept whole (layernorm.recovery.kept_rows: var < eps under a shift)
              read their xhat row as stored: su, sut = sum_j u_j * xhat_j, then sweep 2

Code paths (docs/cpu-kernels.md has the reasons and the measurements):
- every row: sweeps B and C (B twice where the sample's mean is off), sums in blocks of BLOCK
  elements in T joined in float64;
- rows whose T sums overflow (or hold inf/NaN): statistics and y in float64 on x * 2**-e;
- backward tiles of TILE rows share one sweep over the float64 partials; a tile with a scaled
  row, or whose T sums are not finite, goes row by row, the same additions in the same order;
- rows whose backward T sums overflow: dx in float64 on a power-of-two scaling of dy;
- the backward from y: the same sweeps, tiles and float64 path (``_chunks``); a tile's sweep 1
  runs its TILE rows block by block, each block's scale and shift read by the four rows in
  turn while in L1, every row's block sums formed by the one loop a row alone uses (so a row's
  dx has the same bits in any batch), and masks the kept channels' terms only in the blocks
  that hold one; where the shift is 0 on every recovered channel, no sweep reads it
  (``_unshifted``); a tile holding a row kept whole goes row by row (one comparison a tile
  where no row is kept);
- dgamma/dbeta: ``n_chunks(M)`` row chunks of float64 partials, summed in chunk order.

Storage: float32 and float64 arrays are read as they are; float16 travels as its bits in a
uint16 array and bfloat16 as its bits in an int16 array, converted to and from float32 inside
the kernels (``_ld``, ``_to``), so half inputs cost no extra pass. Each row also gets a
checksum of its bits, so that a backward can tell that its x changed since the forward.
Results are bit-identical run to run and for any thread count on one machine.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

BLOCK = 1024  # elements summed in T before the block total joins a float64 sum
SPAN = 256  # elements of an output sweep between prefetch bursts (16 cache lines of float32)
# The forward's output sweep prefetches the next row only for rows of at least this many bytes:
# shorter rows are streamed in time by the hardware prefetcher, and the extra prefetches cost
# (docs/cpu-kernels.md has the measurements).
PREFETCH_ROW_BYTES = 16384
LINE_BYTES = 64  # cache line; prefetches are issued one per line
ROWS_PER_CHUNK = 32  # fewest rows in a backward chunk
MAX_CHUNKS = 16  # most chunks: float64 partial traffic stays ~1% of the bytes for M >= 4096
TILE = 4  # rows of a backward tile: its dgamma/dbeta terms join the float64 partials together
SAMPLES = 16  # elements of a row whose mean is the first guess at the row's mean
# Centred on a guess m0, var = s2/D - c^2 (c = mean - m0) loses about (1 + 2 c^2/var) units of
# rounding of var: a guess within sqrt(1/8) standard deviations of the mean costs at most a
# quarter of a unit more than centring on the rounded mean. Rows whose guess is further off
# (structured rows, or a sample of outliers) take a second sweep centred on the mean.
RECENTRE = 1 / 8

# Per-row statistics, one row of ``stats`` (M, NSTATS) float64 per row: the mean as an
# unevaluated sum HI + LO of two T numbers, RSTD, and SCALE (the power of two the row was scaled
# by, 1 except on rows whose T sums overflow). Beside it, ``check`` (M,) uint64: each row's
# checksum.
HI, LO, RSTD, SCALE = 0, 1, 2, 3
NSTATS = 4

# Bits of the entry points' ``flags``: LayerNorm (else RMSNorm); a checksum per row; the scale
# is 1 + gamma.
CENTRED, CHECKSUM, ZERO_CENTERED = 1, 2, 4


# --- element conversion: storage <-> compute -------------------------------------------------

@intrinsic
def _ld(typingctx, v):
    """An element as a compute value: float16 bits (uint16) and bfloat16 bits (int16) become
    float32 exactly; float32 and float64 are returned as they are."""
    if v in (types.float32, types.float64):
        return v(v), lambda context, builder, sig, args: args[0]
    if v == types.uint16:
        def f16(context, builder, sig, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(v), f16
    if v == types.int16:
        def bf16(context, builder, sig, args):
            w = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(w, ir.FloatType())
        return types.float32(v), bf16
    return None


def _as_float32(builder, v):
    """IR: float32 ``v``, or float64 ``v`` rounded to float32 to odd (toward zero, then the last
    bit set if inexact), so that a second rounding to a half type rounds once in effect."""
    if v.type == ir.FloatType():
        return v
    i32 = ir.IntType(32)
    f = builder.fptrunc(v, ir.FloatType())  # to nearest
    back = builder.fpext(f, ir.DoubleType())
    inexact = builder.fcmp_ordered("one", back, v)
    positive = builder.fcmp_ordered("ogt", v, ir.Constant(ir.DoubleType(), 0.0))
    up = builder.select(positive, builder.fcmp_ordered("ogt", back, v),
                        builder.fcmp_ordered("olt", back, v))  # rounded away from zero
    u = builder.bitcast(f, i32)
    u = builder.select(up, builder.sub(u, i32(1)), u)
    u = builder.select(inexact, builder.or_(u, i32(1)), u)
    return builder.bitcast(u, ir.FloatType())


@intrinsic
def _to(typingctx, v, like):
    """``v`` (float32 or float64) rounded once, to nearest even, to the type of ``like``: a
    float type, float16 bits (uint16) or bfloat16 bits (int16)."""
    if v not in (types.float32, types.float64):
        return None
    if like in (types.float32, types.float64):
        def cast(context, builder, sig, args):
            return context.cast(builder, args[0], sig.args[0], sig.return_type)
        return like(v, like), cast
    if like == types.uint16:
        def f16(context, builder, sig, args):
            f = _as_float32(builder, args[0])
            return builder.bitcast(builder.fptrunc(f, ir.HalfType()), ir.IntType(16))
        return types.uint16(v, like), f16
    if like == types.int16:
        def bf16(context, builder, sig, args):
            i32 = ir.IntType(32)
            f = _as_float32(builder, args[0])
            u = builder.bitcast(f, i32)
            odd = builder.and_(builder.lshr(u, i32(16)), i32(1))
            rounded = builder.add(u, builder.add(odd, i32(0x7FFF)))
            nan = builder.fcmp_unordered("uno", f, f)
            quiet = builder.or_(u, i32(0x00400000))  # a NaN stays a NaN, quiet
            w = builder.select(nan, quiet, rounded)
            return builder.trunc(builder.lshr(w, i32(16)), ir.IntType(16))
        return types.int16(v, like), bf16
    return None


@intrinsic
def _bits(typingctx, v):
    """The bits of an element as uint64 (zero-extended)."""
    width = {types.float32: 32, types.float64: 64, types.uint16: 16, types.int16: 16}.get(v)
    if width is None:
        return None

    def codegen(context, builder, sig, args):
        w = builder.bitcast(args[0], ir.IntType(width)) if width > 16 else args[0]
        return w if width == 64 else builder.zext(w, ir.IntType(64))
    return types.uint64(v), codegen


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # odd: j * _GOLDEN differs for every position j < 2**64
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S = np.uint64(33)


@njit(inline="always", cache=True)
def _mix(v, j):
    """A 64-bit hash of element ``v`` at position ``j`` (MurmurHash3's finaliser of its bits
    plus j * _GOLDEN): every input bit reaches every output bit, so no pattern of changes
    (signs flipped, a power-of-two scaling, a swap) cancels in a sum of hashes except by a
    2**-64 chance."""
    k = _bits(v) + np.uint64(j) * _GOLDEN
    k = (k ^ (k >> _S)) * _M1
    k = (k ^ (k >> _S)) * _M2
    return k ^ (k >> _S)


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


@intrinsic
def _unmanaged(typingctx, arr):
    """``arr`` as a view that no reference counts: its data, shape and strides without its
    meminfo. For the kernels' own scratch arrays, passed to a function per row or per tile:
    each pass and slice of a managed array costs an atomic increment and decrement. The
    caller keeps ``arr`` itself alive while the view is in use (:func:`_alive`)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        view = cgutils.create_struct_proxy(sig.return_type)(context, builder, value=args[0])
        view.meminfo = cgutils.get_null_value(view.meminfo.type)
        view.parent = cgutils.get_null_value(view.parent.type)
        return view._getvalue()

    return arr(arr), codegen


@njit(cache=True)
def _alive(arr):
    """A use of ``arr``: Numba releases an array after its last use, so a call of this after
    the last use of an :func:`_unmanaged` view keeps the memory until then."""
    return arr.shape[0]


@njit(cache=True)
def _prefetch_span(row, j0, j1):
    """Prefetch the lines of ``row[j0:j1]`` (row: (D,); an empty row is skipped)."""
    if row.shape[0] == 0:
        return
    step = max(1, LINE_BYTES // row.itemsize)
    for k in range(j0, min(j1, row.shape[0]), step):
        _prefetch(row, k)


# --- row reductions ----------------------------------------------------------------------
# Loops index views from 0 (``blk[j]``, j in range(n)) so Numba can prove the index
# non-negative and drop its negative-index wraparound, which blocks vectorisation. ``z`` is a
# zero of the compute dtype T.

@njit(cache=True)
def _sample_mean(row, z):
    """T(mean of the row's first SAMPLES elements): a first guess at the mean that costs no
    sweep, read from the row's first cache line (row: (D,) storage). Elements spread over the
    row would be a better guess for rows with a trend, but each is a cache miss ahead of the
    sweep, and a bad guess only costs a second sweep (:func:`_row_stats`)."""
    n = min(SAMPLES, row.shape[0])
    s = 0.0
    for k in range(n):
        s += np.float64(_ld(row[k]))
    return _to(s / n, z)


@njit(fastmath={"reassoc"}, cache=True)
def _sum_centred(row, m0, z, with_ck):
    """(sum_j d_j, sum_j d_j^2, checksum) with d = row - m0 in T (row: (D,) storage; m0, z: T).

    The checksum is sum_j _mix(row_j, j) mod 2**64 when ``with_ck``, else 0.
    """
    s1 = 0.0
    s2 = 0.0
    ck = np.uint64(0)
    for j0 in range(0, row.shape[0], BLOCK):
        blk = row[j0:j0 + BLOCK]  # (<= BLOCK,)
        b1 = z
        b2 = z
        for j in range(blk.shape[0]):
            d = _ld(blk[j]) - m0
            b1 += d
            b2 += d * d
        if with_ck:  # a loop of its own: the sums' order is the same with or without it
            for j in range(blk.shape[0]):
                ck += _mix(blk[j], j0 + j)
        s1 += b1
        s2 += b2
    return s1, s2, ck


@njit(fastmath={"reassoc", "contract"}, cache=True)
def _sum_squares(row, z, with_ck):
    """(sum_j row_j^2, checksum) of a row (D,) of storage; the sum in float64 for float32
    storage, in T (z's type) joined in float64 for the others; the checksum as for
    :func:`_sum_centred`.

    RMSNorm's squares are not centred: on rows of values of one magnitude (an offset, a
    constant, +-a) they are nearly equal, and a sum of them rounds the same way at every step.
    Vectorised over L lanes, each lane adds BLOCK/L of them in sequence, so summed in float32
    they lose up to about BLOCK/L units of rounding, a number set by the CPU: on constant
    float32 rows (D = 4096) up to 17 ulps of y compiled for SSE (8 lanes) and 4 for AVX-512
    (64 lanes), against up to 4 for the NumPy reference's pairwise sum. The square of a float32
    value is exact in float64 and cannot overflow there (so contracting it into the add, an
    FMA, changes no bit), and a float64 sum of them leaves y = x * rstd within its own two
    roundings (under 2 ulps) on any CPU. float16 and bfloat16 outputs are too coarse to see the
    float32 sum's error (at most about 64 float32 units, under a hundredth of their ulp), so
    their squares, exact in float32, stay there, at no cost; float64 is summed as it is, its
    error far below the float64 targets.
    """
    wide = row.itemsize == 4  # float32 storage
    s2 = 0.0
    ck = np.uint64(0)
    for j0 in range(0, row.shape[0], BLOCK):
        blk = row[j0:j0 + BLOCK]  # (<= BLOCK,)
        if wide:
            b64 = 0.0
            for j in range(blk.shape[0]):
                v = np.float64(_ld(blk[j]))
                b64 += v * v
            s2 += b64
        else:
            bt = z
            for j in range(blk.shape[0]):
                w = _ld(blk[j])
                bt += w * w
            s2 += bt
        if with_ck:  # a loop of its own: the sum's order is the same with or without it
            for j in range(blk.shape[0]):
                ck += _mix(blk[j], j0 + j)
    return s2, ck


@njit(fastmath={"reassoc"}, cache=True)
def _sum_grad(xr, dyr, scale, hi, z, with_ck):
    """(sum_j u_j, sum_j u_j (x_j - hi), checksum of x or 0) with u = dy * scale (all (D,))."""
    s1 = 0.0
    s2 = 0.0
    ck = np.uint64(0)
    for j0 in range(0, xr.shape[0], BLOCK):
        xb = xr[j0:j0 + BLOCK]  # (<= BLOCK,)
        db = dyr[j0:j0 + BLOCK]
        gb = scale[j0:j0 + BLOCK]
        b1 = z
        b2 = z
        for j in range(xb.shape[0]):
            u = _ld(db[j]) * gb[j]
            b1 += u
            b2 += u * (_ld(xb[j]) - hi)
        if with_ck:  # a loop of its own: the sums' order is the same with or without it
            for j in range(xb.shape[0]):
                ck += _mix(xb[j], j0 + j)
        s1 += b1
        s2 += b2
    return s1, s2, ck


@njit(cache=True)
def _split_mean(m0, c, z):
    """(hi, lo), two T numbers with hi + lo = m0 + c to about u_T**2 (m0, c: float64).

    m0 + c is formed exactly as s + err (Knuth's two-sum) before rounding to T: for float64
    T, rounding m0 + c to one float64 would lose the correction c, which is below an ulp of m0.
    """
    s = m0 + c
    bb = s - m0
    err = (m0 - (s - bb)) + (c - bb)
    hi = _to(s, z)
    return hi, _to((s - hi) + err, z)


@njit(error_model="numpy", cache=True)
def _row_stats(xr, eps, centred, z, with_ck):
    """(hi, lo, rstd, finite, checksum or 0) of one row (xr: (D,)), corrected two-pass with
    the first pass skipped where a sample of the row stands in for it. IEEE division: with
    eps = 0 (the torch API allows it) a constant row gets rstd = inf, so its xhat is NaN, as
    torch's. RMSNorm's statistics are (0, 0, rstd) from :func:`_sum_squares`; its row takes
    the T path while mean(x^2) fits T (then rstd and x * rstd do too)."""
    D = xr.shape[0]
    if not centred:
        s2, ck = _sum_squares(xr, z, with_ck)
        ms = s2 / D
        return z, z, 1.0 / np.sqrt(ms + eps), np.isfinite(_to(ms, z)), ck
    m0 = _sample_mean(xr, z)
    s1, s2, ck = _sum_centred(xr, m0, z, with_ck)
    c = s1 / D
    var = s2 / D - c * c
    if c * c > var * RECENTRE:  # the sample missed the mean: centre on the mean just found
        m0 = _to(np.float64(m0) + c, z)
        s1, s2, ck = _sum_centred(xr, m0, z, with_ck)
        c = s1 / D
        var = s2 / D - c * c
    var = max(var, 0.0)  # a variance: rounding must not take it below 0
    hi, lo = _split_mean(np.float64(m0), c, z)
    return hi, lo, 1.0 / np.sqrt(var + eps), np.isfinite(m0 + c) and np.isfinite(var), ck


# Rows whose T sums overflow (|x - mean| above ~1.8e19/sqrt(D) in float32, ~1.3e154/sqrt(D)
# in float64), or hold inf or NaN, are normalized as xs = x * 2**-e in float64, max|xs| < 1,
# with eps * 4**-e: a power-of-two scaling is exact and leaves xhat unchanged. Their statistics
# (HI, LO, RSTD) belong to xs, and xhat = ((x * SCALE - HI) - LO) * RSTD; the true rstd is
# RSTD * SCALE. Constant rows of a centred norm are caught first: xhat = 0 exactly and
# rstd = 1/sqrt(eps), whatever the scale, so they keep SCALE = 1 and the T paths.


@njit(cache=True)
def _scaled_row(xr, scale):
    """x * scale as a new float64 row (exact for a power of two, unless it underflows)."""
    xs = np.empty(xr.shape[0])
    for j in range(xr.shape[0]):
        xs[j] = np.float64(_ld(xr[j])) * scale
    return xs


@njit(error_model="numpy", cache=True)
def _scaled_stats(xr, eps, centred, st):
    """Fill ``st`` (NSTATS,) for a row whose T sums overflow (xr: (D,)); return the
    scaled row (D,) float64, or an empty row for a constant centred row (it keeps T paths)."""
    x0 = np.float64(_ld(xr[0]))
    amax = 0.0
    constant = centred
    for j in range(xr.shape[0]):
        v = np.float64(_ld(xr[j]))
        amax = max(amax, abs(v))
        constant = constant and v == x0
    if constant and np.isfinite(x0):
        st[HI], st[LO], st[RSTD], st[SCALE] = x0, 0.0, 1.0 / math.sqrt(eps), 1.0
        return np.empty(0)
    e = math.frexp(amax)[1] if np.isfinite(amax) else 0
    scale = math.ldexp(1.0, -e)
    xs = _scaled_row(xr, scale)
    hi, lo, r, _, _ = _row_stats(xs, math.ldexp(eps, -2 * e), centred, 0.0, False)
    st[HI], st[LO], st[RSTD], st[SCALE] = hi, lo, r, scale
    return xs


# --- forward -----------------------------------------------------------------------------

@njit(cache=True)
def _add_row(xr, rr, hr, zp):
    """h = x + residual in the type of ``zp`` (the widest of x's, residual's and h's compute
    dtypes), rounded once to h (all (D,))."""
    hz = hr.dtype.type(0)
    for j in range(xr.shape[0]):
        hr[j] = _to(_to(_ld(xr[j]), zp) + _to(_ld(rr[j]), zp), hz)


@njit(fastmath={"contract"}, cache=True)
def _write_y(xr, hi, lo, rc, scale, beta, yr, nxt, centred):
    """y = ((x - hi) * rstd - lo * rstd) * scale + beta, rounded to y's storage (all (D,)).

    Without ``centred`` (RMSNorm: hi = lo = beta = 0) the same bits as y = (x * rstd) * scale,
    which is what runs (two multiplications, no third stream). Prefetches the next row ``nxt``
    (D,) when rows are long (PREFETCH_ROW_BYTES).
    """
    D = xr.shape[0]
    nlr = -lo * rc
    yz = yr.dtype.type(0)
    fetch = D * nxt.itemsize >= PREFETCH_ROW_BYTES
    for j0 in range(0, D, SPAN):
        xb = xr[j0:j0 + SPAN]  # (<= SPAN,)
        gb = scale[j0:j0 + SPAN]
        yb = yr[j0:j0 + SPAN]
        if centred:
            bb = beta[j0:j0 + SPAN]
            for j in range(xb.shape[0]):
                yb[j] = _to(((_ld(xb[j]) - hi) * rc + nlr) * gb[j] + bb[j], yz)
        else:
            for j in range(xb.shape[0]):
                yb[j] = _to((_ld(xb[j]) * rc) * gb[j], yz)
        if fetch:
            _prefetch_span(nxt, j0, j0 + SPAN)


@njit(cache=True)
def _forward_row(xr, eps, centred, scale, beta, yr, st, nxt, with_ck):
    """y of one row (xr, yr: (D,)); fills st (NSTATS,); returns the row's checksum (0 without
    ``with_ck``)."""
    z = scale.dtype.type(0)
    hi, lo, r, finite, ck = _row_stats(xr, eps, centred, z, with_ck)
    if finite:
        st[HI], st[LO], st[RSTD], st[SCALE] = hi, lo, r, 1.0
        _write_y(xr, hi, lo, _to(r, z), scale, beta, yr, nxt, centred)
        return ck
    xs = _scaled_stats(xr, eps, centred, st)
    if xs.shape[0] == 0:  # constant row: xhat = 0
        _write_y(xr, _to(st[HI], z), z, _to(st[RSTD], z), scale, beta, yr, nxt, True)
    else:  # float64 arithmetic on the scaled row, y rounded once
        _write_y(xs, st[HI], st[LO], st[RSTD], scale, beta, yr, nxt, True)
    return ck


def _as_t(p, D, zt, fill, plus_one):
    """(D,) parameter ``p`` (as stored, or (0,) where absent) as an array of T, the type of
    ``zt``: ``fill`` where absent, plus one when ``plus_one`` (formed in T). ``p`` itself where
    it already is one (no copy: a decode call's whole work is a few microseconds)."""


@overload(_as_t, jit_options={"cache": True})
def _as_t_typed(p, D, zt, fill, plus_one):
    if p.dtype == zt:
        def same(p, D, zt, fill, plus_one):
            if p.shape[0] == 0:
                return np.full(D, fill, p.dtype)
            if not plus_one:
                return p
            out = p.copy()
            for j in range(D):
                out[j] = out[j] + 1
            return out
        return same

    def convert(p, D, zt, fill, plus_one):
        out = np.full(D, fill, type(zt))
        if p.shape[0] > 0:
            for j in range(D):
                out[j] = _to(_ld(p[j]), zt)
            if plus_one:
                for j in range(D):
                    out[j] = out[j] + 1
        return out
    return convert


@njit(cache=True)
def forward_rows(x, residual, zp, zt, gamma, beta, eps, flags, y, h, stats, check, i0, i1):
    """Rows i0 <= i < i1 of the forward: y (M, D), and for those rows h, stats, check.

    x: (M, D) storage; residual and h: (M, D) storage for an add-norm, else (M, 0) (then the
    norm is of x); zp, zt: zeros of the dtype the add is computed in and of the compute dtype
    T; gamma, beta: (D,) as stored, or (0,) where absent; flags: CENTRED | CHECKSUM |
    ZERO_CENTERED (scale = 1 + gamma); stats: (M, NSTATS) float64, or (0, NSTATS) to keep no
    statistics (inference); check: (M,) uint64, written with CHECKSUM, else (0,).
    """
    M, D = x.shape
    centred = (flags & CENTRED) != 0
    with_ck = (flags & CHECKSUM) != 0
    keep = stats.shape[0] > 0
    scratch = np.empty(NSTATS)  # a row's statistics when none are kept
    scale = _as_t(gamma, D, zt, 1.0, (flags & ZERO_CENTERED) != 0)
    shift = _as_t(beta, D, zt, 0.0, False)
    for i in range(i0, i1):
        nxt = x[min(i + 1, M - 1)]
        st = stats[i] if keep else scratch
        if residual.shape[1] > 0:  # the norm of h, as rounded: the backward reads the same
            _add_row(x[i], residual[i], h[i], zp)
            ck = _forward_row(h[i], eps, centred, scale, shift, y[i], st, nxt, with_ck)
        else:
            ck = _forward_row(x[i], eps, centred, scale, shift, y[i], st, nxt, with_ck)
        if with_ck:
            check[i] = ck


# --- backward ----------------------------------------------------------------------------
# One set of sweeps serves two sources of xhat. The default reads x: xhat = ((x - hi) - lo) *
# rstd with the row's (hi, lo). The memory-efficient backward reads y: xhat = (y - shift) /
# scale with the channel's (shift, scale), and the channels whose xhat the forward kept are
# written afterwards (:func:`_write_kept`); a row the forward kept whole reads its stored xhat
# row on every channel (:func:`_backward_whole_row`). ``me`` (None, or the tuple (chan, keep,
# kept, rows, xrows) of :func:`backward_y_chunks`) and ``cols`` (None, chan, or () for a
# stored xhat row) pick at compile time which one a sweep computes, so none pays for another.

# Rows of ``chan`` (4, D) T, the memory-efficient backward's per-channel values: the scale;
# num, the shift (0 on the kept channels); den, what :func:`_recover` takes: 1 / scale in
# float32, scale in float64 (0 and inf on the kept channels, so that xhat is 0 there); w, 1
# with 0 on the kept channels, filled (and read) only in the blocks that hold kept channels.
CH_SCALE, CH_NUM, CH_DEN, CH_W = 0, 1, 2, 3


def _centring(st, k, cols):
    """(hi, lo) of row k of ``st`` where ``cols`` is None (rows of x), else None."""


@overload(_centring, jit_options={"cache": True})
def _centring_typed(st, k, cols):
    if isinstance(cols, types.NoneType):
        return lambda st, k, cols: (st[k, 0], st[k, 1])
    return lambda st, k, cols: None


def _unshifted(cols):
    """``cols`` of a backward from y whose shift is 0 on every channel it recovers: (chan,),
    whose sweeps read no shift row (:func:`_span`, :func:`_num`); None stays None."""


@overload(_unshifted, jit_options={"cache": True})
def _unshifted_typed(cols):
    if isinstance(cols, types.NoneType):
        return lambda cols: None
    return lambda cols: (cols,)


def _shifted(me):
    """Whether the sweeps read the shift row: ``me``'s flag (:func:`backward_y_chunks`); True
    for the default backward, which has none (its ``cols`` is None either way)."""


@overload(_shifted, jit_options={"cache": True})
def _shifted_typed(me):
    if isinstance(me, types.NoneType):
        return lambda me: True
    return lambda me: me[6]


def _span(cols, j0, j1):
    """None (``cols`` None or ()); (num[j0:j1], den[j0:j1]) of ``cols`` = chan; (den[j0:j1],)
    of ``cols`` = (chan,) (:func:`_unshifted`)."""


@overload(_span, jit_options={"cache": True})
def _span_typed(cols, j0, j1):
    if isinstance(cols, types.NoneType) or (isinstance(cols, types.BaseTuple)
                                            and len(cols) == 0):
        return lambda cols, j0, j1: None
    if isinstance(cols, types.BaseTuple):
        return lambda cols, j0, j1: (cols[0][CH_DEN, j0:j1],)
    return lambda cols, j0, j1: (cols[CH_NUM, j0:j1], cols[CH_DEN, j0:j1])


def _at(cb, j):
    """None, or element j of each array of ``cb`` (a :func:`_span`)."""


@overload(_at, jit_options={"cache": True})
def _at_typed(cb, j):
    if isinstance(cb, types.NoneType):
        return lambda cb, j: None
    if len(cb) == 1:
        return lambda cb, j: (cb[0][j],)
    return lambda cb, j: (cb[0][j], cb[1][j])


def _num(ch, j0, j1):
    """chan[CH_NUM, j0:j1] of ``ch`` = chan, None of ``ch`` = (chan,) (:func:`_unshifted`)."""


@overload(_num, jit_options={"cache": True})
def _num_typed(ch, j0, j1):
    if isinstance(ch, types.BaseTuple):
        return lambda ch, j0, j1: None
    return lambda ch, j0, j1: ch[CH_NUM, j0:j1]


def _rows_of(ch):
    """chan, of ``ch`` = chan or (chan,)."""


@overload(_rows_of, jit_options={"cache": True})
def _rows_of_typed(ch):
    if isinstance(ch, types.BaseTuple):
        return lambda ch: ch[0]
    return lambda ch: ch


def _recover(y, num, den, like):
    """xhat = (y - num) * den in float32, den = 1 / scale rounded once (:func:`_den`); (y -
    num) / den in float64, den = scale: T is the type of ``like``, and y is rounded to T
    first; num None means a shift of 0 (no subtraction: y - 0 is y, the same bits). No test
    for 0 (it would stop the vectorisation): on the kept channels den is 0 (float32) or inf
    (float64), so xhat is 0 there. No fastmath flag, so LLVM folds nothing into the products
    that use xhat.

    float32 multiplies: a division in every element of sweep 2, which runs at the core's
    speed rather than memory's, was its one costly instruction. The reciprocal's rounding is
    the same relative error for every row of a channel: it would not average out of dgamma's
    sum, so each chunk's dgamma partial is corrected with the exact 1 / scale
    (:func:`_unbias`); dx sees at most one more rounding of xhat, next to y's own rounding
    carried through (docs/numerics.md measures both modes). float64 keeps the division: it has
    no wider type in which to correct, and no time goal.
    """


@overload(_recover, jit_options={"cache": True})
def _recover_typed(y, num, den, like):
    if isinstance(num, types.NoneType):  # a shift of 0: y - 0 is y
        if like == types.float64:
            return lambda y, num, den, like: _to(_ld(y), like) / den
        return lambda y, num, den, like: _to(_ld(y), like) * den
    if like == types.float64:
        return lambda y, num, den, like: (_to(_ld(y), like) - num) / den
    return lambda y, num, den, like: (_to(_ld(y), like) - num) * den


def _xhat(x, c, cj, rc):
    """xhat of element x: ((x - hi) - lo) * rc for c = (hi, lo) (x a row of x); recovered
    from y (x a row of y) for cj = (num, den), or (den,) where the shift is 0
    (:func:`_recover` with num = 0: y - 0 is y); x itself when both are None (a kept xhat, or
    a row kept whole)."""


@overload(_xhat, jit_options={"cache": True})
def _xhat_typed(x, c, cj, rc):
    if not isinstance(c, types.NoneType):
        return lambda x, c, cj, rc: ((_ld(x) - c[0]) - c[1]) * rc
    if isinstance(cj, types.BaseTuple) and len(cj) == 1:
        return lambda x, c, cj, rc: _recover(x, None, cj[0], rc)
    if not isinstance(cj, types.NoneType):
        return lambda x, c, cj, rc: _recover(x, cj[0], cj[1], rc)
    return lambda x, c, cj, rc: x


@njit(inline="always", cache=True)
def _dx(x, dy, g, c, cj, rc, mg, mgx):
    """One element: (rstd * ((dy * g - mean_g) - xhat * mean_gxhat), dy, xhat) in T, with xhat
    from x, c and cj (:func:`_xhat`).

    No FMA contraction here (the callers compile without it): fusing dy * g - mean_g would use
    the unrounded product where mean_g summed the rounded one (for D = 1, dx != 0).
    """
    d = _ld(dy)
    xhat = _xhat(x, c, cj, rc)
    return rc * ((d * g - mg) - xhat * mgx), d, xhat


@njit(cache=True)
def _write_dx(xr, dyr, dhr, zp, scale, st, k, cols, dxr, drr, pg, pb, nx, ndy):
    """dx = rstd * ((u - mean_g) - xhat * mean_gxhat) [+ dh]; pg += dy * xhat; pb += dy.

    xr, dyr, scale, dxr: (D,), xr a row of x (``cols`` None), of y (``cols`` = chan, whose
    num and den give xhat, :func:`_recover`) or a row's xhat as stored, in T (``cols`` = ());
    st[k]: (NSWEEP,) T, the row's (hi, lo, rstd, mean_g, mean_gxhat); dhr: (D,), added in the
    type of ``zp``, or (0,) without dh; drr: (D,) receives dx too (an add-norm's dresidual,
    where the caller keeps it apart from dx), else (0,). pg, pb: (D,) float64 (the products
    dy * xhat rounded to T first, as in the reference). Prefetches the next row's x (or y)
    and dy (``nx``, ``ndy``). The four cases are four loops, so that each vectorises.
    """
    D = xr.shape[0]
    xz = dxr.dtype.type(0)
    rz = drr.dtype.type(0)
    add = drr.shape[0] > 0
    with_dh = dhr.shape[0] > 0
    c = _centring(st, k, cols)
    rc, mg, mgx = st[k, 2], st[k, 3], st[k, 4]
    for j0 in range(0, D, SPAN):
        xb = xr[j0:j0 + SPAN]  # (<= SPAN,)
        db = dyr[j0:j0 + SPAN]
        gb = scale[j0:j0 + SPAN]
        cb = _span(cols, j0, j0 + SPAN)
        ob = dxr[j0:j0 + SPAN]
        rb = drr[j0:j0 + SPAN]
        hb = dhr[j0:j0 + SPAN]
        pgb = pg[j0:j0 + SPAN]
        pbb = pb[j0:j0 + SPAN]
        if add and with_dh:
            for j in range(xb.shape[0]):
                v, dy, xhat = _dx(xb[j], db[j], gb[j], c, _at(cb, j), rc, mg, mgx)
                t = _to(v, zp) + _to(_ld(hb[j]), zp)
                ob[j] = _to(t, xz)
                rb[j] = _to(t, rz)
                pgb[j] += dy * xhat
                pbb[j] += dy
        elif with_dh:
            for j in range(xb.shape[0]):
                v, dy, xhat = _dx(xb[j], db[j], gb[j], c, _at(cb, j), rc, mg, mgx)
                ob[j] = _to(_to(v, zp) + _to(_ld(hb[j]), zp), xz)
                pgb[j] += dy * xhat
                pbb[j] += dy
        elif not add:
            for j in range(xb.shape[0]):
                v, dy, xhat = _dx(xb[j], db[j], gb[j], c, _at(cb, j), rc, mg, mgx)
                ob[j] = _to(v, xz)
                pgb[j] += dy * xhat
                pbb[j] += dy
        else:
            for j in range(xb.shape[0]):
                v, dy, xhat = _dx(xb[j], db[j], gb[j], c, _at(cb, j), rc, mg, mgx)
                ob[j] = _to(v, xz)
                rb[j] = _to(v, rz)
                pgb[j] += dy * xhat
                pbb[j] += dy
        _prefetch_span(nx, j0, j0 + SPAN)
        _prefetch_span(ndy, j0, j0 + SPAN)


@njit(cache=True)
def _write_dx_tile(xt, dyt, dht, zp, scale, st, cols, dxt, drt, pg, pb):
    """dx for TILE rows at once, and their dgamma/dbeta terms added to pg, pb row by row.

    xt, dyt, dxt: (TILE, D), xt rows of x or of y (``cols`` as for _write_dx); dht, drt: as
    for _write_dx, (TILE, D) or (TILE, 0), drt of dxt's dtype (it gets a copy of dx: a fifth
    and sixth stream of stores in the unrolled loop stop LLVM from vectorising it); scale:
    (D,) T; st: (TILE, NSWEEP) T, per row as for _write_dx; pg, pb: (D,) float64.
    Each partial is loaded once, gets the TILE rows' terms added in row order (the same
    additions, in the same order, as TILE calls of _write_dx) and is stored once. The rows are
    unrolled by hand so that LLVM vectorises over j.
    """
    D = xt.shape[1]
    xz = dxt.dtype.type(0)
    add = drt.shape[1] > 0
    with_dh = dht.shape[1] > 0
    h0, h1 = _centring(st, 0, cols), _centring(st, 1, cols)
    h2, h3 = _centring(st, 2, cols), _centring(st, 3, cols)
    r0, g0, q0 = st[0, 2], st[0, 3], st[0, 4]
    r1, g1, q1 = st[1, 2], st[1, 3], st[1, 4]
    r2, g2, q2 = st[2, 2], st[2, 3], st[2, 4]
    r3, g3, q3 = st[3, 2], st[3, 3], st[3, 4]
    for j0 in range(0, D, SPAN):
        j1 = min(D, j0 + SPAN)
        a0, a1, a2, a3 = xt[0, j0:j1], xt[1, j0:j1], xt[2, j0:j1], xt[3, j0:j1]  # (<= SPAN,)
        b0, b1, b2, b3 = dyt[0, j0:j1], dyt[1, j0:j1], dyt[2, j0:j1], dyt[3, j0:j1]
        c0, c1, c2, c3 = dxt[0, j0:j1], dxt[1, j0:j1], dxt[2, j0:j1], dxt[3, j0:j1]
        e0, e1, e2, e3 = dht[0, j0:j1], dht[1, j0:j1], dht[2, j0:j1], dht[3, j0:j1]
        gb = scale[j0:j1]
        cb = _span(cols, j0, j1)
        pgb = pg[j0:j1]
        pbb = pb[j0:j1]
        if with_dh:  # an add-norm given dh: dx = dh + the norm's dx, added in zp's type
            for j in range(a0.shape[0]):
                g = gb[j]
                cj = _at(cb, j)
                v0, d0, x0 = _dx(a0[j], b0[j], g, h0, cj, r0, g0, q0)
                v1, d1, x1 = _dx(a1[j], b1[j], g, h1, cj, r1, g1, q1)
                v2, d2, x2 = _dx(a2[j], b2[j], g, h2, cj, r2, g2, q2)
                v3, d3, x3 = _dx(a3[j], b3[j], g, h3, cj, r3, g3, q3)
                c0[j] = _to(_to(v0, zp) + _to(_ld(e0[j]), zp), xz)
                c1[j] = _to(_to(v1, zp) + _to(_ld(e1[j]), zp), xz)
                c2[j] = _to(_to(v2, zp) + _to(_ld(e2[j]), zp), xz)
                c3[j] = _to(_to(v3, zp) + _to(_ld(e3[j]), zp), xz)
                pgb[j] = (((pgb[j] + d0 * x0) + d1 * x1) + d2 * x2) + d3 * x3
                pbb[j] = (((pbb[j] + d0) + d1) + d2) + d3
        else:
            for j in range(a0.shape[0]):
                g = gb[j]
                cj = _at(cb, j)
                v0, d0, x0 = _dx(a0[j], b0[j], g, h0, cj, r0, g0, q0)
                v1, d1, x1 = _dx(a1[j], b1[j], g, h1, cj, r1, g1, q1)
                v2, d2, x2 = _dx(a2[j], b2[j], g, h2, cj, r2, g2, q2)
                v3, d3, x3 = _dx(a3[j], b3[j], g, h3, cj, r3, g3, q3)
                c0[j], c1[j], c2[j], c3[j] = _to(v0, xz), _to(v1, xz), _to(v2, xz), _to(v3, xz)
                pgb[j] = (((pgb[j] + d0 * x0) + d1 * x1) + d2 * x2) + d3 * x3
                pbb[j] = (((pbb[j] + d0) + d1) + d2) + d3
        if add:  # dresidual = dx: the same dtype, so the same bits (a copy while in cache)
            for k in range(TILE):
                src = dxt[k, j0:j1]
                dst = drt[k, j0:j1]
                for j in range(src.shape[0]):
                    dst[j] = src[j]


@njit(inline="always", cache=True)
def _write_kept(dy, dh, zp, scale, keep, kept, st, k, dx, dres, pg, i):
    """Row i's dx on the kept channels ``keep`` (k,), from their xhat kept[i] (k,) T, written
    over what sweep 2 wrote there (it took xhat = 0), and their dgamma terms dy * xhat added
    to pg (sweep 2 added dy * 0: the same row order). Arrays as for :func:`_chunks`, indexed
    rather than sliced: it runs per row, inlined, and a view costs reference counting."""
    xz = dx.dtype.type(0)
    rz = dres.dtype.type(0)
    add = dres.shape[1] > 0
    rc, mg, mgx = st[k, 2], st[k, 3], st[k, 4]
    for q in range(keep.shape[0]):
        j = keep[q]
        v, d, xhat = _dx(kept[i, q], dy[i, j], scale[j], None, None, rc, mg, mgx)
        if dh.shape[1] > 0:
            t = _to(v, zp) + _to(_ld(dh[i, j]), zp)
            dx[i, j] = _to(t, xz)
            if add:
                dres[i, j] = _to(t, rz)
        else:
            dx[i, j] = _to(v, xz)
            if add:
                dres[i, j] = _to(v, rz)
        pg[j] += d * xhat


@njit(cache=True)
def _backward_row_f64(xs, hi, lo, rx, dyr, dhr, scale, st, centred, dxr, drr, pg, pb):
    """Row dx and its dgamma/dbeta terms in float64 (all (D,); st: (NSTATS,)), with
    xhat = ((xs - hi) - lo) * rx from the float64 row xs (x * SCALE, or xhat itself with
    hi = lo = 0 and rx = 1) and rstd = RSTD * SCALE.

    For scaled rows, and for rows whose T sums of the backward overflow (dy near the top of
    the range: the sums here run on a power-of-two scaling of dy).
    """
    D = xs.shape[0]
    r, scale_x = st[RSTD], st[SCALE]
    gs = _scaled_row(scale, 1.0)
    # dx is linear in dy: dy is scaled by 2**-k so that max|dy * scale| < 1 and no sum of the
    # row overflows (float64 dy near its top would), and dx by 2**k (and SCALE) at the end
    umax = 0.0
    for j in range(D):
        umax = max(umax, abs(np.float64(_ld(dyr[j])) * gs[j]))
    k = max(0, math.frexp(umax)[1]) if np.isfinite(umax) else 0
    dys = _scaled_row(dyr, math.ldexp(1.0, -k))
    su, sut, _ = _sum_grad(xs, dys, gs, hi, 0.0, False)
    mg = su / D if centred else 0.0
    mgx = rx * (sut - lo * su) / D
    shift = k + math.frexp(scale_x)[1] - 1  # scale_x = 2**(frexp exponent - 1)
    add = dhr.shape[0] > 0
    two = drr.shape[0] > 0
    xz = dxr.dtype.type(0)
    rz = drr.dtype.type(0)
    for j in range(D):
        xhat = ((xs[j] - hi) - lo) * rx
        # the powers of two last, in one exact step: r * SCALE may be subnormal, 2**k overflow
        v = math.ldexp(r * ((dys[j] * gs[j] - mg) - xhat * mgx), shift)
        if add:
            v += np.float64(_ld(dhr[j]))
        dxr[j] = _to(v, xz)
        if two:
            drr[j] = _to(v, rz)
        dy = _ld(dyr[j])
        pg[j] += dy * xhat
        pb[j] += dy


@njit(cache=True)
def _recovered_row(yr, chan, keep, kr, z):
    """A row's xhat (D,) as float64 for the float64 path: T xhat recovered from y (yr (D,)),
    the kept channels' from ``kr`` (k,)."""
    xs = np.empty(yr.shape[0])
    for j in range(yr.shape[0]):
        xs[j] = _recover(yr[j], chan[CH_NUM, j], chan[CH_DEN, j], z)
    for q in range(keep.shape[0]):
        xs[keep[q]] = kr[q]
    return xs


def _less(v, nb, j):
    """v - nb[j], or v itself where ``nb`` is None (a shift of 0, :func:`_num`)."""


@overload(_less, inline="always", jit_options={"cache": True})
def _less_typed(v, nb, j):
    if isinstance(nb, types.NoneType):
        return lambda v, nb, j: v
    return lambda v, nb, j: v - nb[j]


@njit(inline="always", cache=True)
def _terms(d, dw, g, yv, nb, j, z):
    """One element's terms of sweep 1 from y: (dy * scale, dy * (y - shift_j)), the second
    with dy times w in a block holding kept channels (dw = dy * w, else dy), shift_j from
    ``nb`` (:func:`_less`) (:func:`_sum_grad_y`)."""
    return d * g, dw * _less(_to(_ld(yv), z), nb, j)


@njit(fastmath={"reassoc"}, cache=True)
def _block_grad_y(yb, db, gb, nb, wb, masked, z):
    """(sum_j u_j, sum_j u_j * xhat_j) in T over one block of a row of y (yb, db, gb, wb:
    (<= BLOCK,), wb read only where ``masked``; nb: the block's shift, or None,
    :func:`_less`): the only place the sums of sweep 1 from y are formed, for a row alone and
    for each row of a tile, so that a row's sums, and so its dx, are the same bits in any
    batch (reassociated, a loop's order is LLVM's, one order per loop)."""
    b1 = z
    b2 = z
    if masked:
        for j in range(yb.shape[0]):
            d = _ld(db[j])
            t1, t2 = _terms(d, d * wb[j], gb[j], yb[j], nb, j, z)
            b1 += t1
            b2 += t2
    else:
        for j in range(yb.shape[0]):
            d = _ld(db[j])
            t1, t2 = _terms(d, d, gb[j], yb[j], nb, j, z)
            b1 += t1
            b2 += t2
    return b1, b2


@njit(cache=True)
def _sum_grad_y(yr, dyr, ch, blocks, z):
    """(sum_j u_j, sum_j u_j * xhat_j) of a row of y over the recovered channels, u = dy *
    scale (yr, dyr: (D,); ch: chan (4, D) T, or (chan,) where the shift is 0, whose sweep
    reads no shift row, :func:`_unshifted`): each block's sums (:func:`_block_grad_y`) in T,
    joined in float64 in block order.

    There u_j * xhat_j = dy_j * (y_j - shift_j): the same number without the division and the
    product by scale (two roundings fewer). In the blocks that hold kept channels (``blocks``
    (ceil(D / BLOCK),) bool) the terms are multiplied by w, so the kept channels add 0 (their
    terms are the caller's), or NaN where y overflowed there: the row then takes the float64
    path (sweep 2 would divide inf by inf). The other blocks read no w.
    """
    chan = _rows_of(ch)
    s1 = 0.0
    s2 = 0.0
    for j0 in range(0, yr.shape[0], BLOCK):
        j1 = min(yr.shape[0], j0 + BLOCK)
        b1, b2 = _block_grad_y(yr[j0:j1], dyr[j0:j1], chan[CH_SCALE, j0:j1], _num(ch, j0, j1),
                               chan[CH_W, j0:j1], blocks[j0 // BLOCK], z)
        s1 += b1
        s2 += b2
    return s1, s2


@njit(cache=True)
def _sum_grad_y_tile(yt, dyt, ch, blocks, z):
    """:func:`_sum_grad_y` of TILE rows at once (yt, dyt: (TILE, D)): (su, sut) of rows 0, 1,
    2, 3, block by block, each block's per-channel values (scale, shift, w) sliced once and
    read by the TILE rows in turn while they are in L1 (for long rows, reading them once a
    row took sweep 1 out of L1). Each row's sums are :func:`_sum_grad_y`'s bits: the same
    block sums joined in the same order."""
    chan = _rows_of(ch)
    a0 = a1 = a2 = a3 = c0 = c1 = c2 = c3 = 0.0
    for j0 in range(0, yt.shape[1], BLOCK):
        j1 = min(yt.shape[1], j0 + BLOCK)
        gb = chan[CH_SCALE, j0:j1]  # (<= BLOCK,)
        nb = _num(ch, j0, j1)
        wb = chan[CH_W, j0:j1]
        masked = blocks[j0 // BLOCK]
        p0, q0 = _block_grad_y(yt[0, j0:j1], dyt[0, j0:j1], gb, nb, wb, masked, z)
        p1, q1 = _block_grad_y(yt[1, j0:j1], dyt[1, j0:j1], gb, nb, wb, masked, z)
        p2, q2 = _block_grad_y(yt[2, j0:j1], dyt[2, j0:j1], gb, nb, wb, masked, z)
        p3, q3 = _block_grad_y(yt[3, j0:j1], dyt[3, j0:j1], gb, nb, wb, masked, z)
        a0, a1, a2, a3 = a0 + p0, a1 + p1, a2 + p2, a3 + p3
        c0, c1, c2, c3 = c0 + q0, c1 + q1, c2 + q2, c3 + q3
    return a0, c0, a1, c1, a2, c2, a3, c3


NSWEEP = 5  # a row's values for sweep 2, in T: hi, lo (0 for rows of y), rstd, mean_g,
# mean_gxhat


def _row_sums(src, dy, scale, me, stats, check, centred, i, st, k, pre):
    """Sweep 1 of row i: fills st[k] (NSWEEP,) T for sweep 2; returns (fast, same): whether
    the row may take the T sweep 2 (SCALE = 1 and finite sums), and whether x[i] matched the
    forward's checksum (True where none is verified).

    src: (M, D) x where ``me`` is None, else y (``me`` as for :func:`backward_y_chunks`);
    ``pre``: None, or the row's sums from y over the recovered channels, already formed
    (:func:`_sum_grad_y_tile`).
    Inlined where it is called: it runs once per row, and a call passing a dozen arrays cost
    10% of the backward of rows of 256.
    """


@overload(_row_sums, inline="always", jit_options={"cache": True})
def _row_sums_typed(src, dy, scale, me, stats, check, centred, i, st, k, pre):
    from_x = isinstance(me, types.NoneType)
    formed = not isinstance(pre, types.NoneType)

    def impl(src, dy, scale, me, stats, check, centred, i, st, k, pre):
        D = src.shape[1]
        z = scale.dtype.type(0)
        s = stats[i]
        r = s[RSTD]
        if from_x:
            hi = _to(s[HI], z)
            lo = _to(s[LO], z)
            verify = check.shape[0] > 0
            su, sut, ck = _sum_grad(src[i], dy[i], scale, hi, z, verify)
            same = not verify or ck == check[i]
            mgx = _to(r * (sut - lo * su) / D, z)
        else:
            chan, keep, kept, blocks = me[0], me[1], me[2], me[5]
            if formed:
                su, sut = pre
            elif me[6]:
                su, sut = _sum_grad_y(src[i], dy[i], chan, blocks, z)
            else:
                su, sut = _sum_grad_y(src[i], dy[i], (chan,), blocks, z)
            for q in range(keep.shape[0]):  # the kept channels' terms, indexed: no views
                j = keep[q]
                sut += (_ld(dy[i, j]) * scale[j]) * kept[i, q]
            same = True
            hi = z
            lo = z
            mgx = _to(sut / D, z)
        st[k, 0] = hi
        st[k, 1] = lo
        st[k, 2] = _to(r, z)
        st[k, 3] = _to(su / D, z) if centred else z
        st[k, 4] = mgx
        return same and s[SCALE] == 1.0 and np.isfinite(su) and np.isfinite(sut), same
    return impl


def _tile_sums(src, dy, scale, me, stats, check, centred, i, st):
    """Sweep 1 of the TILE rows from row i (:func:`_row_sums` of each, st[k] for row i + k;
    from y, their sums over the recovered channels in one sweep, :func:`_sum_grad_y_tile`);
    whether every row of the tile may take the T sweep 2. Inlined where it is called."""


@overload(_tile_sums, inline="always", jit_options={"cache": True})
def _tile_sums_typed(src, dy, scale, me, stats, check, centred, i, st):
    if isinstance(me, types.NoneType):
        def from_x(src, dy, scale, me, stats, check, centred, i, st):
            fast = True
            for k in range(TILE):
                row_fast, _ = _row_sums(src, dy, scale, me, stats, check, centred, i + k, st, k,
                                        None)
                fast = fast and row_fast
            return fast
        return from_x

    def from_y(src, dy, scale, me, stats, check, centred, i, st):
        z = scale.dtype.type(0)
        if me[6]:
            sums = _sum_grad_y_tile(src[i:i + TILE], dy[i:i + TILE], me[0], me[5], z)
        else:
            sums = _sum_grad_y_tile(src[i:i + TILE], dy[i:i + TILE], (me[0],), me[5], z)
        fast = True
        for k in range(TILE):
            row_fast, _ = _row_sums(src, dy, scale, me, stats, check, centred, i + k, st, k,
                                    (sums[2 * k], sums[2 * k + 1]))
            fast = fast and row_fast
        return fast
    return from_y


def _whole_rows(me):
    """(r,) int64: rows of ``me`` (the rows kept whole), or none for the default."""


@overload(_whole_rows, jit_options={"cache": True})
def _whole_rows_typed(me):
    if isinstance(me, types.NoneType):
        return lambda me: np.empty(0, np.int64)
    return lambda me: me[3]


@njit(inline="always", cache=True)
def _whole_index(rows, p, whole, i, M):
    """(q, p, whole) at row i, rows met in ascending order: q = p where row i is the next row
    kept whole (rows[p] = whole), and then p and whole move on to the one after it; else
    q = -1 and they stay."""
    if i != whole:
        return -1, p, whole
    return p, p + 1, rows[p + 1] if p + 1 < rows.shape[0] else M


def _cols(me):
    """None for the default, chan of ``me`` for the memory-efficient backward."""


@overload(_cols, jit_options={"cache": True})
def _cols_typed(me):
    if isinstance(me, types.NoneType):
        return lambda me: None
    return lambda me: me[0]


@njit(cache=True)
def _backward_whole_row(xr, dy, dh, zp, scale, stats, centred, dx, dres, pg, pb, i, st, k, nx,
                        ndy):
    """Row i of the backward from y where the forward kept the row whole: xhat is its stored
    row xr (D,) T on every channel, and the row runs the default's formulas on it: sweep 1
    su = sum_j u_j, sut = sum_j u_j * xhat_j (mean(g * xhat) = sut / D), then sweep 2, or the
    float64 path where SCALE != 1 or the T sums are not finite. Arrays as for :func:`_chunks`;
    st[k] receives the row's values for sweep 2; nx, ndy: the next row of y and of dy (D,),
    prefetched."""
    D = xr.shape[0]
    z = scale.dtype.type(0)
    s = stats[i]
    su, sut, _ = _sum_grad(xr, dy[i], scale, z, z, False)
    st[k, 0] = z
    st[k, 1] = z
    st[k, 2] = _to(s[RSTD], z)
    st[k, 3] = _to(su / D, z) if centred else z
    st[k, 4] = _to(sut / D, z)
    if s[SCALE] == 1.0 and np.isfinite(su) and np.isfinite(sut):
        _write_dx(xr, dy[i], dh[i], zp, scale, st, k, (), dx[i], dres[i], pg, pb, nx, ndy)
    else:
        _backward_row_f64(_scaled_row(xr, 1.0), 0.0, 0.0, 1.0, dy[i], dh[i], scale, s, centred,
                          dx[i], dres[i], pg, pb)


@njit(cache=True)
def _backward_row(src, dy, dh, zp, scale, me, stats, check, centred, dx, dres, pg, pb, i, st,
                  k, q):
    """Row i of the backward alone: dx[i] (and dres[i]), its terms added to pg, pb.

    Arguments as for :func:`_row_sums`; q: the row's index among the rows kept whole (its
    stored xhat is xrows[q] of ``me``), or -1. Returns False when x[i] no longer matches the
    forward's checksum (nothing written then).
    """
    M = src.shape[0]
    nxt = min(i + 1, M - 1)
    if me is not None:
        if q >= 0:
            _backward_whole_row(me[4][q], dy, dh, zp, scale, stats, centred, dx, dres, pg, pb,
                                i, st, k, src[nxt], dy[nxt])
            return True
    fast, same = _row_sums(src, dy, scale, me, stats, check, centred, i, st, k, None)
    if not same:
        return False
    dhr = dh[i]  # (D,), or (0,) when there is no dh
    drr = dres[i]  # (D,), or (0,) without a separate dresidual
    s = stats[i]
    if fast:
        if _shifted(me):
            _write_dx(src[i], dy[i], dhr, zp, scale, st, k, _cols(me), dx[i], drr, pg, pb,
                      src[nxt], dy[nxt])
        else:
            _write_dx(src[i], dy[i], dhr, zp, scale, st, k, _unshifted(_cols(me)), dx[i], drr,
                      pg, pb, src[nxt], dy[nxt])
        if me is not None:
            if me[1].shape[0] > 0:
                _write_kept(dy, dh, zp, scale, me[1], me[2], st, k, dx, dres, pg, i)
    elif me is None:
        _backward_row_f64(_scaled_row(src[i], s[SCALE]), s[HI], s[LO], s[RSTD], dy[i], dhr,
                          scale, s, centred, dx[i], drr, pg, pb)
    else:
        chan, keep, kept = me[0], me[1], me[2]
        xs = _recovered_row(src[i], chan, keep, kept[i], scale.dtype.type(0))
        _backward_row_f64(xs, 0.0, 0.0, 1.0, dy[i], dhr, scale, s, centred, dx[i], drr, pg,
                          pb)
    return True


@njit(cache=True)
def _chunks(src, dy, dh, zp, scale, me, stats, check, flags, dx, dres, partial, ok, c0, c1):
    """Chunks c0 <= c < c1 of either backward: :func:`backward_chunks` (``me`` None: src is x)
    and :func:`backward_y_chunks` (src is y)."""
    M = src.shape[0]
    C = partial.shape[0]
    centred = (flags & CENTRED) != 0
    verify = check.shape[0] > 0
    tiles = dres.shape[1] == 0 or dres.dtype == dx.dtype
    owner = np.empty((TILE, NSWEEP), scale.dtype)
    st = _unmanaged(owner)  # per row: the values sweep 2 reads
    cols = _cols(me)
    shifted = _shifted(me)
    rows = _whole_rows(me)  # (r,) ascending: the rows kept whole (none for the default)
    for c in range(c0, c1):
        pg = partial[c, 0]  # (D,) float64
        pb = partial[c, 1]  # (D,) float64
        pg[:] = 0.0
        pb[:] = 0.0
        i = c * M // C
        end = (c + 1) * M // C
        p = np.searchsorted(rows, i)  # the chunk's first row kept whole is rows[p] ...
        whole = rows[p] if p < rows.shape[0] else M  # ... whole (M: none left)
        while tiles and i + TILE <= end:
            # a tile holding a row kept whole goes row by row
            fast = i + TILE <= whole and _tile_sums(src, dy, scale, me, stats, check, centred,
                                                    i, st)
            if fast:
                if shifted:
                    _write_dx_tile(src[i:i + TILE], dy[i:i + TILE], dh[i:i + TILE], zp, scale,
                                   st, cols, dx[i:i + TILE], dres[i:i + TILE], pg, pb)
                else:
                    _write_dx_tile(src[i:i + TILE], dy[i:i + TILE], dh[i:i + TILE], zp, scale,
                                   st, _unshifted(cols), dx[i:i + TILE], dres[i:i + TILE], pg,
                                   pb)
                if me is not None:
                    if me[1].shape[0] > 0:
                        for k in range(TILE):
                            _write_kept(dy, dh, zp, scale, me[1], me[2], st, k, dx, dres, pg,
                                        i + k)
                if verify:
                    for k in range(TILE):
                        ok[i + k] = True
            else:
                for k in range(TILE):
                    q, p, whole = _whole_index(rows, p, whole, i + k, M)
                    same = _backward_row(src, dy, dh, zp, scale, me, stats, check, centred, dx,
                                         dres, pg, pb, i + k, st, k, q)
                    if verify:
                        ok[i + k] = same
            i += TILE
        for k in range(i, end):
            q, p, whole = _whole_index(rows, p, whole, k, M)
            same = _backward_row(src, dy, dh, zp, scale, me, stats, check, centred, dx, dres,
                                 pg, pb, k, st, 0, q)
            if verify:
                ok[k] = same
        if me is not None:
            _unbias(pg, me[0])
    _alive(owner)


def _unbias(pg, chan):
    """pg (D,) float64 *= 1 / (scale * r) per channel, scale and r from ``chan`` (float32):
    a chunk's dgamma partials from y, each channel's sum of dy * xhat with xhat = (y - shift)
    * r, r = 1 / scale rounded to float32, turned into the sum with the exact 1 / scale
    (scale * r is exact in float64; the kept channels, r = 0, keep their sums). The
    reciprocal's rounding is the same relative error on every term of a channel, so it would
    not average out over the rows; the rounding of each xhat does, as a division's would.
    Formed here, once a chunk, rather than kept in an array: for long rows a (D,) float64
    array more per call cost more than the divisions. Nothing in float64, whose xhat is
    divided."""


@overload(_unbias, jit_options={"cache": True, "error_model": "numpy"})
def _unbias_typed(pg, chan):
    if chan.dtype == types.float64:
        return lambda pg, chan: None

    def unbias(pg, chan):
        for j in range(pg.shape[0]):
            r = chan[CH_DEN, j]
            # formed on every channel, then chosen: the loop vectorises
            c = 1.0 / (np.float64(chan[CH_SCALE, j]) * np.float64(r))
            pg[j] *= 1.0 if r == 0 else c
    return unbias


@njit(cache=True)
def backward_chunks(x, dy, dh, zp, scale, stats, check, flags, dx, dres, partial, ok, c0, c1):
    """Chunks c0 <= c < c1 of the backward: their rows' dx (M, D) and dres (M, D) for an
    add-norm, and partial[c] (2, D) float64, the chunk's (dgamma, dbeta) partial sums.

    x, dy: (M, D) storage; dh: (M, D), or (M, 0) without dh, added to the norm's dx in the
    type of ``zp``; dres: (M, D), a second copy of dx for an add-norm whose dresidual is kept
    apart from dx, else (M, 0); scale: (D,) T; stats:
    (M, NSTATS) float64; flags: CENTRED; partial: (C, 2, D) float64 for C = n_chunks(M), chunk
    c holding rows c*M//C to (c+1)*M//C. check (M,) uint64 and ok (M,) bool: whether each row
    of x matched the forward's checksum; both (0,) to skip the comparison.
    Rows go TILE at a time (the chunk's last M % TILE rows, a tile holding a scaled or changed
    row or a row whose T sums are not finite, and add-norms whose dx and dresidual differ in
    dtype, one at a time): the partials get the same additions in the same row order.
    """
    _chunks(x, dy, dh, zp, scale, None, stats, check, flags, dx, dres, partial, ok, c0, c1)


_F32_LARGEST = np.float32(np.finfo(np.float32).max)


def _den(g):
    """The divisor row's value for scale ``g`` (:func:`_recover`): in float32 1 / g rounded
    once (the largest float32 where that rounds to inf: a recovered |g| may be as small as
    tiny / MARGIN = 2**-128, whose reciprocal is off by at most 2**-24 relative then), in
    float64 g itself; for g = 0 (what a kept channel gets) 0 and inf, so that xhat = 0 on the
    kept channels."""


@overload(_den, jit_options={"cache": True, "error_model": "numpy"})
def _den_typed(g):
    if g == types.float64:
        return lambda g: g if g != 0 else np.inf

    def reciprocal(g):  # branch-free, so that the loop filling the row vectorises
        r = max(min(np.float32(1) / g, _F32_LARGEST), -_F32_LARGEST)
        return np.float32(0) if g == 0 else r
    return reciprocal


@njit(cache=True)
def backward_y_chunks(y, dy, dh, zp, scale, shift, keep, kept, rows, xrows, stats, flags, dx,
                      dres, partial, c0, c1):
    """Chunks c0 <= c < c1 of the memory-efficient backward, which reads y instead of x.

    y: (M, D) storage (x's dtype); scale, shift: (D,) T; keep: (k,) int64, the channels whose
    xhat the forward kept (:func:`layernorm.recovery.kept_channels`), ascending; kept: (M, k)
    T, their xhat; rows: (r,) int64, the rows the forward kept whole
    (:func:`layernorm.recovery.kept_rows`), ascending; xrows: (r, D) T, their xhat; stats: the
    forward's; the rest as for :func:`backward_chunks`. xhat = (y - shift) / scale on the
    other channels, in T; rstd = RSTD * SCALE (rows with SCALE != 1, or whose T sums are not
    finite, take the float64 path, as in the default). The sweeps see ``me`` = (chan, keep,
    kept, rows, xrows, blocks, shifted): chan the per-channel rows named by :data:`CH_SCALE`
    and the names beside it (w filled only in the blocks that hold kept channels); blocks
    (ceil(D / BLOCK),) bool, those blocks; shifted, whether the shift is non-zero on a
    recovered channel (else the sweeps read no shift row, :func:`_unshifted`). Sweep 2
    computes xhat = 0 on the kept channels, whose dx and dgamma terms are then written from
    ``kept`` (:func:`_write_kept`); a row kept whole reads xrows instead of y
    (:func:`_backward_whole_row`), in the same row order.
    """
    D = scale.shape[0]
    owner = np.empty((4, D), scale.dtype)
    chan = _unmanaged(owner)
    chan[CH_SCALE] = scale
    chan[CH_NUM] = shift
    z = scale.dtype.type(0)
    for j in range(D):
        chan[CH_DEN, j] = _den(scale[j])
    blocks = np.zeros((D + BLOCK - 1) // BLOCK, np.bool_)
    for q in range(keep.shape[0]):
        j = keep[q]
        if not blocks[j // BLOCK]:  # w is read only in the blocks that hold kept channels
            blocks[j // BLOCK] = True
            chan[CH_W, j - j % BLOCK:j - j % BLOCK + BLOCK] = 1.0
        chan[CH_NUM, j] = 0.0
        chan[CH_DEN, j] = _den(z)
        chan[CH_W, j] = 0.0
    shifted = 0  # channels recovered with a shift other than +0 (-0 counts: y - -0 turns a -0
    for j in range(D):  # y into +0): where none, no sweep reads num
        shifted += _bits(chan[CH_NUM, j]) != 0
    # both sweeps read the scale from chan: one copy of it in cache, not two (for long rows
    # the per-channel rows are a large part of what a tile's sweeps keep in cache)
    _chunks(y, dy, dh, zp, chan[CH_SCALE], (chan, keep, kept, rows, xrows, blocks, shifted > 0),
            stats, np.empty(0, np.uint64), flags, dx, dres, partial, np.empty(0, np.bool_), c0,
            c1)
    _alive(owner)


@njit(cache=True)
def reduce_chunks(partial, out):
    """out (2, D) float64 = sum over c of partial (C, 2, D), added in chunk order."""
    C, _, D = partial.shape
    for k in range(2):
        acc = out[k]  # (D,)
        acc[:] = 0.0
        for c in range(C):
            p = partial[c, k]  # (D,)
            for j in range(D):
                acc[j] += p[j]


# --- entry points as C functions ---------------------------------------------------------
# Compiled by layernorm.cpu.entry with Numba's cfunc, one per combination of storage types.
# Every argument is a pointer, an int64 or a float64, so that one C type serves every storage
# combination; a_p and t_p are null pointers whose types name the dtype the add is computed in
# and the compute dtype.

def forward_c(x_p, r_p, h_p, y_p, a_p, t_p, g_p, b_p, eps, flags, stats_p, check_p, m, d, dr,
              dg, db, ms, mc, i0, i1):
    zp = carray(a_p, (0,)).dtype.type(0)
    zt = carray(t_p, (0,)).dtype.type(0)
    forward_rows(
        carray(x_p, (m, d)), carray(r_p, (m, dr)), zp, zt, carray(g_p, (dg,)),
        carray(b_p, (db,)), eps, flags, carray(y_p, (m, d)), carray(h_p, (m, dr)),
        carray(stats_p, (ms, NSTATS)), carray(check_p, (mc,)), i0, i1)


def backward_c(x_p, dy_p, dh_p, dx_p, dr_p, a_p, scale_p, stats_p, check_p, flags, partial_p,
                ok_p, m, d, dhc, drc, mc, c, c0, c1):
    zp = carray(a_p, (0,)).dtype.type(0)
    backward_chunks(
        carray(x_p, (m, d)), carray(dy_p, (m, d)), carray(dh_p, (m, dhc)), zp,
        carray(scale_p, (d,)), carray(stats_p, (m, NSTATS)), carray(check_p, (mc,)), flags,
        carray(dx_p, (m, d)), carray(dr_p, (m, drc)), carray(partial_p, (c, 2, d)),
        carray(ok_p, (mc,)), c0, c1)


def backward_y_c(y_p, dy_p, dh_p, dx_p, dr_p, a_p, scale_p, shift_p, keep_p, kept_p, rows_p,
                 xrows_p, stats_p, flags, partial_p, m, d, dhc, drc, k, r, c, c0, c1):
    zp = carray(a_p, (0,)).dtype.type(0)
    backward_y_chunks(
        carray(y_p, (m, d)), carray(dy_p, (m, d)), carray(dh_p, (m, dhc)), zp,
        carray(scale_p, (d,)), carray(shift_p, (d,)), carray(keep_p, (k,)),
        carray(kept_p, (m, k)), carray(rows_p, (r,)), carray(xrows_p, (r, d)),
        carray(stats_p, (m, NSTATS)), flags, carray(dx_p, (m, d)), carray(dr_p, (m, drc)),
        carray(partial_p, (c, 2, d)), c0, c1)


def reduce_c(partial_p, out_p, c, d):
    reduce_chunks(carray(partial_p, (c, 2, d)), carray(out_p, (2, d)))


def n_chunks(M: int) -> int:
    """Number of row chunks of the backward's dgamma/dbeta partials: a function of M only.

    A power of two (so 2, 4, 8, 16 threads share them evenly), at most MAX_CHUNKS, each with
    at least ROWS_PER_CHUNK rows when M allows.
    """
    c = 1
    while c * 2 <= MAX_CHUNKS and c * 2 * ROWS_PER_CHUNK <= M:
        c *= 2
    return c
