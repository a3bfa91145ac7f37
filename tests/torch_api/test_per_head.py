"""PerHeadLayerNorm: Cohere's per-head query/key norms (a (heads, head_dim) weight over the
last axis alone) swapped by replace_norms compute what transformers' CohereLayerNorm computes,
forward and backward, keep its state dict, and go through a meta-device build."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CohereLayerNorm = pytest.importorskip("transformers.models.cohere.modeling_cohere").CohereLayerNorm

import layernorm.torch as lt  # noqa: E402 - after the skips
from layernorm.tolerances import assert_close  # noqa: E402
from layernorm.torch._modules import PerHeadLayerNorm  # noqa: E402

HEADS, D, EPS = 3, 16, 0.05

# (input dtype, weight dtype). Tolerances: the coarser dtype's entries of the table. The
# original computes in float32 and rounds once; ours round the weightless norm to the input's
# dtype, then the product with the weight: two roundings to the coarser dtype, inside its "out"
# entry (y, dx; scale the larger of 1 and max|want|, dx being rstd·dy with rstd up to
# 1/sqrt(eps)); dweight, sums over 15 rows of dy·xhat, is "param" with the same scale.
DTYPES = [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32"),
          ("float32", "bfloat16")]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: str, quantity: str, name: str) -> None:
    want64 = want.detach().double().numpy()
    assert_close(got.detach().double().numpy(), want64, dtype, quantity,
                 scale=max(float(np.max(np.abs(want64))), 1.0), name=name)


def _cohere(heads: int = HEADS, eps: float = EPS) -> torch.nn.Module:
    """A CohereLayerNorm over (heads, D) with a random weight (away from its ones)."""
    old = CohereLayerNorm((heads, D), eps=eps)
    with torch.no_grad():
        old.weight.copy_(torch.randn(heads, D))
    return old


def _swap(model: torch.nn.Module, **kw) -> lt.SwapSummary:
    """replace_norms(model, strict=True) with no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return lt.replace_norms(model, strict=True, **kw)


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
def test_per_head_computes_what_cohere_computes(x_dtype, w_dtype, memory_efficient):
    """Protects the swap of a per-head CohereLayerNorm: it becomes PerHeadLayerNorm holding the
    same Parameter and eps, and gives the original's y (and dtype), dx and dweight within the
    tolerances above, with and without memory_efficient. Inputs have mean square eps/4, so a
    wrong eps shows; each head has its own random weight, so a weight applied to the wrong head
    shows."""
    torch.manual_seed(0)
    old = _cohere().to(getattr(torch, w_dtype))
    x = (0.5 * math.sqrt(EPS) * torch.randn(3, 5, HEADS, D)).to(getattr(torch, x_dtype))
    x.requires_grad_()
    want = old(x)
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(2)).to(want.dtype)
    want_dx, want_dw = torch.autograd.grad(want, [x, old.weight], dy)
    model = torch.nn.Sequential(old)

    assert _swap(model, memory_efficient=memory_efficient).swapped == {"CohereLayerNorm": 1}

    ours = model[0]
    assert type(ours) is PerHeadLayerNorm and ours.weight is old.weight
    assert (ours.eps, ours.weight_shape, ours.normalized_shape) == (EPS, (HEADS, D), (D,))
    assert ours.memory_efficient is memory_efficient
    got = ours(x)
    got_dx, got_dw = torch.autograd.grad(got, [x, ours.weight], dy)
    assert got.dtype == want.dtype and got_dw.dtype == want_dw.dtype
    coarse = "bfloat16" if "bfloat16" in (x_dtype, w_dtype) else "float32"
    where = f"x {x_dtype}, weight {w_dtype}"
    _close(got, want, coarse, "out", f"{where}: y")
    _close(got_dx, want_dx, coarse, "out", f"{where}: dx")
    _close(got_dw, want_dw, coarse, "param", f"{where}: dweight")


def test_state_dict_and_repr_are_coheres():
    """Protects loading in both directions: PerHeadLayerNorm's state dict is CohereLayerNorm's
    (one key, weight, of the (heads, head_dim) shape), each loads the other's strictly, a fresh
    weight is ones as Cohere's, and the repr names the class, shape and eps."""
    torch.manual_seed(0)
    old = _cohere()
    ours = PerHeadLayerNorm((HEADS, D), EPS)
    assert torch.equal(ours.weight, torch.ones(HEADS, D))
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in old.state_dict().items()} == {"weight": (HEADS, D)}
    ours.load_state_dict(old.state_dict())
    assert torch.equal(ours.weight, old.weight)
    CohereLayerNorm((HEADS, D)).load_state_dict(ours.state_dict())
    assert repr(ours) == "layernorm.torch.PerHeadLayerNorm((3, 16), eps=0.05)"
    assert repr(PerHeadLayerNorm(8, memory_efficient=True)) == (
        "layernorm.torch.PerHeadLayerNorm((8,), eps=1e-05, memory_efficient=True)")


def _block() -> torch.nn.Module:
    """A query projection and its per-head norm, as Cohere's attention has them."""
    return torch.nn.Sequential(torch.nn.Linear(32, HEADS * D), torch.nn.Unflatten(-1, (HEADS, D)),
                               _cohere())


def test_meta_build_swap_to_empty_load_state_dict():
    """Protects the deferred-initialisation path for per-head norms: a model built on the meta
    device, swapped (strict), moved with to_empty and loaded from a real model's state dict
    gives that model's output (float32 "out"), its norm a PerHeadLayerNorm on the CPU with the
    loaded weight."""
    torch.manual_seed(0)
    reference = _block()
    with torch.device("meta"):
        model = _block()
    assert _swap(model) == 1 and type(model[2]) is PerHeadLayerNorm
    assert model[2].weight.is_meta
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    assert model[2].weight.device.type == "cpu"
    assert torch.equal(model[2].weight, reference[2].weight)
    x = torch.randn(4, 32)
    with torch.no_grad():
        _close(model(x), reference(x), "float32", "out", "output")


def test_meta_tensors_and_empty_sizes_as_coheres():
    """Protects PerHeadLayerNorm against refusing what the original takes: on the meta device
    it gives a meta result of the input's shape and dtype; a head_dim of 0 and a batch of 0
    rows give Cohere's empty result. It adds no check of its own beyond the input's shape."""
    ours = PerHeadLayerNorm((HEADS, D), device="meta")
    got = ours(torch.randn(2, 5, HEADS, D, device="meta", dtype=torch.bfloat16))
    assert (got.device.type, got.shape, got.dtype) == ("meta", (2, 5, HEADS, D), torch.bfloat16)
    for shape, x_shape in (((HEADS, 0), (2, HEADS, 0)), ((HEADS, D), (0, HEADS, D))):
        x = torch.randn(x_shape)
        want = CohereLayerNorm(shape)(x)
        got = PerHeadLayerNorm(shape)(x)
        assert (got.shape, got.dtype) == (want.shape, want.dtype) == (x.shape, x.dtype)


def test_swapped_once_and_counted_as_a_layer_norm():
    """Protects PerHeadLayerNorm's place in replace_norms: it is ours, so a second call neither
    swaps nor names it; only="rms" leaves a per-head Cohere norm without a word, only="layer"
    swaps it."""
    model = torch.nn.Sequential(_cohere())
    assert _swap(model, only="rms") == 0 and type(model[0]) is CohereLayerNorm
    assert _swap(model, only="layer") == 1 and type(model[0]) is PerHeadLayerNorm
    ours = model[0]
    assert _swap(model) == 0 and model[0] is ours


@pytest.mark.filterwarnings("ignore:`torch.jit")  # torch's deprecation of trace itself
def test_traced_without_warnings_for_any_batch():
    """Protects torch.jit.trace (what the TorchScript ONNX exporter runs): the input's shape
    check is not traced (a trace hands out sizes as tensors: it would warn at each), and the
    trace gives the module's result at another batch size."""
    torch.manual_seed(0)
    ours = PerHeadLayerNorm((HEADS, D))
    with torch.no_grad():
        ours.weight.copy_(torch.randn(HEADS, D))
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = torch.jit.trace(ours, torch.randn(2, HEADS, D))
    x = torch.randn(5, 4, HEADS, D)
    with torch.no_grad():
        assert torch.equal(traced(x), ours(x))


def test_bad_arguments_name_the_argument():
    """Protects the errors: a weight_shape of the wrong kind is a TypeError, one without a last
    axis or with a negative size a ValueError; an input that does not end in the weight's shape
    (which the multiply would broadcast into another shape) a ValueError naming input."""
    with pytest.raises(TypeError, match="weight_shape must be an int or a sequence of ints, "
                                        "got 2.0"):
        PerHeadLayerNorm(2.0)
    with pytest.raises(ValueError, match=r"weight_shape must have at least one axis .* got \(\)"):
        PerHeadLayerNorm(())
    with pytest.raises(ValueError, match=r"sizes >= 0, got \(2, -1\)"):
        PerHeadLayerNorm((2, -1))
    norm = PerHeadLayerNorm((HEADS, D))
    for shape in ((5, D), (5, 1, D), (D,)):
        with pytest.raises(ValueError, match=rf"input must end in the weight's shape \(3, 16\), "
                                             rf"got input of shape \({shape[0]},"):
            norm(torch.randn(shape))
