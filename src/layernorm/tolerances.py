"""The one table of tolerances: how far a result may be from the float64 reference.

Every comparison in the tests, ``layernorm check`` and the backends' self-checks reads its
``atol``/``rtol`` from here, so a tolerance is changed in one place with its reason.
Comparisons are ``|got - want| <= atol + rtol * |want|`` elementwise, with ``want`` the
float64 reference on the same (already rounded) inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TOLERANCES", "Tolerance", "tolerance"]


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    reason: str


# Keyed by (dtype name, quantity). "out" is y and dx (per element, O(1) values after
# normalization); "param" is dgamma and dbeta (sums over M rows, accumulated in float64).
TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("float64", "out"): Tolerance(
        1e-12, 1e-10, "float64 throughout; a few ulps of O(1) values, times D-term reductions"
    ),
    ("float64", "param"): Tolerance(1e-10, 1e-10, "float64 sums over rows; reduction order"),
    ("float32", "out"): Tolerance(
        1e-5, 1e-5, "float32 arithmetic: ~60 ulps of 6e-8 covers rstd, the means and the final "
        "rounding, for |xhat| up to ~sqrt(D)"
    ),
    ("float32", "param"): Tolerance(
        1e-5, 1e-5, "products rounded to float32 before a float64 sum; one float32 rounding"
    ),
    ("float16", "out"): Tolerance(
        2e-3, 2e-3, "result rounded to float16 (half ulp 4.9e-4 at 1) after float32 compute; "
        "2 ulps covers float32 error pushed across a rounding boundary"
    ),
    ("float16", "param"): Tolerance(
        2e-3, 2e-3, "dgamma/dbeta returned in float16: one rounding of a float64 sum"
    ),
    ("bfloat16", "out"): Tolerance(
        1.6e-2, 1.6e-2, "result rounded to bfloat16 (half ulp 3.9e-3 at 1); 2 ulps as for float16"
    ),
    ("bfloat16", "param"): Tolerance(
        1.6e-2, 1.6e-2, "dgamma/dbeta returned in bfloat16: one rounding of a float64 sum"
    ),
    # layernorm.gpu: dgamma/dbeta are float32 sums (per-program partials over their rows, then
    # a fixed-order tree over the programs), not float64; y and dx use the "out" entries.
    ("float32", "gpu-param"): Tolerance(
        1e-5, 1e-5, "float32 blocked sums over rows: error ~ 6e-8 * rows per program * |dy*xhat|;"
        " measured <= 0.2 of this bound at M <= 256, 0.7 at M = 1024 (4 programs): tests keep"
        " M <= 256"
    ),
    ("float16", "gpu-param"): Tolerance(
        2e-3, 2e-3, "float32 sums over rows, returned in float16: the final rounding dominates"
    ),
    ("bfloat16", "gpu-param"): Tolerance(
        1.6e-2, 1.6e-2, "float32 sums over rows, returned in bfloat16: the final rounding dominates"
    ),
}


def tolerance(dtype: np.dtype | str, quantity: str = "out") -> Tolerance:
    """The tolerance for results of ``dtype``; ``quantity`` is ``"out"`` or ``"param"``."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    try:
        return TOLERANCES[(name, quantity)]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {name!r} and quantity {quantity!r}") from None
