r"""Finite-difference check of a vector-Jacobian product, for any function.

Given f(*args) -> array and f_vjp(*args, dout) -> one gradient per arg, the check
compares the analytic vᵀJ from f_vjp with central differences of f, in float64.

``mode="fast"`` (any size, a few evaluations): for each argument a, draw a random unit
direction u over a and a random unit cotangent v over the output, and compare

    numerical  (v·f(a + h u) - v·f(a - h u)) / 2h
    analytic   (vᵀJ)·u           where vᵀJ = f_vjp(..., v)

A wrong gradient passes only if its error is orthogonal to u, which a random u makes
a probability-zero event. Tolerance: atol + rtol·‖vᵀJ‖₂ + the estimated round-off of the
difference quotient, 16·ε·(|v·f₊| + |v·f₋|)/2h.

``mode="full"``: per element k of each argument (all of them, or a random sample of
``max_elements``), compare ∂(v·f)/∂a_k by central differences with (vᵀJ)_k. Tolerance per
element: atol + rtol·max|vᵀJ| + the same round-off term.

A fast-mode failure is followed by a full check of that argument (sampled when large), so
the error names an element. The caller's arrays are never touched: the checker works on
private float64 copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

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

    def directional(self, i: int, u: np.ndarray, v: np.ndarray, h: float) -> tuple[float, float]:
        """Central difference of v·f along u in arg i, and its round-off estimate."""
        args = list(self.args)
        args[i] = self.args[i] + h * u
        fp = float(np.vdot(v, self.out(args)))
        args[i] = self.args[i] - h * u
        fm = float(np.vdot(v, self.out(args)))
        return (fp - fm) / (2 * h), 16 * _EPS64 * (abs(fp) + abs(fm)) / (2 * h)


def _differentiable(a: object) -> bool:
    return isinstance(a, np.ndarray) and (a.dtype.kind == "f" or a.dtype.name == "bfloat16")


def _step(a: np.ndarray, eps: float | None) -> float:
    """Central-difference step: cube root of ε (≈ 6e-6) scaled by the argument's size."""
    if eps is not None:
        return eps
    scale = float(np.sqrt(np.mean(np.square(a)))) if a.size else 1.0
    return 6e-6 * max(1.0, scale)


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
        num, noise = p.directional(i, e.reshape(a.shape), v, h)
        idx = np.unravel_index(k, a.shape)
        ana = float(g[idx])
        err = abs(num - ana)
        tol = atol + rtol * scale + noise
        max_abs = max(max_abs, err)
        max_rel = max(max_rel, err / scale if scale > 0 else err)
        if worst is None or err - tol > worst[0]:
            worst = (err - tol, tuple(int(j) for j in idx), ana, num, tol)
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
        eps: finite-difference step; default 6e-6·max(1, rms(arg)) per argument.
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
    if isinstance(n_directions, bool) or not isinstance(n_directions, int) or n_directions < 1:
        raise ValueError(f"n_directions must be a positive integer, got {n_directions!r}")
    if max_elements is not None and (not isinstance(max_elements, int) or max_elements < 1):
        raise ValueError(f"max_elements must be a positive integer or None, got {max_elements!r}")
    if eps is not None and not (np.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite positive step, got {eps!r}")
    atol = 1e-10 if atol is None else float(atol)
    rtol = 1e-6 if rtol is None else float(rtol)
    if not (atol >= 0 and rtol >= 0):
        raise ValueError(f"atol and rtol must be non-negative, got atol={atol}, rtol={rtol}")

    rng = np.random.default_rng(seed)
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
            report, err = _full(p, i, g, v, _step(p.args[i], eps), atol, rtol, max_elements, rng)
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
            h = _step(p.args[i], eps)
            num, noise = p.directional(i, u, v, h)
            ana = float(np.vdot(g, u))
            gnorm = float(np.linalg.norm(g))
            tol = atol + rtol * gnorm + noise
            err = abs(num - ana)
            s = stats[i]
            s[0] = max(s[0], err)
            s[1] = max(s[1], err / gnorm if gnorm > 0 else err)
            s[2] = max(s[2], tol)
            if err > tol:
                # Point at an element: a full check of this argument with the same v.
                _, full_err = _full(p, i, g, v, h, atol, rtol, max_elements, rng)
                where = (
                    f"; worst element: {full_err}"
                    if full_err is not None
                    else f"; no element of the {min(g.size, max_elements or g.size)} sampled "
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
