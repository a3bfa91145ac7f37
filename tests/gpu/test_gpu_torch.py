"""layernorm.torch through the Triton kernels: on CUDA tensors where a GPU is present, else on
CPU tensors routed to Triton's interpreter (``triton_on_cpu``), so the CUDA code path of the
ops (launchers, statistics layout, fake tensors, autograd) runs in CI. Shapes stay small: the
interpreter is slow.
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from triton_route import triton_on_cpu  # noqa: E402

import layernorm.torch as lt  # noqa: E402
from layernorm.family import NORMS  # noqa: E402
from layernorm.torch import _ops  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture
def triton_path():
    """The ops on DEVICE run the Triton kernels for the test's duration."""
    with contextlib.nullcontext() if CUDA else triton_on_cpu():
        yield


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_the_triton_path_matches_the_float64_oracle(name, dtype, triton_path, family_inputs,
                                                    float64_oracle, torch_norm, results_close):
    """Protects the four functions on the Triton path: every result (y, h, dx, dresidual,
    dweight, dbias) against the float64 oracle through the tolerance table, zero-centred gamma
    and a float32 residual stream included."""
    norm = NORMS[name]
    rdt = "float32" if norm.residual and dtype == "bfloat16" else None
    args, cot = family_inputs(norm, (3, 40), dtype, seed=21, residual_dtype=rdt)
    kw = {"residual_dtype": rdt} if norm.residual else {}
    got = torch_norm(norm, args, cot, device=DEVICE, zero_centered_gamma=True, **kw)
    want = float64_oracle(norm, args, cot, zero_centered_gamma=True, **kw)
    results_close(got, want.results, what=f"{name} {dtype}",
                  h_dtype=None if rdt is None else want.results["h"].dtype)


@pytest.mark.parametrize("name", ["layer_norm", "add_rms_norm"])
def test_the_triton_path_passes_gradcheck(name, triton_path):
    """Protects the Triton backward's first derivatives in float64 through torch's checker."""
    n = NORMS[name]
    g = torch.Generator().manual_seed(22)
    x = torch.randn(2, 6, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    r = torch.randn(2, 6, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    w = torch.randn(6, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    data = (x, r) if n.residual else (x,)
    assert torch.autograd.gradcheck(lambda *t: getattr(lt, name)(*t[:-1], 6, t[-1]),
                                    (*data, w))


@pytest.mark.parametrize("name", ["layer_norm", "add_layer_norm"])
def test_the_triton_path_registrations(name, triton_path):
    """Protects the ops' fake tensors on the Triton path (its statistics have another layout
    than the CPU kernels'): torch.library.opcheck on the forward op."""
    n = NORMS[name]
    g = torch.Generator().manual_seed(23)
    x = torch.randn(4, 16, generator=g).to(DEVICE, torch.bfloat16).requires_grad_()
    r = torch.randn(4, 16, generator=g).to(DEVICE).requires_grad_() if n.residual else None
    w = torch.randn(16, generator=g).to(DEVICE).requires_grad_()
    torch.library.opcheck(_ops.fwd, (x, r, w, None, 1e-5, True, False,
                                     torch.float32 if n.residual else None),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))


def test_the_triton_backward_adds_dh_without_a_dresidual(triton_path):
    """Protects layernorm::bwd's contract on the Triton path: given dh and no residual_dtype,
    dx is dh plus the norm's dx (the dx of the same call with residual_dtype) and dresidual is
    empty, as on the CPU kernels."""
    g = torch.Generator().manual_seed(24)
    x, r = (torch.randn(4, 16, generator=g).to(DEVICE) for _ in range(2))
    w = torch.randn(16, generator=g).to(DEVICE)
    dy, dh = (torch.randn(4, 16, generator=g).to(DEVICE) for _ in range(2))
    _y, h, s0, s1 = _ops.fwd(x, r, w, None, 1e-5, False, False, None)
    dx, dres, dw, _ = _ops.bwd(dy, dh, h, w, None, s0, s1, False, False, x.dtype, x.dtype)
    one, none, dw1, _ = _ops.bwd(dy, dh, h, w, None, s0, s1, False, False, x.dtype, None)
    plain, _, _, _ = _ops.bwd(dy, None, h, w, None, s0, s1, False, False, x.dtype, None)
    assert torch.equal(one, dx) and torch.equal(dres, dx) and torch.equal(dw1, dw)
    assert none.numel() == 0 and not torch.equal(plain, dx)


def test_triton_on_cpu_routes_and_restores():
    """Protects the test switch itself (tests/triton_route.py, kept out of the package): inside
    it a CPU tensor's statistics have the Triton layout ((M,) mean and rstd), from the kernels
    and from the fake implementation alike; outside it the CPU kernels' ((M, NSTATS) and an
    (M, 0) placeholder), both again."""
    if CUDA:
        pytest.skip("the switch is for machines without a GPU")
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(3, 8)
    args = (None, None, None, 1e-5, True, False, None)

    def shapes(x):
        return [tuple(t.shape) for t in _ops.fwd(x, *args)[2:]]

    def fake_shapes():
        with FakeTensorMode() as mode:
            return shapes(mode.from_tensor(x))

    with triton_on_cpu():
        assert shapes(x) == fake_shapes() == [(3,), (3,)]
    assert shapes(x) == fake_shapes() == [(3, 4), (3, 0)]


@pytest.mark.parametrize("name", ["layer_norm", "add_rms_norm"])
def test_the_triton_path_under_jvp_and_vmap(name, triton_path):
    """Protects torch.func over the Triton path: the transforms' Function calls the inference
    op, whose batching rule folds the vmapped axis into the rows; jvp and vmap give torch's
    float64 answers."""
    import torch.nn.functional as F

    from layernorm.tolerances import assert_close

    g = torch.Generator().manual_seed(23)
    x, r, t = (torch.randn(3, 6, generator=g, dtype=torch.float64).to(DEVICE) for _ in "xrt")
    w = torch.randn(6, generator=g, dtype=torch.float64).to(DEVICE)
    if name == "layer_norm":
        def ours(x, r):
            return lt.layer_norm(x, 6, w)

        def theirs(x, r):
            return F.layer_norm(x, (6,), w)
    else:
        def ours(x, r):
            y, h = lt.add_rms_norm(x, r, 6, w, 1e-6)
            return y * h

        def theirs(x, r):
            return F.rms_norm(x + r, (6,), w, 1e-6) * (x + r)
    for transform in (lambda f: torch.func.jvp(f, (x, r), (t, t))[1],
                      lambda f: torch.func.vmap(f)(x[:, None], r[:, None])):
        assert_close(transform(ours).cpu().numpy(), transform(theirs).cpu().numpy(), "float64",
                     scale=2.0, name=name)
