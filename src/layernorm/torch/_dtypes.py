"""The compute-dtype rule for torch dtypes, read from the one dtype table
(:data:`layernorm.dtypes.DTYPES`): half inputs compute in float32, float32 in float32, float64
in float64; several inputs (an add-norm's x, residual and h) in the widest of theirs."""

from __future__ import annotations

import torch

from ..dtypes import DTYPES

__all__ = ["compute_dtype"]

# the dtypes that compute in float64 (the others compute in float32)
_WIDE = tuple(getattr(torch, d.torch) for d in DTYPES.values() if d.compute == "float64")


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The widest compute dtype of ``dtypes``: where every backend's kernels compute, and the
    dtype of their statistics. Plain comparisons, so that torch.compile traces through it."""
    for d in dtypes:
        if d in _WIDE:
            return torch.float64
    return torch.float32
