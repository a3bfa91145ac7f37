"""PyTorch's own test inputs for its norms, run against ours.

Protects: layernorm.torch as a drop-in on the inputs torch tests its norms with: the OpInfo
samples of ``nn.functional.layer_norm``, ``native_layer_norm`` (y and the gradients: ours has
no statistics outputs), ``nn.functional.rms_norm``, and the module inputs of ``nn.LayerNorm``
and ``nn.RMSNorm``, in every dtype torch lists, with gradients. Each sample is either within
the tolerance table of the exact answer (torch in float64 on the same, exactly widened,
inputs), or one of the refusals docs/torch.md names ("Where it differs from torch"): a
negative eps, a complex dtype. torch's error inputs must raise with us too.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import layernorm.torch as lt
from layernorm.tolerances import compare

OPS = ("nn.functional.layer_norm", "native_layer_norm", "nn.functional.rms_norm")
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.complex64,
          torch.complex128)
_TOL = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
        torch.float16: "float16"}


@functools.cache
def _op_db() -> dict[str, object]:
    from torch.testing._internal.common_methods_invocations import op_db

    return {o.name: o for o in op_db if o.name in OPS}


@functools.cache
def _module_db() -> dict[str, object]:
    from torch.testing._internal.common_modules import module_db

    return {m.module_cls.__name__: m for m in module_db
            if m.module_cls in (torch.nn.LayerNorm, torch.nn.RMSNorm)}


def _ours(op: str):
    """Our function called with the sample's (input, *args, **kwargs) as torch's op takes them."""
    if op == "nn.functional.rms_norm":
        return lt.rms_norm
    return lt.layer_norm  # native_layer_norm's (input, shape, weight, bias, eps) too


def _theirs(op: str):
    f = {"nn.functional.layer_norm": torch.nn.functional.layer_norm,
         "native_layer_norm": lambda *a: torch.native_layer_norm(*a)[0],
         "nn.functional.rms_norm": torch.nn.functional.rms_norm}[op]
    return f


def _outputs_and_grads(f, inputs: list[torch.Tensor | object], kwargs: dict, cot_seed: int
                       ) -> list[torch.Tensor]:
    """[y, then the gradient of sum(y * c) for each tensor input that requires grad]."""
    y = f(*inputs, **kwargs)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves or y.numel() == 0:
        return [y.detach()]
    g = torch.Generator().manual_seed(cot_seed)
    c = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)
    grads = torch.autograd.grad((y * c).sum(), leaves, allow_unused=True)
    return [y.detach(), *(torch.zeros_like(t) if d is None else d for t, d in zip(
        leaves, grads, strict=True))]


def _widened(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return x.detach().double().requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in x):
        return type(x)(_widened(t) for t in x)
    return x


def _leaf(x: object) -> object:
    return x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x


def _check_sample(label: str, ours, exact, inputs: list, kwargs: dict, dtype: torch.dtype
                  ) -> None:
    got = _outputs_and_grads(ours, [_leaf(t) for t in inputs], kwargs, 0)
    want = _outputs_and_grads(exact, [_widened(t) for t in inputs], kwargs, 0)
    assert len(got) == len(want), label
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == (dtype if i == 0 else g.dtype), (label, i)
        w64 = w.numpy()
        quantity = "out" if i <= 1 else "param"  # y and dx; then sums over rows
        scale = max(1.0, float(np.abs(w64).max())) if w64.size else 1.0
        c = compare(g.double().numpy(), w64, _TOL[dtype], quantity, scale=scale)
        assert c.ok, (f"{label}: result {i} at {c.index}: got {c.got!r}, want {c.want!r} "
                      f"(bound {c.bound:.3g})")


def _refusal(dtype: torch.dtype, args: tuple, kwargs: dict) -> tuple[type, str] | None:
    """The refusal docs/torch.md names for this sample, or None."""
    if dtype.is_complex:
        return TypeError, "complex tensors are not supported"
    eps = kwargs.get("eps", args[-1] if args and isinstance(args[-1], float) else None)
    if eps is not None and eps < 0:
        return ValueError, "eps must be a finite number >= 0"
    return None


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("op", OPS)
def test_torchs_samples(op: str, dtype: torch.dtype) -> None:
    """Every OpInfo sample (with gradients) of the op in this dtype: within the tolerance table
    of the exact answer, or a refusal that docs/torch.md names."""
    info = _op_db()[op]
    if dtype not in info.dtypes:
        pytest.skip(f"torch's OpInfo lists no {dtype} for {op}")
    n = 0
    for k, s in enumerate(info.sample_inputs("cpu", dtype, requires_grad=True)):
        label = f"{op} {dtype} sample {k}: input {tuple(s.input.shape)}, args {s.args!r:.80}"
        inputs = [s.input, *s.args]
        refusal = _refusal(dtype, s.args, s.kwargs)
        if refusal is not None:
            with pytest.raises(refusal[0], match=refusal[1]):
                _ours(op)(*inputs, **s.kwargs)
        else:
            _check_sample(label, _ours(op), _theirs(op), inputs, s.kwargs, dtype)
        n += 1
    assert n >= 6, f"torch's OpInfo gave {n} samples for {op}"


@pytest.mark.parametrize("op", ("native_layer_norm", "nn.functional.rms_norm"))
def test_torchs_error_inputs_are_refused(op: str) -> None:
    """Each input torch's OpInfo says its op refuses raises a ValueError or TypeError here."""
    info = _op_db()[op]
    errors = list(info.error_inputs(torch.device("cpu")))
    assert errors
    for e in errors:
        s = e.sample_input
        with pytest.raises((ValueError, TypeError)):
            _ours(op)(s.input, *s.args, **s.kwargs)


@pytest.mark.parametrize("dtype", DTYPES[:4], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("module", ("LayerNorm", "RMSNorm"))
def test_torchs_module_inputs(module: str, dtype: torch.dtype) -> None:
    """torch's ModuleInfo inputs: our module built with the same constructor arguments, loaded
    with the state dict of torch's (random parameters), gives torch's float64 answer for the
    output and the gradients of the input and parameters within the tolerance table."""
    info = _module_db()[module]
    ours_cls = getattr(lt, module)
    inputs = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True,
                                     training=True)
    assert len(inputs) >= 6
    for k, mi in enumerate(inputs):
        ctor, fwd = mi.constructor_input, mi.forward_input
        theirs = info.module_cls(*ctor.args, **ctor.kwargs, dtype=torch.float64)
        with torch.no_grad():
            for p in theirs.parameters():
                p.normal_(generator=torch.Generator().manual_seed(k))
        ours = ours_cls(*ctor.args, **ctor.kwargs, dtype=dtype)
        ours.load_state_dict({n: t.to(dtype) for n, t in theirs.state_dict().items()})
        with torch.no_grad():  # torch's answer on the same rounded parameters
            for p, q in zip(theirs.parameters(), ours.parameters(), strict=True):
                p.copy_(q.double())
        x = fwd.args[0]
        params = list(ours.parameters())
        label = f"{module} {dtype} input {k}: {ctor.args!r} {ctor.kwargs!r} on {tuple(x.shape)}"
        got = _outputs_and_grads(ours, [_leaf(x)], {}, k)
        want = _outputs_and_grads(theirs, [_widened(x)], {}, k)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            c = compare(g.double().numpy(), w.numpy(), _TOL[dtype], "out",
                        scale=max(1.0, float(w.abs().max())) if w.numel() else 1.0)
            assert c.ok, f"{label}: result {i} at {c.index}: got {c.got!r}, want {c.want!r}"
        if x.shape[0] and params:  # the parameters' gradients, as sums over rows
            y = ours(_leaf(x))
            c_ = torch.randn(y.shape, generator=torch.Generator().manual_seed(k),
                             dtype=torch.float64)
            got_p = torch.autograd.grad((y * c_.to(dtype)).sum(), params)
            yt = theirs(_widened(x))
            want_p = torch.autograd.grad((yt * c_.to(dtype).double()).sum(),
                                         list(theirs.parameters()))
            for g, w in zip(got_p, want_p, strict=True):
                c = compare(g.double().numpy(), w.numpy(), _TOL[dtype], "param",
                            scale=max(1.0, float(w.abs().max())))
                assert c.ok, f"{label}: a parameter's gradient at {c.index}: {c.got!r} {c.want!r}"
