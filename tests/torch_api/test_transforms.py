"""torch.func transforms and forward-mode AD over the PyTorch API: torch's answer, never a
silent zero.

Protects: tangents, batched results and higher derivatives of every function (both norms,
both add-norms; zero-centred gamma; memory_efficient on and off) under jvp, forward_ad, vmap
(of the input and of per-sample parameters), grad, jacrev, jacfwd, hessian, vmap(grad),
grad(vmap) and forward AD followed by a backward, against the same transform of torch's own
norms, through the tolerance table. The eager path keeps the ops (a transform's Function is
taken only under a transform).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwad
import torch.nn.functional as F

import layernorm.torch as lt
from layernorm.tolerances import assert_close
from layernorm.torch import _transforms

D = 8
M = 3


def _inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return {"x": draw(M, D) * 2 + 0.5, "r": draw(M, D), "w": draw(D), "b": draw(D),
            "tx": draw(M, D), "tr": draw(M, D), "tw": draw(D), "tb": draw(D)}


# (ours, torch's): f(x, r, w, b) -> one tensor (an add-norm's y and h enter it both, so that
# the tangent and gradient of h are checked too). torch's side is in float64 on our inputs.
def _ours(name: str, me: bool) -> Callable:
    def f(x, r, w, b):
        if name == "layer_norm":
            return lt.layer_norm(x, (D,), w, b, memory_efficient=me)
        if name == "rms_norm":
            return lt.rms_norm(x, (D,), w, 1e-6, memory_efficient=me)
        if name == "add_layer_norm":
            y, h = lt.add_layer_norm(x, r, (D,), w, b, memory_efficient=me)
        else:
            y, h = lt.add_rms_norm(x, r, (D,), w, 1e-6, zero_centered_gamma=True,
                                   memory_efficient=me)
        return y * h.to(y.dtype)
    return f


def _torch(name: str) -> Callable:
    def f(x, r, w, b):
        if name == "layer_norm":
            return F.layer_norm(x, (D,), w, b)
        if name == "rms_norm":
            return F.rms_norm(x, (D,), w, 1e-6)
        h = x + r
        y = F.layer_norm(h, (D,), w, b) if name == "add_layer_norm" else F.rms_norm(
            h, (D,), w + 1, 1e-6)
        return y * h
    return f


def _elementary(name: str) -> Callable:
    """torch's answer from elementary operations, where F.layer_norm's own second derivatives
    are wrong in torch 2.13 (docs/torch.md): the Hessian's weight-input block and the gradient
    of a forward-mode tangent."""
    def f(x, r, w, b):
        h = x if name in ("layer_norm", "rms_norm") else x + r
        centred = "layer" in name
        hc = h - h.mean(-1, keepdim=True) if centred else h
        eps = 1e-5 if centred else 1e-6
        y = hc * torch.rsqrt((hc * hc).mean(-1, keepdim=True) + eps)
        y = y * (w + 1 if name == "add_rms_norm" else w) + (b if centred else 0)
        return y if h is x else y * h
    return f


def _jvp(f, a):
    return torch.func.jvp(f, (a["x"], a["r"], a["w"], a["b"]),
                          (a["tx"], a["tr"], a["tw"], a["tb"]))[1]


def _forward_ad(f, a):
    with fwad.dual_level():
        duals = [fwad.make_dual(a[k], a["t" + k]) for k in "xrwb"]
        return fwad.unpack_dual(f(*duals)).tangent


def _forward_ad_then_backward(f, a):
    x = a["x"].clone().requires_grad_()
    w = a["w"].clone().requires_grad_()
    with fwad.dual_level():
        t = fwad.unpack_dual(f(fwad.make_dual(x, a["tx"]), a["r"], w, a["b"])).tangent
        return torch.autograd.grad(t.square().sum(), (x, w))


def _loss(f, a):
    return lambda x, w, b: f(x, a["r"], w, b).square().sum()


TRANSFORMS: dict[str, Callable] = {
    "jvp": _jvp,
    "forward_ad": _forward_ad,
    "vmap": lambda f, a: torch.func.vmap(f, in_dims=(0, 0, None, None))(
        a["x"][:, None], a["r"][:, None], a["w"], a["b"]),
    "vmap_params": lambda f, a: torch.func.vmap(f, in_dims=(None, None, 0, 0))(
        a["x"], a["r"], torch.stack([a["w"], a["tw"]]), torch.stack([a["b"], a["tb"]])),
    "grad": lambda f, a: torch.func.grad(_loss(f, a), argnums=(0, 1, 2))(a["x"], a["w"], a["b"]),
    "jacrev": lambda f, a: torch.func.jacrev(f, argnums=(0, 1, 2, 3))(a["x"], a["r"], a["w"],
                                                                      a["b"]),
    "jacfwd": lambda f, a: torch.func.jacfwd(f, argnums=(0, 1, 2, 3))(a["x"], a["r"], a["w"],
                                                                      a["b"]),
    "hessian": lambda f, a: torch.func.hessian(_loss(f, a), argnums=(0, 1))(a["x"], a["w"],
                                                                            a["b"]),
    "vmap_grad": lambda f, a: torch.func.vmap(torch.func.grad(
        lambda x, r: f(x, r, a["w"], a["b"]).square().sum()))(a["x"][:, None], a["r"][:, None]),
    "grad_vmap": lambda f, a: torch.func.grad(lambda x: torch.func.vmap(
        lambda xi, ri: f(xi, ri, a["w"], a["b"]))(x, a["r"][:, None]).square().sum())(
        a["x"][:, None]),
    "forward_ad_then_backward": _forward_ad_then_backward,
}

NAMES = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")


def _flat(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def _check(name: str, transform: str, dtype: torch.dtype, me: bool) -> None:
    a = _inputs(dtype)
    got = _flat(TRANSFORMS[transform](_ours(name, me), a))
    second = transform in ("hessian", "forward_ad_then_backward")
    want_f = _elementary(name) if second and "layer" in name else _torch(name)
    want = _flat(TRANSFORMS[transform](want_f, {k: v.double() for k, v in a.items()}))
    assert len(got) == len(want)
    tol = str(dtype).removeprefix("torch.")
    assert any(float(w.abs().max()) > 0 for w in want), "a zero reference proves nothing"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, (i, g.shape, w.shape)
        w64 = w.detach().numpy()
        scale = max(1.0, float(np.abs(w64).max()))
        assert_close(g.detach().double().numpy(), w64, tol, scale=scale,
                     name=f"{name} {transform} output {i}")


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_a_transform_gives_torchs_answer(name: str, transform: str, dtype: torch.dtype) -> None:
    """Each function under each transform matches the same transform of torch's norm."""
    _check(name, transform, dtype, me=False)


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("name", NAMES)
def test_memory_efficient_under_a_transform_keeps_the_input(name: str, transform: str) -> None:
    """memory_efficient=True under a transform takes the input-keeping route: the same answers
    (float64), including the second derivatives its own backward cannot give."""
    _check(name, transform, torch.float64, me=True)


@pytest.mark.parametrize("transform", ["jvp", "grad", "vmap"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_dtypes_under_a_transform(name: str, transform: str, dtype: torch.dtype) -> None:
    """bfloat16 and float16 inputs: torch's float64 answer within the half dtype's tolerance
    (the results are rounded once to the input's dtype)."""
    _check(name, transform, dtype, me=False)


@pytest.mark.parametrize("name", ["add_layer_norm", "add_rms_norm"])
def test_a_loss_on_h_alone_under_grad_passes_dh_through(name: str) -> None:
    """The Function's backward without dy (y unused): dx = dresidual = dh in their dtypes,
    here bfloat16 x and a float32 residual stream, with eps = 0 on a constant row (where a
    zero dy through the norm would form 0 * inf)."""
    x = torch.ones(2, D, dtype=torch.bfloat16)
    r = torch.zeros(2, D)

    def loss(x, r):
        _y, h = getattr(lt, name)(x, r, (D,), None, eps=0.0, residual_dtype=torch.float32)
        return (h * torch.arange(D)).sum()

    dx, dr = torch.func.grad(loss, argnums=(0, 1))(x, r)
    want = torch.arange(D, dtype=torch.float32).expand(2, D)
    assert dx.dtype == torch.bfloat16 and dr.dtype == torch.float32
    assert torch.equal(dr, want) and torch.equal(dx, want.bfloat16())


@pytest.mark.parametrize("transform", ["grad", "jvp", "vmap_grad", "forward_ad"])
def test_under_torch_compile(transform: str) -> None:
    """torch.compile of a function that applies a transform (Dynamo cannot trace the
    transforms' Function; the ops' autograd has no jvp): torch's standard operations are
    taken, and the answers are torch's, not zeros."""
    a = _inputs(torch.float32)

    def run(f):
        return _flat(TRANSFORMS[transform](f, a))

    got = torch.compile(lambda: run(_ours("layer_norm", False)), backend="aot_eager")()
    want = run(_torch("layer_norm"))
    for g, w in zip(got, want, strict=True):
        assert float(w.abs().max()) > 0
        assert_close(g.detach().numpy(), w.detach().double().numpy(), "float32",
                     scale=max(1.0, float(w.abs().max())), name=transform)


def test_a_tangent_is_not_zero_and_is_linear() -> None:
    """jvp's tangent is the directional derivative: non-zero, and doubling the tangent doubles
    it exactly (a tangent dropped on the floor would be zero; a constant one would not scale)."""
    a = _inputs(torch.float64)
    f = _ours("layer_norm", False)
    t1 = _jvp(f, a)
    t2 = _jvp(f, {**a, **{k: 2 * a[k] for k in ("tx", "tr", "tw", "tb")}})
    assert float(t1.abs().max()) > 0.1
    torch.testing.assert_close(t2, 2 * t1, rtol=1e-15, atol=0)


def test_modules_under_functional_call() -> None:
    """A module's parameters differentiated with torch.func.functional_call + grad and jacfwd:
    torch's module's answer."""
    a = _inputs(torch.float64)
    ours = lt.LayerNorm(D, dtype=torch.float64)
    ref = torch.nn.LayerNorm(D, dtype=torch.float64)
    params = {"weight": a["w"], "bias": a["b"]}
    for transform in (torch.func.grad, torch.func.jacfwd):
        got = transform(lambda p, m=ours: torch.func.functional_call(m, p, (a["x"],)).sum())(
            params)
        want = transform(lambda p, m=ref: torch.func.functional_call(m, p, (a["x"],)).sum())(
            params)
        for k in params:
            assert_close(got[k].numpy(), want[k].numpy(), "float64", scale=1.0, name=k)


def test_the_eager_path_keeps_the_ops() -> None:
    """Outside a transform no Function is taken: the eager call's graph is the op's autograd
    node, and inside a dual level the transform route is (the check reads both states)."""
    x = torch.randn(M, D, requires_grad=True)
    assert not _transforms.active()
    y = lt.layer_norm(x, (D,))
    assert not isinstance(y.grad_fn, _transforms.Norm._backward_cls)
    with fwad.dual_level():
        assert _transforms.active()
        y = lt.layer_norm(x, (D,))
        assert isinstance(y.grad_fn, _transforms.Norm._backward_cls)
