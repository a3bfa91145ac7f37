"""The differential fuzz's inputs, oracle scales and budget, shared by tests/test_fuzz.py and
tests/gpu/test_gpu_fuzz.py.

Budget, from the environment variable LAYERNORM_FUZZ:

- unset or ``ci`` (what ``make test`` runs): each property runs a fixed, derandomized set of
  examples, the same on every run of the same tests (Hypothesis also draws on constants
  from the modules loaded, so one file run alone tests another fixed set);
- ``long``: LONG_FACTOR times as many examples, freshly random on each run. On a failure,
  Hypothesis prints the failing example and a ``@reproduce_failure`` blob.

A problem is drawn as its structure (dtype, shape, kind of values, memory layout, which
parameters, eps) plus a seed for NumPy's generator, which fills the arrays: Hypothesis shrinks
the structure, and the seed keeps the draw cheap for large rows.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st

from layernorm.dtypes import DTYPES, available, resolve
from layernorm.numerics import Exact, exact_layer_norm

LONG_FACTOR = 100
_MODE = os.environ.get("LAYERNORM_FUZZ", "ci")
if _MODE not in ("ci", "long"):
    raise ValueError(f"LAYERNORM_FUZZ must be 'ci' or 'long', got {_MODE!r}")
LONG = _MODE == "long"


def budget(examples: int) -> settings:
    """Hypothesis settings for a property with ``examples`` examples in CI."""
    return settings(
        max_examples=examples * (LONG_FACTOR if LONG else 1),
        derandomize=not LONG,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# What the values of x look like; the names appear in failing examples.
KINDS = (
    "unit",  # N(0, 1) times 10^U(-1, 1)
    "offset",  # a large mean and a small spread: the mean's rounding error matters
    "tiny",  # near the smallest normal number, subnormals included: var + eps is eps
    "huge",  # near the largest number: row sums and squares overflow the compute dtype
    "constant",  # some rows constant (xhat = 0), at any magnitude
    "range",  # ±10^U(-3, 4): a wide dynamic range in every row
)
LAYOUTS = ("C", "F", "strided", "reversed", "unaligned")
# D around the kernels' SPAN (256) and BLOCK (1024) boundaries, and small rows
ROW_LENGTHS = (255, 256, 257, 1023, 1024, 1025)


@dataclass(frozen=True)
class Problem:
    """One drawn input: arrays in their drawn layout, and what they were drawn as."""

    x: np.ndarray
    gamma: np.ndarray | None
    beta: np.ndarray | None
    dy: np.ndarray
    eps: float
    kind: str
    layout: str

    @property
    def dtype(self) -> np.dtype:
        return self.x.dtype

    def exact(self) -> Exact:
        return exact_layer_norm(self.x, self.gamma, self.beta, self.eps, self.dy)

    def inputs(self) -> tuple[np.ndarray, ...]:
        return tuple(a for a in (self.x, self.gamma, self.beta, self.dy) if a is not None)

    def __repr__(self) -> str:  # what Hypothesis prints for a failing example
        return (f"Problem(dtype={self.dtype.name}, shape={self.x.shape}, kind={self.kind!r}, "
                f"layout={self.layout!r}, gamma={self.gamma is not None}, "
                f"beta={self.beta is not None}, eps={self.eps!r})")


def _finite_max(dt: np.dtype) -> float:
    """The largest finite value of dt (values beyond it round to inf)."""
    return DTYPES[dt.name].largest


def _tiny(dt: np.dtype) -> float:
    """The smallest normal value of dt."""
    return {"float16": 2.0**-14, "bfloat16": 2.0**-126, "float32": 2.0**-126,
            "float64": 2.0**-1022}[dt.name]


def _values(rng: np.random.Generator, kind: str, shape: tuple[int, ...], dt: np.dtype
            ) -> np.ndarray:
    """float64 values of the given kind for dtype dt (rounded by the caller)."""
    d = shape[-1]
    noise = rng.standard_normal(shape)
    if kind == "unit":
        return noise * 10.0 ** rng.uniform(-1, 1)
    if kind == "offset":
        top = {"float16": 3, "bfloat16": 4, "float32": 6, "float64": 12}[dt.name]
        loc = rng.choice([-1.0, 1.0]) * 10.0 ** rng.integers(1, top + 1)
        return loc + noise * 10.0 ** rng.uniform(-2, 0)
    if kind == "tiny":
        return noise * _tiny(dt) * 2.0 ** rng.uniform(-8, 8)
    if kind == "huge":
        return rng.uniform(-1, 1, shape) * _finite_max(dt) * 10.0 ** rng.uniform(-3, 0)
    if kind == "constant":
        rows = noise.reshape(-1, d)
        mag = 10.0 ** rng.uniform(-3, math.log10(_finite_max(dt)) - 1, (rows.shape[0], 1))
        const = rng.random((rows.shape[0], 1)) < 0.7
        return np.where(const, rng.choice([-1.0, 1.0], (rows.shape[0], 1)) * mag,
                        rows).reshape(shape)
    if kind == "range":
        return rng.choice([-1.0, 1.0], shape) * 10.0 ** rng.uniform(-3, 4, shape)
    raise ValueError(f"unknown kind {kind!r}")


def _round(values: np.ndarray, dt: np.dtype) -> np.ndarray:
    big = _finite_max(dt)
    return np.clip(values, -big, big).astype(dt)


def _lay_out(a: np.ndarray, layout: str) -> np.ndarray:
    """The same values as ``a`` in another memory layout."""
    if layout == "C" or a.ndim == 0:
        return np.ascontiguousarray(a)
    if layout == "F":
        return np.asfortranarray(a)
    if layout == "strided":
        wide = np.zeros((*a.shape[:-1], 2 * a.shape[-1]), a.dtype)
        wide[..., ::2] = a
        return wide[..., ::2]
    if layout == "reversed":
        return np.ascontiguousarray(a[..., ::-1])[..., ::-1]
    if layout == "unaligned":  # one byte off the dtype's alignment
        raw = np.zeros(a.nbytes + 1, np.uint8)
        out = np.frombuffer(raw.data, a.dtype, a.size, offset=1).reshape(a.shape)
        out[...] = a
        return out
    raise ValueError(f"unknown layout {layout!r}")


def _eps_choices(dt: np.dtype) -> list[float]:
    return [1e-5, 1e-6, 1e-2] + ([1e-12] if dt.name == "float64" else [])


def draw_problem(data: st.DataObject, dtypes: tuple[str, ...] | None = None,
                 kinds: tuple[str, ...] = KINDS, max_elements: int = 4096) -> Problem:
    """Draw a :class:`Problem` (x of at most ``max_elements`` elements, M = 0 and D = 1
    included) of one of ``dtypes`` (default: every dtype available here)."""
    names = dtypes or tuple(available())
    dt = resolve(data.draw(st.sampled_from(names), label="dtype"))
    d = data.draw(st.one_of(st.integers(1, 48), st.sampled_from(ROW_LENGTHS)), label="D")
    lead = data.draw(st.lists(st.integers(0, 5), max_size=2), label="leading axes")
    while lead and math.prod(lead) * d > max_elements:
        lead = lead[1:]
    shape = (*lead, d)
    kind = data.draw(st.sampled_from(kinds), label="kind")
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
    has_gamma, has_beta = data.draw(st.tuples(st.booleans(), st.booleans()), label="affine")
    eps = data.draw(st.sampled_from(_eps_choices(dt)), label="eps")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    x = _round(_values(rng, kind, shape, dt), dt)
    gamma = _round(1 + 0.5 * rng.standard_normal(d), dt) if has_gamma else None
    beta = _round(rng.standard_normal(d), dt) if has_beta else None
    dy = _round(rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2), dt)
    event(f"{dt.name}, {kind}")  # tallied by --hypothesis-show-statistics
    event(f"D {'<= 48' if d <= 48 else d}, M {'0' if 0 in lead else '>= 1'}")
    return Problem(_lay_out(x, layout), gamma, beta, _lay_out(dy, layout), eps, kind, layout)


@dataclass(frozen=True)
class Scales:
    """The size of the terms that make each result (the ``scale`` of the comparison): an error
    of a few ulps of these terms is rounding, not a bug, even where the result itself cancels
    to nearly zero (dx when g is near span{1, xhat}, y when gamma*xhat is near -beta).

    In y = gamma*xhat + beta and dgamma = sum of dy*xhat, |xhat| counts as at least 1: xhat is
    normalized, so an error small against 1 is small even where var << eps makes xhat tiny
    (there, float32 centred values below the normal range are known only to the subnormal
    spacing, which rstd multiplies, and GPU kernels may flush them to zero).
    """

    y: float
    dx: float
    dgamma: float
    dbeta: float


def scales(p: Problem, ex: Exact) -> Scales:
    d = p.x.shape[-1]
    xhat = ex.xhat.reshape(-1, d)  # (M, D)
    rstd = ex.rstd.reshape(-1, 1)  # (M, 1)
    gamma = np.ones(d) if p.gamma is None else p.gamma.astype(np.float64)
    beta = np.zeros(d) if p.beta is None else p.beta.astype(np.float64)
    dy = p.dy.astype(np.float64).reshape(-1, d)  # (M, D)
    g = dy * gamma  # (M, D)
    dx_terms = rstd * (np.abs(g) + np.abs(g.mean(1, keepdims=True))
                       + np.abs(xhat) * np.abs(g * xhat).mean(1, keepdims=True))

    def top(a: np.ndarray) -> float:
        return float(np.max(a)) if a.size else 0.0

    return Scales(
        y=top(np.abs(gamma) * np.maximum(np.abs(xhat), 1.0) + np.abs(beta)),
        dx=top(dx_terms),
        dgamma=top((np.abs(dy) * np.maximum(np.abs(xhat), 1.0)).sum(0)),
        dbeta=top(np.abs(dy).sum(0)),
    )


def draw_family(data: st.DataObject, p: Problem, residual: bool, centred: bool,
                residual_dtypes: tuple[str | None, ...] = (None, "float32")
                ) -> tuple[list, list, dict]:
    """A family member's forward arguments (x, [residual], gamma, [beta]), cotangents (dy,
    [dh]) and keywords (zero_centered_gamma, [residual_dtype]) built on ``p``: the residual is
    drawn as x was (kind, dtype, layout), dh as dy; beta only where the norm is ``centred``."""
    zero_centered = data.draw(st.booleans(), label="zero_centered_gamma")
    args, cot = [p.x], [p.dy]
    kw: dict = {"zero_centered_gamma": zero_centered}
    if residual:
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="residual seed"))
        dt = p.dtype
        args.append(_lay_out(_round(_values(rng, p.kind, p.x.shape, dt), dt), p.layout))
        dh = _round(rng.standard_normal(p.x.shape) * 10.0 ** rng.uniform(-2, 2), dt)
        cot.append(_lay_out(dh, p.layout))
        kw["residual_dtype"] = data.draw(st.sampled_from(residual_dtypes), label="residual_dtype")
    args += [p.gamma, p.beta] if centred else [p.gamma]
    return args, cot, kw


def family_scales(o: object) -> dict[str, float]:
    """The size of the terms that make each result of a family member (the ``scale`` of the
    comparison), as :func:`scales` for LayerNorm, from the float64 oracle's own terms ``o``
    (a tests/conftest.py ``Oracle``): g = dy * scale, and dx = dh + rstd * (g - [mean(g)] -
    xhat * mean(g * xhat)). |xhat| counts as at least 1, as in :class:`Scales`. Rows the
    oracle gives as NaN (h not finite) add nothing: every result there must be NaN."""
    xhat, rstd = o.xhat, o.rstd[:, None]  # (M, D), (M, 1)
    g = o.dy * o.scale  # (M, D)
    centred = "dbeta" in o.results
    with np.errstate(invalid="ignore"):
        dnorm = rstd * (np.abs(g) + (np.abs(g.mean(1, keepdims=True)) if centred else 0.0)
                        + np.abs(xhat) * np.abs(g * xhat).mean(1, keepdims=True))
        xhat1 = np.maximum(np.abs(xhat), 1.0)

    def top(a: np.ndarray) -> float:
        a = a[np.isfinite(a)]
        return float(np.max(a)) if a.size else 0.0

    sizes = {"y": top(np.abs(o.scale) * xhat1 + np.abs(o.beta)),
             "dx": top(dnorm + np.abs(o.dh)),
             "dgamma": top(np.nansum(np.abs(o.dy) * xhat1, axis=0)),
             "dbeta": top(np.abs(o.dy).sum(0))}
    sizes["dresidual"] = sizes["dx"]
    if "h" in o.results:
        sizes["h"] = top(np.abs(o.results["h"]))
    return {k: sizes[k] for k in o.results}
