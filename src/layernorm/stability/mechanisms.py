"""Tables 3 and 6: the ways to compute the backward's dx (``BACKWARD_MECHANISMS`` of
:mod:`layernorm.numerics`): their error against kappa when g = dy*gamma is close to
span{1, xhat} (the cancellation), and their speed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from ..numerics import (
    BACKWARD_MECHANISMS,
    cancellation_inputs,
    exact_layer_norm,
    float32_backward,
    relative_error,
    unit_roundoff,
)
from ..reference import layer_norm_backward, layer_norm_forward
from .common import EXACT, Sizes, Table, _fmt

# --- table 3: the backward's cancellation -------------------------------------------------


def cancellation_table(sz: Sizes, rng: np.random.Generator, eps: float = 1e-5) -> Table:
    """Table 3: dx error against kappa for each mechanism, float32 inputs."""
    u = unit_roundoff(np.float32)
    table = Table(
        f"The backward's cancellation: dx error against kappa, float32, D = {sz.d}",
        ["x", "rho", "kappa", *BACKWARD_MECHANISMS, "reference / (u kappa)",
         "float64 cache / (u kappa)", "float64 reference", "oracle"],
        note=("g = dy*gamma = 0.7 + 1.3*xhat + rho*N(0, 1); kappa = max|g|*rstd/max|dx|; "
              "u = 2^-24. 'float64 reference' is layer_norm_backward on the same values in "
              "float64 (cache in float64)."),
    )
    for offset in (0.0, 1e4):
        for rho in (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5):
            x, gamma, dy = cancellation_inputs(rng, sz.rows, sz.d, rho, offset)
            ex = exact_layer_norm(x, gamma, None, eps, dy)
            g = dy.astype(np.float64) * gamma  # (m, d) exact
            kappa = float(np.abs(g).max() * ex.rstd.max() / np.abs(ex.dx).max())
            errs = [relative_error(float32_backward(x, gamma, dy, eps, mech), ex.dx)
                    for mech in BACKWARD_MECHANISMS]
            cache64 = layer_norm_forward(x.astype(np.float64), gamma.astype(np.float64),
                                         eps=eps)[1]
            err64 = relative_error(layer_norm_backward(dy.astype(np.float64), cache64)[0], ex.dx)
            table.rows.append([
                f"{offset:g} + N(0, 1)", f"{rho:.0e}", f"{kappa:.1e}", *map(_fmt, errs),
                f"{errs[0] / (u * kappa):.2f}", f"{errs[2] / (u * kappa):.2f}", _fmt(err64),
                EXACT,
            ])
    return table


# --- table 6: speed ----------------------------------------------------------------------


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timing_table(sz: Sizes, rng: np.random.Generator, eps: float = 1e-5) -> Table:
    """Table 6: forward + backward time of each mechanism on float32 input."""
    m, d = sz.timing_shape
    x = rng.standard_normal((m, d)).astype(np.float32)
    dy = rng.standard_normal((m, d)).astype(np.float32)
    gamma = rng.standard_normal(d).astype(np.float32)
    table = Table(
        f"Speed: forward + backward, float32 ({m}, {d}) with gamma, median of {sz.repeats}",
        ["mechanism", "ms", "relative"],
    )
    times = [_median_seconds(lambda mech=mech: float32_backward(x, gamma, dy, eps, mech),
                             sz.repeats) for mech in BACKWARD_MECHANISMS]
    for mech, t in zip(BACKWARD_MECHANISMS, times, strict=True):
        table.rows.append([mech, f"{1e3 * t:.1f}", f"{t / times[0]:.2f}"])
    return table
