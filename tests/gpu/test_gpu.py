"""The fused Triton kernels and their PyTorch API against the NumPy reference.

On a machine with CUDA these run on the GPU; otherwise in Triton's interpreter on CPU tensors
(conftest.py sets TRITON_INTERPRET=1), with shapes kept small because the interpreter is slow.
Every comparison is with the float64 reference on the same rounded inputs, with tolerances from
layernorm.tolerances.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from layernorm import tolerances  # noqa: E402
from layernorm.gpu import LayerNorm, kernels, layer_norm, ops  # noqa: E402
from layernorm.reference import layer_norm_backward, layer_norm_forward  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _inputs(M, D, dtype, seed=0, offset=0.0, scale=1.0, param_dtype=None):
    """x, weight, bias, dy on DEVICE, drawn in float32 and rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g) * scale + offset
    w = 1 + 0.5 * torch.randn(D, generator=g)
    b = 0.5 * torch.randn(D, generator=g)
    dy = torch.randn(M, D, generator=g)
    pd = param_dtype or dtype
    return x.to(DEVICE, dtype), w.to(DEVICE, pd), b.to(DEVICE, pd), dy.to(DEVICE, dtype)


def _f64(t):
    return None if t is None else t.detach().double().cpu().numpy()


def _ours(x, w, b, dy, normalized_shape=None):
    """y, dx, dw, db from layer_norm and its autograd backward (dw/db None when absent)."""
    xg, wg, bg = (None if t is None else t.detach().requires_grad_() for t in (x, w, b))
    y = layer_norm(xg, normalized_shape or (x.shape[-1],), wg, bg)
    grads = iter(torch.autograd.grad(y, [t for t in (xg, wg, bg) if t is not None], dy))
    dx = next(grads)
    return y.detach(), dx, None if w is None else next(grads), None if b is None else next(grads)


def _reference(x, w, b, dy):
    """The float64 reference on the same rounded inputs, rows flattened to (M, D)."""
    d = x.shape[-1] if w is None else w.numel()
    x64 = _f64(x).reshape(-1, d)
    w64 = None if w is None else _f64(w).reshape(-1)
    b64 = None if b is None else _f64(b).reshape(-1)
    y, cache = layer_norm_forward(x64, w64, b64)
    return (y, *layer_norm_backward(_f64(dy).reshape(-1, d), cache))


def assert_close(got, want, dtype, quantity):
    got = got if isinstance(got, np.ndarray) else _f64(got)
    tolerances.assert_close(got.reshape(np.shape(want)), want, _name(dtype), quantity)


def assert_matches_reference(x, w, b, dy):
    got = _ours(x, w, b, dy)
    want = _reference(x, w, b, dy)
    assert got[0].dtype == x.dtype and got[1].dtype == x.dtype
    assert_close(got[0], want[0], x.dtype, "out")
    assert_close(got[1], want[1], x.dtype, "out")
    for g, wnt, p in zip(got[2:], want[2:], (w, b), strict=True):
        assert (g is None) == (p is None)
        if p is not None:
            assert g.dtype == p.dtype
            assert_close(g, wnt, p.dtype, "gpu-param")


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("M,D", [(37, 769), (5, 1), (70, 256)], ids=["ragged", "D=1", "pow2"])
def test_matches_reference(M, D, dtype):
    """Protects the short-row kernels: y, dx, dw, db for ragged D = 769, D = 1 and a packed
    power of two (several rows a tile, a partial last tile), in each dtype."""
    assert_matches_reference(*_inputs(M, D, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_long_rows(dtype):
    """Protects the long-row kernels at their real sizes: D = 70,000 (two rows) is looped over
    in blocks, never held whole; the last block is ragged."""
    assert kernels.plan("fwd", 70000).long and kernels.plan("bwd", 70000).long
    assert_matches_reference(*_inputs(2, 70000, dtype))


@pytest.fixture
def long_rows(monkeypatch):
    """Every D > 64 takes the long-row path, in blocks of 128: the long kernels on small shapes."""
    monkeypatch.setattr(kernels, "MAX_SHORT_D_FWD", 64)
    monkeypatch.setattr(kernels, "MAX_SHORT_D_BWD", 64)
    monkeypatch.setattr(kernels, "LONG_BLOCK", 128)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_long_path_small_blocks(long_rows, dtype):
    """Protects the block loop, the Chan merge of block statistics, the ragged last block and
    the (row chunk, column block) grid of the long backward with several partial rows."""
    x, w, b, dy = _inputs(24, 300, dtype)
    assert kernels.plan("bwd", 300).long
    assert_matches_reference(x, w, b, dy)
    assert_matches_reference(x, None, None, dy)


@pytest.mark.parametrize("D", [769, 70000])
def test_large_offset_is_accurate(D):
    """Protects the correction pass (the reference's accuracy mechanism): x = 1000 + 0.01 noise
    in float32, where the rounding error of a plain mean (~3e-5) would shift xhat by ~3e-3."""
    assert_matches_reference(*_inputs(8 if D < 1000 else 2, D, torch.float32, offset=1000.0,
                                      scale=0.01))


def test_large_offset_long_path(long_rows):
    """Protects the shifted block statistics of the long path: same data, blocks of 128, and a
    drift along the row so block means differ."""
    x, w, b, dy = _inputs(4, 769, torch.float32, offset=1000.0, scale=0.01)
    x = x + torch.linspace(0, 0.05, 769, device=DEVICE)
    assert_matches_reference(x, w, b, dy)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_zero_variance_rows(dtype):
    """Protects constant rows: var = 0, rstd = 1/sqrt(eps), y = bias, dx = rstd·(g - mean(g));
    no NaN from a negative rounded variance."""
    x, w, b, dy = _inputs(6, 100, dtype)
    x[1] = 3.0
    x[4] = -0.1
    y, *_ = _ours(x, w, b, dy)
    assert torch.isfinite(y).all()
    assert_matches_reference(x, w, b, dy)


@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
@pytest.mark.parametrize("path", ["short", "long"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_rows_whose_sums_overflow(dtype, path, request):
    """Protects the power-of-two rescaling of rows whose float32 sums overflow: squares of
    3e19 and a sum of 300 values near 1e37 pass FLT_MAX, yet y, dx (relative to its row's
    scale), dw and db match the float64 reference; other rows are untouched."""
    if path == "long":
        request.getfixturevalue("long_rows")
    x, w, b, dy = _inputs(3, 300, dtype)
    x[0] = x[0].float().mul(3e19).to(dtype)
    x[1] = x[1].float().mul(1e35).add(1e37).to(dtype)
    y, dx, dw, db = _ours(x, w, b, dy)
    want = _reference(x, w, b, dy)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    assert_close(y, want[0], dtype, "out")
    row_scale = np.std(_f64(x), axis=1, keepdims=True)  # dx ~ 1/std
    assert_close(_f64(dx) * row_scale, want[1] * row_scale, dtype, "out")
    assert_close(dw, want[2], dtype, "gpu-param")
    assert_close(db, want[3], dtype, "gpu-param")


@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered",
                            "ignore:divide by zero encountered")  # the interpreter's where
@pytest.mark.parametrize("path", ["short", "long"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_rows_at_the_top_of_the_float32_range(dtype, path, request):
    """Protects the rescaling where max|x| >= 2**126 (its scale must stay a normal float32,
    not flush to 0 or -inf) and constant rows on the scaled path (eps * scale**2 underflows:
    rstd must still be 1/sqrt(eps) and y = bias, not NaN)."""
    if path == "long":
        request.getfixturevalue("long_rows")
    x, w, b, dy = _inputs(3, 300, dtype)
    x[0] = x[0].float().clamp(-3, 3).mul(1e38).to(dtype)
    x[1] = 1e37
    x[2, ::2], x[2, 1::2] = 3e38, -3e38
    y, dx, dw, db = _ours(x, w, b, dy)
    want = _reference(x, w, b, dy)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    assert_close(y, want[0], dtype, "out")
    np.testing.assert_array_equal(_f64(y[1]), _f64(b))
    # dx ~ 1/std: rows 0 and 2 have dx ~ 1e-38, subnormal in bfloat16 (a few bits), so
    # bfloat16 checks dx on the constant row only
    rows = slice(None) if dtype == torch.float32 else slice(1, 2)
    row_scale = np.maximum(np.std(_f64(x), axis=1, keepdims=True), 1.0)[rows]
    assert_close(_f64(dx)[rows] * row_scale, want[1][rows] * row_scale, dtype, "out")


@pytest.mark.parametrize("affine", ["none", "weight", "bias"])
def test_optional_weight_and_bias(affine):
    """Protects weight and bias being independently optional: absent ones get no gradient."""
    x, w, b, dy = _inputs(9, 130, torch.float32)
    w = w if affine == "weight" else None
    b = b if affine == "bias" else None
    assert_matches_reference(x, w, b, dy)


def test_mixed_parameter_dtype():
    """Protects bfloat16 x with float32 weight and bias: y and dx in bfloat16, dw and db in
    float32 from float32 accumulation."""
    assert_matches_reference(*_inputs(12, 200, torch.bfloat16, param_dtype=torch.float32))


def test_several_normalized_axes():
    """Protects normalized_shape covering several trailing axes: flattened to D = 4·5, with
    weight and bias of shape (4, 5) and their gradients too."""
    x, w, b, dy = _inputs(6, 20, torch.float32)
    x, dy = x.reshape(2, 3, 4, 5), dy.reshape(2, 3, 4, 5)
    w, b = w.reshape(4, 5), b.reshape(4, 5)
    y, dx, dw, db = _ours(x, w, b, dy, normalized_shape=(4, 5))
    assert y.shape == x.shape and dw.shape == (4, 5) and db.shape == (4, 5)
    want = _reference(x, w, b, dy)
    quantities = ("out", "out", "gpu-param", "gpu-param")
    for got, wnt, q in zip((y, dx, dw, db), want, quantities, strict=True):
        assert_close(got, wnt, torch.float32, q)


@pytest.mark.parametrize("layout", ["row-slice", "transposed", "dy-transposed", "dy-expanded"])
def test_non_contiguous(layout):
    """Protects strided inputs and gradients: a row slice of a wider tensor (read in place
    through its row stride), a transpose (copied at the boundary) and a transposed or
    broadcast dy."""
    x, w, b, dy = _inputs(10, 96, torch.float32)
    if layout == "row-slice":
        wide = torch.randn(10, 200, device=DEVICE)
        wide[:, 50:146] = x
        x = wide[:, 50:146]
        assert x.stride() == (200, 1)
    elif layout == "transposed":
        x = x.t().contiguous().t()
        assert not x.is_contiguous()
    elif layout == "dy-transposed":
        dy = dy.t().contiguous().t()
    else:
        dy = torch.randn(96, device=DEVICE).expand(10, 96)
    assert_matches_reference(x, w, b, dy)


@pytest.mark.parametrize("path", ["short", "long"])
def test_deterministic(path, monkeypatch):
    """Protects bit-identical results run to run (no atomics): y, dx, dw, db of two runs are
    bitwise equal, with several programs writing partial rows of dw and db."""
    if path == "long":
        monkeypatch.setattr(kernels, "MAX_SHORT_D_BWD", 64)
        monkeypatch.setattr(kernels, "LONG_BLOCK", 128)
    x, w, b, dy = _inputs(64, 300, torch.bfloat16)
    first, second = _ours(x, w, b, dy), _ours(x, w, b, dy)
    for a, c in zip(first, second, strict=True):
        assert torch.equal(a, c)


def test_statistics_are_float32():
    """Protects the saved statistics: mean and rstd are float32 for bfloat16 input, and close
    to the float64 ones (rstd to float32 accuracy)."""
    x, *_ = _inputs(8, 300, torch.bfloat16)
    _, mean, rstd = ops.fwd(x, None, None, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float32
    x64 = _f64(x)
    # Not table entries: the table bounds results, not the saved statistics; 1e-6 (1e-5 for
    # rstd, whose float32 sum of squares of D = 300 terms rounds more) is float32's accuracy.
    np.testing.assert_allclose(_f64(mean), x64.mean(1), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(_f64(rstd), 1 / np.sqrt(x64.var(1) + 1e-5), atol=1e-6, rtol=1e-5)


def test_empty_batch():
    """Protects M = 0: an empty y, an empty dx and zero parameter gradients, no launch."""
    _, w, b, _ = _inputs(1, 16, torch.float32)
    x = torch.randn(2, 0, 16, device=DEVICE)
    y, dx, dw, db = _ours(x, w, b, torch.randn_like(x))
    assert y.shape == x.shape and dx.shape == x.shape
    assert torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))


def _small_model(norm_cls, **kwargs):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 48), norm_cls(48, **kwargs),
                               torch.nn.Linear(48, 8)).to(DEVICE)


@pytest.mark.parametrize("kwargs", [{}, {"bias": False}, {"elementwise_affine": False}],
                         ids=["affine", "no-bias", "no-affine"])
def test_module_is_a_drop_in(kwargs):
    """Protects LayerNorm as a drop-in for torch.nn.LayerNorm: a subclass with the same state
    dict, which loads torch's strictly and gives the same outputs and gradients in a model."""
    theirs = _small_model(torch.nn.LayerNorm, **kwargs)
    with torch.no_grad():
        for p in theirs[1].parameters():
            p.uniform_(0.5, 1.5)
    ours = _small_model(LayerNorm, **kwargs)
    assert isinstance(ours[1], torch.nn.LayerNorm)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict(), strict=True)

    x = torch.randn(5, 7, 24, device=DEVICE)
    out_theirs, out_ours = theirs(x), ours(x)
    out_theirs.square().sum().backward()
    out_ours.square().sum().backward()
    assert_close(out_ours, _f64(out_theirs), torch.float32, "out")
    for p_ours, p_theirs in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert_close(p_ours.grad, _f64(p_theirs.grad), torch.float32, "gpu-param")


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")  # inside inductor
def test_compiled_fullgraph_keeps_our_op():
    """Protects the torch.library registration: torch.compile(fullgraph=True) traces
    layer_norm without a graph break, the graph calls layernorm::triton_fwd (no silent
    fallback), and the compiled function (inductor) gives the eager results and gradients."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x, w, b):
        return layer_norm(x, (4, 32), w, b).sin()

    x, w, b, dy = _inputs(12, 128, torch.float32)
    x, dy = x.reshape(3, 4, 4, 32), dy.reshape(3, 4, 4, 32)
    w, b = w.reshape(4, 32), b.reshape(4, 32)
    torch.compile(f, fullgraph=True, backend=capture)(x, w, b)
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.layernorm.triton_fwd.default in targets

    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    y_eager = f(*leaves)
    grads_eager = torch.autograd.grad(y_eager, leaves, dy)
    y_comp = torch.compile(f, fullgraph=True)(*leaves)
    grads_comp = torch.autograd.grad(y_comp, leaves, dy)
    assert_close(y_comp, _f64(y_eager), torch.float32, "out")
    for a, c in zip(grads_comp, grads_eager, strict=True):
        assert_close(a, _f64(c), torch.float32, "out")


def test_opcheck():
    """Protects the custom ops' registration (schema, fake tensors, autograd, AOT dispatch) by
    torch.library.opcheck, with and without parameters."""
    x, w, b, dy = _inputs(6, 40, torch.float32)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    torch.library.opcheck(ops.fwd, (xg, wg, bg, 1e-5))
    torch.library.opcheck(ops.fwd, (x, None, None, 1e-5))
    _, mean, rstd = ops.fwd(x, w, b, 1e-5)
    torch.library.opcheck(ops.bwd, (dy, x, w, b, mean, rstd))


@pytest.mark.parametrize(
    "call,exc,name",
    [
        (lambda x, w: layer_norm(x.tolist(), (8,)), TypeError, "x"),
        (lambda x, w: layer_norm(x.to(torch.int32), (8,)), TypeError, "x"),
        (lambda x, w: layer_norm(x.double(), (8,)), TypeError, "x"),
        (lambda x, w: layer_norm(x, (7,)), ValueError, "normalized_shape"),
        (lambda x, w: layer_norm(x, (2, 8)), ValueError, "normalized_shape"),
        (lambda x, w: layer_norm(x, ()), ValueError, "normalized_shape"),
        (lambda x, w: layer_norm(x, "8"), TypeError, "normalized_shape"),
        (lambda x, w: layer_norm(x, (8.0,)), TypeError, "normalized_shape"),
        (lambda x, w: layer_norm(x, (8,), w[:7]), ValueError, "weight"),
        (lambda x, w: layer_norm(x, (8,), w.tolist()), TypeError, "weight"),
        (lambda x, w: layer_norm(x, (8,), None, w.to(torch.int64)), TypeError, "bias"),
        (lambda x, w: layer_norm(x, (8,), eps=0.0), ValueError, "eps"),
        (lambda x, w: layer_norm(x, (8,), eps="1e-5"), TypeError, "eps"),
    ],
)
def test_bad_input(call, exc, name):
    """Protects the error messages: ValueError/TypeError naming the argument at fault."""
    x = torch.randn(3, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(exc, match=name):
        call(x, w)


def test_cpu_tensor_needs_the_interpreter(monkeypatch):
    """Protects the device check: a CPU tensor without the interpreter is a ValueError naming x,
    not a crash inside Triton."""
    monkeypatch.setattr(kernels, "INTERPRET", False)
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        layer_norm(torch.randn(2, 8), (8,))


def test_changing_weight_in_place_before_backward_is_refused():
    """Protects the one rule for gamma on the PyTorch side: the op saves weight for autograd,
    so changing it in place between forward and backward (an optimizer step) raises instead
    of giving the gradient of a function that never ran."""
    x, w, b, dy = _inputs(4, 32, torch.float32)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = layer_norm(xg, (32,), wg, b)
    with torch.no_grad():
        wg.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)
