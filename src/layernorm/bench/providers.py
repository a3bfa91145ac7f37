"""The CPU implementations ``layernorm bench`` times, keyed by (norm, backend).

    (norm, "numpy")  the NumPy reference (:mod:`layernorm.reference`); in float64 it is also
                     the oracle every provider is checked against
    (norm, "fused")  the fused Numba kernels of :mod:`layernorm.cpu`, outputs reused through
                     ``out=``
    (norm, "torch")  PyTorch's CPU functions with autograd: ``F.layer_norm`` or ``F.rms_norm``,
                     after ``h = x + residual`` for an add-norm

for every norm of :data:`layernorm.family.NORMS`.

Each provider turns a case's inputs into its operations, ``fwd`` (the forward as in training:
PyTorch records its graph), ``bwd`` (the backward alone, from one forward's cache or kept
graph) and ``fwd+bwd`` (one training step, timed as a unit), and a function returning its
results in the order of :func:`outputs`. The norm is a parameter of everything here and in
the harness.
"""

from __future__ import annotations

import functools
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


def _split(norm: str, a: dict[str, np.ndarray]) -> tuple[list, list, float]:
    """``norm``'s forward arguments (inputs then parameters, as its functions take them), its
    backward's cotangents (dy, and dh for an add-norm) and its eps."""
    n = family_norm(norm)
    args = [a[k] for k in (*n.forward_inputs, *n.params)]
    cot = [a[k] for k in n.backward_inputs if k not in n.forward_inputs]
    return args, cot, n.eps


def _numpy(norm: str, a: dict[str, np.ndarray]) -> tuple[Ops, Results]:
    from .. import reference as ref

    args, cot, eps = _split(norm, a)
    fwd = getattr(ref, f"{norm}_forward")
    bwd = getattr(ref, f"{norm}_backward")
    cache = fwd(*args, eps)[-1]

    def results():
        *outs, c = fwd(*args, eps)
        return (*outs, *bwd(*cot, c))

    ops = {
        "fwd": lambda: fwd(*args, eps),
        "bwd": lambda: bwd(*cot, cache),
        "fwd+bwd": lambda: bwd(*cot, fwd(*args, eps)[-1]),
    }
    return ops, results


def _fused(norm: str, a: dict[str, np.ndarray]) -> tuple[Ops, Results]:
    from .. import cpu

    n = family_norm(norm)
    args, cot, eps = _split(norm, a)
    fwd = getattr(cpu, f"{norm}_forward")
    bwd = getattr(cpu, f"{norm}_backward")
    x = a["x"]
    # outputs reused across calls, as a training loop with buffers would
    fwd_out = {"out": np.empty_like(x)}
    bwd_out = {"out": np.empty_like(x)}
    if n.residual:
        fwd_out["out_h"] = np.empty_like(a["residual"])
        bwd_out["out_dresidual"] = np.empty_like(a["residual"])
    cache = fwd(*args, eps, **fwd_out)[-1]

    def results():
        *outs, c = fwd(*args, eps)
        return (*outs, *bwd(*cot, c))

    ops = {
        "fwd": lambda: fwd(*args, eps, **fwd_out),
        "bwd": lambda: bwd(*cot, cache, **bwd_out),
        "fwd+bwd": lambda: bwd(*cot, fwd(*args, eps, **fwd_out)[-1], **bwd_out),
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


def _torch(norm: str, a: dict[str, np.ndarray]) -> tuple[Ops, Results]:
    """PyTorch's own composition with autograd: ``F.layer_norm`` or ``F.rms_norm``, after
    ``h = x + residual`` for an add-norm."""
    import torch
    import torch.nn.functional as F

    n = family_norm(norm)
    args, cot, eps = _split(norm, a)
    leaves = [_to_torch(v).requires_grad_(True) for v in args]
    grads_out = [_to_torch(v) for v in cot]
    d = a["x"].shape[-1]

    def forward():
        if n.residual:
            h = leaves[0] + leaves[1]
            params = leaves[2:]
        else:
            h, params = leaves[0], leaves[1:]
        y = (F.layer_norm(h, (d,), *params, eps) if n.centred
             else F.rms_norm(h, (d,), *params, eps))
        return (y, h) if n.residual else (y,)

    kept = forward()

    def step():
        return torch.autograd.grad(forward(), leaves, grads_out)

    def results():
        outs = forward()
        grads = torch.autograd.grad(outs, leaves, grads_out)
        return tuple(_from_torch(t) for t in (*outs, *grads))

    ops = {
        "fwd": forward,
        "bwd": lambda: torch.autograd.grad(kept, leaves, grads_out, retain_graph=True),
        "fwd+bwd": step,
    }
    return ops, results


_BACKEND_SETUP = {"numpy": ("numpy", _numpy), "fused": ("numba", _fused),
                  "torch": ("torch", _torch)}

PROVIDERS: dict[tuple[str, str], Provider] = {
    (norm, backend): Provider(needs, functools.partial(setup, norm))
    for norm in NORMS for backend, (needs, setup) in _BACKEND_SETUP.items()
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
    """The oracle: ``norm``'s NumPy provider on float64 copies of the same rounded inputs.

    An add-norm is defined on h = x + residual rounded once to the case's dtype: the oracle
    normalizes that h (as x, with a zero residual), so that it differs from a provider only by
    the provider's own error.
    """
    a64 = {k: v.astype(np.float64) for k, v in a.items()}
    if family_norm(norm).residual:
        h = (a64["x"] + a64["residual"]).astype(a["x"].dtype).astype(np.float64)
        a64["x"], a64["residual"] = h, np.zeros_like(h)
    return PROVIDERS[(norm, "numpy")].setup(a64)[1]()
