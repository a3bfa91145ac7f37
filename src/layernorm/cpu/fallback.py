"""The engine's two entry points in NumPy, for a machine where the C++ engine cannot run.

:func:`forward_into` and :func:`backward_into` take the arguments of the engine's
``forward_into`` and ``backward_into`` (``engine/csrc/arrays.cpp``) as NumPy arrays of values and
fill the same outputs: y, h, the statistics (:mod:`.statistics`' layout), the checksums, dx,
dresidual and the sums of dgamma and dbeta. The arithmetic is the reference's
(:mod:`layernorm.reference`), so results agree with the engine's within the tolerance table,
not bit for bit; the time is the reference's, on one thread.
"""

from __future__ import annotations

import zlib

import numpy as np

from ..dtypes import widest_compute_dtype
from ..reference.core import NormCache, OutputCache, _backward, _normalize
from . import statistics
from .statistics import HI, LO, RSTD, SCALE

__all__ = ["backward_into", "checksums", "forward_into"]

_F64 = np.dtype(np.float64)


def _store(dst: np.ndarray, values: np.ndarray) -> None:
    """dst = values rounded once to dst's dtype. NumPy's (ml_dtypes') float64 to bfloat16 goes
    through float32 and can round twice; there float32 rounded to odd comes first, which the
    second rounding cannot undo (as the engine converts)."""
    if values.dtype == np.float64 and dst.dtype.name == "bfloat16":
        with np.errstate(over="ignore", invalid="ignore"):
            f32 = values.astype(np.float32)
            # toward zero where float32's nearest rounded away from zero, then the last bit set
            # where inexact: the float32 value rounded to odd
            away = np.abs(f32.astype(np.float64)) > np.abs(values)
            f32 = np.where(away, np.nextafter(f32, np.float32(0)), f32)
            inexact = (f32.astype(np.float64) != values) & np.isfinite(values)
        f32 = np.where(inexact, (f32.view(np.uint32) | np.uint32(1)).view(np.float32), f32)
        values = f32
    np.copyto(dst, values, casting="unsafe")


def checksums(a: np.ndarray) -> np.ndarray:
    """(M,) uint64: a checksum of each row's bits of the C-contiguous (M, D) ``a``."""
    rows = a.view(np.uint8).reshape(a.shape[0], -1)
    return np.fromiter((zlib.crc32(row) for row in rows), np.uint64, a.shape[0])


def _mean(x64: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) (M,): the rows' mean as hi + lo, hi the float64 mean and lo the mean of the
    rows less hi (the reference's corrected two-pass: lo carries what hi's rounding lost, which
    matters where a row is nearly constant)."""
    hi = x64.mean(axis=1)
    return hi, (x64 - hi[:, None]).mean(axis=1)


def _statistics(xn: np.ndarray, rstd: np.ndarray, centred: bool) -> np.ndarray:
    """(M, NSTATS) of the rows of xn (M, D) with their rstd (M,): the mean as HI + LO
    (:func:`_mean`), SCALE 1; a finite row whose float64 sums overflow is scaled by a power of
    two first, as the engine scales it."""
    x64 = xn.astype(np.float64)
    out = np.zeros((xn.shape[0], statistics.NSTATS))
    out[:, RSTD] = rstd
    out[:, SCALE] = 1.0
    if not centred:
        return out
    out[:, HI], out[:, LO] = _mean(x64)
    big = ~np.isfinite(out[:, HI] + out[:, LO]) & np.isfinite(x64).all(axis=1)
    if big.any():
        e = np.frexp(np.abs(x64[big]).max(axis=1))[1]  # (B,) max|x| < 2**e
        out[big, HI], out[big, LO] = _mean(np.ldexp(x64[big], -e[:, None]))
        out[big, SCALE] = np.ldexp(1.0, -e)
        out[big, RSTD] = np.ldexp(rstd[big], e)
    return out


def forward_into(x: np.ndarray, residual: np.ndarray | None, scale: np.ndarray,
                 shift: np.ndarray, eps: float, centred: bool, y: np.ndarray,
                 h: np.ndarray | None, stats: np.ndarray | None,
                 checksum: np.ndarray | None) -> None:
    """y = the norm of x (or of h = x + residual, rounded once to h's dtype, written to h),
    with the scale and shift (D,) in the compute dtype; each row's statistics into ``stats``
    and the checksum of the normalized row's bits into ``checksum`` where given."""
    cdt = scale.dtype
    xn = x
    with np.errstate(all="ignore"):  # inf and NaN propagate, as in the engine, silently
        if residual is not None:
            adt = widest_compute_dtype(x.dtype, residual.dtype, h.dtype)
            _store(h, np.add(x, residual, dtype=adt))
            xn = h
        xhat, rstd = _normalize(xn, cdt, eps, centred)  # (M, D), (M,) in cdt
        xhat *= scale
        if centred:
            xhat += shift
        _store(y, xhat)
        if stats is not None:
            stats[...] = _statistics(xn, rstd, centred)
    if checksum is not None:
        checksum[...] = checksums(xn)


def backward_into(src: np.ndarray, dy: np.ndarray, dh: np.ndarray | None, scale: np.ndarray,
                  stats: np.ndarray, checksum: np.ndarray | None, shift: np.ndarray | None,
                  keep: np.ndarray | None, kept: np.ndarray | None, rows: np.ndarray | None,
                  xrows: np.ndarray | None, centred: bool, dx: np.ndarray,
                  dres: np.ndarray | None, sums: np.ndarray, ok: np.ndarray | None) -> None:
    """dx (and dresidual) = dh + the norm's gradient, and sums (2, D) = dgamma, dbeta in
    float64, from src: x (or h) with its statistics, or with ``shift`` given, y with the kept
    channels and rows (the backward from y). ``ok`` gets whether each row still matches its
    ``checksum``, where one is given."""
    cdt = scale.dtype
    m, d = src.shape
    if checksum is not None:
        ok[...] = checksums(src) == checksum
    with np.errstate(over="ignore"):
        rstd = statistics.rstd(stats).astype(cdt)
    params = dict(centred=centred, rstd=rstd, scale=scale, gamma_dtype=_F64, beta_dtype=_F64,
                  x_shape=(m, d), x_dtype=cdt)
    if shift is None:
        cache = NormCache(xhat=statistics.xhat(src, stats, cdt), **params)
    else:
        cache = OutputCache(y=src, shift=shift, keep=keep, xhat_kept=kept, rows=rows,
                            xhat_rows=xrows, **params)
    with np.errstate(all="ignore"):
        dnorm, sums[0], sums[1] = _backward(dy, cache, cdt)  # (M, D) in cdt
        if dh is not None or dres is not None:
            adt = widest_compute_dtype(dx.dtype, cdt, *(() if dres is None else (dres.dtype,)))
            dnorm = dnorm.astype(adt) if dh is None else np.add(dnorm, dh, dtype=adt)
        _store(dx, dnorm)
        if dres is not None:
            _store(dres, dnorm)
