"""The statistics a CPU forward keeps per row, and what they mean.

One row of ``stats`` (M, NSTATS) float64 per row of x, its columns named here:

    HI, LO  the row's mean as an unevaluated sum HI + LO of two numbers of the compute dtype T
            (both 0 for RMSNorm)
    RSTD    1/sqrt(var + eps) (LayerNorm) or 1/sqrt(mean(x**2) + eps) (RMSNorm)
    SCALE   the power of two the row was scaled by: 1, except on a row whose T sums overflow,
            whose statistics belong to x * SCALE (then mean = (HI + LO) / SCALE and
            rstd = RSTD * SCALE)

so that xhat = ((x * SCALE - HI) - LO) * RSTD on every row. The C++ engine writes this layout
(``kHi``, ``kLo``, ``kRstd``, ``kScale``, ``kStats`` in ``engine/csrc/engine.h``), the NumPy
fallback (:mod:`.fallback`) writes it, and the torch ops return it on CPU tensors.
"""

from __future__ import annotations

import numpy as np

__all__ = ["HI", "LO", "NSTATS", "RSTD", "SCALE", "mean", "rstd", "xhat"]

HI, LO, RSTD, SCALE = 0, 1, 2, 3
NSTATS = 4


def mean(stats: np.ndarray) -> np.ndarray:
    """(M,) float64 row means, (HI + LO) / SCALE (0 for RMSNorm)."""
    return (stats[:, HI] + stats[:, LO]) / stats[:, SCALE]


def rstd(stats: np.ndarray) -> np.ndarray:
    """(M,) float64 true rstd of each row, RSTD * SCALE."""
    return stats[:, RSTD] * stats[:, SCALE]


def xhat(xs: np.ndarray, stats: np.ndarray, cdt: np.dtype) -> np.ndarray:
    """(n, c) xhat of xs (n, c), values of n rows of what was normalized, with those rows'
    statistics (n, NSTATS): ((x * SCALE - HI) - LO) * RSTD in float64, rounded once to ``cdt``;
    C-contiguous."""
    xk = xs.astype(np.float64)  # (n, c)
    s = stats[:, :, None]  # (n, NSTATS, 1)
    with np.errstate(invalid="ignore", over="ignore"):
        out = (((xk * s[:, SCALE]) - s[:, HI]) - s[:, LO]) * s[:, RSTD]  # (n, c) float64
    return np.ascontiguousarray(out, dtype=cdt)
