"""Fused layer norm for PyTorch: Triton kernels, a ``torch.library`` op and a drop-in module.

    from layernorm.gpu import layer_norm, LayerNorm
    y = layer_norm(x, (D,), weight, bias)      # like torch.nn.functional.layer_norm
    norm = LayerNorm(D)                         # a torch.nn.LayerNorm, with our kernels

Needs the optional extra ``gpu`` (torch and triton). Tensors live on a CUDA device, or on the
CPU when ``TRITON_INTERPRET=1`` is set before triton is imported (Triton's interpreter: slow,
for tests). ``layer_norm`` and ``LayerNorm`` are imported on first use, so that
``layernorm.bench.gpu`` (results and report section) works on machines without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LayerNorm", "layer_norm"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'layernorm.gpu' has no attribute {name!r}")
    try:
        from . import api
    except ModuleNotFoundError as exc:
        if exc.name not in ("torch", "triton"):
            raise
        raise ImportError(
            f"layernorm.gpu.{name} needs torch and triton ({exc.name} is not installed): "
            "pip install 'layernorm[gpu]'"
        ) from exc
    return getattr(api, name)
