r"""Finite-difference check of a vector-Jacobian product, for any function.

Given f(*args) -> array (or a tuple of arrays) and f_vjp(*args, dout) -> one gradient per arg,
the check compares the analytic vᵀJ from f_vjp with central differences of f, in float64.

``mode="fast"`` (any size, a few evaluations): for each argument a, draw a random unit
direction u over a and a random unit cotangent v over the output, and compare

    numerical  v·(f(a₊) - f(a₋)) / 2h            a₊ = a + h u,  a₋ = a - h u (rounded)
    analytic   (vᵀJ)·(a₊ - a₋) / 2h              vᵀJ = f_vjp(..., v)

The analytic side uses the step actually taken, a₊ - a₋, so the rounding of a ± h u does
not count as error (it matters when |a| is large against h); the outputs are subtracted
before the dot product, so a large constant part of f cancels exactly there. A wrong gradient
passes only if its error is orthogonal to u, a probability-zero event for a random u.

``mode="full"``: per element k of each argument (all of them, or a random sample of
``max_elements``), the same comparison with u = the k-th unit vector.

Tolerance: atol + rtol·(|analytic| + scale) + round-off. scale is the typical size of the
derivative: ‖vᵀJ‖/√n in fast mode (the size of (vᵀJ)·u for a random unit u over n elements,
so the test's power does not fade as n grows), max|vᵀJ| in full mode. round-off =
2ε·Σ|v|·(|f(a₊)| + |f(a₋)|)/2h, ε the output dtype's machine epsilon, bounds what the
rounding of f's outputs does to the difference. A non-finite analytic value fails.

Truncation. A comparison that fails at step h is repeated at h/2 and judged on the
Richardson extrapolation of the two (error O(h⁴) instead of O(h²)), so a function curved on
the scale of the step (sin(a) with |a| ~ 1e3) does not fail a right gradient. It fails only
if the extrapolated difference exceeds its tolerance plus the change between the two steps.
Where rounding against a large |a| bent the steps off u, there is no extrapolation: it fails
only if the difference at h/2 is out of tolerance and about the same at h (a wrong gradient
does not depend on the step; truncation does).

Kinks. At a kink (max(a, 0) or |a| at 0) the central differences at h and h/2 agree with
each other, on the mean of the two one-sided derivatives, so an analytic value equal to that
mean (sign(0) = 0 for |a|) passes, and any other fails the comparison above. Such a failure
is then checked for a kink with f at the point, already computed, so no further evaluations:
the forward and backward differences differ by gap(s) = v·(f(a₊) - 2f(a) + f(a₋))/s, which a
smooth f makes c·s + O(s³) and a kink a constant. Where gap(h) - 2·gap(h/2) (the part that stays
as the step halves) exceeds both gap(h) - gap(h/2) (the part that shrinks) and the tolerance
(atol + rtol·the derivative's size + its round-off), the comparison is inconclusive, not
failed. Rounding can make a₊ - a and a - a₋ unequal, which adds (vᵀJ)·(a₊ + a₋ - 2a)/s to the
gap; the analytic vᵀJ removes it, and what a wrong vᵀJ leaves is allowed for, 1e5 times over.

Never a silent pass. A passing comparison must also have a round-off allowance within atol
or RESOLUTION (1e-5) of the derivative's size (the largest of |analytic|, |numerical| and the
argument's scale over the step taken): in fast mode a gradient wrong by a relative δ then
passes only where both random directions see less than RESOLUTION/δ of its typical size (for
δ = 1%, a chance of about 6e-7). Where the allowance is larger (f's output has a large
constant part, e.g. y + 1e10, whose rounding hides the derivative; or the derivative is zero
and f's output is not), or where a ± h·u rounds to a for more than half the step (|a| large
against h), the comparison is repeated with a step WIDEN (64) times longer. Where the check
still cannot judge, it raises :class:`GradcheckInconclusive` instead of passing; also where
the differences at h and h/2 disagree by more than they differ from the analytic value (f is
not smooth on the scale of the step), where f has a kink (above), and where f is not finite
at a ± h.

Step: h = 6e-6·max(1, std(a)) (ε^(1/3) balances truncation against round-off, scaled by
the spread of a, not its size: x = 1e4 + N(0, 1) needs a step against 1, not 1e4). Fast
mode multiplies it by n^(1/6): u moves each element by only about h/√n, so a longer step
keeps round-off down while truncation, which falls with the displacement, stays small.

A fast-mode failure is followed by a full check of that argument, on a sample whose size
keeps the cost to about 2^26 output elements computed, so the error names an element.
Empty arguments have nothing to check (their gradients must still have their shape). The
caller's arrays are never touched: the checker works on private float64 copies, and draws u
and v from a private generator.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .differences import (
    RESOLUTION,
    WIDEN,
    _compare,
    _differentiable,
    _Limits,
    _Problem,
    _step,
    _unit,
    _Verdict,
)

__all__ = [
    "RESOLUTION",
    "WIDEN",
    "ArgReport",
    "GradcheckError",
    "GradcheckInconclusive",
    "GradcheckReport",
    "check_vjp",
]


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


class GradcheckInconclusive(Exception):
    """Finite differences cannot judge the gradient at this point (module docstring).

    Attributes: ``arg`` (name), ``index`` (element, or None for a direction), ``hidden``
    (the error the differences cannot see: the round-off allowance, or the change between
    steps h and h/2) and ``size`` (the derivative's size it was compared with).
    """

    def __init__(self, message: str, *, arg: str, index: tuple[int, ...] | None,
                 hidden: float, size: float) -> None:
        super().__init__(message)
        self.arg = arg
        self.index = index
        self.hidden = hidden
        self.size = size


@dataclass(frozen=True)
class ArgReport:
    """Result for one argument: largest errors and allowances over what was checked.

    ``tolerance`` is the largest tolerance a comparison used, round-off included;
    ``roundoff`` the largest round-off allowance in it.
    """

    name: str
    n_checked: int
    max_abs_err: float
    max_rel_err: float
    tolerance: float
    roundoff: float = 0.0

    def __repr__(self) -> str:
        return (f"ArgReport({self.name!r}, {self.n_checked} checked, "
                f"max abs err {float(self.max_abs_err):.2g}, "
                f"max rel err {float(self.max_rel_err):.2g}, "
                f"tolerance {float(self.tolerance):.2g}, round-off {float(self.roundoff):.2g})")


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

    def __repr__(self) -> str:
        """A header line, then one line per argument."""
        n = len(self.args)
        head = (f"GradcheckReport(mode={self.mode!r}, {n} argument{'s' * (n != 1)}, "
                f"max abs err {float(self.max_abs_err):.2g}, "
                f"max rel err {float(self.max_rel_err):.2g})")
        return "\n".join([head, *(f"  {a!r}" for a in self.args)])


def _full(
    p: _Problem,
    i: int,
    g: np.ndarray,
    v: np.ndarray,
    h: float,
    lim: _Limits,
    max_elements: int | None,
    rng: np.random.Generator,
    retry: bool = True,
) -> tuple[ArgReport, GradcheckError | None, GradcheckInconclusive | None]:
    """Every sampled element of arg i; the worst failure and the first inconclusive element."""
    a = p.args[i]
    flat = np.arange(a.size)
    if max_elements is not None and a.size > max_elements:
        flat = np.sort(rng.choice(a.size, size=max_elements, replace=False))
    worst = None  # (excess over tolerance, index, verdict)
    unsure = None
    max_abs = max_rel = tol_used = roundoff = 0.0
    for k in flat:
        e = np.zeros(a.size)
        e[k] = 1.0
        verdict = _compare(p, i, g, e.reshape(a.shape), v, h, lim, retry)
        idx = tuple(int(j) for j in np.unravel_index(k, a.shape))
        err = verdict.err
        max_abs = max(max_abs, err)
        max_rel = max(max_rel, err / lim.scale if lim.scale > 0 else err)
        tol_used = max(tol_used, verdict.tolerance)
        roundoff = max(roundoff, verdict.roundoff)
        if verdict.status == "fail":
            excess = err - verdict.tolerance
            if worst is None or excess > worst[0]:
                worst = (excess, idx, verdict)
        elif verdict.status == "inconclusive" and unsure is None:
            unsure = _inconclusive(p.names[i], idx, verdict, "full")
    report = ArgReport(p.names[i], len(flat), max_abs, max_rel, tol_used, roundoff)
    if worst is None:
        return report, None, unsure
    _, idx, vd = worst
    how = ", extrapolated from steps h and h/2" if vd.extrapolated else ""
    msg = (
        f"gradient check failed for {p.names[i]} at index {idx}: analytic {vd.analytic:.10g}, "
        f"numerical {vd.numerical:.10g}, |difference| {vd.err:.3g} > tolerance "
        f"{vd.tolerance:.3g} (full mode{how}, {len(flat)} of {a.size} elements checked)"
    )
    return report, GradcheckError(msg, arg=p.names[i], index=idx, analytic=vd.analytic,
                                  numerical=vd.numerical, tolerance=vd.tolerance), unsure


def _inconclusive(name: str, index: tuple[int, ...] | None, vd: _Verdict,
                  mode: str) -> GradcheckInconclusive:
    where = f" at index {index}" if index is not None else ""
    h = vd.step
    why = {
        "rough": f"finite differences at steps {h:.3g} and {h / 2:.3g} change by "
                 f"{vd.hidden:.3g}, as much as they differ from the analytic value "
                 f"{vd.analytic:.10g}: f is not smooth on the scale of the step; pass a "
                 f"smaller eps",
        "roundoff": f"the rounding of f's output could hide {vd.hidden:.3g} in the derivative, "
                    f"more than atol and {RESOLUTION:g} of its size {vd.size:.3g}, even with "
                    f"the step {h:.3g}: f's output has a large constant part or barely changes "
                    f"over the step; check f without the constant part, pass a larger eps, or a "
                    f"larger atol if derivatives below it do not matter",
        "kink": f"forward and backward differences disagree by {vd.hidden:.3g} at steps "
                f"{h:.3g} and {h / 2:.3g} alike, where a smooth f's disagreement halves with "
                f"the step: f has a kink here (as max(a, 0) at 0), where central differences "
                f"cannot judge a gradient; check at a point away from it",
        "step": f"the step {h:.3g} rounds away against the argument's magnitude (a ± h·u is a "
                f"for {100 * vd.hidden:.0f}% of the step): pass a larger eps",
        "domain": f"f is not finite at the argument ± {h:.3g}: pass a smaller eps",
    }[vd.why]
    return GradcheckInconclusive(
        f"gradient check of {name}{where} is inconclusive ({mode} mode): {why}",
        arg=name, index=index, hidden=vd.hidden, size=vd.size)


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


def _scales(p: _Problem, grads: list, fast: bool) -> dict[int, float]:
    """Each differentiable argument's typical derivative size (module docstring)."""
    out = {}
    for i in p.diff:
        g = p.grad_of(grads, i)
        if g.size == 0:
            out[i] = 0.0
        elif fast:
            out[i] = float(np.linalg.norm(g)) / np.sqrt(g.size)
        else:
            out[i] = float(np.max(np.abs(g)))
        if not np.isfinite(out[i]):
            out[i] = 0.0  # a non-finite gradient fails its comparison; it sets no size
    return out


def check_vjp(
    f: Callable[..., np.ndarray | tuple[np.ndarray, ...]],
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
        f: ``f(*args) -> array``, or a tuple of arrays (of any shapes), of real floats.
        f_vjp: ``f_vjp(*args, dout) -> tuple`` with one entry per arg: the gradient of
            ``sum(dout * f(*args))`` w.r.t. that arg, or None for a non-array argument.
            ``dout`` has f's layout: an array, or a tuple with one array per output.
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
        GradcheckInconclusive: where finite differences cannot judge (never a silent pass).
        ValueError, TypeError: for bad arguments, or results of f or f_vjp that are not
            real arrays of the right shapes.
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
    if not any(_differentiable(a) for a in args):
        raise ValueError("args has no floating ndarray to differentiate")
    p = _Problem(f, f_vjp, args, names)
    checked = [i for i in p.diff if p.args[i].size > 0]  # an empty argument has nothing to vary
    unsure: list[GradcheckInconclusive] = []

    if mode == "full":
        v = _unit(rng, (p.layout.size,))
        grads = p.vjp(v)
        scales = _scales(p, grads, fast=False)
        reports = []
        for i in p.diff:
            if i not in checked:
                reports.append(ArgReport(p.names[i], 0, 0.0, 0.0, 0.0))
                continue
            g = p.grad_of(grads, i)
            lim = _Limits(atol, rtol, scales[i])
            report, err, inc = _full(p, i, g, v, _step(p.args[i], eps, False), lim,
                                     max_elements, rng)
            if err is not None:
                raise err
            unsure += [inc] if inc is not None else []
            reports.append(report)
        if unsure:
            raise unsure[0]
        return GradcheckReport("full", reports)

    stats = {i: [0.0, 0.0, 0.0, 0.0] for i in p.diff}  # max abs, max rel, tolerance, round-off
    for _ in range(n_directions):
        v = _unit(rng, (p.layout.size,))
        grads = p.vjp(v)
        scales = _scales(p, grads, fast=True)
        for i in p.diff:
            g = p.grad_of(grads, i)
            if i not in checked:
                continue
            u = _unit(rng, g.shape)
            h = _step(p.args[i], eps, fast=True)
            lim = _Limits(atol, rtol, scales[i])
            vd = _compare(p, i, g, u, v, h, lim)
            s = stats[i]
            s[0] = max(s[0], vd.err)
            s[1] = max(s[1], vd.err / scales[i] if scales[i] > 0 else vd.err)
            s[2] = max(s[2], vd.tolerance)
            s[3] = max(s[3], vd.roundoff)
            if vd.status == "inconclusive":
                unsure.append(_inconclusive(p.names[i], None, vd, "fast"))
            elif vd.status == "fail":
                raise _fast_failure(p, i, g, v, vd, eps, lim, max_elements, rng)
    if unsure:
        raise unsure[0]
    return GradcheckReport("fast", [ArgReport(p.names[i], n_directions if i in checked else 0,
                                              *stats[i]) for i in p.diff])


def _fast_failure(p: _Problem, i: int, g: np.ndarray, v: np.ndarray, vd: _Verdict,
                  eps: float | None, lim: _Limits, max_elements: int | None,
                  rng: np.random.Generator) -> GradcheckError:
    """The error for a failed direction, pointing at an element where a full check of a
    sample (same v, no extrapolation: it only ranks elements) finds one."""
    sample = _followup_size(g.size, p.layout.size, max_elements)
    _, full_err, _ = _full(p, i, g, v, _step(p.args[i], eps, fast=False), lim, sample, rng,
                           retry=False)
    how = ", extrapolated from steps h and h/2" if vd.extrapolated else ""
    where = (f"; worst element: {full_err}" if full_err is not None
             else f"; no element of the {sample} sampled exceeds its tolerance, so the error is "
                  f"spread or outside the sample")
    return GradcheckError(
        f"gradient check failed for {p.names[i]}: directional derivative analytic "
        f"{vd.analytic:.10g}, numerical {vd.numerical:.10g}, |difference| {vd.err:.3g} > "
        f"tolerance {vd.tolerance:.3g} (fast mode{how}){where}",
        arg=p.names[i],
        index=None if full_err is None else full_err.index,
        analytic=vd.analytic if full_err is None else full_err.analytic,
        numerical=vd.numerical if full_err is None else full_err.numerical,
        tolerance=vd.tolerance if full_err is None else full_err.tolerance,
    )
