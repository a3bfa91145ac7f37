"""torch.func transforms and forward-mode AD over the PyTorch API: never a silent zero.

Protects: a tangent or a batched result that comes back wrong without an error. Each case
either gives torch's answer or raises NotImplementedError naming the limit.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwad

import layernorm.torch as lt
from layernorm.torch._functional import TRANSFORMS

D = 8


def _args():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(s, generator=g, dtype=torch.float64) for s in ((3, D), (D,), (D,)))


TRANSFORMED = {
    "jvp": lambda f, x, w, b: torch.func.jvp(f, (x, w, b), (x, w, b))[1],
    "vmap": lambda f, x, w, b: torch.func.vmap(f, in_dims=(0, None, None))(x, w, b),
    "grad": lambda f, x, w, b: torch.func.grad(lambda *a: f(*a).sum())(x, w, b),
    "jacfwd": lambda f, x, w, b: torch.func.jacfwd(f)(x, w, b),
}


@pytest.mark.parametrize("transform", sorted(TRANSFORMED))
def test_a_transform_raises_instead_of_a_zero_tangent(transform: str) -> None:
    """Under a torch.func transform the functions refuse with NotImplementedError."""
    x, w, b = _args()
    with pytest.raises(NotImplementedError, match="not supported yet"):
        TRANSFORMED[transform](lambda x, w, b: lt.layer_norm(x, (D,), w, b), x, w, b)


def test_forward_ad_raises_instead_of_a_zero_tangent() -> None:
    """Under forward_ad.dual_level a dual input is refused, not given a zero tangent."""
    x, w, b = _args()
    with fwad.dual_level(), pytest.raises(NotImplementedError) as info:
        lt.rms_norm(fwad.make_dual(x, torch.ones_like(x)), (D,), w)
    assert str(info.value) == TRANSFORMS
