"""The CPU implementations ``layernorm bench`` times, keyed by (norm, backend).

    ("layer_norm", "numpy")  the NumPy reference (:mod:`layernorm.reference`); in float64 it is
                             also the oracle every provider is checked against
    ("layer_norm", "fused")  the fused Numba kernels of :mod:`layernorm.cpu`, outputs reused
                             through ``out=``
    ("layer_norm", "torch")  PyTorch's CPU ``torch.nn.functional.layer_norm`` with autograd

Each provider turns a case's inputs into its operations, ``fwd`` (the forward as in training:
PyTorch records its graph), ``bwd`` (the backward alone, from one forward's cache or kept
graph) and ``fwd+bwd`` (one training step, timed as a unit), and a function returning its
results in the order of :func:`outputs`. The norm (a name of :data:`layernorm.family.NORMS`)
is a parameter of everything here and in the harness: a norm is benchmarked by adding its
providers to :data:`PROVIDERS`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..dtypes import resolve
from ..family import NORMS
from ..family import norm as family_norm

__all__ = ["BACKENDS", "OPS", "PROVIDERS", "Provider", "available", "inputs", "norms",
           "outputs", "quantity", "reference"]

BACKENDS = ("numpy", "fused", "torch")
OPS = ("fwd", "bwd", "fwd+bwd")

Ops = dict[str, Callable[[], object]]
Results = Callable[[], tuple[np.ndarray, ...]]


@dataclass(frozen=True)
class Provider:
    """``setup(inputs) -> (ops, results)``; ``needs`` is the library that must import."""

    needs: str
    setup: Callable[[dict[str, np.ndarray]], tuple[Ops, Results]]


def _layer_norm_numpy(a: dict[str, np.ndarray]) -> tuple[Ops, Results]:
    from .. import reference as ref

    eps = NORMS["layer_norm"].eps
    x, g, b, dy = a["x"], a["gamma"], a["beta"], a["dy"]
    cache = ref.layer_norm_forward(x, g, b, eps)[1]

    def step():
        return ref.layer_norm_backward(dy, ref.layer_norm_forward(x, g, b, eps)[1])

    def results():
        y, c = ref.layer_norm_forward(x, g, b, eps)
        return (y, *ref.layer_norm_backward(dy, c))

    ops = {
        "fwd": lambda: ref.layer_norm_forward(x, g, b, eps),
        "bwd": lambda: ref.layer_norm_backward(dy, cache),
        "fwd+bwd": step,
    }
    return ops, results


def _layer_norm_fused(a: dict[str, np.ndarray]) -> tuple[Ops, Results]:
    from .. import cpu

    eps = NORMS["layer_norm"].eps
    x, g, b, dy = a["x"], a["gamma"], a["beta"], a["dy"]
    y = np.empty_like(x)  # (..., D) outputs reused across calls
    dx = np.empty_like(x)
    cache = cpu.layer_norm_forward(x, g, b, eps, out=y)[1]

    def step():
        c = cpu.layer_norm_forward(x, g, b, eps, out=y)[1]
        return cpu.layer_norm_backward(dy, c, out=dx)

    def results():
        yy, c = cpu.layer_norm_forward(x, g, b, eps)
        return (yy, *cpu.layer_norm_backward(dy, c))

    ops = {
        "fwd": lambda: cpu.layer_norm_forward(x, g, b, eps, out=y),
        "bwd": lambda: cpu.layer_norm_backward(dy, cache, out=dx),
        "fwd+bwd": step,
    }
    return ops, results


def _to_torch(a: np.ndarray):
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _from_torch(t) -> np.ndarray:
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.numpy()


def _layer_norm_torch(a: dict[str, np.ndarray]) -> tuple[Ops, Results]:
    import torch
    import torch.nn.functional as F

    eps = NORMS["layer_norm"].eps
    x, g, b = (_to_torch(a[k]).requires_grad_(True) for k in ("x", "gamma", "beta"))
    dy = _to_torch(a["dy"])
    d = a["x"].shape[-1]
    y = F.layer_norm(x, (d,), g, b, eps)

    def step():
        return torch.autograd.grad(F.layer_norm(x, (d,), g, b, eps), (x, g, b), dy)

    def results():
        yy = F.layer_norm(x, (d,), g, b, eps)
        grads = torch.autograd.grad(yy, (x, g, b), dy)
        return tuple(_from_torch(t) for t in (yy, *grads))

    ops = {
        "fwd": lambda: F.layer_norm(x, (d,), g, b, eps),
        "bwd": lambda: torch.autograd.grad(y, (x, g, b), dy, retain_graph=True),
        "fwd+bwd": step,
    }
    return ops, results


PROVIDERS: dict[tuple[str, str], Provider] = {
    ("layer_norm", "numpy"): Provider("numpy", _layer_norm_numpy),
    ("layer_norm", "fused"): Provider("numba", _layer_norm_fused),
    ("layer_norm", "torch"): Provider("torch", _layer_norm_torch),
}


def norms() -> list[str]:
    """The norms that have providers, in the family's order."""
    return [n for n in NORMS if any(key[0] == n for key in PROVIDERS)]


def available(norm: str = "layer_norm") -> list[str]:
    """The backends of ``norm`` whose libraries import here, in :data:`BACKENDS` order."""
    found = []
    for backend in BACKENDS:
        provider = PROVIDERS.get((norm, backend))
        if provider is None:
            continue
        try:
            importlib.import_module(provider.needs)
        except ImportError:
            continue
        found.append(backend)
    return found


def inputs(norm: str, shape: tuple[int, ...], dtype: str, seed: int = 0
           ) -> dict[str, np.ndarray]:
    """Random inputs of ``norm`` in ``dtype``: the (..., D) arrays its forward and backward
    read (x = 2·N(0, 1) + 0.5, the others N(0, 1)) and its (D,) parameters, drawn in the order
    forward inputs, parameters, backward inputs."""
    n = family_norm(norm)
    rng = np.random.default_rng(seed)
    dt = resolve(dtype)
    names = [*n.forward_inputs, *n.params,
             *(k for k in n.backward_inputs if k not in n.forward_inputs)]
    a = {}
    for name in names:
        size = shape[-1] if name in n.params else shape
        v = rng.standard_normal(size, dtype=np.float32)
        a[name] = (v * 2 + 0.5 if name == "x" else v).astype(dt)
    return a


def outputs(norm: str) -> tuple[str, ...]:
    """The names of a provider's results, in order: forward outputs, backward outputs, the
    parameters' gradients."""
    n = family_norm(norm)
    return (*n.forward_outputs, *n.backward_outputs, *(f"d{p}" for p in n.params))


def quantity(norm: str, output: str) -> str:
    """The tolerance quantity of one of ``norm``'s results: ``"param"`` for a parameter's
    gradient (a sum over rows), else ``"out"``."""
    return "param" if output[1:] in family_norm(norm).params else "out"


def reference(norm: str, a: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    """The oracle: ``norm``'s NumPy provider on float64 copies of the same rounded inputs."""
    a64 = {k: v.astype(np.float64) for k, v in a.items()}
    return PROVIDERS[(norm, "numpy")].setup(a64)[1]()
