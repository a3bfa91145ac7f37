"""Fused CPU kernels for the family of norms: the NumPy API of :mod:`layernorm` with the same
names and signatures, plus ``out=``, computed in one parallel pass over the rows.

The kernels are the C++ engine's (``layernorm/torch/csrc``, the arrays handed over as tensors
on the same memory); where torch or the engine is missing, the Numba kernels of ``kernels``.
``api`` holds the checked functions, ``module`` the stateful modules; ``dir(layernorm.cpu)``
lists the public API, ``__all__``, only. docs/cpu-kernels.md
explains the design and its measurements.
"""

try:
    import numba  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without numba
    raise ImportError(
        "layernorm.cpu needs numba: from a checkout, pip install -e '.[fast]' "
        "(make test installs it)"
    ) from exc

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
from .kernels import HI, LO, NSTATS, RSTD, SCALE, n_chunks  # noqa: F401 - CpuNormCache.stats' columns
from .module import LayerNorm, RMSNorm

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
    """The public API only; numba, the submodules and the kernels' constants stay reachable
    as attributes (``layernorm.cpu.kernels``, ``layernorm.cpu.NSTATS``) but are not listed."""
    return sorted(__all__)
