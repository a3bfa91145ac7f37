"""Table 1: the error of xhat when each variance algorithm of :mod:`layernorm.numerics`
computes the statistics in the dtype, and of the library's y, against the exact oracle; and the
offset sweep that :func:`layernorm.stability.plot_sweep` draws."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..dtypes import NAMES
from ..numerics import VARIANCE_ALGORITHMS, exact_layer_norm, normalize, relative_error, ulp
from ..reference import layer_norm_forward
from .common import EXACT, Sizes, Table, _dtypes, _fits, _fmt

OFFSETS = tuple(10.0**k for k in range(0, 15, 2))
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
