"""The PyTorch API: the family of norms on CPU and CUDA tensors, with autograd.

    import layernorm.torch as lt
    y = lt.layer_norm(x, (D,), weight, bias)             # as torch.nn.functional.layer_norm
    y = lt.rms_norm(x, (D,), weight)                     # as torch.nn.functional.rms_norm
    y, h = lt.add_layer_norm(x, residual, (D,), weight, bias)   # h = x + residual, y = LN(h)
    y, h = lt.add_rms_norm(x, residual, (D,), weight)
    lt.LayerNorm(D), lt.RMSNorm(D)                       # subclasses of torch's modules
    lt.PerHeadLayerNorm((heads, D))                      # a (heads, D) weight (Cohere's q/k)
    q, s = lt.rms_norm_quant(x, (D,), weight, dtype=torch.int8)  # y quantized: int8 or
                                                         # float8, static/per-token/per-group
    n = lt.replace_norms(model)                          # swap a model's norms in place:
                                                         # n.swapped, n.left by class

CPU tensors run the C++ engine on the tensors' own memory (compiled into the wheel:
:mod:`layernorm.engine`); CUDA tensors run the Triton kernels. float16, bfloat16, float32 and
float64 on both. Each function is a ``torch.library`` custom op with a fake implementation
(``torch.compile(fullgraph=True)``), autograd (double backward included) and torch's
autocast rule; under ``torch.func`` transforms (grad, vmap, jvp, jacrev, jacfwd, hessian) and
forward-mode AD the functions take one Python autograd Function with a hand-derived jvp
(:mod:`._transforms`).
``memory_efficient=True`` (every function, the modules, ``replace_norms``) makes training
keep each norm's output y instead of its input, which the next layer keeps anyway; its
backward cannot be differentiated again.
docs/torch.md has the details.
Needs the extra ``torch`` (torch; triton for CUDA).
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"layernorm.torch needs torch ({exc.name} is not installed): install the package's "
        "`torch` extra"
    ) from exc

from . import _distributed  # noqa: F401 - how DTensor shards the ops, once DTensor is imported
from ._functional import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from ._modules import LayerNorm, PerHeadLayerNorm, RMSNorm
from ._quant import layer_norm_quant, rms_norm_quant
from ._swap import SwapSummary, replace_norms

__all__ = [
    "LayerNorm",
    "PerHeadLayerNorm",
    "RMSNorm",
    "SwapSummary",
    "add_layer_norm",
    "add_rms_norm",
    "layer_norm",
    "layer_norm_quant",
    "replace_norms",
    "rms_norm",
    "rms_norm_quant",
]
