"""What the tables of the suite share: the problem sizes, the table, cell formatting, the
backends that run a norm (the reference and the fused CPU kernels), and the targets per dtype."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..dtypes import DTYPES, available, resolve
from ..family import Norm
from ..numerics import relative_error, ulp_error
from ..reference import layer_norm_backward, layer_norm_forward

EXACT = "exact"
FUSED = "fused CPU"


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


def _dtypes() -> list[np.dtype]:
    return [resolve(name) for name in available()]


def _fmt(v: float) -> str:
    if math.isinf(v) or math.isnan(v):
        return "inf"
    return "0" if v == 0 else f"{v:.1e}"


def _fits(x: np.ndarray, dt: np.dtype) -> bool:
    """Whether x rounds to finite values of dt (bfloat16 has float32's range)."""
    return bool(np.abs(x).max() < DTYPES[dt.name].largest)


# the targets per dtype: table 4 holds the family to them, table 5 ours beside the peers
_F64 = {"y": 1e-13, "dx": 1e-13}
_F32 = {"y": 2e-6, "dx": 2e-5}
_HALF = {"y ulps": 2.0, "dx ulps": 2.0}
_TARGETS = {"float64": _F64, "float32": _F32, "float16": _HALF, "bfloat16": _HALF}


Backend = tuple[str, Callable, Callable]  # name, forward, backward


def _fused_cpu() -> object | None:
    """:mod:`layernorm.cpu` where its C++ engine runs, else None (its NumPy fallback is the
    reference's arithmetic: nothing more to measure)."""
    from .. import cpu

    return cpu if cpu.api.engine_runs() else None


def _backends() -> list[Backend]:
    """The reference, and the fused CPU kernels where the C++ engine runs."""
    found: list[Backend] = [("reference", layer_norm_forward, layer_norm_backward)]
    cpu = _fused_cpu()
    if cpu is None:
        return found
    return [*found, (FUSED, cpu.layer_norm_forward, cpu.layer_norm_backward)]


def _family_modules() -> list[tuple[str, object]]:
    """The reference, and the fused CPU kernels where the C++ engine runs."""
    from .. import reference

    cpu = _fused_cpu()
    return [("reference", reference)] if cpu is None else [("reference", reference), (FUSED, cpu)]


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


def _ulps(got: np.ndarray, exact: np.ndarray, dt: np.dtype) -> float:
    """ulp_error, or the absolute error where the exact answer is all zeros (a zero row)."""
    if not np.any(exact):
        return relative_error(got, exact)
    return ulp_error(got, exact, dt)
