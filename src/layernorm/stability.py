"""Measure the norms' numerical error against exact answers: the adversarial suite.

Seven tables, every error normwise, max|got - exact|/max|exact| (ulps: in the output dtype at
max|exact|), against the exact oracle (:func:`layernorm.numerics.exact_norm`, integer
arithmetic) unless the oracle column says otherwise:

1. Variance algorithms: the error of xhat = ((x - mean) - mean_lo)/sqrt(var + eps) when each
   algorithm of :mod:`layernorm.numerics` computes the statistics in the given dtype, and of
   the library's y = xhat (no gamma, beta) for an input of that dtype. Offset sweep
   x = offset + N(0, 1) for offsets 1e0 ... 1e14, tiny and zero variance, dynamic range,
   float16 extremes, long rows (D = 1e5).
2. LayerNorm in the library's backends (the NumPy reference and, with numba, the fused CPU
   kernels) on the targets: large offsets, zero-variance rows, values whose squares or sums
   overflow, values near the top of float64's range, long rows and many rows (M = 1e6, where
   the oracle is the float64 reference with math.fsum), with the target and pass/FAIL.
3. The backward's cancellation: dy chosen so that g = dy*gamma is close to span{1, xhat};
   the error of dx against kappa = max|g|*rstd/max|dx| for each way to compute it.
4. The rest of the family (RMSNorm, add+LayerNorm, add+RMSNorm) in both backends, every
   dtype, with the targets of table 2: large offsets, squares that overflow, dgamma over many
   rows; and zero-centred gamma for every norm.
5. The peers, each on the same inputs as ours (the fused CPU kernels): torch's eager
   F.layer_norm and F.rms_norm, the same under torch.compile, onnxruntime's fused CPU
   operators; y and, where the peer has a backward, dx, against the exact oracle and ours'
   targets: large mean with small variance, the rows of onnxruntime's tracker, constant rows,
   values near 1e30 (float32, bfloat16) and 1e300 (float64), float16 extremes, long rows. A
   peer that does not import here is shown absent, with the reason.
6. Speed of the reference and of the float64-arithmetic alternative.
7. The memory-efficient backward (y kept instead of x, xhat recovered from it): dx, dgamma
   and dbeta of each norm in both modes, in each backend, against the exact oracle, on
   adversarial rows and the hard cases of the recovery rule (gamma = 0, gamma from 1e-4 to
   1e4, beta = 1e4 * gamma); k, the channels the rule keeps; the memory-efficient error
   over the default's (the goal: at most 2x in float32 and float64); and the tolerance
   table's verdict (the target, in every dtype).

Exit status 1 if a target of ours in table 2, 4, 5 or 7 fails (the peers' misses are findings,
not failures). ``--quick`` shrinks the sizes of tables 1-4 and 6 (the report uses it); table 5
has sizes of its own.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ._table import render
from .dtypes import DTYPES, NAMES, available, resolve
from .family import NORMS, Norm
from .numerics import (
    BACKWARD_MECHANISMS,
    VARIANCE_ALGORITHMS,
    cancellation_inputs,
    exact_layer_norm,
    exact_norm,
    float32_backward,
    float64_param_grads,
    normalize,
    relative_error,
    ulp,
    ulp_error,
    unit_roundoff,
)
from .reference import layer_norm_backward, layer_norm_forward
from .tolerances import compare

OFFSETS = tuple(10.0**k for k in range(0, 15, 2))
EXACT = "exact"


@dataclass(frozen=True)
class Sizes:
    """Problem sizes: full for the command, quick for the report."""

    rows: int
    d: int
    long_d: int
    many_rows: int
    timing_shape: tuple[int, int]
    repeats: int


FULL = Sizes(rows=4, d=1024, long_d=100_000, many_rows=1_000_000, timing_shape=(4096, 1024),
             repeats=7)
QUICK = Sizes(rows=2, d=256, long_d=10_000, many_rows=100_000, timing_shape=(1024, 1024),
              repeats=3)


@dataclass
class Table:
    title: str
    head: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""


@dataclass
class Results:
    """The tables, the offset sweep for the plot and whether every target held."""

    tables: list[Table]
    # dtype -> series name -> [(offset, error)]
    sweep: dict[str, dict[str, list[tuple[float, float]]]]
    failed: list[str]
    # peer -> the cases of table 5 where it misses a target: (norm title, case, dtype)
    missed: dict[str, list[tuple[str, str, str]]] = field(default_factory=dict)


def _dtypes() -> list[np.dtype]:
    return [resolve(name) for name in available()]


def _fmt(v: float) -> str:
    if math.isinf(v) or math.isnan(v):
        return "inf"
    return "0" if v == 0 else f"{v:.1e}"


def _fits(x: np.ndarray, dt: np.dtype) -> bool:
    """Whether x rounds to finite values of dt (bfloat16 has float32's range)."""
    return bool(np.abs(x).max() < DTYPES[dt.name].largest)


# --- table 1: variance algorithms ---------------------------------------------------------

_EVERY = frozenset(NAMES)


@dataclass(frozen=True)
class AlgoCase:
    """Rows center + std*noise (or other values) for the variance algorithms."""

    name: str
    x: np.ndarray  # (M, D) float64, rounded to each dtype by the runner
    dtypes: frozenset = _EVERY
    center: float = 0.0
    std: float = math.inf  # inf: no noise to resolve
    offset: float | None = None  # the sweep's abscissa

    def resolved(self, dt: np.dtype) -> bool:
        """The dtype's spacing at the center is at most std/8: the noise survives rounding."""
        return self.center == 0 or ulp(self.center, dt) <= self.std / 8


def _algorithm_cases(sz: Sizes, rng: np.random.Generator) -> list[AlgoCase]:
    m, d = sz.rows, sz.d
    cases = [AlgoCase(f"offset {off:.0e}", off + rng.standard_normal((m, d)), center=off,
                      std=1.0, offset=off) for off in OFFSETS]
    mag = 10.0 ** rng.uniform(-3, 4, (m, d)) * rng.choice([-1.0, 1.0], (m, d))
    return [
        *cases,
        AlgoCase("tiny variance: 10 + N(0, 1e-3), var < eps",
                 10 + 1e-3 * rng.standard_normal((m, d)), center=10.0, std=1e-3),
        AlgoCase("zero variance, |x| < 5 (absolute error)",
                 np.repeat(rng.uniform(-5, 5, (m, 1)), d, 1)),
        AlgoCase("zero variance, |x| ~ 1e6 (absolute error)",
                 np.repeat(rng.uniform(1e6, 2e6, (m, 1)), d, 1)),
        AlgoCase("dynamic range: ±10^U(-3, 4)", mag),
        AlgoCase("float16 extremes: U(-6e4, 6e4)", rng.uniform(-6e4, 6e4, (m, d))),
        AlgoCase(f"long rows: 1e4 + N(0, 1), D = {sz.long_d:.0e}",
                 1e4 + rng.standard_normal((2, sz.long_d)), frozenset({"float32", "float64"}),
                 center=1e4, std=1.0),
    ]


def algorithm_table(sz: Sizes, rng: np.random.Generator, eps: float = 1e-5
                    ) -> tuple[Table, dict[str, dict[str, list[tuple[float, float]]]]]:
    """Table 1 and the offset sweep (dtype -> algorithm -> [(offset, error)])."""
    names = [*VARIANCE_ALGORITHMS, "library y"]
    table = Table(
        "Variance algorithms: error of xhat, statistics computed in the dtype",
        ["case", "dtype", *names, "oracle"],
        note=("Arithmetic in the dtype as NumPy does it: float16 sums carry float32 partial "
              "sums, bfloat16 sums are sequential in bfloat16. 'library y' is "
              "layer_norm_forward on an input of that dtype (half precision computed in "
              "float32, rounded to the dtype). A dtype is left out where it cannot hold the "
              "values, or where its spacing at the offset exceeds std/8 (the rounded rows "
              "would be nearly constant: zero variance has its own row). Long rows skip the "
              "half dtypes: Welford's count overflows float16."),
    )
    sweep: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for case in _algorithm_cases(sz, rng):
        for dt in _dtypes():
            if dt.name not in case.dtypes or not _fits(case.x, dt) or not case.resolved(dt):
                continue
            x = case.x.astype(dt)
            want = exact_layer_norm(x, eps=eps).xhat
            with np.errstate(all="ignore"):  # overflow and negative variances are the point
                errs = [relative_error(normalize(x, algo(x, None), eps), want)
                        for algo in VARIANCE_ALGORITHMS.values()]
            errs.append(relative_error(layer_norm_forward(x, eps=eps)[0], want))
            table.rows.append([case.name, dt.name, *map(_fmt, errs), EXACT])
            if case.offset is not None:
                series = sweep.setdefault(dt.name, {})
                for name, err in zip(names, errs, strict=True):
                    series.setdefault(name, []).append((case.offset, err))
    return table, sweep


# --- table 2: the library against the targets ---------------------------------------------

_REF_COLS = ("y", "dx", "dgamma", "dbeta", "y ulps", "dx ulps")
FUSED = "fused CPU"

Backend = tuple[str, Callable, Callable]  # name, forward, backward


def _backends() -> list[Backend]:
    """The reference, and the fused CPU kernels where numba is installed."""
    found: list[Backend] = [("reference", layer_norm_forward, layer_norm_backward)]
    try:
        from . import cpu
    except ImportError:
        return found
    return [*found, (FUSED, cpu.layer_norm_forward, cpu.layer_norm_backward)]


@dataclass(frozen=True)
class RefCase:
    name: str
    dtype: str
    x: np.ndarray  # (M, D) float64, rounded to dtype by the runner
    eps: float = 1e-5
    targets: dict[str, float] = field(default_factory=dict)
    fortran: bool = False  # pass x and dy column-major (strided rows)


def _ref_cases(sz: Sizes, rng: np.random.Generator) -> list[RefCase]:
    m, d = sz.rows, sz.d
    f32 = {"y": 2e-6, "dx": 2e-5}
    half = {"y ulps": 2.0, "dx ulps": 2.0}
    cases = [
        RefCase("1e8 + N(0, 1e-3), eps = 1e-12", "float64",
                1e8 + 1e-3 * rng.standard_normal((m, d)), 1e-12, {"y": 1e-12}),
        RefCase("1e4 + N(0, 0.1)", "float32", 1e4 + 0.1 * rng.standard_normal((m, d)),
                targets=f32),
    ]
    cases += [RefCase(f"{off:.0e} + N(0, 1)", "float32", off + rng.standard_normal((m, d)),
                      targets=f32) for off in (1e2, 1e4, 1e6)]
    cases += [
        RefCase("float16 extremes: U(-6e4, 6e4)", "float16", rng.uniform(-6e4, 6e4, (m, d)),
                targets=half),
        RefCase("N(0, 1)", "float16", rng.standard_normal((m, d)), targets=half),
        RefCase("N(0, 1)", "bfloat16", rng.standard_normal((m, d)), targets=half),
        RefCase("50 + N(0, 1)", "bfloat16", 50 + rng.standard_normal((m, d)), targets=half),
        RefCase("±U(1e20, 1e30): squares overflow", "bfloat16",
                rng.choice([-1.0, 1.0], (m, d)) * 10.0 ** rng.uniform(20, 30, (m, d)),
                targets=half),
        RefCase("1e20 + N(0, 1e19): squares overflow", "float32",
                1e20 + 1e19 * rng.standard_normal((m, d)), targets=f32),
        RefCase("1e200 + N(0, 1e199): squares overflow", "float64",
                1e200 + 1e199 * rng.standard_normal((m, d)), targets={"y": 1e-12}),
        RefCase(f"long rows: 1e4 + N(0, 1), D = {sz.long_d:.0e}", "float32",
                1e4 + rng.standard_normal((2, sz.long_d)), targets=f32),
        RefCase(f"long rows, column-major x and dy, D = {sz.long_d:.0e}", "float32",
                1e4 + rng.standard_normal((2, sz.long_d)), targets=f32, fortran=True),
    ]
    const = np.repeat(rng.uniform(-100, 100, (m, 1)), d, axis=1)
    for dt in _dtypes():
        cases.append(RefCase("zero variance: y = beta, dx = rstd*(g - mean(g))", dt.name, const,
                             targets={"y ulps": 0.5, "dx ulps": 4.0}))
    return cases


def _float64_cases(sz: Sizes, rng: np.random.Generator) -> list[RefCase]:
    """float64 where a kernel can lose what the reference keeps: the mean's correction below an
    ulp of a large mean, and rows whose sums or centred values overflow."""
    m, d = sz.rows, sz.d
    f64 = {"y": 1e-13, "dx": 1e-13}
    top = np.tile([1.7e308, -1.7e308, 1.0e308, -0.5e308], (m, 1))
    return [
        RefCase("1e8 + N(0, 1)", "float64", 1e8 + rng.standard_normal((m, d)), targets=f64),
        RefCase("1e8 + N(0, 0.01)", "float64", 1e8 + 0.01 * rng.standard_normal((m, d)),
                targets=f64),
        RefCase("3 + N(0, 0.01)", "float64", 3 + 0.01 * rng.standard_normal((m, d)),
                targets=f64),
        RefCase(f"±U(0, 9e307), D = {sz.long_d:.0e}: sums overflow", "float64",
                rng.choice([-9e307, 9e307], (2, sz.long_d)) * rng.random((2, sz.long_d)),
                targets=f64),
        RefCase("[1.7e308, -1.7e308, 1e308, -0.5e308]: x - mean overflows", "float64", top,
                targets=f64),
    ]


def _ref_rows(case: RefCase, rng: np.random.Generator, backends: list[Backend]
              ) -> list[tuple[list[str], list[str]]]:
    """One row per backend for ``case``, all on the same drawn inputs."""
    dt = resolve(case.dtype)
    m, d = case.x.shape
    x = case.x.astype(dt)
    gamma = (1 + 0.5 * rng.standard_normal(d)).astype(dt)
    beta = rng.standard_normal(d).astype(dt)
    dy = rng.standard_normal((m, d)).astype(dt)
    order = np.asfortranarray if case.fortran else np.ascontiguousarray
    ex = exact_layer_norm(x, gamma, beta, case.eps, dy)
    rows = []
    for name, forward, backward in backends:
        y, cache = forward(order(x), gamma, beta, case.eps)
        dx, dgamma, dbeta = backward(order(dy), cache)
        got = {
            "y": relative_error(y, ex.y),
            "dx": relative_error(dx, ex.dx),
            "dgamma": relative_error(dgamma, ex.dgamma),
            "dbeta": relative_error(dbeta, ex.dbeta),
            "y ulps": ulp_error(y, ex.y, dt),
            "dx ulps": ulp_error(dx, ex.dx, dt),
        }
        rows.append(_verdict(case.name, case.dtype, name, got, case.targets, EXACT))
    return rows


def _verdict(name: str, dtype: str, backend: str, got: dict[str, float],
             targets: dict[str, float], oracle: str, cols: tuple[str, ...] = _REF_COLS
             ) -> tuple[list[str], list[str]]:
    failed = [f"{name} [{dtype}, {backend}] {k}: {got[k]:.2e} > {bound:.0e}"
              for k, bound in targets.items() if not got[k] <= bound]
    target = ", ".join(f"{k} <= {v:g}" for k, v in targets.items())
    result = ("FAIL" if failed else "pass") if targets else ""
    cells = [_fmt(got[c]) if c in got else "—" for c in cols]
    return [name, dtype, backend, *cells, target, result, oracle], failed


def _many_rows(sz: Sizes, rng: np.random.Generator, backends: list[Backend]
               ) -> list[tuple[list[str], list[str]]]:
    """dgamma and dbeta over many rows of D = 8 in float32: each backend and a float32 sum."""
    m, d = sz.many_rows, 8
    x = (3 + rng.standard_normal((m, d))).astype(np.float32)
    dy = (0.1 + rng.standard_normal((m, d))).astype(np.float32)
    gamma = np.ones(d, np.float32)
    beta = np.zeros(d, np.float32)
    want_g, want_b = float64_param_grads(x, dy)
    oracle = "float64 + fsum"
    name = f"many rows: M = {m:.0e}, D = 8"
    rows = []
    for backend, forward, backward in backends:
        _, dgamma, dbeta = backward(dy, forward(x, gamma, beta)[1])
        lib = {"dgamma": relative_error(dgamma, want_g), "dbeta": relative_error(dbeta, want_b)}
        rows.append(_verdict(name, "float32", backend, lib, {"dgamma": 1e-6, "dbeta": 1e-6},
                             oracle))
    xhat = layer_norm_forward(x, gamma, beta)[1].xhat  # (M, D) float32
    plain = {"dgamma": relative_error((dy * xhat).sum(axis=0), want_g),
             "dbeta": relative_error(dy.sum(axis=0), want_b)}
    rows.append(_verdict(name + ", float32 column sums (not the library)", "float32", "—",
                         plain, {}, oracle))
    return rows


def reference_table(sz: Sizes, rng: np.random.Generator, seed: int = 0
                    ) -> tuple[Table, list[str]]:
    """Table 2 and the failed targets."""
    backends = _backends()
    table = Table(
        "The library against the targets (gamma = 1 + N(0, 0.25), beta, dy ~ N(0, 1))",
        ["case", "dtype", "backend", *_REF_COLS, "target", "result", "oracle"],
        note=("y, dx, dgamma, dbeta: normwise relative errors; ulps: of the output dtype at "
              "max|exact|, 0.5 meaning correctly rounded. Each backend runs on the same "
              f"inputs; '{FUSED}' is layernorm.cpu on the C++ engine, whose sums have one "
              "order on every CPU (the Numba kernels where the engine is missing: an order "
              "fixed per CPU)."),
    )
    failed: list[str] = []
    rows = [row for case in _ref_cases(sz, rng) for row in _ref_rows(case, rng, backends)]
    many = _many_rows(sz, rng, backends)
    # The float64 cases draw from a stream of their own: the other rows do not depend on them.
    extra = np.random.default_rng([seed, 2])
    f64 = [row for case in _float64_cases(sz, extra) for row in _ref_rows(case, extra, backends)]
    first = next(k for k, (cells, _) in enumerate(rows) if cells[1] != "float64")
    for cells, bad in rows[:first] + f64 + rows[first:] + many:  # the float64 cases together
        table.rows.append(cells)
        failed += bad
    return table, failed


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


# --- table 4: the family against the targets ----------------------------------------------

_FAMILY_COLS = ("y", "dx", "dgamma", "y ulps", "dx ulps", "h ulps")
_F64 = {"y": 1e-13, "dx": 1e-13}
_F32 = {"y": 2e-6, "dx": 2e-5}
_HALF = {"y ulps": 2.0, "dx ulps": 2.0}
_TARGETS = {"float64": _F64, "float32": _F32, "float16": _HALF, "bfloat16": _HALF}


@dataclass(frozen=True)
class FamilyCase:
    """Values v (M, D) for one dtype. A norm normalizes v; an add-norm adds
    x = v - residual and residual = v*U(0.2, 0.8), both rounded to the dtype, so h ~ v."""

    name: str
    dtype: str
    v: np.ndarray  # (M, D) float64
    norms: tuple[str, ...]  # the family members it runs for
    zero_centered_gamma: bool = False

    @property
    def targets(self) -> dict[str, float]:
        bound = {"h ulps": 0.5} if any(NORMS[n].residual for n in self.norms) else {}
        return {**_TARGETS[self.dtype], **bound}


def _family_cases(sz: Sizes, rng: np.random.Generator) -> list[FamilyCase]:
    m, d = sz.rows, sz.d
    new = ("rms_norm", "add_layer_norm", "add_rms_norm")
    every = tuple(NORMS)

    def huge(lo: float, hi: float) -> np.ndarray:  # (m, d) ±10^U(lo, hi)
        return rng.choice([-1.0, 1.0], (m, d)) * 10.0 ** rng.uniform(lo, hi, (m, d))

    cases = [FamilyCase("N(0, 1)", dt, rng.standard_normal((m, d)), new)
             for dt in ("float64", "float32", "float16", "bfloat16")]
    cases += [
        FamilyCase("1e4 + N(0, 1)", "float32", 1e4 + rng.standard_normal((m, d)), new),
        FamilyCase("1e8 + N(0, 1)", "float64", 1e8 + rng.standard_normal((m, d)), new),
        FamilyCase("float16 extremes: U(-6e4, 6e4)", "float16", rng.uniform(-6e4, 6e4, (m, d)),
                   new),
        FamilyCase("±10^U(20, 30): squares overflow", "float32", huge(20, 30), new),
        FamilyCase("±10^U(20, 30): squares overflow", "bfloat16", huge(20, 30), new),
        FamilyCase("±10^U(160, 300): squares overflow", "float64", huge(160, 300), new),
    ]
    cases += [FamilyCase("zero rows: y = 0, dx = g/sqrt(eps)", dt, np.zeros((m, d)),
                         ("rms_norm",)) for dt in ("float64", "float32", "float16", "bfloat16")]
    cases += [FamilyCase("zero-centred gamma: scale = 1 + 0.1*N(0, 1)", dt,
                         rng.standard_normal((m, d)), every, zero_centered_gamma=True)
              for dt in ("float32", "bfloat16")]
    return cases


def _norm_functions(module: object, norm: Norm) -> tuple[Callable, Callable]:
    return getattr(module, f"{norm.name}_forward"), getattr(module, f"{norm.name}_backward")


def _run_norm(module: object, norm: Norm, x: np.ndarray, residual: np.ndarray | None,
              gamma: np.ndarray, beta: np.ndarray | None, zcg: bool, dy: np.ndarray,
              dh: np.ndarray | None) -> dict[str, np.ndarray | None]:
    """y, h, dx, dresidual, dgamma of ``norm`` in ``module`` (the reference or layernorm.cpu)."""
    forward, backward = _norm_functions(module, norm)
    params = {"gamma": gamma, "eps": norm.eps, "zero_centered_gamma": zcg}
    if norm.centred:
        params["beta"] = beta
    if norm.residual:
        y, h, cache = forward(x, residual, **params)
        dx, dresidual, dgamma, *_ = backward(dy, dh, cache)
        return {"y": y, "h": h, "dx": dx, "dresidual": dresidual, "dgamma": dgamma}
    y, cache = forward(x, **params)
    dx, dgamma, *_ = backward(dy, cache)
    return {"y": y, "h": None, "dx": dx, "dresidual": None, "dgamma": dgamma}


def _family_modules() -> list[tuple[str, object]]:
    """The reference, and the fused CPU kernels where numba is installed."""
    from . import reference
    try:
        from . import cpu
    except ImportError:
        return [("reference", reference)]
    return [("reference", reference), (FUSED, cpu)]


def _ulps(got: np.ndarray, exact: np.ndarray, dt: np.dtype) -> float:
    """ulp_error, or the absolute error where the exact answer is all zeros (a zero row)."""
    if not np.any(exact):
        return relative_error(got, exact)
    return ulp_error(got, exact, dt)


def _family_rows(case: FamilyCase, norm: Norm, rng: np.random.Generator,
                 modules: list[tuple[str, object]]) -> list[tuple[list[str], list[str]]]:
    """One row per backend for ``norm`` on ``case``, all on the same drawn inputs."""
    dt = resolve(case.dtype)
    m, d = case.v.shape
    gamma = (0.1 if case.zero_centered_gamma else 0.5) * rng.standard_normal(d)
    gamma = (gamma if case.zero_centered_gamma else 1 + gamma).astype(dt)
    beta = rng.standard_normal(d).astype(dt) if norm.centred else None
    dy = rng.standard_normal((m, d)).astype(dt)
    if norm.residual:
        residual = (case.v * rng.uniform(0.2, 0.8, (m, d))).astype(dt)
        x = (case.v - residual.astype(np.float64)).astype(dt)
        # h rounded once; the sum in float64 is exact for these half and float32 inputs
        h = np.add(x, residual, dtype=np.float64).astype(dt)
        # dh of the size of the norm's dx (rstd*g), so that neither term hides the other;
        # rms(h) = big*rms(h/big), as h**2 may overflow
        big = np.abs(h.astype(np.float64)).max(axis=1, keepdims=True)  # (m, 1)
        rms = np.sqrt(np.mean(np.square(h / big), axis=1, keepdims=True))  # (m, 1)
        dh = (rng.standard_normal((m, d)) / rms / big).astype(dt)
    else:
        x, residual, h, dh = case.v.astype(dt), None, None, None
    ex = exact_norm(x if h is None else h, gamma, beta, norm.eps, dy, centred=norm.centred,
                    zero_centered_gamma=case.zero_centered_gamma, dh=dh)
    rows = []
    for backend, module in modules:
        out = _run_norm(module, norm, x, residual, gamma, beta, case.zero_centered_gamma, dy, dh)
        dxs = [out["dx"]] if out["dresidual"] is None else [out["dx"], out["dresidual"]]
        got = {
            "y": relative_error(out["y"], ex.y),
            "dx": max(relative_error(a, ex.dx) for a in dxs),
            "dgamma": relative_error(out["dgamma"], ex.dgamma),
            "y ulps": _ulps(out["y"], ex.y, dt),
            "dx ulps": max(_ulps(a, ex.dx, dt) for a in dxs),
        }
        if h is not None:
            got["h ulps"] = _ulps(out["h"], h, dt)
        targets = {k: v for k, v in case.targets.items() if k in got}
        cells, failed = _verdict(case.name, case.dtype, backend, got, targets, EXACT,
                                 _FAMILY_COLS)
        rows.append(([norm.title, *cells], [f"{norm.title}: {f}" for f in failed]))
    return rows


def _many_rows_rms(sz: Sizes, rng: np.random.Generator, modules: list[tuple[str, object]]
                   ) -> list[tuple[list[str], list[str]]]:
    """RMSNorm's dgamma over many rows of D = 8 in float32, as table 2's LayerNorm case."""
    m, d = sz.many_rows, 8
    norm = NORMS["rms_norm"]
    x = (3 + rng.standard_normal((m, d))).astype(np.float32)
    dy = (0.1 + rng.standard_normal((m, d))).astype(np.float32)
    gamma = np.ones(d, np.float32)
    want = float64_param_grads(x, dy, norm.eps, centred=False)[0]
    name = f"many rows: M = {m:.0e}, D = 8"
    rows = []
    for backend, module in modules:
        forward, backward = _norm_functions(module, norm)
        dgamma = backward(dy, forward(x, gamma)[1])[1]
        cells, failed = _verdict(name, "float32", backend,
                                 {"dgamma": relative_error(dgamma, want)}, {"dgamma": 1e-6},
                                 "float64 + fsum", _FAMILY_COLS)
        rows.append(([norm.title, *cells], [f"{norm.title}: {f}" for f in failed]))
    return rows


def family_table(sz: Sizes, rng: np.random.Generator) -> tuple[Table, list[str]]:
    """Table 4 (RMSNorm, the add-norms, zero-centred gamma) and the failed targets."""
    modules = _family_modules()
    table = Table(
        "The family against the targets (gamma = 1 + N(0, 0.25), beta, dy ~ N(0, 1))",
        ["norm", "case", "dtype", "backend", *_FAMILY_COLS, "target", "result", "oracle"],
        note=("Each norm with its default eps (1e-5 LayerNorm, 1e-6 RMSNorm). An add-norm "
              "normalizes h = x + residual with residual = v*U(0.2, 0.8) and x = v - residual "
              "rounded to the dtype, so h ~ the case's values v; dh ~ N(0, 1)/rms(h), of the "
              "size of the norm's dx. dx: the worse of dx and dresidual, both dh + the norm's "
              "dx. h ulps: h against x + residual correctly rounded. The oracle is exact_norm "
              "on that h; 'zero-centred gamma' rows scale by 1 + gamma, gamma ~ N(0, 0.01)."),
    )
    failed: list[str] = []
    cases = _family_cases(sz, rng)
    for norm in NORMS.values():
        for case in cases:
            if norm.name not in case.norms:
                continue
            for cells, bad in _family_rows(case, norm, rng, modules):
                table.rows.append(cells)
                failed += bad
    for cells, bad in _many_rows_rms(sz, rng, modules):
        table.rows.append(cells)
        failed += bad
    return table, failed


# --- table 5: the peers on the same adversarial inputs ------------------------------------

PEERS = ("torch", "torch.compile", "onnxruntime")
OURS = "ours"
PEER_TITLE = "The peers on the same inputs: error of y and dx against the exact oracle"
_PEER_BACKWARD = ("torch", "torch.compile")  # onnxruntime has no backward
_PEER_COLS = (*(f"{w} y" for w in (OURS, *PEERS)), *(f"{w} dx" for w in (OURS, *_PEER_BACKWARD)))
# The peers' cases have sizes of their own, the same under --quick, so that torch.compile
# compiles the same graphs for the report and the command (Inductor caches them on disk).
PEER_ROWS, PEER_D, PEER_LONG_D = 4, 1024, 100_000


@dataclass(frozen=True)
class PeerCase:
    """Rows x (M, D) of one norm (LayerNorm or RMSNorm) in one dtype, for ours and the peers."""

    norm: str  # a key of NORMS without a residual
    name: str
    dtype: str
    x: np.ndarray  # (M, D) float64, rounded to the dtype by the runner


def _peer_cases(rng: np.random.Generator) -> list[PeerCase]:
    """Large mean with small variance, the rows of onnxruntime's tracker, constant rows, values
    near the top of float32's and float64's range, half-precision extremes and long rows."""
    m, d = PEER_ROWS, PEER_D

    def huge(lo: float, hi: float) -> np.ndarray:  # (m, d) ±10^U(lo, hi)
        return rng.choice([-1.0, 1.0], (m, d)) * 10.0 ** rng.uniform(lo, hi, (m, d))

    def long_rows() -> np.ndarray:  # (2, PEER_LONG_D)
        return 1e4 + rng.standard_normal((2, PEER_LONG_D))

    ln, rms = "layer_norm", "rms_norm"
    long_name = f"long rows: 1e4 + N(0, 1), D = {PEER_LONG_D:.0e}"
    cases = [
        PeerCase(ln, "N(0, 1)", "float32", rng.standard_normal((m, d))),
        PeerCase(ln, "1e4 + N(0, 1)", "float32", 1e4 + rng.standard_normal((m, d))),
        PeerCase(ln, "[4e4, 4e4 + 1, 4e4 + 2, 4e4 + 3] (onnxruntime #28463)", "float32",
                 4e4 + np.arange(4.0)[None, :]),
        PeerCase(ln, "[1e7, 1e7 + 1, 1e7 + 2, 1e7 + 3]", "float32", 1e7 + np.arange(4.0)[None, :]),
        PeerCase(ln, "constant rows, U(1e5, 1e6)", "float32",
                 np.repeat(rng.uniform(1e5, 1e6, (m, 1)), d, axis=1)),
        PeerCase(ln, "±10^U(20, 30)", "float32", huge(20, 30)),
        PeerCase(ln, "1e8 + N(0, 1)", "float64", 1e8 + rng.standard_normal((m, d))),
        PeerCase(ln, "±10^U(160, 300)", "float64", huge(160, 300)),
        PeerCase(ln, "float16 extremes: U(-6e4, 6e4)", "float16", rng.uniform(-6e4, 6e4, (m, d))),
        PeerCase(ln, "±10^U(20, 30)", "bfloat16", huge(20, 30)),
        PeerCase(ln, long_name, "float32", long_rows()),
        PeerCase(rms, "N(0, 1)", "float32", rng.standard_normal((m, d))),
        PeerCase(rms, "4e4 + N(0, 1e-3)", "float32", 4e4 + 1e-3 * rng.standard_normal((m, d))),
        PeerCase(rms, "constant rows, ±U(1, 1e4)", "float32",
                 np.repeat(rng.choice([-1.0, 1.0], (m, 1)) * rng.uniform(1, 1e4, (m, 1)), d, 1)),
        PeerCase(rms, "±10^U(20, 30)", "float32", huge(20, 30)),
        PeerCase(rms, "±10^U(160, 300)", "float64", huge(160, 300)),
        PeerCase(rms, "float16 extremes: U(-6e4, 6e4)", "float16", rng.uniform(-6e4, 6e4, (m, d))),
        PeerCase(rms, "±10^U(20, 30)", "bfloat16", huge(20, 30)),
        PeerCase(rms, long_name, "float32", long_rows()),
    ]
    return [c for c in cases if c.dtype in available()]


def _torch_peer(backend: str) -> Callable[[Norm, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """y and dx of ``backend`` ("torch" or "torch.compile") through its provider of
    :mod:`layernorm.bench.providers` (autograd; torch.compile compiles for each case)."""
    def run(norm: Norm, a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from .bench import providers

        y, dx, *_ = providers.PROVIDERS[(norm.name, backend)].setup(a)[1]()
        return {"y": y, "dx": dx}
    return run


def _onnxruntime(norm: Norm, a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """y of onnxruntime's fused CPU operator for ``norm``, a graph of one node:
    LayerNormalization (opset 17) or SimplifiedLayerNormalization (its RMSNorm), on float16,
    float32 or float64 inputs (its epsilon attribute is a float32)."""
    import onnxruntime as ort

    from .bench.peers import onnx_model

    names = ["x", "gamma", "beta"] if norm.centred else ["x", "gamma"]
    model = onnx_model(norm.name, a["x"].shape, a["x"].dtype.name, norm.eps)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    return {"y": sess.run(None, {k: a[k] for k in names})[0]}


_PEER_RUN = {"torch": _torch_peer("torch"), "torch.compile": _torch_peer("torch.compile"),
             "onnxruntime": _onnxruntime}


def absent_peers() -> dict[str, str]:
    """Each peer that cannot run here, and why (the providers' and the peers benchmark's own
    checks: the library does not import, or torch.compile fails on a small norm)."""
    from .bench import peers, providers

    why = {p: providers.why_not("layer_norm", p) for p in ("torch", "torch.compile")}
    why["onnxruntime"] = peers.available_peers()["onnxruntime"]
    return {p: reason for p, reason in why.items() if reason is not None}


def _no_kernel(peer: str, dtype: str) -> bool:
    """The peer has no CPU kernel for the dtype (onnxruntime: none for bfloat16)."""
    return peer == "onnxruntime" and dtype == "bfloat16"


def _peer_cell(got: np.ndarray, exact: np.ndarray, dt: np.dtype) -> tuple[str, dict[str, float]]:
    """(cell, errors) of one result: the cell is the normwise relative error, or "NaN", "inf"
    or "all 0" for a result with a NaN, an infinity, or only zeros where the exact one is
    not; the errors (relative and in ulps) are what the targets are checked on."""
    g = np.asarray(got, dtype=np.float64)
    if np.isnan(g).any() or np.isinf(g).any():
        text = "NaN" if np.isnan(g).any() else "inf"
        return text, {"": math.inf, " ulps": math.inf}
    errs = {"": relative_error(g, exact), " ulps": _ulps(g, exact, dt)}
    return ("all 0" if np.any(exact) and not np.any(g) else _fmt(errs[""])), errs


def _misses(errs: dict[str, float], dtype: str) -> list[tuple[str, float, float]]:
    """(target, error, bound) for each of table 4's targets of the dtype that ``errs`` (keys
    "y", "y ulps", "dx", "dx ulps", those measured) misses."""
    return [(k, errs[k], bound) for k, bound in _TARGETS[dtype].items()
            if k in errs and not errs[k] <= bound]


def _peer_row(case: PeerCase, rng: np.random.Generator, ours: tuple[str, object],
              absent: dict[str, str]
              ) -> tuple[list[str], dict[str, list[tuple[str, float, float]]], list[str]]:
    """(cells, the targets ours and each peer miss, peers that raised) of one case, every
    implementation on the same drawn inputs."""
    norm = NORMS[case.norm]
    dt = resolve(case.dtype)
    m, d = case.x.shape
    a = {"x": case.x.astype(dt), "gamma": (1 + 0.5 * rng.standard_normal(d)).astype(dt)}
    if norm.centred:
        a["beta"] = rng.standard_normal(d).astype(dt)
    a["dy"] = rng.standard_normal((m, d)).astype(dt)
    ex = exact_norm(a["x"], a["gamma"], a.get("beta"), norm.eps, a["dy"], centred=norm.centred)
    out = _run_norm(ours[1], norm, a["x"], None, a["gamma"], a.get("beta"), False, a["dy"],
                    None)
    results: dict[str, dict[str, np.ndarray] | str] = {OURS: {"y": out["y"], "dx": out["dx"]}}
    raised = []
    for peer in PEERS:
        if peer in absent:
            results[peer] = "absent"
        elif _no_kernel(peer, case.dtype):
            results[peer] = "—"
        else:
            try:
                results[peer] = _PEER_RUN[peer](norm, a)
            except Exception as exc:  # noqa: BLE001 - a peer's failure is a finding, not ours
                results[peer] = "—"
                raised.append(f"{peer} raised {type(exc).__name__} on {norm.title} "
                              f"{case.name} [{case.dtype}]")
    cells: dict[str, str] = {}
    misses: dict[str, list[tuple[str, float, float]]] = {}
    for who, res in results.items():
        errs: dict[str, float] = {}
        for key in ("y", "dx"):
            if isinstance(res, str) or key not in res:
                cells[f"{who} {key}"] = res if isinstance(res, str) else "—"
                continue
            cells[f"{who} {key}"], e = _peer_cell(res[key], getattr(ex, key), dt)
            errs.update({key + unit: v for unit, v in e.items()})
        if found := _misses(errs, case.dtype):
            misses[who] = found
    fails = "; ".join(f"{who} {', '.join(k.split()[0] for k, _, _ in found)}"
                      for who, found in misses.items())
    row = [norm.title, case.name, case.dtype, *(cells[c] for c in _PEER_COLS), fails or "—"]
    return row, misses, raised


def _versions() -> str:
    """The peers' library versions, as the table's note gives them."""
    import importlib

    found = []
    for lib in ("torch", "onnxruntime", "onnx"):
        try:
            found.append(f"{lib} {importlib.import_module(lib).__version__}")
        except ImportError:
            found.append(f"{lib} not installed")
    return ", ".join(found)


def _where(cases: list[tuple[str, str, str]]) -> str:
    """": LayerNorm float32 `a`, `b`; RMSNorm float64 `c`" for (norm, case, dtype) triples,
    grouped by norm and dtype in their order of appearance; "" for none."""
    groups: dict[tuple[str, str], list[str]] = {}
    for norm, case, dtype in cases:
        groups.setdefault((norm, dtype), []).append(f"`{case}`")
    if not groups:
        return ""
    return ": " + "; ".join(f"{norm} {dtype} {', '.join(names)}"
                            for (norm, dtype), names in groups.items())


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch, and the code Inductor compiles, on one thread while the peers run (where torch is
    installed), restored after: torch's and Inductor's reductions split a row by the thread
    count, which moves the last digits of their errors."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    # Inductor reads the thread count when it compiles, and its cache of compiled graphs keys
    # on its config, not on the count: so the count goes into the config as well
    try:
        from torch._inductor import config
        compiled = config.patch({"cpp.threads": 1})
    except (ImportError, AttributeError, RuntimeError):
        compiled = contextlib.nullcontext()
    try:
        with compiled:
            yield
    finally:
        torch.set_num_threads(before)


def peer_table(rng: np.random.Generator, cases: list[PeerCase] | None = None
               ) -> tuple[Table, list[str], dict[str, list[tuple[str, str, str]]]]:
    """Table 5: ours and each peer against the exact oracle on the same inputs.

    Returns the table, the targets ours missed (as table 4 words them) and, per peer, the
    cases (norm title, case, dtype) where it misses a target. ``cases`` defaults to
    :func:`_peer_cases` drawn from ``rng``.
    """
    ours = _family_modules()[-1]
    absent = absent_peers()
    table = Table(PEER_TITLE, ["norm", "case", "dtype", *_PEER_COLS, "fails"])
    failed: list[str] = []
    missed: dict[str, list[tuple[str, str, str]]] = {p: [] for p in PEERS}
    problems: list[str] = []
    with _one_torch_thread():
        rows = [(case, *_peer_row(case, rng, ours, absent))
                for case in (_peer_cases(rng) if cases is None else cases)]
    for case, row, misses, raised in rows:
        table.rows.append(row)
        problems += raised
        for who, found in misses.items():
            if who == OURS:  # worded as table 4's failures
                failed += [f"{row[0]}: {case.name} [{case.dtype}, {ours[0]}] {k}: {err:.2e} > "
                           f"{bound:.0e}" for k, err, bound in found]
            else:
                missed[who].append((row[0], case.name, case.dtype))
    mine = ("the fused CPU kernels (layernorm.cpu, what layernorm.torch calls)"
            if ours[0] == FUSED else "the NumPy reference (numba is not installed)")
    notes = [
        f"Normwise relative errors (max|got - exact|/max|exact|) of each implementation on the "
        f"same inputs: gamma = 1 + N(0, 0.25), beta and dy ~ N(0, 1), each norm's default eps "
        f"(1e-5 LayerNorm, 1e-6 RMSNorm). {OURS}: {mine}. torch: F.layer_norm and F.rms_norm, "
        f"eager, with autograd; torch.compile: the same function under Inductor, static shapes, "
        f"compiled for each case; both on one thread (how their reductions split a row "
        f"depends on the thread count); onnxruntime: LayerNormalization (opset 17) and "
        f"SimplifiedLayerNormalization on its CPU provider, with no backward (no dx column) "
        f"and no bfloat16 CPU kernel (—); its epsilon attribute is a float32. NaN, inf: the "
        f"result holds one; all 0: zeros where the exact result is not. fails: the results "
        f"that miss the target ours is held to (float64 1e-13; float32 y 2e-6, dx 2e-5; "
        f"float16 and bfloat16 2 ulps). Versions: {_versions()}.",
        "Where each peer misses a target: " + "; ".join(
            f"{p} is absent ({absent[p]})" if p in absent else
            f"{p}, {len(missed[p])} of {len(table.rows)} cases" + _where(missed[p])
            for p in PEERS) + ".",
    ]
    if problems:
        notes.append("Not run: " + "; ".join(problems) + ".")
    table.note = "\n\n".join(notes)
    return table, failed, missed


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


# --- table 7: the memory-efficient backward -------------------------------------------------

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
    from .reference import AddNormCache

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


# --- running, printing, plotting ----------------------------------------------------------


def run_suite(quick: bool = False, seed: int = 0, timing: bool = True, peers: bool = True
              ) -> Results:
    """Every table (without the peers' or the speed table when asked); deterministic for a
    given seed and the peers' versions (timings aside)."""
    sz = QUICK if quick else FULL
    rng = np.random.default_rng(seed)
    algorithms, sweep = algorithm_table(sz, rng)
    ref, failed = reference_table(sz, rng, seed)
    # The family draws from a stream of its own: the other tables do not depend on it.
    family, family_failed = family_table(sz, np.random.default_rng([seed, 3]))
    tables = [algorithms, ref, cancellation_table(sz, rng), family]
    failed += family_failed
    missed: dict[str, list[tuple[str, str, str]]] = {}
    if peers:  # a stream of its own too, and the same cases under --quick
        table, peers_failed, missed = peer_table(np.random.default_rng([seed, 5]))
        tables.append(table)
        failed += peers_failed
    if timing:
        tables.append(timing_table(sz, rng))
    me, me_failed = memory_efficient_table(sz, np.random.default_rng([seed, 7]))
    tables.append(me)
    failed += me_failed
    return Results(tables, sweep, failed, missed)


def format_table(table: Table, markdown: bool = False) -> str:
    title = f"**{table.title}**" if markdown else table.title
    lines = [title, "", render(table.head, table.rows, markdown)]
    if table.note:
        lines += ["", table.note]
    return "\n".join(lines)


def plot_sweep(sweep: dict[str, dict[str, list[tuple[float, float]]]], path: Path) -> Path:
    """PNG of each variance algorithm's error against the offset of the data, one panel per
    dtype with at least two offsets (a dtype with fewer is named in the figure's caption), each
    panel's offset axis only as wide as its data. Needs matplotlib (ImportError if missing)."""
    from matplotlib.figure import Figure  # Figure.savefig renders PNG with Agg, no pyplot
    from matplotlib.lines import Line2D

    floor = 1e-18  # exact zeros are drawn here, on the log axis
    shown = {d: s for d, s in sweep.items() if len({o for pts in s.values() for o, _ in pts}) > 1}
    left_out = [d for d in sweep if d not in shown]
    if not shown:
        raise ValueError("the sweep has no dtype with two or more offsets to plot")
    fig = Figure(figsize=(3.4 * len(shown) + 2.6, 4.2), layout="constrained")
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    handles: dict[str, object] = {}
    for ax, (dtype, series) in zip(axes, shown.items(), strict=True):
        finite = [e for pts in series.values() for _, e in pts if math.isfinite(e)]
        ceiling = 10 * max(max(finite, default=1.0), 1.0)  # non-finite errors drawn here
        for k, (name, points) in enumerate(series.items()):
            color = f"C{k}"
            xs = [o for o, _ in points]
            ys = [max(e, floor) if math.isfinite(e) else ceiling for _, e in points]
            (line,) = ax.loglog(xs, ys, marker="o", ms=3, color=color,
                                ls="--" if name == "library y" else "-")
            handles.setdefault("this library (its y)" if name == "library y" else name, line)
            bad = [(o, ceiling) for o, e in points if not math.isfinite(e)]
            if bad:
                ax.plot(*zip(*bad, strict=True), "x", color=color, ms=8, mew=2)
        u = unit_roundoff(np.dtype(dtype))
        ax.axhline(u, color="gray", ls=":", lw=1)
        ax.set_title(dtype)
        ax.set_xlabel("offset: each row is offset + N(0, 1)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("relative error of the normalized row\n(max abs error / max abs exact)")
    handles["unit roundoff of the dtype"] = Line2D([], [], color="gray", ls=":", lw=1)
    handles["overflow or NaN (drawn at the top)"] = Line2D([], [], color="black", ls="",
                                                           marker="x", ms=8, mew=2)
    fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=8,
               title="statistics computed by", title_fontsize=8)
    title = ("Variance algorithms against exact arithmetic as the mean grows "
             "(statistics in the dtype of x)")
    if left_out:
        title += (f"\nnot plotted, fewer than two offsets representable: "
                  f"{', '.join(left_out)} (see the table)")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=100)
    return path
