"""layernorm.torch on CPU tensors: results against the float64 oracle, the autograd contracts
torch users rely on (gradcheck, double backward, version counters, autocast, torch.compile,
opcheck), the modules as drop-ins, and argument errors.

The ops run the C++ engine here; tests/gpu/test_gpu_torch.py runs the same API through the
Triton kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import layernorm.torch as lt  # noqa: E402
from layernorm.family import NORMS  # noqa: E402
from layernorm.tolerances import assert_close  # noqa: E402
from layernorm.torch import _ops  # noqa: E402

FAMILY = list(NORMS)
DTYPES = ["float16", "bfloat16", "float32", "float64"]
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def _call(name, x, residual, d, w, b, *, torch_own=False):
    """(y, h or None) of ``name``'s function of layernorm.torch on the given tensors, or with
    ``torch_own`` of torch's functions: F.layer_norm / F.rms_norm, after h = x + residual."""
    n = NORMS[name]
    if torch_own:
        h = x + residual if n.residual else None
        src = h if n.residual else x
        return (F.layer_norm(src, d, w, b) if n.centred else F.rms_norm(src, d, w)), h
    data = (x, residual) if n.residual else (x,)
    params = (w, b) if n.centred else (w,)
    out = getattr(lt, name)(*data, d, *params)
    return out if isinstance(out, tuple) else (out, None)


# --- results --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILY)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_results_match_the_float64_oracle(name, dtype, zero_centered, family_inputs,
                                          float64_oracle, torch_norm, results_close):
    """Protects every result of the four functions (y, h, dx, dresidual, dweight, dbias) in
    every dtype, with and without zero-centred gamma, against the float64 oracle on the same
    rounded inputs, through the tolerance table."""
    norm = NORMS[name]
    args, cot = family_inputs(norm, (3, 5, 96), dtype, seed=1)
    got = torch_norm(norm, args, cot, zero_centered_gamma=zero_centered)
    want = float64_oracle(norm, args, cot, zero_centered_gamma=zero_centered)
    results_close(got, want.results, what=f"{name} {dtype}")


@pytest.mark.parametrize("name", ["add_layer_norm", "add_rms_norm"])
def test_add_norm_keeps_a_float32_residual_stream(name, family_inputs, float64_oracle,
                                                  torch_norm, results_close):
    """Protects residual_dtype: bfloat16 activations on a float32 residual stream give h and
    dresidual in float32 and the norm of h computed in float32."""
    norm = NORMS[name]
    args, cot = family_inputs(norm, (4, 64), "bfloat16", seed=2, residual_dtype="float32")
    got = torch_norm(norm, args, cot, residual_dtype="float32")
    assert got["h"].dtype == np.float32 and got["dresidual"].dtype == np.float32
    assert got["dx"].dtype.name == "bfloat16"
    want = float64_oracle(norm, args, cot, residual_dtype=np.float32)
    results_close(got, want.results, h_dtype=np.float32, what=name)


@pytest.mark.parametrize("name", ["add_layer_norm", "add_rms_norm"])
def test_add_norm_writes_one_gradient_for_x_and_residual(name):
    """Protects the add-norms' one-gradient backward on the CPU: where the residual shares x's
    dtype, autograd gets one tensor as the gradient of both (as from torch's own x + residual),
    so the kernel writes one (M, D) gradient instead of two, with the bits of the bwd op asked
    for dresidual apart; the bwd op given dh and no residual_dtype adds dh all the same; the
    leaves' .grad are still two tensors; under a float32 residual stream the gradients stay
    two tensors in their own dtypes."""
    n = NORMS[name]
    g = torch.Generator().manual_seed(12)
    x, r = (torch.randn(6, 32, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(32, generator=g, requires_grad=True)
    b = torch.randn(32, generator=g, requires_grad=True) if n.centred else None
    dy, dh = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g)
    fn = getattr(lt, name)
    y, h = fn(x, r, 32, w, b, 1e-5) if n.centred else fn(x, r, 32, w, 1e-5)
    gx, gr = torch.autograd.grad((y, h), (x, r), (dy, dh), retain_graph=True)
    assert gx.data_ptr() == gr.data_ptr()
    _y, hn, s0, s1 = _ops.fwd(x.detach(), r.detach(), w.detach(),
                              None if b is None else b.detach(), 1e-5, n.centred, False, None)
    wd, bd = w.detach(), None if b is None else b.detach()
    dx, dres, _, _ = _ops.bwd(dy, dh, hn, wd, bd, s0, s1, n.centred, False, x.dtype, r.dtype)
    assert torch.equal(dx, gx) and torch.equal(dres, gx) and dx.data_ptr() != dres.data_ptr()
    one, none, _, _ = _ops.bwd(dy, dh, hn, wd, bd, s0, s1, n.centred, False, x.dtype, None)
    assert torch.equal(one, dx) and none.numel() == 0
    torch.autograd.backward((y, h), (dy, dh))
    assert torch.equal(x.grad, gx) and torch.equal(r.grad, gx)
    assert x.grad.data_ptr() != r.grad.data_ptr()
    xb = x.detach().bfloat16().requires_grad_()
    y, h = (fn(xb, r, 32, w, b, residual_dtype=torch.float32) if n.centred
            else fn(xb, r, 32, w, residual_dtype=torch.float32))
    gx, gr = torch.autograd.grad((y, h), (xb, r), (dy.bfloat16(), dh))
    assert (gx.dtype, gr.dtype) == (torch.bfloat16, torch.float32)
    assert torch.equal(gx, gr.bfloat16())


@pytest.mark.parametrize("name", FAMILY)
def test_absent_and_mixed_dtype_parameters(name, family_inputs, float64_oracle, torch_norm,
                                           results_close):
    """Protects parameters that are absent (no gradient, no error) or of another dtype than x
    (float32 weight on bfloat16 x: dweight comes back in float32)."""
    norm = NORMS[name]
    args, cot = family_inputs(norm, (6, 40), "bfloat16", seed=3)
    k = 2 if norm.residual else 1
    none = args[:k] + [None] * len(norm.params)
    results_close(torch_norm(norm, none, cot), float64_oracle(norm, none, cot).results,
                  what=f"{name} without parameters")
    mixed = args[:k] + [p.astype(np.float32) for p in args[k:]]
    got = torch_norm(norm, mixed, cot)
    assert got["dgamma"].dtype == np.float32
    results_close(got, float64_oracle(norm, mixed, cot).results, what=f"{name} mixed")


@pytest.mark.parametrize("name", FAMILY)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_agrees_with_torchs_own_functions(name, dtype):
    """Protects the drop-in claim: the same results as F.layer_norm / F.rms_norm (after
    x + residual) on several trailing axes, within the tolerance table."""
    g = torch.Generator().manual_seed(4)
    tdt = TORCH_DTYPES[dtype]
    shape, d = (2, 3, 4, 16), (4, 16)
    x = (torch.randn(shape, generator=g) * 3 + 1).to(tdt)
    r = torch.randn(shape, generator=g).to(tdt)
    w = torch.randn(d, generator=g).to(tdt)
    b = torch.randn(d, generator=g).to(tdt)
    ours = _call(name, x, r, d, w, b)
    theirs = _call(name, x, r, d, w, b, torch_own=True)
    for o, t in zip(ours, theirs, strict=True):
        if t is not None:
            assert o.dtype == t.dtype and o.shape == t.shape
            assert_close(o.float().numpy(), t.double().numpy(), dtype, "out", name=name)


def test_eps_defaults_and_zero_eps_as_torch():
    """Protects eps semantics: rms_norm's eps=None is the compute dtype's finfo eps as in
    F.rms_norm (float32's for 16- and 32-bit inputs, float64's for float64), and eps = 0 is
    accepted as torch accepts it (a constant row then gives NaN, as torch's)."""
    x = torch.randn(4, 32, dtype=torch.float64)
    assert torch.equal(lt.rms_norm(x, 32), lt.rms_norm(x, 32, eps=torch.finfo(x.dtype).eps))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        small = torch.full((1, 4), 0.01, dtype=dtype)  # mean(x²) = 1e-4: eps decides y
        assert torch.equal(lt.rms_norm(small, 4), F.rms_norm(small, (4,)))
        assert torch.equal(lt.rms_norm(small, 4),
                           lt.rms_norm(small, 4, eps=torch.finfo(torch.float32).eps))
    assert_close(lt.rms_norm(x, 32).numpy(), F.rms_norm(x, (32,)).numpy(), "float64", "out")
    assert_close(lt.layer_norm(x, 32, eps=0.0).numpy(),
                 F.layer_norm(x, (32,), eps=0.0).numpy(), "float64", "out")
    const = torch.ones(2, 8)
    assert torch.isnan(lt.layer_norm(const, 8, eps=0.0)).all()
    assert torch.isnan(F.layer_norm(const, (8,), eps=0.0)).all()


def test_outputs_are_fresh_and_a_strided_input_gives_the_same_rows():
    """Protects the outputs and the layout handling: y is a new contiguous tensor of x's shape
    (x is read in place, never written), and a non-contiguous x gives the bits its contiguous
    copy gives."""
    x = torch.randn(4, 3, 16)
    before = x.clone()
    y, _h, _s, _c = _ops.fwd(x, None, None, None, 1e-5, True, False, None)
    assert y.shape == x.shape and y.is_contiguous() and y.data_ptr() != x.data_ptr()
    assert torch.equal(x, before)
    xt = torch.randn(16, 12).t()  # (12, 16), strides (1, 12)
    yt = _ops.norm(xt, None, None, None, 1e-5, True, False, None)[0]
    assert torch.equal(yt, _ops.norm(xt.contiguous(), None, None, None, 1e-5, True, False,
                                     None)[0])


def test_the_callers_storage_stays_resizable():
    """Protects the callers' tensors from a side effect: handing memory to the kernels must
    not mark a storage unresizable (Tensor.numpy() does, for good), which breaks FSDP2, whose
    gathered parameters are freed by resizing their storage to 0."""
    ts = [torch.randn(s, requires_grad=True) for s in ((4, 16), (4, 16), 16, 16)]
    y, h = lt.add_layer_norm(*ts[:2], 16, *ts[2:])
    torch.autograd.grad((y, h), ts, (torch.ones_like(y), torch.ones_like(h)))
    for t in ts:
        t.detach().untyped_storage().resize_(0)  # raises if it was marked


def test_inputs_are_never_modified_and_strided_inputs_work():
    """Protects the inputs (never written) and non-contiguous inputs (a transposed view):
    the same results as on a contiguous copy."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 6, generator=g).t()  # (6, 16), not contiguous
    r = torch.randn(6, 16, generator=g)
    w, b = torch.randn(16, generator=g), torch.randn(16, generator=g)
    before = [t.clone() for t in (x, r, w, b)]
    y, h = lt.add_layer_norm(x, r, 16, w, b)
    y2, h2 = lt.add_layer_norm(x.contiguous(), r, 16, w, b)
    assert torch.equal(y, y2) and torch.equal(h, h2)
    for t, t0 in zip((x, r, w, b), before, strict=True):
        assert torch.equal(t, t0)


def test_zero_rows():
    """Protects M = 0: empty outputs of the right shape, zero parameter gradients."""
    x = torch.empty(0, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    y = lt.layer_norm(x, 8, w)
    assert y.shape == (0, 8)
    (dw,) = torch.autograd.grad(y.sum(), [w])
    assert torch.equal(dw, torch.zeros(8))


# --- autograd contracts ----------------------------------------------------------------------


def _f64_args(name, zero_centered=False, seed=6):
    g = torch.Generator().manual_seed(seed)
    n = NORMS[name]
    shape, d = (2, 2, 4), (2, 4)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5
    r = torch.randn(shape, generator=g, dtype=torch.float64)
    w = torch.randn(d, generator=g, dtype=torch.float64)
    b = torch.randn(d, generator=g, dtype=torch.float64)
    tensors = [x, r, w, b] if n.residual else [x, w, b]
    tensors = [t.requires_grad_() for t in (tensors if n.centred else tensors[:-1])]

    def f(*ts):
        data, params = (ts[:2], ts[2:]) if n.residual else (ts[:1], ts[1:])
        out = getattr(lt, name)(*data, d, *params, zero_centered_gamma=zero_centered)
        return out

    return f, tensors


@pytest.mark.parametrize("name", FAMILY)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_gradcheck_and_gradgradcheck(name, zero_centered):
    """Protects the first and second derivatives of every function in float64, through
    torch's own checkers: the fused backward, and the differentiable backward autograd uses
    when the backward is itself differentiated (checked in fast mode: random projections of
    the second derivative, which any wrong entry changes)."""
    f, ts = _f64_args(name, zero_centered)
    assert torch.autograd.gradcheck(f, ts)
    assert torch.autograd.gradgradcheck(f, ts, fast_mode=True)


@pytest.mark.parametrize("name", FAMILY)
def test_changing_a_saved_input_in_place_raises(name):
    """Protects against silently wrong gradients: x (or h for an add-norm) and the weight
    changed in place between the forward and the backward raise torch's version error."""
    for victim in ("data", "weight"):
        f, ts = _f64_args(name)
        out = f(*ts)
        y, h = out if isinstance(out, tuple) else (out, None)
        if victim == "weight":
            with torch.no_grad():
                ts[-1 if not NORMS[name].centred else -2].mul_(2)
        elif h is not None:
            with torch.no_grad():
                h.mul_(2)
        else:
            with torch.no_grad():
                ts[0].mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_unused_outputs_cost_no_gradient_and_give_the_right_one():
    """Protects add-norms whose y or h is unused: the missing cotangent is zero."""
    f, ts = _f64_args("add_rms_norm")
    y, h = f(*ts)
    dx_h, = torch.autograd.grad(h.sum(), [ts[0]])
    assert torch.equal(dx_h, torch.ones_like(dx_h))  # h = x + residual only
    f, ts = _f64_args("add_rms_norm")
    y, h = f(*ts)
    dx_y, dr_y = torch.autograd.grad(y.sum(), ts[:2])
    assert torch.equal(dx_y, dr_y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_autocast_as_torchs_own_norms_on_cpu(dtype):
    """Protects autocast: under CPU autocast our four functions return the dtypes torch's own
    functions return on the same inputs."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 16, generator=g).to(dtype)
    r = torch.randn(4, 16, generator=g).to(dtype)
    w, b = torch.randn(16, generator=g), torch.randn(16, generator=g)  # float32 parameters
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for name in FAMILY:
            ours = _call(name, x, r, (16,), w, b)
            theirs = _call(name, x, r, (16,), w, b, torch_own=True)
            assert [None if t is None else t.dtype for t in ours] == \
                [None if t is None else t.dtype for t in theirs], name


def test_autocast_rule_table_follows_torch():
    """Protects the autocast table: only layer_norm on CUDA is cast (to float32, torch's
    fp32 list); rms_norm and every norm on the CPU keep their dtypes."""
    from layernorm.torch._functional import AUTOCAST

    assert AUTOCAST == {("cuda", True): torch.float32}


def _op_calls(fn, *args) -> dict[str, int]:
    """How many times each op of ours and each of torch's norm kernels ran during fn(*args)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    names = ("layernorm::fwd", "layernorm::bwd", "layernorm::norm", "aten::native_layer_norm",
             "aten::layer_norm", "aten::rms_norm", "aten::_fused_rms_norm")
    counts = dict.fromkeys(names, 0)
    for e in prof.events():
        if e.name in counts:
            counts[e.name] += 1
    return counts


def _step(x, r, w, b):
    y1 = lt.layer_norm(x, 16, w, b)
    y2 = lt.rms_norm(y1, 16, w)
    y3, h = lt.add_layer_norm(y2, r, 16, w, b)
    y4, h2 = lt.add_rms_norm(y3, h, 16, w)
    return (y4.sin() * h2).sum()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_graphs_call_our_ops_in_both_passes(backend):
    """Protects torch.compile(fullgraph=True): the four functions compile without a graph
    break, the compiled forward and backward call our ops (not a decomposition, and never
    torch's own norm kernels), and the gradients equal eager mode's; under no_grad the
    compiled graph calls the inference op."""
    g = torch.Generator().manual_seed(8)
    ts = [torch.randn(s, generator=g, requires_grad=True) for s in ((4, 16), (4, 16), 16, 16)]
    compiled = torch.compile(_step, fullgraph=True, backend=backend)
    got = torch.autograd.grad(compiled(*ts), ts)  # compiles outside the profiled runs

    def train(*a):
        torch.autograd.grad(compiled(*a), a)

    counts = _op_calls(train, *ts)
    assert counts["layernorm::fwd"] == 4 and counts["layernorm::bwd"] == 4, counts
    assert sum(v for k, v in counts.items() if k.startswith("aten")) == 0, counts
    want = torch.autograd.grad(_step(*ts), ts)
    for a, b in zip(got, want, strict=True):
        if backend == "aot_eager":
            assert torch.equal(a, b)
        else:  # inductor compiles the sin and the product around our ops its own way
            assert_close(a.numpy(), b.double().numpy(), "float32", "out")
    with torch.no_grad():
        compiled(*ts)
        counts = _op_calls(compiled, *ts)
    assert counts["layernorm::norm"] == 4 and counts["layernorm::fwd"] == 0, counts


def test_compile_with_inductor():
    """Protects the default backend (inductor): a compiled training step gives eager's
    loss and gradients."""
    def step(x, r, w):
        y, h = lt.add_rms_norm(x, r, 16, w)
        return (lt.layer_norm(y, 16) * h).sum()

    g = torch.Generator().manual_seed(9)
    ts = [torch.randn(s, generator=g, requires_grad=True) for s in ((4, 16), (4, 16), 16)]
    loss = torch.compile(step, fullgraph=True)(*ts)
    got = torch.autograd.grad(loss, ts)
    want = torch.autograd.grad(step(*ts), ts)
    for a, b in zip(got, want, strict=True):
        assert_close(a.numpy(), b.double().numpy(), "float32", "out")


@pytest.mark.parametrize("name", FAMILY)
def test_opcheck(name):
    """Protects the custom ops' registrations (schema, fake tensors, autograd, AOT dispatch)
    for every norm, through torch.library.opcheck, on the three ops; x of three axes for the
    inference op, which takes any rank."""
    n = NORMS[name]
    g = torch.Generator().manual_seed(10)
    x = torch.randn(5, 16, generator=g, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(5, 16, generator=g, requires_grad=True) if n.residual else None
    w = torch.randn(16, generator=g, requires_grad=True)
    b = torch.randn(16, generator=g, requires_grad=True) if n.centred else None
    h_dtype = torch.float32 if n.residual else None
    torch.library.opcheck(_ops.fwd, (x, r, w, b, 1e-5, n.centred, True, h_dtype))
    x3, r3 = x.detach().view(5, 1, 16), None if r is None else r.detach().view(5, 1, 16)
    torch.library.opcheck(_ops.norm, (x3, r3, w.detach(), None if b is None else b.detach(),
                                      1e-5, n.centred, False, h_dtype))
    _y, h, s0, s1 = _ops.fwd(x.detach(), None if r is None else r.detach(), w.detach(),
                             None if b is None else b.detach(), 1e-5, n.centred, True, h_dtype)
    xn = h if n.residual else x.detach()
    dy = torch.randn(5, 16, generator=g, dtype=torch.bfloat16)
    dh = torch.randn(5, 16, generator=g) if n.residual else None
    torch.library.opcheck(_ops.bwd, (dy, dh, xn, w.detach(), None if b is None else b.detach(),
                                     s0, s1, n.centred, True, x.dtype, h_dtype))


# --- modules ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ours, theirs, kw", [
    (lt.LayerNorm, torch.nn.LayerNorm, {}),
    (lt.LayerNorm, torch.nn.LayerNorm, {"bias": False}),
    (lt.RMSNorm, torch.nn.RMSNorm, {"eps": 1e-6}),
])
def test_modules_are_drop_ins(ours, theirs, kw):
    """Protects the modules as drop-ins: subclasses of torch's, load torch's state dict, give
    torch's results within the table, and say in the repr that they are ours."""
    torch.manual_seed(11)
    ref = theirs((2, 16), **kw)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p))
    mod = ours((2, 16), **kw)
    assert isinstance(mod, theirs)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(3, 2, 16)
    assert_close(mod(x).detach().numpy(), ref(x).detach().double().numpy(), "float32", "out")
    assert repr(mod).startswith(f"layernorm.torch.{theirs.__name__}(")
    assert repr(mod).removeprefix("layernorm.torch.") == repr(ref)


def test_zero_centered_modules_start_at_the_identity_scale():
    """Protects zero_centered_gamma on the modules: the weight starts at 0 (scale 1), so a
    fresh module normalizes as an unscaled norm does, and the repr says so."""
    x = torch.randn(3, 16)
    for mod, plain in ((lt.RMSNorm(16, zero_centered_gamma=True), F.rms_norm(x, (16,))),
                       (lt.LayerNorm(16, zero_centered_gamma=True), F.layer_norm(x, (16,)))):
        assert torch.equal(mod.weight, torch.zeros(16))
        assert_close(mod(x).detach().numpy(), plain.double().numpy(), "float32", "out")
        assert "zero_centered_gamma=True" in repr(mod)


# --- errors ----------------------------------------------------------------------------------


X = torch.randn(2, 8)
W = torch.randn(8)


@pytest.mark.parametrize("call, error, names", [
    (lambda: lt.layer_norm(X.tolist(), (8,)), TypeError, "input"),
    (lambda: lt.layer_norm(X.to(torch.int32), (8,)), TypeError, "input"),
    (lambda: lt.layer_norm(X.to(torch.complex64), (8,)), TypeError, "input"),
    (lambda: lt.layer_norm(X, (7,)), ValueError, "normalized_shape"),
    (lambda: lt.layer_norm(X, (2, 8, 8)), ValueError, "normalized_shape"),
    (lambda: lt.layer_norm(X, ()), ValueError, "normalized_shape"),
    (lambda: lt.layer_norm(X, "8"), TypeError, "normalized_shape"),
    (lambda: lt.layer_norm(X, (8.0,)), TypeError, "normalized_shape"),
    (lambda: lt.layer_norm(X, True), TypeError, "normalized_shape"),
    (lambda: lt.layer_norm(X, (8,), W[:7]), ValueError, "weight"),
    (lambda: lt.layer_norm(X, (8,), W.tolist()), TypeError, "weight"),
    (lambda: lt.layer_norm(X, (8,), None, W.to(torch.int64)), TypeError, "bias"),
    (lambda: lt.layer_norm(X, (8,), eps=-1e-5), ValueError, "eps"),
    (lambda: lt.layer_norm(X, (8,), eps=float("nan")), ValueError, "eps"),
    (lambda: lt.layer_norm(X, (8,), eps="1e-5"), TypeError, "eps"),
    (lambda: lt.rms_norm(X, (8,), eps=True), TypeError, "eps"),
    (lambda: lt.rms_norm(X, (8,), zero_centered_gamma=1), TypeError, "zero_centered_gamma"),
    (lambda: lt.add_rms_norm(X, X[:1], (8,)), ValueError, "residual"),
    (lambda: lt.add_rms_norm(X, X.numpy(), (8,)), TypeError, "residual"),
    (lambda: lt.add_rms_norm(X, X, (8,), residual_dtype=torch.int8), TypeError,
     "residual_dtype"),
    (lambda: lt.add_layer_norm(X.to("meta"), X, (8,)), ValueError, "x"),
])
def test_bad_arguments_name_the_argument(call, error, names):
    """Protects the errors: a TypeError for a wrong kind, a ValueError for a wrong value, each
    naming the argument."""
    with pytest.raises(error, match=names):
        call()
