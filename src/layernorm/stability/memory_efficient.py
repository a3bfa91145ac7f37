"""Table 7: the memory-efficient backward (y kept instead of x, xhat recovered from it)
against the default mode, each norm in each backend, against the exact oracle and the
tolerance table, on adversarial rows and the hard cases of the recovery rule."""

from __future__ import annotations

import numpy as np

from ..dtypes import DTYPES, available, resolve
from ..family import NORMS, Norm
from ..numerics import exact_norm, relative_error, unit_roundoff
from ..tolerances import compare
from .common import Sizes, Table, _family_modules, _norm_functions

ME_TITLE = "The memory-efficient backward against the default mode: errors against the exact oracle"
_ME_GRADS = ("dx", "dgamma", "dbeta")
_ME_GOAL = 2.0  # the memory-efficient error over the default's, float32 and float64


def _me_cases(sz: Sizes, rng: np.random.Generator, dtype: str, centred: bool
              ) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray | None]]:
    """(name, values v (M, D), gamma, beta) of one dtype: adversarial rows with
    gamma = 1 + N(0, 0.25) and beta ~ N(0, 1), then the hard cases of the recovery rule."""
    m, d = sz.rows, sz.d
    offset = {"float64": 1e8, "float32": 1e4, "float16": 50.0, "bfloat16": 50.0}[dtype]
    big = {"float64": 1e200, "float32": 1e20, "float16": 1e3, "bfloat16": 1e20}[dtype]
    top = DTYPES[dtype].largest

    def beta_of(b: np.ndarray) -> np.ndarray | None:
        return np.clip(b, -top / 4, top / 4) if centred else None

    def ordinary() -> tuple[np.ndarray, np.ndarray | None]:
        return 1 + 0.5 * rng.standard_normal(d), beta_of(rng.standard_normal(d))

    noise = rng.standard_normal((m, d))
    cases = [(name, v, *ordinary()) for name, v in (
        ("N(0, 1)", rng.standard_normal((m, d))),
        (f"{offset:.0e} + N(0, 1)", offset + rng.standard_normal((m, d))),
        (f"{big:.0e} + N(0, {big / 10:.0e})", big * (1 + 0.1 * noise)),
    )]
    if centred:
        const = np.repeat(rng.uniform(-100, 100, (m, 1)), d, axis=1)
        cases.append(("zero variance", const, *ordinary()))
    span = np.geomspace(1e-4, 1e4, d) * np.where(np.arange(d) % 2, 1.0, -1.0)
    zero = np.where(np.arange(d) % 5 == 0, 0.0, 1 + 0.5 * rng.standard_normal(d))
    hard = [("gamma = 0 on every fifth channel", zero, beta_of(rng.standard_normal(d))),
            ("gamma from 1e-4 to 1e4", span, beta_of(np.zeros(d)))]
    if centred:
        hard.append(("beta = 1e4 * gamma, gamma from 1e-4 to 1e4", span, beta_of(1e4 * span)))
    cases += [(name, rng.standard_normal((m, d)) + 0.5, g, b) for name, g, b in hard]
    return cases


def _me_errors(module: object, norm: Norm, x: np.ndarray, residual: np.ndarray | None,
               gamma: np.ndarray, beta: np.ndarray | None, dy: np.ndarray, ex: object,
               dt: np.dtype, memory_efficient: bool) -> tuple[dict[str, float], bool, str]:
    """Errors of dx, dgamma, dbeta against the exact ``ex``, whether each is within the
    tolerance table, and "k / r" (the kept channels and rows; "" in the default mode)."""
    forward, backward = _norm_functions(module, norm)
    params = {"gamma": gamma, "eps": norm.eps, "memory_efficient": memory_efficient}
    if norm.centred:
        params["beta"] = beta
    if norm.residual:
        *_, cache = forward(x, residual, **params)
        dx, _, dgamma, *rest = backward(dy, None, cache)
    else:
        *_, cache = forward(x, **params)
        dx, dgamma, *rest = backward(dy, cache)
    got = {"dx": dx, "dgamma": dgamma, "dbeta": rest[0] if rest else None}
    want = {"dx": ex.dx, "dgamma": ex.dgamma, "dbeta": ex.dbeta}
    errs, ok = {}, True
    for k, g in got.items():
        if g is None:
            continue
        errs[k] = relative_error(g, want[k])
        size = float(np.max(np.abs(want[k]))) or 1.0
        ok = ok and compare(g, want[k], dt.name, "out" if k == "dx" else "param",
                            scale=size).ok
    from ..reference import AddNormCache

    inner = cache.norm if isinstance(cache, AddNormCache) else cache  # the norm's
    rows = getattr(inner, "rows", np.empty(0))
    return errs, ok, f"{inner.keep.shape[0]} / {rows.shape[0]}" if memory_efficient else ""


def memory_efficient_table(sz: Sizes, rng: np.random.Generator) -> tuple[Table, list[str]]:
    """Table 7 and the failed targets (a result outside the tolerance table)."""
    table = Table(
        ME_TITLE,
        ["norm", "case", "dtype", "backend", "k / r", *(f"{g}{m}" for g in _ME_GRADS
                                                  for m in ("", " (ME)")),
         "ME / default", f"goal <= {_ME_GOAL:g}x", "result"],
        note=("ME: memory_efficient=True, the backward recovering xhat = (y - beta)/scale from "
              "y; k / r: the channels the rule keeps xhat for, and the rows it keeps whole "
              "(src/layernorm/recovery.py). Errors "
              "normwise against the exact oracle. ME / default: the largest ratio over dx, "
              "dgamma, dbeta, an error below one unit in the last place (2u) counted as one "
              "unit; the goal applies to float32 and float64. result: every ME gradient within "
              "the tolerance table (src/layernorm/tolerances.py), the target in every dtype. "
              "gamma = 1 + N(0, 0.25), beta ~ N(0, 1) unless the case sets them; an add-norm "
              "normalizes h = x + residual ~ the case's values."),
    )
    failed: list[str] = []
    modules = _family_modules()
    for norm in NORMS.values():
        for dtype in ("float64", "float32", "float16", "bfloat16"):
            if dtype not in available():
                continue
            dt = resolve(dtype)
            u = unit_roundoff(dt)
            for name, v, g64, b64 in _me_cases(sz, rng, dtype, norm.centred):
                gamma = g64.astype(dt)
                beta = None if b64 is None else b64.astype(dt)
                dy = rng.standard_normal(v.shape).astype(dt)
                if norm.residual:
                    residual = (v * rng.uniform(0.2, 0.8, v.shape)).astype(dt)
                    x = (v - residual.astype(np.float64)).astype(dt)
                    with np.errstate(over="ignore"):
                        h = np.add(x, residual, dtype=np.float64).astype(dt)
                else:
                    x, residual, h = v.astype(dt), None, v.astype(dt)
                if not np.all(np.isfinite(h.astype(np.float64))):
                    continue
                ex = exact_norm(h, gamma, beta, norm.eps, dy, centred=norm.centred)
                for backend, module in modules:
                    base, _, _ = _me_errors(module, norm, x, residual, gamma, beta, dy, ex, dt,
                                            False)
                    errs, ok, k = _me_errors(module, norm, x, residual, gamma, beta, dy, ex, dt,
                                             True)
                    ratio = max(errs[q] / max(base[q], 2 * u) for q in errs)
                    goal = ("met" if ratio <= _ME_GOAL else "missed") \
                        if dtype in ("float32", "float64") else ""
                    cells = [f"{vals[q]:.1e}" if q in vals else "—"
                             for q in _ME_GRADS for vals in (base, errs)]
                    table.rows.append([norm.title, name, dtype, backend, k, *cells,
                                       f"{ratio:.2f}", goal, "pass" if ok else "FAIL"])
                    if not ok:
                        failed.append(f"{norm.title}: {name} [{dtype}, {backend}, memory-"
                                      f"efficient] a gradient outside the tolerance table")
    return table, failed
