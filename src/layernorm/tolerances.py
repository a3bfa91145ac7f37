"""The one table of tolerances, and the one helper that compares against it.

Every comparison in the tests, ``layernorm check`` and the backends' self-checks reads its
``atol``/``rtol`` from here, so a tolerance is changed in one place with its reason.
Comparisons (:func:`compare`, :func:`assert_close`) are elementwise,

    |got - want| <= atol * scale + rtol * |want| + 2 * (the result dtype's subnormal spacing)

(and where |want| exceeds the dtype's largest value, got may be inf of want's sign)

with ``want`` the float64 reference on the same (already rounded) inputs, or the exact oracle;
``scale`` is the size of the result (1 for y and dx of unit-scale inputs; max|want| where the
size follows the inputs, e.g. dx ~ rstd * dy), and the last term is the finest difference the
result's dtype can show at all (subnormal results round to multiples of it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import DTYPES, float8_spacing

__all__ = ["QUANT_EQUAL", "TOLERANCES", "Comparison", "Tolerance", "assert_close",
           "assert_quantized", "compare", "tolerance"]


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
    # layernorm.gpu: dgamma/dbeta of 16- and 32-bit data are float32 sums (per-program partials
    # over their rows, then a fixed-order tree over the programs), not float64; float64 data is
    # summed in float64 and uses the "param" entries; y and dx use the "out" entries.
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
    # The quantized norms' scales (float32 for every input dtype): max|y| / qmax rounded once.
    ("float32", "quant-scale"): Tolerance(
        0.0, 1e-6, "max|y| carries y's own roundings in the compute dtype (a few float32 ulps, "
        "~2.4e-7 relative) before the division and the one rounding to float32"
    ),
    ("float64", "quant-scale"): Tolerance(
        0.0, 1e-6, "as float32's: the scale is rounded to float32 whatever the compute dtype"
    ),
}

QUANT_EQUAL = 0.999
"""The fraction of a quantized output's elements that must equal the reference's: the rest may
differ by one step of their grid, where y's last-ulp differences between backends (or the
scale's) move y / s across a rounding boundary, which needs y / s within a few ulps of one."""


def tolerance(dtype: np.dtype | str, quantity: str = "out") -> Tolerance:
    """The tolerance for results of ``dtype``; ``quantity`` is ``"out"`` or ``"param"``."""
    name = _dtype_name(dtype)
    try:
        return TOLERANCES[(name, quantity)]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {name!r} and quantity {quantity!r}") from None


@dataclass(frozen=True)
class Comparison:
    """The outcome of :func:`compare`: ``ok``, the largest errors, and the element with the
    largest error relative to its bound."""

    ok: bool
    max_abs_err: float
    max_rel_err: float  # normwise: max|got - want| / max|want| (absolute if want is all 0)
    index: tuple[int, ...] | None
    got: float
    want: float
    bound: float
    tolerance: Tolerance

    def __bool__(self) -> bool:
        return self.ok


def compare(got: np.ndarray, want: np.ndarray, dtype: np.dtype | str, quantity: str = "out",
            *, scale: float = 1.0, floor: float = 0.0) -> Comparison:
    """``got`` against ``want`` under the tolerance for ``dtype`` and ``quantity`` (module
    docstring), plus ``floor``, an absolute allowance for what the inputs' own resolution
    explains. Where ``want`` is not finite, ``got`` must be the same inf, or NaN."""
    tol = tolerance(dtype, quantity)
    name = _dtype_name(dtype)
    g = np.asarray(got).astype(np.float64)
    w = np.asarray(want).astype(np.float64)
    if g.shape != w.shape:
        raise ValueError(f"got has shape {g.shape} but want has shape {w.shape}")
    if g.size == 0:
        return Comparison(True, 0.0, 0.0, None, 0.0, 0.0, 0.0, tol)
    fin = np.isfinite(w)
    with np.errstate(invalid="ignore", over="ignore"):
        # beyond the dtype's largest value, the right result may round to inf of w's sign
        over = fin & (np.abs(w) > DTYPES[name].largest) & (g == np.copysign(np.inf, w))
        err = np.where(fin, np.abs(g - w), np.where((g == w) | (np.isnan(g) & np.isnan(w)),
                                                    0.0, np.inf))
        err = np.where(over, 0.0, err)
        bound = tol.atol * float(scale) + tol.rtol * np.where(fin, np.abs(w), 0.0) \
            + 2 * DTYPES[name].subnormal + floor
        err = np.where(np.isnan(err), np.inf, err)
    k = int(np.argmax(err / bound))
    idx = tuple(int(i) for i in np.unravel_index(k, w.shape))
    big = float(np.max(np.abs(w[fin]))) if np.any(fin) else 0.0
    worst = float(np.max(err))
    return Comparison(bool(np.all(err <= bound)), worst, worst / big if big > 0 else worst,
                      idx, float(g.flat[k]), float(w.flat[k]), float(bound.flat[k]), tol)


def assert_close(got: np.ndarray | None, want: np.ndarray | None, dtype: np.dtype | str,
                 quantity: str = "out", *, scale: float = 1.0, floor: float = 0.0,
                 name: str = "result") -> None:
    """Raise AssertionError unless :func:`compare` passes (or both are None), naming ``name``,
    the element, both values and the bound."""
    if got is None or want is None:
        assert got is None and want is None, f"{name}: got {got is None and 'None'}, want " \
            f"{want is None and 'None'} (one is None, the other not)"
        return
    c = compare(got, want, dtype, quantity, scale=scale, floor=floor)
    assert c.ok, (f"{name} [{_dtype_name(dtype)} {quantity}] at {c.index}: got {c.got!r}, want "
                  f"{c.want!r}, |difference| {abs(c.got - c.want):.3g} > {c.bound:.3g} "
                  f"(atol {c.tolerance.atol:g} x scale {scale:.3g} + rtol {c.tolerance.rtol:g} "
                  f"+ floor {floor:.3g}; "
                  f"{c.tolerance.reason})")


def _quant_step(want: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of ``dtype``'s values (int8, or float8_e4m3fn) at each of ``want``."""
    return np.ones_like(want) if dtype == "int8" else float8_spacing(want)


def assert_quantized(got: np.ndarray, want: np.ndarray, dtype: str, *,
                     name: str = "q") -> None:
    """A quantized output ``got`` against the reference's ``want`` (values, any float view):
    the same NaNs, every element within one step of ``dtype``'s grid at want, and at least
    :data:`QUANT_EQUAL` of them equal. -0.0 equals 0.0."""
    g = np.asarray(got).astype(np.float64)
    w = np.asarray(want).astype(np.float64)
    assert g.shape == w.shape, f"{name}: shape {g.shape}, want {w.shape}"
    nan_g, nan_w = np.isnan(g), np.isnan(w)
    assert np.array_equal(nan_g, nan_w), (f"{name}: NaN at {np.argwhere(nan_g != nan_w)[:4]} "
                                          "where the reference has none, or the other way")
    g, w = g[~nan_w], w[~nan_w]
    if g.size == 0:
        return
    steps = np.abs(g - w) / _quant_step(w, dtype)
    k = int(np.argmax(steps))
    assert steps[k] <= 1, f"{name} [{dtype}]: got {g[k]!r}, want {w[k]!r}: {steps[k]:g} steps"
    equal = float(np.mean(g == w))
    assert equal >= QUANT_EQUAL, (f"{name} [{dtype}]: {equal:.5f} of elements equal the "
                                  f"reference's, fewer than {QUANT_EQUAL}")


def _dtype_name(dtype: np.dtype | str) -> str:
    """The table's name for ``dtype`` (a dtype or its name)."""
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name
