r"""Finite-difference check of a vector-Jacobian product, for any function.

Given f(*args) -> array and f_vjp(*args, dout) -> one gradient per arg, the check
compares the analytic vᵀJ from f_vjp with central differences of f, in float64.

``mode="fast"`` (any size, a few evaluations): for each argument a, draw a random unit
direction u over a and a random unit cotangent v over the output, and compare

    numerical  (v·f(a₊) - v·f(a₋)) / 2h          a₊ = a + h u,  a₋ = a - h u (rounded)
    analytic   (vᵀJ)·(a₊ - a₋) / 2h              vᵀJ = f_vjp(..., v)

The analytic side uses the step actually taken, a₊ - a₋, so the rounding of a ± h u does
not count as error (it matters when |a| is large against h). A wrong gradient passes only
if its error is orthogonal to u, a probability-zero event for a random u.

Tolerance: atol + rtol·(|analytic| + ‖vᵀJ‖/√n) + round-off, where ‖vᵀJ‖/√n is the typical
size of (vᵀJ)·u for a random unit u over n elements (so the test's power does not fade as
n grows), and round-off = 2ε·(Σ|v∘f(a₊)| + Σ|v∘f(a₋)|)/2h bounds the rounding of the two
dot products. Any non-finite value fails.

``mode="full"``: per element k of each argument (all of them, or a random sample of
``max_elements``), compare ∂(v·f)/∂a_k by central differences with (vᵀJ)_k. Tolerance per
element: atol + rtol·max|vᵀJ| + the same round-off term.

Step: h = 6e-6·max(1, std(a)) (ε^(1/3) balances truncation against round-off, scaled by
the spread of a, not its size: x = 1e4 + N(0, 1) needs a step against 1, not 1e4). Fast
mode multiplies it by n^(1/6): u moves each element by only about h/√n, so a longer step
keeps round-off down while truncation, which falls with the displacement, stays small.

A fast-mode failure is followed by a full check of that argument, on a sample whose size
keeps the cost to about 2^26 output elements computed, so the error names an element.
The caller's arrays are never touched: the checker works on private float64 copies, and
draws u and v from a private generator.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ._validate import is_float_dtype

__all__ = ["ArgReport", "GradcheckError", "GradcheckReport", "check_vjp"]

_EPS64 = np.finfo(np.float64).eps


class GradcheckError(Exception):
    """The analytic gradient disagrees with finite differences.

    Attributes: ``arg`` (name), ``index`` (worst element, a tuple, or None when only a
    direction was checked), ``analytic``, ``numerical``, ``tolerance``.
    """

    def __init__(
        self,
        message: str,
        *,
        arg: str,
        index: tuple[int, ...] | None,
        analytic: float,
        numerical: float,
        tolerance: float,
    ) -> None:
        super().__init__(message)
        self.arg = arg
        self.index = index
        self.analytic = analytic
        self.numerical = numerical
        self.tolerance = tolerance


@dataclass(frozen=True)
class ArgReport:
    """Result for one argument: largest errors over what was checked."""

    name: str
    n_checked: int
    max_abs_err: float
    max_rel_err: float
    tolerance: float


@dataclass(frozen=True)
class GradcheckReport:
    """What a passing :func:`check_vjp` checked, per argument."""

    mode: str
    args: list[ArgReport] = field(default_factory=list)

    @property
    def max_abs_err(self) -> float:
        return max((a.max_abs_err for a in self.args), default=0.0)

    @property
    def max_rel_err(self) -> float:
        return max((a.max_rel_err for a in self.args), default=0.0)


def _unit(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    u = rng.standard_normal(shape)
    n = np.linalg.norm(u)
    return u / n if n > 0 else u


class _Problem:
    """f and f_vjp on private float64 copies of the differentiable arguments."""

    def __init__(self, f: Callable, f_vjp: Callable, args: Sequence, names: Sequence[str]):
        self.f, self.f_vjp, self.names = f, f_vjp, list(names)
        self.args = [
            np.array(a, dtype=np.float64, copy=True) if _differentiable(a) else a for a in args
        ]
        self.diff = [i for i, a in enumerate(args) if _differentiable(a)]

    def out(self, args: list | None = None) -> np.ndarray:
        y = self.f(*(self.args if args is None else args))
        return np.asarray(y, dtype=np.float64)

    def vjp(self, v: np.ndarray) -> list:
        grads = self.f_vjp(*self.args, v)
        if not isinstance(grads, (tuple, list)) or len(grads) != len(self.args):
            n = len(grads) if hasattr(grads, "__len__") else "?"
            raise TypeError(
                f"f_vjp must return a tuple with one gradient per argument ({len(self.args)}), "
                f"got {type(grads).__name__} of length {n}"
            )
        return list(grads)

    def grad_of(self, grads: list, i: int) -> np.ndarray:
        """The analytic gradient of arg i as float64 with arg i's shape."""
        gi = grads[i]
        if gi is None:
            raise TypeError(
                f"f_vjp returned None for {self.names[i]}, a floating array argument; pass it "
                f"as a constant (e.g. wrap it in a lambda) if it is not meant to be differentiated"
            )
        gi = np.asarray(gi, dtype=np.float64)
        if gi.shape != self.args[i].shape:
            raise ValueError(
                f"f_vjp's gradient for {self.names[i]} has shape {gi.shape}, "
                f"expected {self.args[i].shape}"
            )
        return gi

    def directional(self, i: int, u: np.ndarray, v: np.ndarray, h: float) -> tuple:
        """Central difference of v·f along h·u in arg i.

        Returns (numerical derivative, the step taken a₊ - a₋ divided by 2h, round-off bound).
        """
        args = list(self.args)
        args[i] = ap = self.args[i] + h * u
        vfp = v * self.out(args)
        args[i] = am = self.args[i] - h * u
        vfm = v * self.out(args)
        num = (float(np.sum(vfp)) - float(np.sum(vfm))) / (2 * h)
        noise = 2 * _EPS64 * (float(np.sum(np.abs(vfp))) + float(np.sum(np.abs(vfm)))) / (2 * h)
        return num, (ap - am) / (2 * h), noise


def _differentiable(a: object) -> bool:
    return isinstance(a, np.ndarray) and is_float_dtype(a.dtype)


def _step(a: np.ndarray, eps: float | None, fast: bool) -> float:
    """Central-difference step for argument a (module docstring)."""
    if eps is not None:
        return eps
    spread = float(np.std(a)) if a.size else 1.0
    h = 6e-6 * max(1.0, spread)
    return h * a.size ** (1 / 6) if fast else h


def _full(
    p: _Problem,
    i: int,
    g: np.ndarray,
    v: np.ndarray,
    h: float,
    atol: float,
    rtol: float,
    max_elements: int | None,
    rng: np.random.Generator,
) -> tuple[ArgReport, GradcheckError | None]:
    a = p.args[i]
    flat = np.arange(a.size)
    if max_elements is not None and a.size > max_elements:
        flat = np.sort(rng.choice(a.size, size=max_elements, replace=False))
    scale = float(np.max(np.abs(g))) if g.size else 0.0
    worst = None  # (excess over tolerance, index, analytic, numerical, tol)
    max_abs = max_rel = 0.0
    tol_used = atol + rtol * scale
    for k in flat:
        e = np.zeros(a.size)
        e[k] = 1.0
        num, step, noise = p.directional(i, e.reshape(a.shape), v, h)
        idx = np.unravel_index(k, a.shape)
        ana = float(g[idx]) * float(step[idx])
        err = abs(num - ana)
        tol = atol + rtol * scale + noise
        max_abs = max(max_abs, err) if np.isfinite(err) else np.inf
        max_rel = max(max_rel, err / scale if scale > 0 else err) if np.isfinite(err) else np.inf
        excess = err - tol if np.isfinite(err) and np.isfinite(tol) else np.inf
        if worst is None or excess > worst[0]:
            worst = (excess, tuple(int(j) for j in idx), ana, num, tol)
    report = ArgReport(p.names[i], len(flat), max_abs, max_rel, tol_used)
    if worst is not None and worst[0] > 0:
        _, idx, ana, num, tol = worst
        msg = (
            f"gradient check failed for {p.names[i]} at index {idx}: analytic {ana:.10g}, "
            f"numerical {num:.10g}, |difference| {abs(ana - num):.3g} > tolerance {tol:.3g} "
            f"(full mode, {len(flat)} of {a.size} elements checked)"
        )
        return report, GradcheckError(
            msg, arg=p.names[i], index=idx, analytic=ana, numerical=num, tolerance=tol
        )
    return report, None


# Budget of output elements computed by the follow-up of a fast-mode failure: each sampled
# input element costs two evaluations of f, so large outputs get a smaller sample (about a
# second for a 4M-element layer norm) instead of minutes.
_FOLLOWUP_OUTPUT_BUDGET = 2**26


def _followup_size(n_in: int, n_out: int, max_elements: int | None) -> int:
    """How many elements the full check after a fast-mode failure samples."""
    cap = n_in if max_elements is None else min(n_in, max_elements)
    return max(1, min(cap, max(16, _FOLLOWUP_OUTPUT_BUDGET // max(n_out, 1))))


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}: {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _real(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}: {value!r}")
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def check_vjp(
    f: Callable[..., np.ndarray],
    f_vjp: Callable[..., Sequence[np.ndarray | None]],
    args: Sequence[object],
    *,
    mode: str = "fast",
    eps: float | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    n_directions: int = 2,
    max_elements: int | None = 4096,
    names: Sequence[str] | None = None,
) -> GradcheckReport:
    """Check ``f_vjp`` against central differences of ``f``; raise on disagreement.

    Args:
        f: ``f(*args) -> array``.
        f_vjp: ``f_vjp(*args, dout) -> tuple`` with one entry per arg: the gradient of
            ``sum(dout * f(*args))`` w.r.t. that arg, or None for a non-array argument.
        args: the point to check at. Floating ndarrays are differentiated (as float64
            copies: the caller's arrays are never modified); anything else is passed as is.
        mode: ``"fast"`` (random directional derivatives) or ``"full"`` (per element).
        eps: finite-difference step; default 6e-6·max(1, std(arg)), times n^(1/6) in fast
            mode (module docstring).
        atol, rtol: tolerances; defaults 1e-10 and 1e-6 (float64 central differences
            are good to about 1e-9 relative for smooth functions of moderate curvature).
        seed: seed of the checker's private random generator.
        n_directions: directions per argument in fast mode.
        max_elements: in full mode, check a random sample of this many elements of larger
            arguments (None: every element). Also bounds the follow-up of a fast failure.
        names: names of the arguments for reports and errors (default ``arg0``, ...).

    Returns:
        A :class:`GradcheckReport` with the largest errors per differentiable argument.

    Raises:
        GradcheckError: naming the argument, the worst element, both values and the tolerance.
        ValueError, TypeError: for bad arguments or f_vjp results of the wrong shape.
    """
    if mode not in ("fast", "full"):
        raise ValueError(f"mode must be 'fast' or 'full', got {mode!r}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list of arguments, got {type(args).__name__}")
    if names is None:
        names = [f"arg{i}" for i in range(len(args))]
    if len(names) != len(args):
        raise ValueError(f"names has {len(names)} entries for {len(args)} args")
    n_directions = _positive_int(n_directions, "n_directions")
    if max_elements is not None:
        max_elements = _positive_int(max_elements, "max_elements")
    if eps is not None:
        eps = _real(eps, "eps")
        if eps <= 0:
            raise ValueError(f"eps must be a finite positive step, got {eps!r}")
    atol = 1e-10 if atol is None else _real(atol, "atol")
    rtol = 1e-6 if rtol is None else _real(rtol, "rtol")
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol and rtol must be non-negative, got atol={atol}, rtol={rtol}")

    # Salted, so that u and v never coincide with data the caller drew with the same seed.
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    rng = np.random.default_rng([int(seed), 0x9E3779B9])
    p = _Problem(f, f_vjp, args, names)
    if not p.diff:
        raise ValueError("args has no floating ndarray to differentiate")
    y = p.out()
    reports = []
    if mode == "full":
        v = _unit(rng, y.shape)
        grads = p.vjp(v)
        for i in p.diff:
            g = p.grad_of(grads, i)
            h = _step(p.args[i], eps, fast=False)
            report, err = _full(p, i, g, v, h, atol, rtol, max_elements, rng)
            if err is not None:
                raise err
            reports.append(report)
        return GradcheckReport("full", reports)

    stats = {i: [0.0, 0.0, 0.0] for i in p.diff}  # max abs, max rel, tolerance
    for _ in range(n_directions):
        v = _unit(rng, y.shape)
        grads = p.vjp(v)
        for i in p.diff:
            g = p.grad_of(grads, i)
            u = _unit(rng, g.shape)
            h = _step(p.args[i], eps, fast=True)
            num, step, noise = p.directional(i, u, v, h)
            ana = float(np.vdot(g, step))
            gnorm = float(np.linalg.norm(g))
            tol = atol + rtol * (abs(ana) + gnorm / np.sqrt(max(g.size, 1))) + noise
            err = abs(num - ana)
            s = stats[i]
            s[0] = max(s[0], err) if np.isfinite(err) else np.inf
            s[1] = max(s[1], err / gnorm if gnorm > 0 else err) if np.isfinite(err) else np.inf
            s[2] = max(s[2], tol)
            if not err <= tol:  # also catches NaN
                # Point at an element: a full check of this argument with the same v.
                h_full = _step(p.args[i], eps, fast=False)
                sample = _followup_size(g.size, y.size, max_elements)
                _, full_err = _full(p, i, g, v, h_full, atol, rtol, sample, rng)
                where = (
                    f"; worst element: {full_err}"
                    if full_err is not None
                    else f"; no element of the {sample} sampled "
                    f"exceeds its tolerance, so the error is spread or outside the sample"
                )
                raise GradcheckError(
                    f"gradient check failed for {p.names[i]}: directional derivative analytic "
                    f"{ana:.10g}, numerical {num:.10g}, |difference| {err:.3g} > tolerance "
                    f"{tol:.3g} (fast mode){where}",
                    arg=p.names[i],
                    index=None if full_err is None else full_err.index,
                    analytic=ana if full_err is None else full_err.analytic,
                    numerical=num if full_err is None else full_err.numerical,
                    tolerance=tol if full_err is None else full_err.tolerance,
                )
    for i in p.diff:
        reports.append(ArgReport(p.names[i], n_directions, *stats[i]))
    return GradcheckReport("fast", reports)
