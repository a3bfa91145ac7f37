"""The measuring side of the GPU benchmark (:mod:`layernorm.bench.gpu`): the providers, each
pass's check against the NumPy reference, its timing, and :class:`CudaSession`, which
:func:`layernorm.bench.gpu.sweep` measures through. Needs torch (the peers only where they
import); :mod:`layernorm.bench.gpu` imports this module only to measure, so its results, table
and plot work without torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .. import family
from ..dtypes import DTYPES
from ..tolerances import compare
from .gpu import CHECK_ROWS, FLUSH_BYTES, WARMUP, Measured, Provider, _one_line, _quantiles

# ---------------------------------------------------------------------------------------------
# Providers (need torch; the peers only where they import)
# ---------------------------------------------------------------------------------------------


def _as_tuple(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _ours(norm: str, N: int, eps: float) -> Callable[..., Any]:
    # through the import system (sys.modules), not the package's attribute, so an import that
    # fails, or is stubbed out, is seen every time
    lt = importlib.import_module("layernorm.torch")
    fn = getattr(lt, norm)
    k = len(family.norm(norm).forward_inputs)
    return lambda *a: fn(*a[:k], (N,), *a[k:], eps=eps)


def _eager(norm: str, N: int, eps: float) -> Callable[..., Any]:
    """PyTorch's own: F.layer_norm or F.rms_norm, after h = x + residual for an add-norm."""
    import torch.nn.functional as F

    nm = family.norm(norm)
    norm_fn = F.layer_norm if nm.centred else F.rms_norm
    k = len(nm.forward_inputs)

    def eager(*a):
        h = a[0] + a[1] if nm.residual else a[0]
        y = norm_fn(h, (N,), *a[k:], eps=eps)
        return (y, h) if nm.residual else y

    return eager


def _liger(norm: str, N: int, eps: float) -> Callable[..., Any] | None:
    """Liger-Kernel's autograd Functions (liger_kernel/ops/*.py); it has no add + LayerNorm."""
    if norm == "layer_norm":
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, eps)
    if norm == "rms_norm":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # (X, W, eps, offset, casting_mode, in_place): not in place, which overwrites dy
        return lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
    if norm == "add_rms_norm":
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        return lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama",
                                                                  False)
    return None


def _quack(norm: str, N: int, eps: float) -> Callable[..., Any] | None:
    """QuACK's quack/rmsnorm.py: ``rmsnorm`` (autograd; a residual with ``prenorm=True``
    returns (y, h)) and ``layernorm_fwd``/``layernorm_bwd`` (no autograd Function, so joined
    in one here); it has no add + LayerNorm in its public API."""
    if norm == "rms_norm":
        from quack.rmsnorm import rmsnorm

        return lambda x, w: rmsnorm(x, w, eps=eps)
    if norm == "add_rms_norm":
        from quack.rmsnorm import rmsnorm

        return lambda x, r, w: rmsnorm(x, w, residual=r, eps=eps, prenorm=True)
    if norm == "layer_norm":
        import torch
        from quack.rmsnorm import layernorm_bwd, layernorm_fwd

        class QuackLayerNorm(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, w, b):
                y, rstd, mean = layernorm_fwd(x, w, b, eps, return_rstd=True, return_mean=True)
                ctx.save_for_backward(x, w, rstd, mean)
                return y

            @staticmethod
            def backward(ctx, dy):
                x, w, rstd, mean = ctx.saved_tensors
                return layernorm_bwd(x, w, dy.contiguous(), rstd, mean, has_bias=True)

        return QuackLayerNorm.apply
    return None


# name -> (factory(norm, N, eps) -> fn, or None where the library lacks the norm; fp32_params)
_PEERS: dict[str, tuple[Callable[[str, int, float], Callable[..., Any] | None], bool]] = {
    "liger": (_liger, False),
    "quack": (_quack, True),
}


def providers_for(norm: str, N: int, compiled: bool = True) -> tuple[list[Provider], list[str]]:
    """The providers of ``norm`` for rows of length N, and notes on the ones that do not
    import (a library that lacks the norm is left out without a note); torch.compile's only
    if ``compiled``."""
    import torch

    eps = family.norm(norm).eps
    torch._dynamo.reset()  # a fresh cache per (norm, N): no recompile limit, no dynamic shapes
    found, notes = [], []
    try:
        found.append(Provider("layernorm", _ours(norm, N, eps)))
    except Exception as exc:  # an import may fail in any way
        notes.append(f"layernorm: no {norm} from layernorm.torch ({_one_line(exc)})")
    eager = _eager(norm, N, eps)
    found.append(Provider("torch", eager))
    if compiled:
        found.append(Provider("torch.compile", torch.compile(eager, dynamic=False)))
    for name, (factory, fp32_params) in _PEERS.items():
        try:
            fn = factory(norm, N, eps)
        except Exception as exc:  # an import may fail in any way
            notes.append(f"{name}: not importable ({_one_line(exc)})")
            continue
        if fn is not None:
            found.append(Provider(name, fn, fp32_params))
    return found, notes


# ---------------------------------------------------------------------------------------------
# Checking and timing one pass
# ---------------------------------------------------------------------------------------------


def _check(norm: str, dtype: str, inputs: Sequence[Any], params: Sequence[Any],
           outputs: Sequence[Any], cotangents: Sequence[Any] = (),
           grads: Sequence[Any] | None = None) -> str | None:
    """None if the outputs (y, h) and, given, the input gradients (dx, dresidual) match the
    NumPy reference on the first :data:`CHECK_ROWS` rows, else what differs."""
    from .. import reference

    nm = family.norm(norm)

    def rows(t):
        return t[:CHECK_ROWS].detach().double().cpu().numpy()

    def whole(t):
        return t.detach().double().cpu().numpy()

    # h is rounded once to the input dtype, as the providers store it
    kw = {"residual_dtype": dtype} if nm.residual else {}
    *want, cache = getattr(reference, f"{norm}_forward")(
        *map(rows, inputs), *map(whole, params), nm.eps, **kw)
    pairs = list(zip(nm.forward_outputs, map(rows, outputs), want, strict=True))
    if grads is not None:
        want_grads = getattr(reference, f"{norm}_backward")(*map(rows, cotangents), cache)
        pairs += zip(nm.backward_outputs, map(rows, grads), want_grads, strict=False)
    for name, got, expected in pairs:
        c = compare(got, expected, dtype, "out")
        if not c:
            return (f"{name}: max error {c.max_abs_err:.2e}, at {c.index} {c.got:.6g} against "
                    f"{c.want:.6g} (bound {c.bound:.2e})")
    return None


def prepare(prov: Provider, norm: str, dtype: str, inputs: Sequence[Any],
            params: Sequence[Any], cotangents: Sequence[Any], pass_: str
            ) -> tuple[Callable[[], Any], str | None]:
    """The call that is one ``pass_`` of ``prov``, and how its results differ from the
    reference (None if they agree). Any device: the timing is the caller's."""
    import torch

    params = [p.float() for p in params] if prov.fp32_params else list(params)
    if pass_ == "fwd":
        outputs = _as_tuple(prov.fn(*inputs, *params))
        mismatch = _check(norm, dtype, inputs, params, outputs)
        return (lambda: prov.fn(*inputs, *params)), mismatch
    leaves = [t.detach().requires_grad_() for t in (*inputs, *params)]
    outputs = _as_tuple(prov.fn(*leaves))
    grads = torch.autograd.grad(outputs, leaves, cotangents, retain_graph=True)
    mismatch = _check(norm, dtype, inputs, params, outputs, cotangents, grads[:len(inputs)])
    del grads
    return (lambda: torch.autograd.grad(outputs, leaves, cotangents, retain_graph=True)), mismatch


def _event_times(fn: Callable[[], Any], rounds: int, flush: Any) -> list[float]:
    """Sorted times (ms) of ``rounds`` runs of ``fn``, each after an L2 flush, by CUDA events
    on the current stream."""
    import torch

    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rounds)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rounds)]
    for start, end in zip(starts, ends, strict=True):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def _time(fn: Callable[[], Any], rounds: int, flush: Any) -> tuple[list[float], str, str | None]:
    """Sorted times (ms) of ``fn``, replayed from a CUDA graph where it captures, else called;
    how ("cuda_graph" or "events"); and why capture failed (or None). Run on a side stream:
    capture needs one, and a backward runs on its forward's stream."""
    import torch

    for _ in range(WARMUP):  # compile and autotune before capture, which cannot
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
            fn()
    except Exception as exc:  # whatever stops capture, time the calls instead
        torch.cuda.synchronize()
        return _event_times(fn, rounds, flush), "events", _one_line(exc)
    return _event_times(graph.replay, rounds, flush), "cuda_graph", None


class CudaSession:
    """The measuring side of :func:`sweep` on the current CUDA device: one side stream for
    everything, an L2 flush buffer, and one (norm, dtype, M, N)'s tensors at a time.
    ``compile_ns``: the row lengths at which torch.compile is a provider (None: all)."""

    def __init__(self, rounds: int, compile_ns: Iterable[int] | None = None) -> None:
        import torch

        self.rounds = rounds
        self.compile_ns = None if compile_ns is None else frozenset(compile_ns)
        self.stream = torch.cuda.Stream()
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        self._key: tuple | None = None
        self._tensors: tuple | None = None

    def copy_gbps(self, dtype: str, M: int, N: int) -> float:
        """Bandwidth of a device-to-device copy of an (M, N) tensor (read and write)."""
        import torch

        self._key = self._tensors = None
        with torch.cuda.stream(self.stream):
            x = torch.ones(M, N, device="cuda", dtype=getattr(torch, DTYPES[dtype].torch))
            dst = torch.empty_like(x)
            p50 = _quantiles(_time(lambda: dst.copy_(x), self.rounds, self.flush)[0])[0]
        return 2 * x.numel() * x.element_size() / (p50 * 1e6)

    def providers(self, norm: str, N: int) -> tuple[list[Provider], list[str]]:
        return providers_for(norm, N, self.compile_ns is None or N in self.compile_ns)

    def _case(self, norm: str, dtype: str, M: int, N: int) -> tuple:
        """(inputs, params, cotangents) of one case, kept until the case changes."""
        import torch

        key = (norm, dtype, M, N)
        if key != self._key:
            self._key = self._tensors = None  # free the last case's before making these
            nm = family.norm(norm)
            dt = getattr(torch, DTYPES[dtype].torch)
            gen = torch.Generator(device="cuda").manual_seed(0)

            def randn(*shape):
                return torch.randn(*shape, device="cuda", dtype=dt, generator=gen)

            inputs = [randn(M, N) for _ in nm.forward_inputs]
            params = [1 + 0.1 * randn(N), 0.1 * randn(N)][:len(nm.params)]  # weight, bias
            cotangents = [randn(M, N) for _ in nm.forward_outputs]  # dy, and dh
            self._tensors, self._key = (inputs, params, cotangents), key
        return self._tensors

    def run(self, prov: Provider, norm: str, dtype: str, M: int, N: int, pass_: str
            ) -> Measured:
        import torch

        with torch.cuda.stream(self.stream):
            fn, mismatch = prepare(prov, norm, dtype, *self._case(norm, dtype, M, N), pass_)
            times, timing, capture_error = _time(fn, self.rounds, self.flush)
        return Measured(times, timing, mismatch, capture_error)

    def release(self) -> None:
        import torch

        self._key = self._tensors = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
