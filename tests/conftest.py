"""Shared test inputs and oracles, as fixtures: one way to build a family member's inputs, to
run a module's forward and backward, to compute the float64 oracle, and to compare the lot.

    family_inputs(norm, shape, dtype, seed=0, *, residual_dtype=None, loc=0.5, spread=2.0)
        -> (args, cot): the forward's arguments in the order its functions take them
           (x, [residual], gamma, [beta]) and the backward's cotangents (dy, [dh])
    run_norm(module, norm, args, cot, **kw) -> {name: array}: y, [h], dx, [dresidual],
           dgamma, [dbeta] from ``module`` (layernorm, layernorm.reference or layernorm.cpu)
    float64_oracle(norm, args, cot, *, eps=None, zero_centered_gamma=False,
                   residual_dtype=None) -> Oracle: the same results in float64
    check_rows -> tuple of CheckRow: layernorm.selfcheck.run_checks() at its defaults
    cpu_threads(n) -> context: the NumPy API's CPU kernels split each call over n threads
    assert_results_close(got, want, dtype, *, scales=None, floor=0.0, what="")
        -> every result of ``got`` against ``want`` through the tolerance table
    run_torch(norm, args, cot, *, device="cpu", **kw) -> {name: array}: the same results
           from :mod:`layernorm.torch` and autograd, on tensors of the inputs' dtypes

``norm`` is a :class:`layernorm.family.Norm` (``NORMS[name]``). The fixtures are session-scoped,
so Hypothesis properties may use them too.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pytest

from layernorm.dtypes import DTYPES, available, compute_dtype, resolve
from layernorm.family import Norm
from layernorm.tolerances import assert_close

# Under pytest-xdist (`make test`) each worker's torch gets its share of the cores for its
# OpenMP threads, set before torch is imported: OpenMP threads wait for work by spinning, so
# two workers with a thread per core each would take each other's cores (measured: the warm
# suite on 2 cores took as long in 2 workers as in one). A test that sets the thread count
# itself still gets what it sets.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(
        1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# y, h, dx and dresidual are per-element results ("out"); dgamma and dbeta sums over rows
QUANTITY = {"y": "out", "h": "out", "dx": "out", "dresidual": "out",
            "dgamma": "param", "dbeta": "param"}


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype called ``name``; skips the test where bfloat16 (ml_dtypes) is absent."""
    if name not in available():
        pytest.skip("bfloat16 needs ml_dtypes")
    return resolve(name)


def inputs(norm: Norm, shape: tuple[int, ...], dtype: str, seed: int = 0, *,
           residual_dtype: str | None = None, loc: float = 0.5, spread: float = 2.0
           ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The forward's arguments (x, [residual], gamma, [beta]) and the backward's cotangents
    (dy, [dh]) of ``norm``, drawn from ``seed`` and rounded to ``dtype`` (residual and dh to
    ``residual_dtype``, default ``dtype``). x is loc + spread * N(0, 1); the rest N(0, 1)."""
    rng = np.random.default_rng(seed)
    dt, rt = numpy_dtype(dtype), numpy_dtype(residual_dtype or dtype)
    d = shape[-1]
    args = [(rng.standard_normal(shape) * spread + loc).astype(dt)]
    if norm.residual:
        args.append(rng.standard_normal(shape).astype(rt))
    args += [rng.standard_normal(d).astype(dt) for _ in norm.params]
    cot = [rng.standard_normal(shape).astype(dt)]
    if norm.residual:
        cot.append(rng.standard_normal(shape).astype(rt))
    return args, cot


def names(norm: Norm) -> tuple[str, ...]:
    """The names of ``norm``'s results in the order its functions return them."""
    return (*norm.forward_outputs, *norm.backward_outputs, *("d" + p for p in norm.params))


def run(module: object, norm: Norm, args: list, cot: list, **kw: object
        ) -> dict[str, np.ndarray | None]:
    """``norm``'s forward outputs (not the cache), then its backward's, from ``module``; ``kw``
    goes to the forward."""
    *outs, cache = getattr(module, f"{norm.name}_forward")(*args, **kw)
    grads = getattr(module, f"{norm.name}_backward")(*cot, cache)
    return dict(zip(names(norm), (*outs, *grads), strict=True))


def to_torch(a: np.ndarray | None, device: str = "cpu", grad: bool = False):
    """``a`` as a tensor of the same dtype (bfloat16 through float32, exactly), or None."""
    import torch

    if a is None:
        return None
    bf16 = a.dtype.name == "bfloat16"
    t = torch.from_numpy(np.array(a, np.float32 if bf16 else a.dtype))
    t = t.to(device, torch.bfloat16 if bf16 else t.dtype)
    return t.requires_grad_() if grad else t


def from_torch(t) -> np.ndarray | None:
    """A tensor as a NumPy array of the same dtype (bfloat16 through float32, exactly)."""
    import torch

    if t is None:
        return None
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(resolve("bfloat16"))
    return t.numpy()


def run_torch(norm: Norm, args: list, cot: list, *, device: str = "cpu", **kw: object
              ) -> dict[str, np.ndarray | None]:
    """:func:`run` through :mod:`layernorm.torch`: ``norm``'s function on tensors made of
    ``args`` (None parameters stay None), its autograd gradients for ``cot``; ``kw`` goes to
    the function (``residual_dtype`` as a dtype name or None)."""
    import torch

    import layernorm.torch as lt

    if isinstance(kw.get("residual_dtype"), str):
        kw["residual_dtype"] = getattr(torch, kw["residual_dtype"])
    ts = [to_torch(a, device, grad=True) for a in args]
    n_data = 2 if norm.residual else 1
    d = args[0].shape[-1]
    outs = getattr(lt, norm.name)(*ts[:n_data], (d,), *ts[n_data:], eps=norm.eps, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    live = [t for t in ts if t is not None]
    grads = iter(torch.autograd.grad(outs, live, [to_torch(c, device) for c in cot]))
    results = [*outs, *(None if t is None else next(grads) for t in ts)]
    return dict(zip(names(norm), map(from_torch, results), strict=True))


@dataclass(frozen=True)
class Oracle:
    """The float64 oracle's results (keyed as :func:`run`'s) and the terms they are made of.

    Attributes:
        results: y, [h], dx, [dresidual], dgamma, [dbeta] in float64 (a gradient is None where
            its parameter is).
        xhat: (M, D) the normalized rows; rstd: (M,); scale: (D,) gamma, 1 + gamma or ones;
            beta: (D,) or zeros; dy, dh: (M, D) (dh zeros when absent), all float64.
    """

    results: dict[str, np.ndarray | None]
    xhat: np.ndarray
    rstd: np.ndarray
    scale: np.ndarray
    beta: np.ndarray
    dy: np.ndarray
    dh: np.ndarray


def _row(x: np.ndarray, g: np.ndarray, eps: float, centred: bool
         ) -> tuple[np.ndarray, float, np.ndarray]:
    """xhat, rstd and dx of one finite row x (float64) with g = dy * scale, by math.fsum.

    With c = x - mean (c = x uncentred), the chain rule gives d/dx_i [c_j rstd] =
    rstd (dc_j/dx_i) - c_j rstd**3 c_i / D, with dc_j/dx_i = delta_ij - 1/D (centred) or
    delta_ij; so dx = rstd (g - mean(g)) - xhat rstd mean(g xhat), written with xhat = c rstd
    (rstd**3 alone underflows for |x| beyond ~1e102). A row whose squares could overflow is
    first scaled by s = 2**-e (exact), with eps * s**2: xhat is unchanged, rstd and dx are s
    times those of the scaled row. The centring is corrected (c -= mean(c)), so the rounding
    of the mean does not shift c when |mean| >> std.
    """
    d = x.size
    top = float(np.max(np.abs(x))) if d else 0.0
    e = math.frexp(top)[1] if top > 2.0**400 else 0
    s = math.ldexp(1.0, -e)
    c = x * s
    if centred:
        c = c - math.fsum(c) / d
        c = c - math.fsum(c) / d
    var = math.fsum(c * c) / d
    mean_g = math.fsum(g) / d if centred else 0.0
    if var == 0.0:  # a constant row (eps * s**2 may underflow): xhat = 0, rstd = 1/sqrt(eps)
        rstd = 1.0 / math.sqrt(eps)
        return np.zeros(d), rstd, rstd * (g - mean_g)
    rstd_s = 1.0 / math.sqrt(var + math.ldexp(eps, -2 * e))
    xhat = c * rstd_s
    dx = rstd_s * (g - mean_g - xhat * (math.fsum(g * xhat) / d)) * s
    return xhat, rstd_s * s, dx


def _row_ieee(x: np.ndarray, g: np.ndarray, eps: float, centred: bool
              ) -> tuple[np.ndarray, float, np.ndarray]:
    """xhat, rstd and dx of a row holding inf or NaN: the definition in IEEE float64, which is
    all there is to compare with (LayerNorm: NaN throughout; RMSNorm with an inf: rstd = 0, so
    xhat is NaN at the inf and 0 elsewhere, and dx NaN)."""
    with np.errstate(invalid="ignore", over="ignore"):
        c = x - x.mean() if centred else x
        rstd = 1.0 / np.sqrt(np.mean(c * c) + eps)
        xhat = c * rstd
        dx = rstd * (g - (g.mean() if centred else 0.0) - xhat * np.mean(g * xhat))
    return xhat, float(rstd), dx


def h_rounded(x: np.ndarray, residual: np.ndarray, residual_dtype: object = None) -> np.ndarray:
    """h = x + residual as the add-norms define it: formed in the widest compute dtype of x,
    residual and residual_dtype, rounded once to residual_dtype (default x's dtype)."""
    if residual_dtype is None:
        hdt = x.dtype
    elif isinstance(residual_dtype, str):
        hdt = resolve(residual_dtype)
    else:
        hdt = np.dtype(residual_dtype)
    adt = max((compute_dtype(t) for t in (x.dtype, residual.dtype, hdt)),
              key=lambda t: t.itemsize)
    with np.errstate(over="ignore"):
        return (x.astype(adt) + residual.astype(adt)).astype(hdt)


def oracle(norm: Norm, args: list, cot: list, *, eps: float | None = None,
           zero_centered_gamma: bool = False, residual_dtype: object = None) -> Oracle:
    """``norm``'s results in float64 from the definition, one row at a time with math.fsum, on
    the given (already rounded) inputs; an add-norm normalizes h rounded as it defines
    (:func:`h_rounded`). A row with a non-finite value follows IEEE arithmetic
    (:func:`_row_ieee`)."""
    eps = norm.eps if eps is None else eps
    x = args[0]
    if norm.residual:
        h = h_rounded(x, args[1], residual_dtype)
        params = args[2:]
    else:
        h, params = x, args[1:]
    gamma, beta = (list(params) + [None, None])[:2]
    d = x.shape[-1]
    h2 = np.asarray(h, np.float64).reshape(-1, d)  # (M, D)
    dy = np.asarray(cot[0], np.float64).reshape(-1, d)  # (M, D)
    dh = np.zeros_like(dy) if len(cot) < 2 or cot[1] is None else \
        np.asarray(cot[1], np.float64).reshape(-1, d)  # (M, D)
    scale = np.ones(d) if gamma is None else \
        np.asarray(gamma, np.float64) + (1.0 if zero_centered_gamma else 0.0)  # (D,)
    shift = np.zeros(d) if beta is None else np.asarray(beta, np.float64)  # (D,)
    m = h2.shape[0]
    xhat, dx, rstd = np.full((m, d), np.nan), np.full((m, d), np.nan), np.full(m, np.nan)
    for r in range(m):
        row = _row if np.all(np.isfinite(h2[r])) else _row_ieee
        xhat[r], rstd[r], dx[r] = row(h2[r], dy[r] * scale, eps, norm.centred)
    with np.errstate(invalid="ignore", over="ignore"):
        y = scale * xhat + shift  # (M, D)
        dgamma = np.array([math.fsum(col) if np.all(np.isfinite(col)) else np.nan
                           for col in (dy * xhat).T])  # (D,)
    dbeta = np.array([math.fsum(col) for col in dy.T])  # (D,)
    shape = x.shape
    results = {"y": y.reshape(shape)}
    if norm.residual:
        results["h"] = h2.reshape(shape)
    results["dx"] = (dx + dh).reshape(shape)
    if norm.residual:
        results["dresidual"] = results["dx"]
    results["dgamma"] = None if gamma is None else dgamma
    if norm.centred:
        results["dbeta"] = None if beta is None else dbeta
    return Oracle(results, xhat, rstd, scale, shift, dy, dh)


def tolerance_dtype(result_dtype: np.dtype, h_dtype: np.dtype | None = None) -> str:
    """The table's dtype for a result: its own, or the compute dtype of h where that is less
    precise (float64 x on a float32 residual stream computes its norm in float32)."""
    own = DTYPES[np.dtype(result_dtype).name]
    if h_dtype is None:
        return own.name
    comp = DTYPES[compute_dtype(h_dtype).name]
    return min(own, comp, key=lambda t: t.significand_bits).name


def assert_results_close(got: dict, want: dict, dtype: object = None, *,
                         scales: dict | None = None, floor: float = 0.0, what: str = "",
                         h_dtype: np.dtype | None = None) -> None:
    """Every result in ``got`` (from :func:`run`) against ``want`` (an oracle's results, or
    :func:`run`'s from another module) with :func:`layernorm.tolerances.assert_close`: the
    table's entry for ``dtype`` (default: each result's own dtype, made no more precise than
    h's compute dtype when ``h_dtype`` is given) and the result's quantity, scaled by
    ``scales[name]`` (default 1)."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for name, g in got.items():
        w = want[name]
        if g is not None and w is not None:
            assert g.shape == np.shape(w), f"{what} {name}: shape {g.shape}, want {np.shape(w)}"
        dt = dtype if dtype is not None else \
            None if g is None else tolerance_dtype(g.dtype, h_dtype)
        assert_close(g, w, dt or "float64", QUANTITY[name],
                     scale=1.0 if scales is None else scales[name], floor=floor,
                     name=f"{what} {name}".strip())


@pytest.fixture(scope="session")
def family_inputs():
    """:func:`inputs`: a family member's forward arguments and cotangents."""
    return inputs


@pytest.fixture(scope="session")
def run_norm():
    """:func:`run`: a module's forward and backward of a family member, results by name."""
    return run


@pytest.fixture(scope="session")
def torch_norm():
    """:func:`run_torch`: a family member through layernorm.torch and autograd."""
    pytest.importorskip("torch")
    pytest.importorskip("torch")
    return run_torch


@pytest.fixture(scope="session")
def float64_oracle():
    """:func:`oracle`: the float64 oracle of a family member on rounded inputs."""
    return oracle


@pytest.fixture(scope="session")
def results_close():
    """:func:`assert_results_close`: every result against the tolerance table."""
    return assert_results_close


@pytest.fixture(scope="session")
def check_rows():
    """``layernorm.selfcheck.run_checks()``: every row of `layernorm check` at its defaults,
    computed once for the session (several seconds) and only read by the tests."""
    from layernorm import selfcheck

    return tuple(selfcheck.run_checks())


@pytest.fixture(scope="session")
def dtype_or_skip():
    """:func:`numpy_dtype`: a dtype by name, skipping the test where it is unavailable."""
    return numpy_dtype


@pytest.fixture
def cpu_threads(monkeypatch):
    """A context manager: inside ``cpu_threads(n)``, each call of the NumPy API's CPU kernels
    splits its rows over ``n`` of torch's threads (more than the machine's cores is allowed),
    however small the call; where the engine is missing, the fallback runs on one thread."""
    pytest.importorskip("torch")
    import contextlib

    from layernorm.cpu import api

    monkeypatch.setattr(api, "SERIAL_ELEMENTS", 1)

    @contextlib.contextmanager
    def threads(n: int):
        if api._engine() is None:
            yield
            return
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    return threads
