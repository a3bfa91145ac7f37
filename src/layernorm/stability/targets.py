"""Tables 2 and 4: the library against its targets, in each backend (the NumPy reference and
the fused CPU kernels), every dtype. Table 2 is LayerNorm: large offsets, zero-variance rows,
sums and squares that overflow, values near the top of float64's range, long and column-major
rows, and dgamma, dbeta over many rows. Table 4 is the rest of the family (RMSNorm, add+LayerNorm,
add+RMSNorm) on the same kinds of input, and zero-centred gamma for every norm."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..dtypes import resolve
from ..family import NORMS, Norm
from ..numerics import (
    exact_layer_norm,
    exact_norm,
    float64_param_grads,
    relative_error,
    ulp_error,
)
from ..reference import layer_norm_forward
from .common import (
    _TARGETS,
    EXACT,
    FUSED,
    Backend,
    Sizes,
    Table,
    _backends,
    _dtypes,
    _family_modules,
    _fmt,
    _norm_functions,
    _run_norm,
    _ulps,
)

# --- table 2: LayerNorm against the targets -----------------------------------------------

_REF_COLS = ("y", "dx", "dgamma", "dbeta", "y ulps", "dx ulps")


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
              "order on every CPU."),
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


# --- table 4: the family against the targets ----------------------------------------------

_FAMILY_COLS = ("y", "dx", "dgamma", "y ulps", "dx ulps", "h ulps")


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
