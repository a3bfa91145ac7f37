"""The CPU implementations ``layernorm bench`` times, keyed by (norm, backend).

    (norm, "numpy")  the NumPy reference (:mod:`layernorm.reference`); in float64 it is also
                     the oracle every provider is checked against
    (norm, "fused")  the fused kernels of :mod:`layernorm.cpu` (the C++ engine), outputs
                     reused through ``out=``
    (norm, "torch")  PyTorch's CPU functions with autograd (eager): ``F.layer_norm`` or
                     ``F.rms_norm``, after ``h = x + residual`` for an add-norm
    (norm, "layernorm.torch")  this package's PyTorch API with autograd (:mod:`layernorm.torch`:
                     the C++ engine behind torch's autograd)
    (norm, "torch.compile")    ``torch.compile`` (inductor, the default backend) of the same
                     eager function ``torch`` times, compiled once in setup for the case's
                     shape and dtype; absent where compiling fails on this machine
    (norm, "fused-me"), (norm, "layernorm.torch-me")  ``fused`` and ``layernorm.torch`` in
                     memory-efficient mode (``memory_efficient=True``: the backward recovers
                     xhat from y); ``fused-me`` returns a fresh y each call (the cache holds
                     it, read-only)

for every norm of :data:`layernorm.family.NORMS`. :func:`why_not` says, in one line, why a
backend cannot run here (its library does not import, or compiling fails).

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

__all__ = ["BACKENDS", "MEMORY_EFFICIENT", "OPS", "PROVIDERS", "Provider", "available", "eager",
           "inputs", "norms", "ours", "outputs", "quantity", "reference", "why_not"]

BACKENDS = ("numpy", "fused", "fused-me", "layernorm.torch", "layernorm.torch-me", "torch",
            "torch.compile")
MEMORY_EFFICIENT = {"fused-me": "fused", "layernorm.torch-me": "layernorm.torch"}
"""Each memory-efficient backend and the default-mode backend it is compared with."""
OPS = ("fwd", "bwd", "fwd+bwd")

Ops = dict[str, Callable[[], object]]
Results = Callable[[], tuple[np.ndarray, ...]]


@dataclass(frozen=True)
class Provider:
    """``setup(inputs) -> (ops, results)``; ``needs`` is the module that must import;
    ``probe() -> reason or None`` (when given) says why the backend cannot run here after all."""

    needs: str
    setup: Callable[[dict[str, np.ndarray]], tuple[Ops, Results]]
    probe: Callable[[], str | None] | None = None


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


def _fused(norm: str, a: dict[str, np.ndarray], memory_efficient: bool = False
           ) -> tuple[Ops, Results]:
    from .. import cpu

    n = family_norm(norm)
    args, cot, eps = _split(norm, a)
    fwd = functools.partial(getattr(cpu, f"{norm}_forward"), memory_efficient=memory_efficient)
    bwd = getattr(cpu, f"{norm}_backward")
    x = a["x"]
    # outputs reused across calls, as a training loop with buffers would; y is the
    # memory-efficient cache, so that mode makes a fresh one each call
    fwd_out = {} if memory_efficient else {"out": np.empty_like(x)}
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


def eager(norm: str, d: int, eps: float) -> Callable:
    """PyTorch's own composition of ``norm`` on (..., ``d``) tensors: ``F.layer_norm`` or
    ``F.rms_norm``, after ``h = x + residual`` for an add-norm. Takes the forward's arguments
    (inputs, then parameters); returns (y,) or (y, h)."""
    import torch.nn.functional as F

    n = family_norm(norm)

    def forward(*args):
        if n.residual:
            h = args[0] + args[1]
            params = args[2:]
        else:
            h, params = args[0], args[1:]
        y = (F.layer_norm(h, (d,), *params, eps) if n.centred
             else F.rms_norm(h, (d,), *params, eps))
        return (y, h) if n.residual else (y,)

    return forward


def ours(norm: str, d: int, eps: float, memory_efficient: bool = False) -> Callable:
    """``norm`` through :mod:`layernorm.torch`, with :func:`eager`'s arguments and results."""
    import layernorm.torch as lt

    n = family_norm(norm)
    fn = getattr(lt, norm)

    def forward(*args):
        k = 2 if n.residual else 1
        out = fn(*args[:k], (d,), *args[k:], eps, memory_efficient=memory_efficient)
        return out if n.residual else (out,)

    return forward


def _compiled(norm: str, a: dict[str, np.ndarray]) -> tuple[Ops, Results]:
    """:func:`eager` under ``torch.compile`` (inductor), whole graph, static shapes, compiled
    here for the case's shape and dtype (the forward now, the backward at its first call).

    ``bwd`` runs the backward again and again on one kept graph (``retain_graph``), which a
    compiled backward that reuses its saved tensors' memory ("donated buffers") refuses: it
    runs with donated buffers off, so that torch compiles it a backward that keeps them.
    ``fwd+bwd``, the training step, uses torch.compile's defaults.
    """
    import torch

    # A fresh start per case: dynamo caches compiled code per code object, so the cases would
    # otherwise share eager's cache, recompile up to its limit and then run eager.
    torch._dynamo.reset()
    ops, results = _autograd(
        lambda *args: torch.compile(eager(*args), fullgraph=True, dynamic=False), norm, a)
    bwd = ops["bwd"]

    def bwd_on_kept_graph():
        with torch._functorch.config.patch(donated_buffer=False):
            return bwd()

    ops["bwd"] = bwd_on_kept_graph
    return ops, results


def _autograd(make: Callable, norm: str, a: dict[str, np.ndarray]) -> tuple[Ops, Results]:
    """The ops of a torch function of ``norm`` (``make(norm, d, eps)``, as :func:`eager`)
    with autograd: the inputs and parameters are leaves that require grad, the cotangents are
    dy (and dh for an add-norm); ``bwd`` differentiates one kept graph."""
    import torch

    args, cot, eps = _split(norm, a)
    leaves = [_to_torch(v).requires_grad_(True) for v in args]
    grads_out = [_to_torch(v) for v in cot]
    d = a["x"].shape[-1]
    fn = make(norm, d, eps)

    def forward():
        return fn(*leaves)

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


@functools.cache
def _compile_probe() -> str | None:
    """Why ``torch.compile`` (inductor) cannot run here, in one line, or None when it can:
    compiles a small layer norm's forward and backward (the inductor CPU backend needs a C++
    compiler)."""
    import torch

    a = inputs("layer_norm", (2, 8), "float32")
    try:
        ops, _ = _compiled("layer_norm", a)
        for op in OPS:
            ops[op]()
    except Exception as exc:  # any failure of the compiler stack makes the backend absent
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        return f"compiling failed ({type(exc).__name__}: {first})"
    finally:
        torch._dynamo.reset()
    return None


# backend -> (the module that must import, setup(norm, inputs), probe or None)
_BACKEND_SETUP = {
    "numpy": ("numpy", _numpy, None),
    "fused": ("torch", _fused, None),
    "fused-me": ("torch", functools.partial(_fused, memory_efficient=True), None),
    "layernorm.torch": ("layernorm.torch", functools.partial(_autograd, ours), None),
    "layernorm.torch-me": ("layernorm.torch", functools.partial(
        _autograd, functools.partial(ours, memory_efficient=True)), None),
    "torch": ("torch", functools.partial(_autograd, eager), None),
    "torch.compile": ("torch", _compiled, _compile_probe),
}

PROVIDERS: dict[tuple[str, str], Provider] = {
    (norm, backend): Provider(needs, functools.partial(setup, norm), probe)
    for norm in NORMS for backend, (needs, setup, probe) in _BACKEND_SETUP.items()
}


def norms() -> list[str]:
    """The norms that have providers, in the family's order."""
    return [n for n in NORMS if any(key[0] == n for key in PROVIDERS)]


def why_not(norm: str, backend: str) -> str | None:
    """Why ``backend`` cannot time ``norm`` here, in one line, or None when it can: no such
    provider, its module does not import, or its probe fails."""
    provider = PROVIDERS.get((norm, backend))
    if provider is None:
        return f"no {backend} provider for {norm}"
    try:
        importlib.import_module(provider.needs)
    except ImportError as exc:
        return f"not installed ({exc.name or provider.needs} does not import)"
    return provider.probe() if provider.probe else None


def available(norm: str = "layer_norm", backends: tuple[str, ...] = BACKENDS) -> list[str]:
    """Those of ``backends`` that can time ``norm`` here, in :data:`BACKENDS` order."""
    return [b for b in BACKENDS if b in backends and why_not(norm, b) is None]


def inputs(norm: str, shape: tuple[int, ...], dtype: str, seed: int = 0
           ) -> dict[str, np.ndarray]:
    """Random inputs of ``norm`` in ``dtype``: the (..., D) arrays its forward and backward
    read (x = 2·N(0, 1) + 0.5, the others N(0, 1)) and its (D,) parameters as trained ones
    look (gamma = 1 + N(0, 1)/4, beta = N(0, 1)/4: the memory-efficient mode recovers every
    channel of such weights up to D = 4096, and keeps 8 of 65536), drawn in the order forward
    inputs, parameters, backward inputs."""
    n = family_norm(norm)
    rng = np.random.default_rng(seed)
    dt = resolve(dtype)
    names = [*n.forward_inputs, *n.params,
             *(k for k in n.backward_inputs if k not in n.forward_inputs)]
    a = {}
    for name in names:
        size = shape[-1] if name in n.params else shape
        v = rng.standard_normal(size, dtype=np.float32)
        v = {"x": v * 2 + 0.5, "gamma": 1 + v / 4, "beta": v / 4}.get(name, v)
        a[name] = v.astype(dt)
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
