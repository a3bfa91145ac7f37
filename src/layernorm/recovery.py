r"""The memory-efficient backward's rule: which channels' xhat can be recovered from y.

In memory-efficient mode the forward keeps y (which the next layer keeps anyway) instead of x,
and the backward recovers xhat_j = (y_j - shift_j) / scale_j, with scale the scale the kernel
used (gamma, or 1 + gamma) and shift = beta (0 for RMSNorm or without beta). y has been
rounded to its dtype Y (unit roundoff u = 2**-p, smallest normal number tiny): each y_j is off
by at most u*|y_j| + u*tiny (half the subnormal spacing), so the recovered value is off by

    |delta xhat_j| <= u * (|xhat_j| + (|shift_j| + tiny) / |scale_j|)     (plus the rounding
                                                                            of - and /)

The first term is y's own rounding carried back, the same relative error as y. The second is
what recovery adds: it is unbounded as scale_j -> 0 (scale 0 loses xhat_j entirely, yet dx and
dgamma still need it) and grows with |shift_j / scale_j| (the subtraction cancels). Channel j is
**recovered** when

    MARGIN * |scale_j| >= |shift_j| + tiny            (the added error is at most MARGIN * u)
    |scale_j| * sqrt(D) + |shift_j| <= largest / 2    (y_j cannot overflow: |xhat_j| <= sqrt(D))

and **kept** otherwise: the forward stores xhat_j for every row, (M, k) values for the k kept
channels, and the backward reads them. The rule depends only on scale, shift, D and y's dtype,
never on the data, so the forward and the backward agree on it. A NaN scale or shift is kept.
With MARGIN = 4 the recovered xhat's error is at most u * (|xhat_j| + 4) + the rounding of the
two operations, of the order of y's own rounding of the row's largest |xhat| (>= 1 in every row
with var >> eps, about 3 for D = 1024 and 4 for D = 10**4). MARGIN was chosen by measurement
(docs/numerics.md, "The memory-efficient backward"): with gamma = 1 + N(0, 0.25) and
beta ~ N(0, 1) at D = 1024 it keeps about 5% of the channels, and the errors of dx and dgamma
stay within 1.4x the default mode's in every dtype; MARGIN = 1 keeps a third of them for no
measurable gain, MARGIN = 16 reaches 1.5x in float32 and 3.8x in float16. Weights at their
initial values (gamma = 1, beta = 0) keep nothing.

**Rows.** The second term is an absolute error of at most MARGIN * u, small against a row's
largest |xhat| only when that is near 1 or more. A row's mean square of xhat is
var / (var + eps), so a row whose variance is below eps (a constant row, a padding row of
zeros) has all its |xhat| small, and recovery through a non-zero shift would lose their
relative accuracy: dgamma, summed over a batch of such rows alone, would be off by MARGIN * u
of sum|dy| where it is near 0. Such rows are **kept whole**: the forward keeps the row
(r rows, O(r * D) values) and the backward runs the default mode's formula on it. The test is
rstd**2 * eps > 1/2 (var < eps), and it applies only where the shift is non-zero on a
recovered channel: without a shift t = y exactly and recovery keeps y's relative accuracy on
every row.

The rule is written once for arrays, in :func:`recovered_of` and :func:`whole_rows` (operators
only, so NumPy arrays and torch tensors alike): the reference, the NumPy API and its fallback
call it through :func:`kept_channels` and :func:`kept_rows`, the torch operator's CUDA and
fallback paths through ``layernorm.torch._ops``. The C++ CPU operator states it once more in
C++ (``keep_of`` and ``rows_of`` in ``cpu_ops.cpp``, with MARGIN passed from here): calling
this statement from the operator through the dispatcher instead would cost two calls back
into Python on every memory-efficient forward, several times the whole forward of a small
batch. The tests
compare the kept sets of all of them, at the rule's boundaries included.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .dtypes import info

__all__ = ["MARGIN", "kept_channels", "kept_rows", "limits", "recovered", "recovered_of",
           "whole_rows"]

MARGIN = 4.0
"""The largest |shift_j| / |scale_j| (tiny included) for which xhat_j is recovered from y."""


def limits(y_dtype: object) -> tuple[float, float]:
    """(tiny, largest) of y's dtype: its smallest normal number and its largest finite one."""
    d = info(y_dtype)
    return math.ldexp(d.subnormal, d.significand_bits - 1), d.largest


def recovered_of(s: Any, b: Any, tiny: float, largest: float, d: int) -> Any:
    """(D,) bool: the rule itself (module docstring) on ``s`` = |scale| and ``b`` = |shift|,
    (D,) float64 arrays of NumPy or torch (operators only: the result is of the same kind),
    with y's dtype's ``tiny`` and ``largest`` (:func:`limits`). NaN compares false: kept."""
    return (MARGIN * s >= b + tiny) & (s * math.sqrt(d) + b <= largest / 2)


def whole_rows(rstd: Any, eps: float) -> Any:
    """(M,) bool: the rows whose variance is below eps, rstd**2 * eps > 1/2 on each row's true
    rstd (M,) float64, NumPy's or torch's (module docstring, "Rows"; the caller checks the
    shift). inf * 0 (eps = 0) compares false: not kept."""
    return rstd * rstd * eps > 0.5


def recovered(scale: np.ndarray | None, shift: np.ndarray | None, y_dtype: object,
              d: int) -> np.ndarray:
    """(D,) bool: the channels whose xhat the backward recovers from y (module docstring).

    ``scale`` and ``shift`` are the kernel's (D,) values (None: ones, zeros); ``y_dtype`` is
    the dtype y is stored in (x's dtype).
    """
    tiny, largest = limits(y_dtype)
    s = np.ones(d) if scale is None else np.abs(np.asarray(scale, dtype=np.float64))
    b = np.zeros(d) if shift is None else np.abs(np.asarray(shift, dtype=np.float64))
    with np.errstate(over="ignore", invalid="ignore"):
        return recovered_of(s, b, tiny, largest, d)


def kept_channels(scale: np.ndarray | None, shift: np.ndarray | None, y_dtype: object,
                  d: int) -> np.ndarray:
    """(k,) int64, ascending: the channels whose xhat the forward keeps (not recovered)."""
    return np.flatnonzero(~recovered(scale, shift, y_dtype, d)).astype(np.int64)


def kept_rows(rstd: np.ndarray, eps: float, shift: np.ndarray | None,
              keep: np.ndarray) -> np.ndarray:
    """(r,) int64, ascending: the rows kept whole (module docstring, "Rows"): rows with
    rstd**2 * eps > 1/2 (var < eps), where ``shift`` is non-zero on a channel not in ``keep``
    (the kept channels); none otherwise. ``rstd`` (M,) as the forward computed it."""
    if shift is None:
        return np.empty(0, np.int64)
    live = np.asarray(shift, dtype=np.float64).copy()
    live[keep] = 0.0
    if not np.any(live):
        return np.empty(0, np.int64)
    r = np.asarray(rstd, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 (eps = 0): not kept
        return np.flatnonzero(whole_rows(r, eps)).astype(np.int64)
