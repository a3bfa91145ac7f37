"""The PyTorch API where torch's own norms take an input: torch's defaults, a normalized size
of 0, meta tensors, and clear refusals of what it does not take.

Protects: each function and module behaves as torch's norm (shape, dtype, values, gradients)
on these inputs, or raises an error naming the argument and what is supported.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import layernorm.torch as lt

FUNCTIONS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")


def _call(name: str, x: torch.Tensor, shape: tuple[int, ...], *, weight=None, **kw):
    """(y, h) of ``name`` (h None for a plain norm), the residual equal to x."""
    f = getattr(lt, name)
    if name.startswith("add_"):
        return f(x, x.detach().clone(), shape, weight, **kw)
    return f(x, shape, weight, **kw), None


@pytest.mark.parametrize("name", FUNCTIONS)
def test_a_normalized_size_of_zero_gives_empty_outputs(name: str) -> None:
    """F.layer_norm(randn(4, 0), (0,)) returns a (4, 0) tensor: so does every function, and
    the backward gives empty gradients of the inputs' shapes."""
    x = torch.randn(4, 0, requires_grad=True)
    w = torch.ones(0, requires_grad=True)
    y, h = _call(name, x, (0,), weight=w)
    assert y.shape == (4, 0) and y.dtype == x.dtype
    assert h is None or h.shape == (4, 0)
    y.sum().backward()
    assert x.grad.shape == (4, 0) and w.grad.shape == (0,)


@pytest.mark.parametrize("me", [False, True], ids=["default", "memory_efficient"])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_meta_tensors_give_shapes_and_dtypes(name: str, me: bool) -> None:
    """On meta tensors (shape inference, models built on torch.device("meta")) every function
    returns meta outputs of torch's shapes and dtypes, and a backward gives meta gradients."""
    x = torch.randn(2, 5, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(8, device="meta", requires_grad=True)
    kw = {"residual_dtype": torch.float32} if name.startswith("add_") else {}
    y, h = _call(name, x, (8,), weight=w, memory_efficient=me, **kw)
    assert y.device.type == "meta" and y.shape == x.shape and y.dtype == torch.bfloat16
    assert h is None or (h.device.type == "meta" and h.dtype == torch.float32)
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == (8,)


def test_modules_on_meta_match_torchs() -> None:
    """lt.LayerNorm and lt.RMSNorm built on meta run on meta input as torch's modules do."""
    for ours, theirs in ((lt.LayerNorm, torch.nn.LayerNorm), (lt.RMSNorm, torch.nn.RMSNorm)):
        x = torch.randn(3, 16, device="meta", dtype=torch.float16)
        got = ours(16, device="meta", dtype=torch.float16)(x)
        want = theirs(16, device="meta", dtype=torch.float16)(x)
        assert (got.device, got.shape, got.dtype) == (want.device, want.shape, want.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_rms_norm_default_eps_is_torchs(dtype: torch.dtype) -> None:
    """eps=None is the compute dtype's machine epsilon, as F.rms_norm and nn.RMSNorm take it:
    on rows whose mean square is near eps the result shows which eps was used."""
    x = torch.full((2, 4), 1e-4 if dtype != torch.float64 else 1e-8, dtype=dtype)
    assert torch.equal(lt.rms_norm(x, (4,)), F.rms_norm(x, (4,)))
    assert torch.equal(lt.RMSNorm(4, dtype=dtype)(x), torch.nn.RMSNorm(4, dtype=dtype)(x))
    r = torch.zeros_like(x)
    y, _h = lt.add_rms_norm(x, r, (4,))
    assert torch.equal(y, F.rms_norm(x, (4,)))


@pytest.mark.parametrize("name", FUNCTIONS)
def test_complex_and_nested_inputs_are_refused(name: str) -> None:
    """Complex dtypes and nested (jagged) or sparse layouts raise TypeError naming the argument
    and what is supported, where they failed inside or would be silently reinterpreted."""
    arg = "x" if name.startswith("add_") else "input"
    with pytest.raises(TypeError, match=rf"{arg} must have dtype .* \(complex tensors are not"):
        _call(name, torch.randn(3, 4, dtype=torch.complex64), (4,))
    nested = torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(5, 4)],
                                        layout=torch.jagged)
    with pytest.raises(TypeError, match=rf"{arg} must be a dense \(strided\) tensor"):
        _call(name, nested, (4,))
    with pytest.raises(TypeError, match="dense"):
        _call(name, torch.randn(3, 4).to_sparse(), (4,))
    with pytest.raises(TypeError, match=r"weight must be a dense \(strided\) tensor"):
        _call(name, torch.randn(3, 4), (4,), weight=torch.randn(4).to_sparse())


@pytest.mark.parametrize("name", FUNCTIONS)
def test_negative_eps_is_refused(name: str) -> None:
    """torch computes with a negative eps (and may give NaN); ours refuses it, naming eps
    (docs/torch.md lists the difference)."""
    with pytest.raises(ValueError, match="eps must be a finite number >= 0, got -1e-05"):
        _call(name, torch.randn(3, 4), (4,), eps=-1e-5)
