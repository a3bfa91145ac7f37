"""The library checks itself: what ``layernorm check`` computes, one row per check and norm.

For every norm of the family (:data:`layernorm.family.NORMS`), on a few shapes:

    finite differences  the float64 reference's gradients by :func:`layernorm.check_vjp`:
                        fast mode on every shape and once more on a large one, full mode on
                        the small shapes; every differentiable argument (x, residual, gamma,
                        beta as the norm has them) and every output (the add-norms' y and h,
                        with their cotangents dy and dh)
    vs float64          the reference in each lower precision available here against the
                        float64 reference on the same rounded inputs
    fused CPU           :mod:`layernorm.cpu` (where its C++ engine runs) against the
                        reference in the same dtype, every dtype

Comparisons go through :func:`layernorm.tolerances.compare`. The rows of ZERO_CENTRED_SHAPE
use scale = 1 + gamma (``zero_centered_gamma``), the others scale = gamma. An add-norm's
reference rounds h before normalizing it, so its float64 twin normalizes that rounded h:
y and the norm's part of dx are judged on the same rounded input, h against x + residual.

No check raises: a failure, or a gradient check with no verdict, is a row with passed=False.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from . import reference
from .dtypes import available, resolve
from .family import NORMS, Norm, norm
from .gradcheck import GradcheckError, GradcheckInconclusive, check_vjp
from .tolerances import compare, tolerance

__all__ = ["FULL_SIZE", "LARGE_SHAPE", "SHAPES", "ZERO_CENTRED_SHAPE", "CheckRow", "run_checks"]

SHAPES: tuple[tuple[int, ...], ...] = ((8, 64), (4, 16, 128), (2, 3, 5, 33), (6, 1))
ZERO_CENTRED_SHAPE: tuple[int, ...] = (2, 3, 5, 33)
# Fast mode checks a few directions whatever the size: one large shape per norm shows it
# (the s column: the time is that of a few forwards and backwards, not one per element).
LARGE_SHAPE: tuple[int, ...] = (4, 256, 1024)
# Full mode checks every element, two forwards each: on the shapes of at most FULL_SIZE
# elements. (4, 16, 128) has fast mode only: element by element, an add-norm there (two
# (M, D) arguments, 16384 outputs) would take longer than all the other checks together,
# and far longer on a busy machine (with OpenBLAS, a dot product of more than 10^4
# elements runs multithreaded, and the checker makes one per element).
FULL_SIZE = 1024

_FAST, _FULL = "finite differences (fast)", "finite differences (full)"
_VS_FLOAT64, _CPU = "vs float64 reference", "fused CPU vs reference"


@dataclass(frozen=True)
class CheckRow:
    """One check of one norm: its errors, the tolerance as text, seconds taken, and why it
    failed. ``scale`` is ``"gamma"`` or ``"1+gamma"`` (zero-centred gamma)."""

    norm: str
    shape: tuple[int, ...]
    scale: str
    dtype: str
    method: str
    max_abs_err: float
    max_rel_err: float
    tolerance: str
    seconds: float
    passed: bool
    detail: str = ""


def _inputs(nm: Norm, shape: tuple[int, ...], seed: int, zero_centred: bool
            ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """float64 arguments (x, [residual], gamma, [beta]) and cotangents (dy, [dh])."""
    rng = np.random.default_rng(seed)
    d = shape[-1]
    args = [rng.standard_normal(shape) * 2.0 + 0.5]  # x
    if nm.residual:
        args.append(rng.standard_normal(shape))  # residual
    gamma = rng.standard_normal(d) * (0.3 if zero_centred else 1.0)  # (D,) near 0 when 1+gamma
    args += [gamma, *(rng.standard_normal(d) for _ in nm.params[1:])]  # gamma, [beta]
    cot = [rng.standard_normal(shape) for _ in nm.forward_outputs]  # dy, [dh]
    return args, cot


def _run(module: ModuleType, nm: Norm, args: Sequence[np.ndarray], cot: Sequence[np.ndarray],
         zero_centred: bool) -> list[np.ndarray]:
    """``nm``'s forward outputs (y, [h]), then its backward's (dx, [dresidual], dgamma,
    [dbeta]), from ``module`` (the reference or :mod:`layernorm.cpu`)."""
    *outs, cache = getattr(module, f"{nm.name}_forward")(*args, zero_centered_gamma=zero_centred)
    return [*outs, *getattr(module, f"{nm.name}_backward")(*cot, cache)]


def _names(nm: Norm) -> tuple[str, ...]:
    return (*nm.forward_outputs, *nm.backward_outputs, *("d" + p for p in nm.params))


def _scale_name(zero_centred: bool) -> str:
    return "1+gamma" if zero_centred else "gamma"


def _gradcheck_row(nm: Norm, shape: tuple[int, ...], mode: str, seed: int,
                   zero_centred: bool) -> CheckRow:
    args, _ = _inputs(nm, shape, seed, zero_centred)
    fwd = getattr(reference, f"{nm.name}_forward")
    bwd = getattr(reference, f"{nm.name}_backward")

    def f(*a: np.ndarray) -> np.ndarray | tuple[np.ndarray, ...]:
        *outs, _ = fwd(*a, zero_centered_gamma=zero_centred)
        return tuple(outs) if nm.residual else outs[0]  # (y, h) or y

    def f_vjp(*a: object) -> tuple:
        *a, dout = a
        cache = fwd(*a, zero_centered_gamma=zero_centred)[-1]
        return bwd(*dout, cache) if nm.residual else bwd(dout, cache)

    method = _FAST if mode == "fast" else _FULL
    head = (nm.name, shape, _scale_name(zero_centred), "float64", method)
    t0 = time.perf_counter()
    try:
        rep = check_vjp(f, f_vjp, args, mode=mode, seed=seed,
                        names=(*nm.forward_inputs, *nm.params))
    except GradcheckError as exc:
        return CheckRow(*head, abs(exc.numerical - exc.analytic), float("nan"),
                        f"{exc.tolerance:.1e}", time.perf_counter() - t0, False, str(exc))
    except GradcheckInconclusive as exc:  # no verdict is a failure of the check, not a pass
        return CheckRow(*head, float("nan"), float("nan"), "-", time.perf_counter() - t0,
                        False, str(exc))
    tol = max(a.tolerance for a in rep.args)
    return CheckRow(*head, rep.max_abs_err, rep.max_rel_err, f"{tol:.1e}",
                    time.perf_counter() - t0, True)


def _float64_twin(nm: Norm, args: Sequence[np.ndarray], cot: Sequence[np.ndarray],
                  got: Sequence[np.ndarray], zero_centred: bool) -> list[np.ndarray]:
    """The float64 reference's results on the rounded inputs ``args`` and ``cot``; for an
    add-norm, the norm of the h in ``got`` (rounded as the reference rounds it), and h = x +
    residual, dx = dresidual = dh + that norm's dx."""
    a64 = [a.astype(np.float64) for a in args]
    c64 = [c.astype(np.float64) for c in cot]
    if not nm.residual:
        return _run(reference, nm, a64, c64, zero_centred)
    inner = norm("layer_norm" if nm.centred else "rms_norm")
    y, dnorm, *dparams = _run(reference, inner, [got[1].astype(np.float64), *a64[2:]],
                              c64[:1], zero_centred)
    total = dnorm + c64[1]  # (M, D) dh + the norm's dx
    return [y, a64[0] + a64[1], total, total, *dparams]


def _compare_row(nm: Norm, shape: tuple[int, ...], dtype_name: str, method: str,
                 got: Sequence[np.ndarray], want: Sequence[np.ndarray], zero_centred: bool,
                 seconds: float) -> CheckRow:
    """One row judging every result of ``nm`` (``got`` against ``want``) under the table's
    tolerance for ``dtype_name``: "out" for y, h, dx, dresidual; "param" for dgamma, dbeta."""
    n_out = len(nm.forward_outputs) + len(nm.backward_outputs)
    results = [compare(g, w, dtype_name, "out" if i < n_out else "param")
               for i, (g, w) in enumerate(zip(got, want, strict=True))]
    bad = [(name, c) for name, c in zip(_names(nm), results, strict=True) if not c]
    detail = "; ".join(f"{name} at {c.index}: got {c.got:.6g}, want {c.want:.6g}, "
                       f"|difference| {abs(c.got - c.want):.3g} > {c.bound:.3g}"
                       for name, c in bad)
    t = tolerance(dtype_name, "out")
    return CheckRow(nm.name, shape, _scale_name(zero_centred), dtype_name, method,
                    max(c.max_abs_err for c in results),
                    max(c.max_rel_err for c in results),  # normwise, per result
                    f"{t.atol:.2g}+{t.rtol:.2g}|ref|", seconds, not bad, detail)


def _dtype_row(nm: Norm, shape: tuple[int, ...], dtype_name: str, seed: int,
               zero_centred: bool) -> CheckRow:
    args, cot = _inputs(nm, shape, seed, zero_centred)
    dt = resolve(dtype_name)
    args, cot = [a.astype(dt) for a in args], [c.astype(dt) for c in cot]
    t0 = time.perf_counter()
    got = _run(reference, nm, args, cot, zero_centred)
    want = _float64_twin(nm, args, cot, got, zero_centred)
    return _compare_row(nm, shape, dtype_name, _VS_FLOAT64, got, want, zero_centred,
                        time.perf_counter() - t0)


def _backend_row(backend: ModuleType, nm: Norm, shape: tuple[int, ...], dtype_name: str,
                 seed: int, zero_centred: bool) -> CheckRow:
    args, cot = _inputs(nm, shape, seed, zero_centred)
    dt = resolve(dtype_name)
    args, cot = [a.astype(dt) for a in args], [c.astype(dt) for c in cot]
    t0 = time.perf_counter()
    got = _run(backend, nm, args, cot, zero_centred)
    want = _run(reference, nm, args, cot, zero_centred)
    return _compare_row(nm, shape, dtype_name, _CPU, got, want, zero_centred,
                        time.perf_counter() - t0)


def _fused_cpu() -> ModuleType | None:
    """:mod:`layernorm.cpu` where its C++ engine runs, else None (its NumPy fallback is the
    reference's arithmetic: nothing to check)."""
    from . import cpu

    return cpu if cpu.api.engine_runs() else None


def run_checks(seed: int = 0, norms: Sequence[str] | None = None) -> list[CheckRow]:
    """Every check row of ``norms`` (names from :data:`NORMS`; default all), in the family's
    order; none raises: a failure is a row with ``passed=False``."""
    wanted = {norm(n).name for n in (NORMS if norms is None else norms)}
    chosen = [nm for nm in NORMS.values() if nm.name in wanted]
    cpu = _fused_cpu()
    low = [n for n in available() if n != "float64"]
    rows = []
    for nm in chosen:
        for shape in SHAPES:
            zc = shape == ZERO_CENTRED_SHAPE
            rows.append(_gradcheck_row(nm, shape, "fast", seed, zc))
            if math.prod(shape) <= FULL_SIZE:
                rows.append(_gradcheck_row(nm, shape, "full", seed, zc))
            rows.extend(_dtype_row(nm, shape, name, seed, zc) for name in low)
            if cpu is not None:
                rows.extend(_backend_row(cpu, nm, shape, name, seed, zc) for name in available())
        rows.append(_gradcheck_row(nm, LARGE_SHAPE, "fast", seed, False))
    return rows
