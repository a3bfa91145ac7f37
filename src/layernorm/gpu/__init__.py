"""The Triton kernels of the family (:mod:`layernorm.gpu.kernels`, which names those of
:mod:`layernorm.gpu.forward` and :mod:`layernorm.gpu.backward`) and their launchers
(:mod:`layernorm.gpu.launch`), which :mod:`layernorm.torch` runs on CUDA tensors.

    from layernorm.gpu import layer_norm, LayerNorm      # aliases of layernorm.torch's

The public PyTorch API is :mod:`layernorm.torch` (CPU and CUDA tensors); the names here are
aliases of its own, kept so code written against ``layernorm.gpu`` keeps working. Needs torch
(and triton for CUDA). The names are imported on first use, so that ``layernorm.bench.gpu``
(results and report section) works on machines without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LayerNorm", "RMSNorm", "add_layer_norm", "add_rms_norm", "layer_norm", "rms_norm"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'layernorm.gpu' has no attribute {name!r}")
    import layernorm.torch

    return getattr(layernorm.torch, name)
