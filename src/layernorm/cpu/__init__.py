"""Fused CPU kernels for the family of norms (Numba): the NumPy API of :mod:`layernorm` with
the same names and signatures, plus ``out=``, computed in one parallel pass over the rows.

``kernels`` holds the Numba code, ``api`` the checked functions, ``module`` the stateful
modules. docs/cpu-kernels.md explains the design and its measurements.
"""

try:
    import numba  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without numba
    raise ImportError(
        "layernorm.cpu needs numba: install the package's `fast` extra (make test does)"
    ) from exc

from .api import (
    CpuNormCache,
    add_layer_norm_backward,
    add_layer_norm_forward,
    add_rms_norm_backward,
    add_rms_norm_forward,
    layer_norm_backward,
    layer_norm_forward,
    rms_norm_backward,
    rms_norm_forward,
)
from .kernels import HI, LO, NSTATS, RSTD, SCALE, n_chunks
from .module import LayerNorm, RMSNorm

__all__ = [
    "HI",
    "LO",
    "NSTATS",
    "RSTD",
    "SCALE",
    "CpuNormCache",
    "LayerNorm",
    "RMSNorm",
    "add_layer_norm_backward",
    "add_layer_norm_forward",
    "add_rms_norm_backward",
    "add_rms_norm_forward",
    "layer_norm_backward",
    "layer_norm_forward",
    "n_chunks",
    "rms_norm_backward",
    "rms_norm_forward",
]
