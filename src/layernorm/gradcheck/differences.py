"""The finite differences of :func:`layernorm.gradcheck.check_vjp` and their verdicts: f and
f_vjp on private float64 copies (:class:`_Problem`), the central difference along a direction
with its round-off bound (:class:`_Difference`), and the comparison with the analytic value:
at h, again at a wider step where round-off hides the derivative, extrapolated from h and h/2
where it fails, and called inconclusive where f has a kink (the rules: the package's
docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from .._validate import is_float_dtype
from ..dtypes import DTYPES

# The largest share of the derivative's size that f's round-off may hide in a passing check.
RESOLUTION = 1e-5
# Where round-off hides the derivative, the comparison is repeated with a step this much longer.
WIDEN = 64.0
# A kink is believed only where it exceeds this many times what a wrong gradient could add to
# it through unequal rounded steps: two random projections of the error differ by this factor
# with a chance of about 6e-6.
_SKEW_MARGIN = 1e5


def _unit(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    u = rng.standard_normal(shape)
    n = np.linalg.norm(u)
    return u / n if n > 0 else u


def _is_real_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or is_float_dtype(dtype)


def _epsilon(dtype: np.dtype) -> float:
    """Machine epsilon (the spacing at 1) of a real floating dtype, bfloat16 included."""
    bits = DTYPES[dtype.name].significand_bits if dtype.name in DTYPES else None
    return 2.0 ** (1 - bits) if bits is not None else float(np.finfo(dtype).eps)


@dataclass(frozen=True)
class _Outputs:
    """How f's result is laid out: one array, or a tuple of arrays (flattened in order)."""

    shapes: tuple[tuple[int, ...], ...]
    is_tuple: bool
    eps: np.ndarray  # (size,) machine epsilon of each output element's dtype

    @property
    def size(self) -> int:
        return self.eps.size

    def split(self, flat: np.ndarray) -> np.ndarray | tuple[np.ndarray, ...]:
        """The flat (size,) cotangent in f's layout, as f_vjp receives it."""
        parts, start = [], 0
        for shape in self.shapes:
            n = int(np.prod(shape, dtype=np.int64))
            parts.append(flat[start:start + n].reshape(shape))
            start += n
        return tuple(parts) if self.is_tuple else parts[0]


def _as_output(y: object) -> tuple[np.ndarray, _Outputs]:
    """f's result as one flat float64 vector, and its layout; TypeError for what is not
    real floating arrays."""
    is_tuple = isinstance(y, (tuple, list))
    parts = list(y) if is_tuple else [y]
    if is_tuple and not parts:
        raise TypeError("f returned an empty tuple: it must return an array or a tuple of arrays")
    arrays = []
    for k, part in enumerate(parts):
        what = f"f's output {k}" if is_tuple else "f's output"
        if part is None:
            raise TypeError(f"{what} is None: f must return an array or a tuple of arrays")
        try:
            a = np.asarray(part)
        except Exception as exc:  # ragged nested lists
            raise TypeError(f"{what} is not an array: {exc}") from None
        if not _is_real_float(a.dtype):
            raise TypeError(f"{what} must have a real floating dtype to be differentiated, got "
                            f"{a.dtype}")
        arrays.append(a)
    flat = np.concatenate([a.astype(np.float64).ravel() for a in arrays])
    eps = np.concatenate([np.full(a.size, _epsilon(a.dtype)) for a in arrays])
    return flat, _Outputs(tuple(a.shape for a in arrays), is_tuple, eps)


class _Problem:
    """f and f_vjp on private float64 copies of the differentiable arguments."""

    def __init__(self, f: Callable, f_vjp: Callable, args: Sequence, names: Sequence[str]):
        self.f, self.f_vjp, self.names = f, f_vjp, list(names)
        self.args = [
            np.array(a, dtype=np.float64, copy=True) if _differentiable(a) else a for a in args
        ]
        self.diff = [i for i, a in enumerate(args) if _differentiable(a)]
        # f at the point: its layout, checked at every evaluation, and its value, which the
        # one-sided differences of a failing comparison need
        self.at_point, self.layout = _as_output(f(*self.args))

    def out(self, args: list) -> np.ndarray:
        flat, layout = _as_output(self.f(*args))
        if layout.shapes != self.layout.shapes:
            raise ValueError(f"f's output changed layout between evaluations: "
                             f"{self.layout.shapes} at the point, {layout.shapes} nearby")
        return flat

    def vjp(self, v: np.ndarray) -> list:
        grads = self.f_vjp(*self.args, self.layout.split(v))
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
        name = self.names[i]
        if gi is None:
            raise TypeError(
                f"f_vjp returned None for {name}, a floating array argument; pass it "
                f"as a constant (e.g. wrap it in a lambda) if it is not meant to be differentiated"
            )
        try:
            arr = np.asarray(gi)
        except Exception as exc:
            raise TypeError(f"f_vjp's gradient for {name} is not an array: {exc}") from None
        if arr.dtype.kind not in "iuf" and not is_float_dtype(arr.dtype):
            raise TypeError(f"f_vjp's gradient for {name} must be real numbers, got dtype "
                            f"{arr.dtype}")
        if arr.shape != self.args[i].shape:
            raise ValueError(
                f"f_vjp's gradient for {name} has shape {arr.shape}, "
                f"expected {self.args[i].shape}"
            )
        return arr.astype(np.float64)

    def difference(self, i: int, u: np.ndarray, v: np.ndarray, h: float) -> _Difference:
        """Central difference of v·f along h·u in arg i, with what the one-sided ones need."""
        a = self.args[i]
        args = list(self.args)
        args[i] = ap = a + h * u
        fp = self.out(args)
        args[i] = am = a - h * u
        fm = self.out(args)
        f0 = self.at_point
        # NumPy's pairwise sums, not np.dot: BLAS threads a long dot product, which costs more
        # than it gains once per element of a full Jacobian on a busy machine
        av = self.layout.eps * np.abs(v)  # (size,) ε·|v|
        return _Difference(
            num=float(np.sum(v * (fp - fm))) / (2 * h),
            step=(ap - am) / (2 * h),
            noise=2 * float(np.sum(av * (np.abs(fp) + np.abs(fm)))) / (2 * h),
            bend=float(np.sum(v * ((fp - f0) - (f0 - fm)))),
            bend_noise=2 * float(np.sum(av * (np.abs(fp) + 2 * np.abs(f0) + np.abs(fm)))),
            skew=(ap - a) + (am - a),
        )


@dataclass(frozen=True)
class _Difference:
    """Finite differences of v·f at a ± h·u (rounded to a₊, a₋): ``num`` the central one,
    ``step`` = (a₊ - a₋)/2h, ``noise`` the round-off bound of num; ``bend`` =
    v·(f(a₊) - 2f(a) + f(a₋)), h times the forward difference less the backward one,
    ``bend_noise`` its round-off bound, and ``skew`` = a₊ + a₋ - 2a, by which rounding made
    the two steps unequal."""

    num: float
    step: np.ndarray
    noise: float
    bend: float
    bend_noise: float
    skew: np.ndarray


def _differentiable(a: object) -> bool:
    return isinstance(a, np.ndarray) and is_float_dtype(a.dtype)


def _step(a: np.ndarray, eps: float | None, fast: bool) -> float:
    """Central-difference step for argument a (the package's docstring)."""
    if eps is not None:
        return eps
    h = 6e-6 * max(1.0, float(np.std(a)))
    return h * a.size ** (1 / 6) if fast else h


@dataclass(frozen=True)
class _Verdict:
    """One comparison: ``status`` is "pass", "fail" or "inconclusive"; ``why`` says what made
    it inconclusive: "roundoff", "rough" (steps h and h/2 disagree), "kink" (forward and
    backward differences disagree at both steps), "step" (the step rounds away against |a|) or
    "domain" (f is not finite at a ± h)."""

    status: str
    analytic: float
    numerical: float
    tolerance: float
    roundoff: float
    step: float
    extrapolated: bool = False
    why: str = ""
    hidden: float = 0.0  # with why: the error the differences cannot see
    size: float = 0.0  # with why: the derivative's size it was compared with

    @property
    def err(self) -> float:
        d = abs(self.numerical - self.analytic)
        return d if np.isfinite(d) else np.inf


@dataclass(frozen=True)
class _Limits:
    atol: float
    rtol: float
    scale: float  # this argument's typical derivative size for a unit step

    def judge(self, ana: float, num: float, tol: float, noise: float, h: float, moved: float,
              extrapolated: bool = False, change: float = 0.0) -> _Verdict:
        """The verdict on analytic ``ana`` against numerical ``num`` at step h, of which the
        fraction ``moved`` survived rounding; ``change``: between steps h and h/2."""
        common = {"analytic": ana, "numerical": num, "roundoff": noise, "step": h,
                  "extrapolated": extrapolated}
        # what a wrong gradient would show here: both values, and the typical size over the
        # step actually taken
        size = max(abs(ana), abs(num) if np.isfinite(num) else 0.0, self.scale * moved)
        if not np.isfinite(ana):
            return _Verdict("fail", tolerance=tol, **common)
        if not np.isfinite(num):
            return _Verdict("inconclusive", tolerance=tol, why="domain", **common)
        if moved < 0.5:  # a ± h·u rounds (nearly) to a: both sides are (nearly) zero
            return _Verdict("inconclusive", tolerance=tol, why="step", hidden=1 - moved,
                            size=size, **common)
        err = abs(num - ana)
        if err > tol:
            if extrapolated and err <= tol + change:
                return _Verdict("inconclusive", tolerance=tol + change, why="rough",
                                hidden=change, size=size, **common)
            return _Verdict("fail", tolerance=tol + change, **common)
        if noise > max(RESOLUTION * size, self.atol):
            return _Verdict("inconclusive", tolerance=tol, why="roundoff", hidden=noise,
                            size=size, **common)
        return _Verdict("pass", tolerance=tol, **common)


def _compare(p: _Problem, i: int, g: np.ndarray, u: np.ndarray, v: np.ndarray, h: float,
             lim: _Limits, retry: bool = True) -> _Verdict:
    """Compare (vᵀJ)·u with central differences at h (the package's docstring); where round-off
    hides the derivative, or the step rounds away, again at WIDEN·h."""
    vd = _compare_at(p, i, g, u, v, h, lim, retry)
    if retry and vd.why in ("roundoff", "step"):
        wide = _compare_at(p, i, g, u, v, WIDEN * h, lim, retry)
        if wide.why != "domain":  # a step that leaves f's domain decides nothing
            return wide
    return vd


def _compare_at(p: _Problem, i: int, g: np.ndarray, u: np.ndarray, v: np.ndarray, h: float,
                lim: _Limits, retry: bool) -> _Verdict:
    """Compare (vᵀJ)·u with central differences at h; on failure, extrapolate from h and h/2,
    and call what still fails inconclusive where f has a kink along u."""
    d1 = p.difference(i, u, v, h)
    ana = float(np.vdot(g, d1.step))
    unit = float(np.linalg.norm(u))
    moved = float(np.linalg.norm(d1.step)) / unit
    tol = lim.atol + lim.rtol * (abs(ana) + lim.scale) + d1.noise
    first = lim.judge(ana, d1.num, tol, d1.noise, h, moved)
    if first.status != "fail" or not retry or not np.isfinite(ana):
        return first
    d2 = p.difference(i, u, v, h / 2)
    ana2 = float(np.vdot(g, d2.step))
    moved2 = float(np.linalg.norm(d2.step)) / unit
    # Residuals r = num - ana at h and h/2: r(h) = e + c h² + ..., Richardson removes c h²,
    # provided both steps were taken along u (rounding against a large |a| may bend them).
    r1, r2 = d1.num - ana, d2.num - ana2
    change = abs(r1 - r2)
    bent = max(float(np.linalg.norm(d.step - u)) for d in (d1, d2))
    if bent <= 0.01 * unit:
        noise_r = (4 * d2.noise + d1.noise) / 3
        tol_r = lim.atol + lim.rtol * (abs(ana2) + lim.scale) + noise_r
        vd = lim.judge(ana2, ana2 + (4 * r2 - r1) / 3, tol_r, noise_r, h, min(moved, moved2),
                       extrapolated=True, change=change)
    else:
        # Steps bent by rounding: no extrapolation. A wrong gradient leaves the same residual
        # at both steps; truncation on a scale the rounding distorts does not.
        vd = lim.judge(ana2, d2.num, lim.atol + lim.rtol * (abs(ana2) + lim.scale) + d2.noise,
                       d2.noise, h, moved2)
        wrong = vd.status == "fail" and change <= 0.5 * min(abs(r1), abs(r2))
        if vd.status != "inconclusive" and not wrong:
            vd = replace(vd, status="inconclusive", why="rough", hidden=change,
                         size=max(abs(ana2), lim.scale * moved2))
    # what h/2 says it cannot judge keeps its own reason; what fails may be a kink
    return _kink(vd, g, h, unit, d1, d2, lim) if vd.status == "fail" else vd


def _kink(vd: _Verdict, g: np.ndarray, h: float, unit: float, d1: _Difference, d2: _Difference,
          lim: _Limits) -> _Verdict:
    """The failed verdict ``vd`` from the differences d1 at h and d2 at h/2, or inconclusive
    where f has a kink along u (the package's docstring, Kinks)."""
    # the gap between forward and backward differences, less what the unequal rounded steps
    # add to it (through the analytic vᵀJ)
    gap1 = (d1.bend - float(np.vdot(g, d1.skew))) / h
    gap2 = (d2.bend - float(np.vdot(g, d2.skew))) / (h / 2)
    # the gap's part that stays as the step halves, and the part that shrinks with it (all of
    # a smooth f's gap; its terms in h³ and beyond show in stays too, so stays must exceed it)
    stays, shrinks = abs(gap1 - 2 * gap2), abs(gap1 - gap2)
    noise = d1.bend_noise / h + 4 * d2.bend_noise / h
    # a wrong gradient's error e adds e·(skew(h) - 4·skew(h/2))/h to stays: this share of e·u
    skew = float(np.linalg.norm(d1.skew - 4 * d2.skew)) / (h * unit)
    # the derivative's size, as a wrong gradient would show it: both values, and the typical
    # size over the step taken
    size = max(abs(vd.analytic), abs(d2.num), lim.scale * float(np.linalg.norm(d2.step)) / unit)
    if stays > max(shrinks, lim.atol + lim.rtol * size + noise + _SKEW_MARGIN * skew * vd.err):
        return replace(vd, status="inconclusive", why="kink", hidden=stays, size=size)
    return vd
