"""The quantized norms on the CPU paths: :class:`quant_cases.QuantSpec` (the spec, held to
independent oracles) on the NumPy reference and on ``layernorm.torch``'s op (the C++ engine, or
the NumPy fallback in the fallback pass of ``make test``); then the reference's and the PyTorch
API's refusals, shapes, threads, compile and export."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_cases import QuantSpec

import layernorm as ln
import layernorm.torch as lt


@pytest.fixture(params=["reference", "torch"])
def backend(request) -> str:
    return request.param


class TestQuantSpec(QuantSpec):
    """The spec on the NumPy reference and the CPU op."""


REFERENCE_REFUSALS = [
    ({"dtype": "int4"}, ValueError, "dtype must be int8 or float8_e4m3fn"),
    ({"dtype": np.int8}, TypeError, "dtype must be a dtype name"),
    ({"group_size": 32}, ValueError, "group_size must be None or one of"),
    ({"group_size": True}, TypeError, "group_size must be None or an int"),
    ({"scale_ub": 0.0}, ValueError, "scale_ub must be finite and > 0"),
    ({"scale_ub": "1"}, TypeError, "scale_ub must be None or a real number"),
    ({"scale": np.array(0.1)}, TypeError, "scale must be a float32 array"),
    ({"scale": np.array([0.1, 0.2], np.float32)}, ValueError, "scale must have shape"),
    ({"scale": np.array(-1.0, np.float32)}, ValueError, "scale must be finite and > 0"),
    ({"scale": np.array(1.0, np.float32), "group_size": 64}, ValueError,
     "scale must be None with group_size"),
    ({"residual_dtype": "float32"}, ValueError, "residual_dtype must be None without"),
    ({"scale_ub": np.array([[1.0]])}, ValueError, "scale_ub must be a number or an array"),
]


@pytest.mark.parametrize("kw,error,message", REFERENCE_REFUSALS)
def test_reference_refuses_bad_arguments(kw, error, message):
    """Protects the reference's checks: each bad argument named, with what was wrong."""
    with pytest.raises(error, match=message):
        ln.rms_norm_quant(np.ones((2, 128), np.float32), **kw)


# --- the PyTorch API only --------------------------------------------------------------------

def _x(shape=(4, 256), dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


TORCH_REFUSALS = [
    ({"dtype": torch.float16}, ValueError, "dtype must be torch.int8 or torch.float8_e4m3fn"),
    ({"dtype": "int8"}, TypeError, "dtype must be torch.int8 or torch.float8_e4m3fn"),
    ({"group_size": 96}, ValueError, "group_size must be None or one of"),
    ({"scale": torch.tensor(0.1, dtype=torch.float64)}, TypeError, "scale must be a float32"),
    ({"scale": torch.tensor([[0.1]])}, ValueError, "scale must be a float32 tensor of shape"),
    ({"scale": torch.tensor(float("inf"))}, ValueError, "scale must be finite and > 0"),
    ({"scale": 0.1}, TypeError, "scale must be a float32 tensor"),
    ({"scale": torch.tensor(0.1), "scale_ub": 1.0}, ValueError, "scale must be None with"),
    ({"scale_ub": float("nan")}, ValueError, "scale_ub must be finite and > 0"),
    ({"scale_ub": torch.tensor([1.0, 2.0])}, ValueError, "scale_ub must be a float32 tensor"),
    ({"residual_dtype": torch.float32}, ValueError, "residual_dtype must be None without"),
]


@pytest.mark.parametrize("kw,error,message", TORCH_REFUSALS)
def test_torch_refuses_bad_arguments(kw, error, message):
    """Protects the API's checks: each bad argument named, with what was wrong."""
    with pytest.raises(error, match=message):
        lt.rms_norm_quant(_x(), 256, **kw)


def test_group_size_must_divide_d():
    """Protects per-group scales from a partial last group: 128 does not divide 192."""
    with pytest.raises(ValueError, match="dividing D = 192"):
        lt.layer_norm_quant(_x((2, 192)), 192, group_size=128)


def test_a_gradient_is_refused():
    """Protects inference only: an argument that needs a gradient is refused, naming it; under
    torch.no_grad() the same call runs."""
    w = torch.ones(256, requires_grad=True)
    with pytest.raises(ValueError, match="weight requires grad"):
        lt.rms_norm_quant(_x(dtype=torch.float32), 256, w)
    with torch.no_grad():
        q, s = lt.rms_norm_quant(_x(dtype=torch.float32), 256, w)
    assert q.dtype == torch.int8 and s.shape == (4, 1)


def test_shapes_strides_and_normalized_shapes():
    """Protects flattening: a 3-D strided input normalized over two axes gives q of its shape,
    scales of its leading shape, and the values of the contiguous (M, D) call."""
    x = _x((6, 8, 32), torch.float32).transpose(0, 1)  # (8, 6, 32), not contiguous
    w = torch.rand(6, 32) + 0.5
    q, s = lt.layer_norm_quant(x, (6, 32), w, dtype=torch.float8_e4m3fn, group_size=64)
    q2, s2 = lt.layer_norm_quant(x.reshape(8, 192).contiguous(), 192, w.reshape(-1),
                                 dtype=torch.float8_e4m3fn, group_size=64)
    assert q.shape == (8, 6, 32) and s.shape == (8, 3)
    assert torch.equal(q.view(torch.uint8).reshape(8, 192), q2.view(torch.uint8))
    assert torch.equal(s, s2)


def test_thread_count_does_not_change_the_result(cpu_threads):
    """Protects row independence across torch's threads: 1 and 2 threads give the same bits."""
    x = _x((256, 1024))
    outs = []
    for n in (1, 2):
        cpu_threads(n)
        q, s, h = lt.rms_norm_quant(x, 1024, residual=x.flip(0), dtype=torch.float8_e4m3fn)
        outs.append((q.view(torch.uint8), s, h))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_empty_inputs():
    """Protects the edges torch's norms allow: no rows, and a normalized size of 0, whose
    per-token scales are min_scale (the amax of no values is 0) and per-group scales none."""
    q, s = lt.rms_norm_quant(torch.empty(0, 64), 64)
    assert q.shape == (0, 64) and s.shape == (0, 1)
    q, s = lt.rms_norm_quant(torch.empty(3, 0), 0, dtype=torch.float8_e4m3fn)
    assert q.shape == (3, 0) and q.dtype == torch.float8_e4m3fn
    assert torch.equal(s, torch.full((3, 1), 1 / (448 * 512)))
    q, s = lt.layer_norm_quant(torch.empty(3, 0), 0, group_size=64)
    assert q.shape == (3, 0) and s.shape == (3, 0)


def test_torch_inputs_are_not_modified():
    """Protects the caller's tensors: input, residual, weight, bias, a static scale and a
    scale_ub tensor are read only (compared bit for bit after the calls)."""
    x, r = _x((4, 256), torch.float32), _x((4, 256), torch.float32, seed=1)
    w, b = torch.rand(256) + 0.5, torch.rand(256)
    scale, ub = torch.tensor([0.05]), torch.tensor(3.0)
    before = [t.clone() for t in (x, r, w, b, scale, ub)]
    lt.layer_norm_quant(x, 256, w, b, residual=r, scale=scale, dtype=torch.float8_e4m3fn)
    lt.rms_norm_quant(x, 256, w, residual=r, scale_ub=ub, group_size=128)
    for a, b_ in zip((x, r, w, b, scale, ub), before, strict=True):
        assert torch.equal(a, b_)


def test_the_ops_check_a_direct_call():
    """Protects the ops called directly (not through the functions' checks): a group size the
    kernels do not take, a static scale of 0 and a static scale with a group size are refused,
    never quantized with (the C++ engine or, in the fallback pass, the NumPy fallback)."""
    from layernorm.torch._ops import norm_quant

    x, w = _x((2, 192), torch.float32), torch.ones(192)
    bad = [dict(scale=None, group_size=32, scale_ub=None),
           dict(scale=None, group_size=128, scale_ub=None),  # 128 does not divide 192
           dict(scale=torch.tensor([0.0]), group_size=None, scale_ub=None),
           dict(scale=torch.tensor([1.0]), group_size=64, scale_ub=None),
           dict(scale=None, group_size=None, scale_ub=torch.tensor([-1.0]))]
    for kw in bad:
        with pytest.raises((ValueError, RuntimeError), match="group_size|scale"):
            norm_quant(x, w, None, 1e-6, False, False, False, kw["scale"], kw["group_size"],
                       kw["scale_ub"])


def test_meta_tensors_give_the_shapes():
    """Protects the fake implementation: shapes and dtypes without data."""
    x = torch.empty(2, 5, 256, device="meta")
    q, s, h = lt.rms_norm_quant(x, 256, residual=x, group_size=128, dtype=torch.float8_e4m3fn,
                                residual_dtype=torch.float32)
    assert (q.shape, q.dtype, s.shape, s.dtype) == ((2, 5, 256), torch.float8_e4m3fn, (2, 5, 2),
                                                     torch.float32)
    assert h.dtype == torch.float32


def test_compile_fullgraph_and_export_give_the_eager_result():
    """Protects the op under torch.compile(fullgraph=True) and torch.export: the same q,
    scales and h as eager, with per-group and static scales."""
    x, r, w = _x((8, 256)), _x((8, 256), seed=1), torch.rand(256) + 0.5
    scale = torch.tensor(0.02)

    def f(x, r, w):
        q1, s1, h = lt.rms_norm_quant(x, 256, w, residual=r, group_size=64, scale_ub=4.0)
        q2, s2 = lt.layer_norm_quant(h, 256, w, dtype=torch.float8_e4m3fn, scale=scale)
        return q1, s1, h, q2.view(torch.uint8), s2

    eager = f(x, r, w)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x, r, w)

    class M(torch.nn.Module):
        def forward(self, x, r, w):
            return f(x, r, w)

    exported = torch.export.export(M(), (x, r, w)).module()(x, r, w)
    for a, b, c in zip(eager, compiled, exported, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


# --- the benchmark's pieces -------------------------------------------------------------------

def test_the_eager_pair_and_the_models_quantizer_follow_the_spec():
    """Protects the comparisons of ``layernorm bench --quant``: the pair it times against
    (norm_then_quantize) and the W8A8 model's per-token quantizer give the spec's q and scales
    on float32 input, where y in the compute dtype is y in x's dtype (the pair rounds y to x's
    dtype first, so on bfloat16 input they may differ by a step)."""
    from layernorm.bench.quant import norm_then_quantize
    from layernorm.bench.w8a8 import quantize_tokens

    x = _x((16, 512), torch.float32)
    w = torch.rand(512) + 0.5
    with torch.no_grad():
        for dtype, qmax, min_scale in ((torch.int8, 127.0, 2.0**-23),
                                       (torch.float8_e4m3fn, 448.0, 1 / (448 * 512))):
            q, s = lt.rms_norm_quant(x, 512, w, 1e-6, dtype=dtype)
            qp, sp = norm_then_quantize(x, w, 1e-6, dtype, qmax, min_scale)
            assert torch.equal(q.float(), qp.float()) and torch.equal(s, sp)
        qt, st = quantize_tokens(lt.rms_norm(x, 512, w, 1e-6))
        q, s = lt.rms_norm_quant(x, 512, w, 1e-6)
        assert torch.equal(qt, q) and torch.equal(st, s)


def test_the_w8a8_models_fused_and_unfused_agree(monkeypatch):
    """Protects the end-to-end comparison: on float32 activations the fused quantized norms
    feed the int8 Linears the same q and scales as norm-then-quantize, so the two W8A8 models
    give the same logits, and both stay near the float model (a small config)."""
    from layernorm.bench import w8a8

    monkeypatch.setattr(w8a8, "CONFIG", {**w8a8.CONFIG, "hidden": 128, "intermediate": 256,
                                         "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 300,
                                         "max_len": 64})
    model = w8a8.Model()
    tokens = torch.arange(12) * 7 % 300
    with torch.no_grad():
        fused = model.forward(tokens, 0, "w8a8 fused")
        unfused = model.forward(tokens, 0, "w8a8 unfused")
        ref = model.forward(tokens, 0, "float")
        step = model.forward(tokens[:1] + 1, 12, "w8a8 fused")  # a decode step over the cache
    assert torch.equal(fused, unfused)
    assert float((fused - ref).abs().max()) < 0.1 * float(ref.abs().max())
    assert step.shape == (1, 300)


def test_the_benchmarks_verdicts():
    """Protects how ``layernorm bench --quant`` judges: an at-most goal (decode) met only where
    p80 is within it, missed where p20 is beyond it; the summary counts undecided rows apart."""
    from layernorm.bench import quant

    assert quant._at_most([1.1, 1.05, 1.15], 1.2) == "met"
    assert quant._at_most([1.3, 1.25, 1.4], 1.2) == "missed"
    assert quant._at_most([1.2, 1.1, 1.3], 1.2).startswith("within the noise")
    rows = [{"verdicts": {"eager": "met", "torch.compile": "missed"}},
            {"verdicts": {"eager": "noisy: rerun (1.40x-1.70x)", "torch.compile": "met"}}]
    assert quant.summary_line(rows) == ("1.5x eager: 1 met, 0 missed, 1 undecided; "
                                        "1.2x torch.compile: 1 met, 1 missed")
