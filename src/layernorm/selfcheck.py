"""The reference checks itself: what ``layernorm check`` computes, one row per check.

    finite differences  float64 gradients by :func:`layernorm.check_vjp`, fast and full modes,
                        on a few shapes (fast mode once more on a large one)
    vs float64          each lower precision available here against the float64 reference on
                        the same rounded inputs, through :func:`layernorm.tolerances.compare`

No check raises: a failure, or a gradient check with no verdict, is a row with passed=False.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .dtypes import available, resolve
from .gradcheck import GradcheckError, GradcheckInconclusive, check_vjp
from .reference import layer_norm_backward, layer_norm_forward
from .tolerances import compare, tolerance

__all__ = ["LARGE_SHAPE", "SHAPES", "CheckRow", "run_checks"]

SHAPES: tuple[tuple[int, ...], ...] = ((8, 64), (4, 16, 128), (2, 3, 5, 33), (6, 1))
# Fast mode's cost does not grow with size: one large shape shows it (the s column).
LARGE_SHAPE: tuple[int, ...] = (8, 512, 1024)


@dataclass(frozen=True)
class CheckRow:
    """One check: its errors, the tolerance as text, seconds taken, and why it failed."""

    shape: tuple[int, ...]
    dtype: str
    method: str
    max_abs_err: float
    max_rel_err: float
    tolerance: str
    seconds: float
    passed: bool
    detail: str = ""


def _fwd(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
    return layer_norm_forward(x, gamma, beta)[0]


def _vjp(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, dy: np.ndarray) -> tuple:
    return layer_norm_backward(dy, layer_norm_forward(x, gamma, beta)[1])


def _inputs(shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    d = shape[-1]
    x = rng.standard_normal(shape) * 2.0 + 0.5
    return x, rng.standard_normal(d), rng.standard_normal(d), rng.standard_normal(shape)


def _gradcheck_row(shape: tuple[int, ...], mode: str, seed: int) -> CheckRow:
    x, gamma, beta, _ = _inputs(shape, seed)
    t0 = time.perf_counter()
    try:
        rep = check_vjp(_fwd, _vjp, (x, gamma, beta), mode=mode, seed=seed,
                        names=("x", "gamma", "beta"))
    except GradcheckError as exc:
        return CheckRow(shape, "float64", f"finite differences ({mode})",
                        abs(exc.numerical - exc.analytic), float("nan"), f"{exc.tolerance:.1e}",
                        time.perf_counter() - t0, False, str(exc))
    except GradcheckInconclusive as exc:  # no verdict is a failure of the check, not a pass
        return CheckRow(shape, "float64", f"finite differences ({mode})", float("nan"),
                        float("nan"), "-", time.perf_counter() - t0, False, str(exc))
    tol = max(a.tolerance for a in rep.args)
    return CheckRow(shape, "float64", f"finite differences ({mode})", rep.max_abs_err,
                    rep.max_rel_err, f"{tol:.1e}", time.perf_counter() - t0, True)


def _dtype_row(shape: tuple[int, ...], dtype_name: str, seed: int) -> CheckRow:
    x, gamma, beta, dy = (a.astype(resolve(dtype_name)) for a in _inputs(shape, seed))
    t0 = time.perf_counter()
    y, cache = layer_norm_forward(x, gamma, beta)
    got = (y, *layer_norm_backward(dy, cache))
    x64, g64, b64, dy64 = (a.astype(np.float64) for a in (x, gamma, beta, dy))
    y64, cache64 = layer_norm_forward(x64, g64, b64)
    want = (y64, *layer_norm_backward(dy64, cache64))
    results = [compare(a, b, dtype_name, "out" if i < 2 else "param")
               for i, (a, b) in enumerate(zip(got, want, strict=True))]
    passed = all(results)
    max_abs = max(c.max_abs_err for c in results)
    max_rel = max(c.max_rel_err for c in results)  # normwise, per output
    t = tolerance(dtype_name, "out")
    detail = "" if passed else "an element of y, dx, dgamma or dbeta is outside the tolerance"
    return CheckRow(shape, dtype_name, "vs float64 reference", max_abs, max_rel,
                    f"{t.atol:.2g}+{t.rtol:.2g}|ref|", time.perf_counter() - t0, passed, detail)


def run_checks(seed: int = 0) -> list[CheckRow]:
    """Every check row; none raises: a failure is a row with ``passed=False``."""
    rows = []
    for shape in SHAPES:
        rows.append(_gradcheck_row(shape, "fast", seed))
        rows.append(_gradcheck_row(shape, "full", seed))
        rows.extend(_dtype_row(shape, name, seed) for name in available()
                    if name != "float64")
    rows.append(_gradcheck_row(LARGE_SHAPE, "fast", seed))
    return rows
