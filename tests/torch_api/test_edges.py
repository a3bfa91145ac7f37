"""Edges of layernorm.torch's autograd that differential fuzzing against torch found: cases
where one gradient path is absent and must contribute nothing.

An add-norm whose y is unused (the loss reads h alone) gets no gradient for y: h = x +
residual is then all that is differentiated, so dx = dresidual = dh in their dtypes and the
parameters get none, as torch's ``x + r`` then ``F.layer_norm`` gives. Filling the missing dy
with zeros instead and running the norm's backward would form 0 * inf on a row of zero
variance with eps = 0 (rstd = inf). Checked for both modes through the C++ autograd, the Python
autograd (CUDA's, and the CPU's where the C++ operator is not built) and the Triton launchers
in Triton's interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import layernorm.torch as lt  # noqa: E402
from layernorm.torch import _ops  # noqa: E402

ADD_NORMS = ["add_layer_norm", "add_rms_norm"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["C++", "Python"])
def autograd(request):
    """Which autograd serves the ops' CPU tensors while a test runs: the C++ operator's, or
    the ops' Python one (_ops._backward, _ops._backward_y: what CUDA tensors run, and the CPU
    where the C++ operator is not built) registered over it as
    torch.library.register_autograd makes it."""
    if not _ops.NATIVE:  # the Python autograd is the one there is
        if request.param == "C++":
            pytest.skip("the C++ operator is not built here")
        yield request.param
        return
    if request.param == "C++":
        yield request.param
        return
    la = pytest.importorskip("torch._library.autograd")
    if not (hasattr(la, "make_autograd_impl") and hasattr(la, "Info")):
        pytest.skip("this torch has no torch._library.autograd.make_autograd_impl")
    lib = torch.library.Library("layernorm", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid")
        for name, op, backward, setup in (
                ("fwd", _ops.fwd, _ops._backward, _ops._setup_context),
                ("fwd_y", _ops.fwd_y, _ops._backward_y, _ops._setup_context_y)):
            lib.impl(name, la.make_autograd_impl(op, la.Info(backward, setup)), "AutogradCPU",
                     with_keyset=True, allow_override=True)
    try:
        yield request.param
    finally:
        lib._destroy()


def _h_only(name: str, x_dtype: torch.dtype, residual_dtype: torch.dtype | None,
            memory_efficient: bool) -> dict:
    """Gradients of x, residual, weight and bias (None where autograd gave none) for a loss on
    h alone of ``name`` with eps = 0, on (3, 16) inputs whose row 1 of h is constant (0.75 for
    LayerNorm, 0 for RMSNorm: var = 0, mean(h^2) = 0, so rstd = inf), with the cotangent of h
    ``dh`` returned beside them."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 16, generator=g).to(x_dtype)
    r = torch.randn(3, 16, generator=g).to(residual_dtype or x_dtype)
    x[1], r[1] = (0.75 if name == "add_layer_norm" else 0.0), 0.0
    x.requires_grad_()
    r.requires_grad_()
    w = (1 + torch.randn(16, generator=g)).requires_grad_()
    b = torch.randn(16, generator=g).requires_grad_()
    params = (w, b) if name == "add_layer_norm" else (w,)
    kw = {} if residual_dtype is None else {"residual_dtype": residual_dtype}
    _y, h = getattr(lt, name)(x, r, 16, *params, eps=0.0, memory_efficient=memory_efficient,
                              **kw)
    dh = torch.randn(h.shape, generator=g).to(h.dtype)
    (h * dh).sum().backward()
    return {"dh": dh, "dx": x.grad, "dr": r.grad, "dw": w.grad, "db": b.grad}


def _assert_passes_dh(res: dict, x_dtype: torch.dtype, r_dtype: torch.dtype) -> None:
    """dx and dresidual are dh in x's and the residual's dtypes, bit for bit; no parameter
    has a gradient."""
    assert res["dx"].dtype == x_dtype and res["dr"].dtype == r_dtype
    for k, dtype in (("dx", x_dtype), ("dr", r_dtype)):
        got, want = res[k], res["dh"].to(dtype)
        assert torch.equal(got, want), \
            f"{k}: {int(got.isnan().sum())} NaN, {int((got != want).sum())} differ from dh"
    assert res["dw"] is None and res["db"] is None, (res["dw"], res["db"])


_CASES = [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("x_dtype, residual_dtype", _CASES)
@pytest.mark.parametrize("name", ADD_NORMS)
def test_loss_on_h_alone_passes_dh_through(name, x_dtype, residual_dtype, memory_efficient,
                                           autograd):
    """Protects an add-norm whose y is unused, through either autograd: with eps = 0 and a
    constant row, dx and dresidual are dh in their dtypes (finite, as torch's x + r then
    F.layer_norm gives), not 0 * inf = NaN from a norm backward run on a zero dy; weight and
    bias get no gradient."""
    res = _h_only(name, x_dtype, residual_dtype, memory_efficient)
    _assert_passes_dh(res, x_dtype, residual_dtype or x_dtype)


def test_loss_on_h_alone_double_backward(autograd):
    """Protects a differentiated backward of a loss on h alone, through either autograd: the
    gradient is dh itself, whose derivative is exact (no norm term), so create_graph=True
    works in both modes (the memory-efficient mode refuses only a backward through the
    norm)."""
    for me in (False, True):
        x = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
        r = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
        _y, h = lt.add_rms_norm(x, r, 8, eps=0.0, memory_efficient=me)
        (dx,) = torch.autograd.grad((h * h).sum(), x, create_graph=True)
        assert torch.equal(dx, 2 * (x + r))
        (ddx,) = torch.autograd.grad(dx.sum(), x)
        assert torch.equal(ddx, torch.full_like(x, 2.0))


# The Triton launchers through triton_on_cpu, with the ops' Python autograd when LAYERNORM_NO_CPP
# is set: printed as JSON, one entry per case, whether the gradients are dh and no parameter
# got one.
_TRITON = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path[:0] = ["tests/torch_api", "tests"]
    import test_edges as t
    from layernorm.torch import _ops
    from triton_route import triton_on_cpu
    out = {"native": _ops.NATIVE}
    with triton_on_cpu():
        for name in t.ADD_NORMS:
            for me in (False, True):
                res = t._h_only(name, torch.float32, None, me)
                out[f"{name} {me}"] = [
                    bool(torch.equal(res["dx"], res["dh"])),
                    bool(torch.equal(res["dr"], res["dh"])),
                    res["dw"] is None and res["db"] is None]
    print(json.dumps(out))
""")


@pytest.mark.parametrize("no_cpp", ["", "1"])
def test_loss_on_h_alone_triton_path(no_cpp):
    """Protects the CUDA code path (the Triton launchers, in Triton's interpreter on CPU
    tensors), under the C++ autograd and under the Python one (LAYERNORM_NO_CPP=1): a loss on
    h alone with eps = 0 and a constant row gives dx = dresidual = dh and no parameter
    gradient, in both modes."""
    pytest.importorskip("triton")
    env = {**os.environ, "LAYERNORM_NO_CPP": no_cpp}
    res = subprocess.run([sys.executable, "-c", _TRITON], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out.pop("native") == (_ops.NATIVE and not no_cpp)
    assert out == {f"{n} {me}": [True, True, True] for n in ADD_NORMS for me in (False, True)}


@pytest.mark.parametrize("name", ["add_layer_norm", "add_rms_norm"])
def test_a_memory_efficient_add_norm_with_a_wider_residual_stream_warns(name):
    """Protects the warning docs/numerics.md promises: memory_efficient=True with h more
    precise than x (bfloat16 x, float32 h) warns once at the caller's line, naming the
    remedy; the same call in x's dtype, or in the default mode, does not."""
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(4, 8)
    f = getattr(lt, name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(x, r, 8, residual_dtype=torch.float32, memory_efficient=True)
        f(x, r.bfloat16(), 8, memory_efficient=True)
        f(x, r, 8, residual_dtype=torch.float32)
    assert [w.category for w in caught] == [UserWarning]
    assert caught[0].filename == __file__
    assert "use memory_efficient=False" in str(caught[0].message)
