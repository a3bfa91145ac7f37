"""Fused CPU kernels for the family of norms: the NumPy API of :mod:`layernorm` with the same
names and signatures, plus ``out=``, computed in one parallel pass over the rows.

The kernels are the C++ engine's (``layernorm/engine/csrc``, the arrays handed over as tensors
on the same memory, which needs torch: the extra ``fast``); where torch or the engine is
missing, ``fallback`` computes the same outputs with the reference's arithmetic, and one warning
says so. ``api`` holds the checked functions, ``module`` the stateful modules, ``statistics``
the per-row statistics' layout; ``dir(layernorm.cpu)`` lists the public API, ``__all__``, only.
docs/cpu-kernels.md explains the design and its measurements.
"""

from .api import (
    CpuNormCache,
    CpuOutputCache,
    add_layer_norm_backward,
    add_layer_norm_forward,
    add_rms_norm_backward,
    add_rms_norm_forward,
    layer_norm_backward,
    layer_norm_forward,
    rms_norm_backward,
    rms_norm_forward,
)
from .module import LayerNorm, RMSNorm
from .statistics import HI, LO, NSTATS, RSTD, SCALE  # noqa: F401 - CpuNormCache.stats' columns

__all__ = [
    "CpuNormCache",
    "CpuOutputCache",
    "LayerNorm",
    "RMSNorm",
    "add_layer_norm_backward",
    "add_layer_norm_forward",
    "add_rms_norm_backward",
    "add_rms_norm_forward",
    "layer_norm_backward",
    "layer_norm_forward",
    "rms_norm_backward",
    "rms_norm_forward",
]


def __dir__() -> list[str]:
    """The public API only; the submodules and the statistics' columns stay reachable as
    attributes (``layernorm.cpu.statistics``, ``layernorm.cpu.NSTATS``) but are not listed."""
    return sorted(__all__)
