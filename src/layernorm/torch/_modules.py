"""``LayerNorm`` and ``RMSNorm``: subclasses of torch's modules computed by the fused ops.

Same constructor (plus ``zero_centered_gamma``), parameters and state dict as
``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``, so each loads the state dict of the module it
replaces and takes its place in a model unchanged; the repr names the class as ours.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._functional import layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm"]


class _Ours:
    """What both modules add to torch's: zero-centred gamma, and a name that says whose."""

    zero_centered_gamma: bool

    def _get_name(self) -> str:  # the repr's class name
        return f"layernorm.torch.{type(self).__name__}"

    def _zero_centred_init(self) -> None:
        # with scale = 1 + weight, the identity scale is weight = 0
        if self.zero_centered_gamma and getattr(self, "weight", None) is not None:
            with torch.no_grad():
                self.weight.zero_()

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base}, zero_centered_gamma=True" if self.zero_centered_gamma else base


class LayerNorm(_Ours, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by :func:`layernorm.torch.layer_norm`.

    With ``zero_centered_gamma=True`` the scale is 1 + weight and the weight starts at zero.
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device=None, dtype=None,
                 *, zero_centered_gamma: bool = False) -> None:
        self.zero_centered_gamma = zero_centered_gamma
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self._zero_centred_init()

    def forward(self, input: Tensor) -> Tensor:
        """Normalized ``input`` (..., *normalized_shape), same shape and dtype."""
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps,
                          zero_centered_gamma=self.zero_centered_gamma)


class RMSNorm(_Ours, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by :func:`layernorm.torch.rms_norm`.

    With ``zero_centered_gamma=True`` the scale is 1 + weight (Gemma's convention) and the
    weight starts at zero.
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float | None = None,
                 elementwise_affine: bool = True, device=None, dtype=None,
                 *, zero_centered_gamma: bool = False) -> None:
        self.zero_centered_gamma = zero_centered_gamma
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self._zero_centred_init()

    def forward(self, x: Tensor) -> Tensor:
        """Normalized ``x`` (..., *normalized_shape), same shape and dtype."""
        return rms_norm(x, self.normalized_shape, self.weight, self.eps,
                        zero_centered_gamma=self.zero_centered_gamma)
