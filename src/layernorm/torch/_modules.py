"""``LayerNorm`` and ``RMSNorm``: subclasses of torch's modules computed by the fused ops.

Same constructor (plus ``zero_centered_gamma``, ``result_dtype`` and ``memory_efficient``),
parameters and state dict as ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``, so each loads the
state dict of the module it replaces and takes its place in a model unchanged; the repr names
the class as ours.

Two options serve modules taking the place of other libraries' norms (``replace_norms``):
- ``result_dtype``: the dtype of the result where the weight's dtype is not the input's:
  "input" (torch's rule, the default), "promote" (the promoted dtype of input, weight and bias,
  as ``weight * normed`` returns) or "half_weight" (the weight's dtype where that is float16 or
  bfloat16, else as "promote": T5's rule). The norm is computed in the wider of the input's and
  the result's dtype and rounded once to the result's.
- ``normalized_shape=None`` (only without weight and bias): the last axis, whatever its size,
  as a weightless norm that does not fix its size normalizes; the attribute then reads ``()``
  (still a tuple, as torch's type says).

``memory_efficient=True`` (an attribute too, which may be set on a built module) passes the
functions' option of that name: in training, autograd keeps the module's output y instead of
its input (``layernorm.torch.layer_norm`` says more). It is not part of the state dict.

``RMSNorm``'s ``eps=None`` is torch's: ``torch.finfo`` of the input's compute dtype (float32
for float16, bfloat16 and float32 inputs, float64 for float64), whatever ``result_dtype`` makes
the module compute in.

``PerHeadLayerNorm`` takes the place of a LayerNorm whose weight spans more axes than it
normalizes (Cohere's query/key norms: a (heads, head_dim) weight over (..., heads, head_dim),
each head normalized on its own): the fused op normalizes the last axis without weight, and
one more elementwise pass multiplies by the weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._functional import default_eps, layer_norm, rms_norm

__all__ = ["LayerNorm", "PerHeadLayerNorm", "RMSNorm"]

RESULT_DTYPES = ("input", "promote", "half_weight")
_HALF = (torch.float16, torch.bfloat16)


class _Ours:
    """What both modules add to torch's: zero-centred gamma, the result's dtype, the last axis
    of any size, and a name that says whose."""

    # class-level defaults: a module pickled without an option reads it as off
    zero_centered_gamma: bool = False
    result_dtype: str = "input"
    memory_efficient: bool = False
    _last_axis: bool = False  # built with normalized_shape=None

    def _options(self, normalized_shape: object, elementwise_affine: bool,
                 zero_centered_gamma: bool, result_dtype: object,
                 memory_efficient: object = False) -> object:
        """Check and keep the options; ``normalized_shape`` as torch's constructor takes it."""
        if not isinstance(memory_efficient, bool):
            raise TypeError(f"memory_efficient must be a bool, got "
                            f"{type(memory_efficient).__name__}")
        if not isinstance(result_dtype, str):
            raise TypeError(f"result_dtype must be a str, got {type(result_dtype).__name__}")
        if result_dtype not in RESULT_DTYPES:
            raise ValueError(f"result_dtype must be one of {', '.join(RESULT_DTYPES)}, got "
                             f"{result_dtype!r}")
        if normalized_shape is None and elementwise_affine:
            raise ValueError("normalized_shape None (the last axis, any size) needs "
                             "elementwise_affine=False: a weight fixes the size")
        self.zero_centered_gamma = zero_centered_gamma
        self.result_dtype = result_dtype
        self.memory_efficient = memory_efficient
        self._last_axis = normalized_shape is None
        return () if self._last_axis else normalized_shape

    def _get_name(self) -> str:  # the repr's class name
        return f"layernorm.torch.{type(self).__name__}"

    def _zero_centred_init(self) -> None:
        # with scale = 1 + weight, the identity scale is weight = 0
        if self.zero_centered_gamma and getattr(self, "weight", None) is not None:
            with torch.no_grad():
                self.weight.zero_()

    def _shape(self, x: Tensor) -> tuple[int, ...] | int:
        if not self._last_axis:
            return self.normalized_shape
        if x.dim() == 0:
            raise ValueError("input must have a last axis to normalize, got a 0-d tensor")
        return x.shape[-1]

    def _result(self, x: Tensor, params: tuple[Tensor | None, ...]) -> torch.dtype | None:
        """The result's dtype where ``result_dtype`` makes it other than x's (else None)."""
        if self.result_dtype == "input" or all(p is None or p.dtype == x.dtype for p in params):
            return None  # the common cases first: they cost least
        weight = params[0]
        if self.result_dtype == "half_weight" and weight is not None and weight.dtype in _HALF:
            return weight.dtype
        out = x.dtype
        for p in params:
            if p is not None:
                out = torch.promote_types(out, p.dtype)
        return out

    def _run(self, norm, x: Tensor, *params: Tensor | None) -> Tensor:
        """``norm(x, shape, *params, eps)`` (params: weight, then bias) in the wider of x's and
        the result's dtype, rounded once to the result's dtype."""
        out = self._result(x, params)
        eps = self.eps
        if out is not None:
            if eps is None:  # torch's eps for the input's dtype, not the one computed in
                eps = default_eps(x.dtype)
            x = x.to(torch.promote_types(x.dtype, out))
        y = norm(x, self._shape(x), *params, eps,
                 zero_centered_gamma=self.zero_centered_gamma,
                 memory_efficient=self.memory_efficient)
        return y if out is None else y.to(out)

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        if self._last_axis:
            base = base.replace("()", "None (the last axis)", 1)
        if self.zero_centered_gamma:
            base += ", zero_centered_gamma=True"
        if self.result_dtype != "input":
            base += f", result_dtype={self.result_dtype!r}"
        if self.memory_efficient:
            base += ", memory_efficient=True"
        return base


class LayerNorm(_Ours, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by :func:`layernorm.torch.layer_norm`.

    With ``zero_centered_gamma=True`` the scale is 1 + weight and the weight starts at zero;
    ``result_dtype``, ``normalized_shape=None`` and ``memory_efficient`` as in the module
    docstring.
    """

    def __init__(self, normalized_shape: int | Sequence[int] | None, eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device=None, dtype=None,
                 *, zero_centered_gamma: bool = False, result_dtype: str = "input",
                 memory_efficient: bool = False) -> None:
        shape = self._options(normalized_shape, elementwise_affine, zero_centered_gamma,
                              result_dtype, memory_efficient)
        super().__init__(shape, eps, elementwise_affine, bias, device, dtype)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self._zero_centred_init()

    def forward(self, input: Tensor) -> Tensor:
        """Normalized ``input`` (..., *normalized_shape), same shape; input's dtype unless
        ``result_dtype`` says otherwise."""
        if self.result_dtype == "input" and not self._last_axis:  # the common case, directly
            return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps,
                              zero_centered_gamma=self.zero_centered_gamma,
                              memory_efficient=self.memory_efficient)
        return self._run(layer_norm, input, self.weight, self.bias)


class RMSNorm(_Ours, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by :func:`layernorm.torch.rms_norm`.

    With ``zero_centered_gamma=True`` the scale is 1 + weight (Gemma's convention) and the
    weight starts at zero; ``result_dtype``, ``normalized_shape=None`` and ``memory_efficient``
    as in the module docstring.
    """

    def __init__(self, normalized_shape: int | Sequence[int] | None, eps: float | None = None,
                 elementwise_affine: bool = True, device=None, dtype=None,
                 *, zero_centered_gamma: bool = False, result_dtype: str = "input",
                 memory_efficient: bool = False) -> None:
        shape = self._options(normalized_shape, elementwise_affine, zero_centered_gamma,
                              result_dtype, memory_efficient)
        super().__init__(shape, eps, elementwise_affine, device, dtype)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self._zero_centred_init()

    def forward(self, x: Tensor) -> Tensor:
        """Normalized ``x`` (..., *normalized_shape), same shape; x's dtype unless
        ``result_dtype`` says otherwise."""
        if self.result_dtype == "input" and not self._last_axis:  # the common case, directly
            return rms_norm(x, self.normalized_shape, self.weight, self.eps,
                            zero_centered_gamma=self.zero_centered_gamma,
                            memory_efficient=self.memory_efficient)
        return self._run(rms_norm, x, self.weight)


class PerHeadLayerNorm(_Ours, torch.nn.Module):
    """LayerNorm over the last axis, times a weight that spans more axes: each (head_dim,)
    row of the input (..., heads, head_dim) normalized on its own, then multiplied by the
    (heads, head_dim) weight; Cohere's query/key norm (``CohereLayerNorm`` built with a
    tuple), which ``replace_norms`` swaps for this module.

        y = weight * layer_norm(input, (D,), eps=eps)   # (..., *weight_shape), D = last axis

    The norm is the fused op without weight; the product is a torch op (one more elementwise
    pass, and autograd's backward for it: dweight sums dy·xhat over the leading axes). The
    result has the input's dtype. The state dict holds ``weight`` alone, of ``weight_shape``,
    initialised to ones. ``memory_efficient`` as in the module docstring.
    """

    def __init__(self, weight_shape: int | Sequence[int], eps: float = 1e-5, device=None,
                 dtype=None, *, memory_efficient: bool = False) -> None:
        super().__init__()
        shape = (weight_shape,) if isinstance(weight_shape, int) else weight_shape
        if not isinstance(shape, Sequence) or not all(
                isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise TypeError(f"weight_shape must be an int or a sequence of ints, got "
                            f"{weight_shape!r}")
        shape = tuple(shape)
        if not shape or min(shape) < 0:
            raise ValueError(f"weight_shape must have at least one axis (the last is "
                             f"normalized) and sizes >= 0, got {shape}")
        self.normalized_shape = self._options(shape[-1:], True, False, "input", memory_efficient)
        self.weight_shape = shape
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)

    def forward(self, input: Tensor) -> Tensor:
        """``input`` (..., *weight_shape) normalized over its last axis and multiplied by the
        weight; same shape and dtype."""
        n = len(self.weight_shape)
        # a trace hands out sizes as tensors, and would warn at each one compared
        if not torch.jit.is_tracing() and (
                input.dim() < n or tuple(input.shape[-n:]) != self.weight_shape):
            raise ValueError(f"input must end in the weight's shape {self.weight_shape}, got "
                             f"input of shape {tuple(input.shape)}")
        y = layer_norm(input, self.normalized_shape, None, None, self.eps,
                       memory_efficient=self.memory_efficient)
        out = y * self.weight
        return out if out.dtype == input.dtype else out.to(input.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight_shape}, eps={self.eps}" + super().extra_repr()
