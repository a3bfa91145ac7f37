"""layernorm: the normalization family (LayerNorm, RMSNorm, each with the residual add fused in)
with a hand-derived backward and the tools that prove it.

``import layernorm`` needs NumPy alone; the fused backends live in ``layernorm.cpu`` (the
C++ engine, through torch) and ``layernorm.gpu`` (triton), the PyTorch API in
``layernorm.torch`` (torch), each imported only when used.
"""

from .gradcheck import GradcheckError, GradcheckInconclusive, GradcheckReport, check_vjp
from .reference import (
    AddNormCache,
    LayerNorm,
    NormCache,
    RMSNorm,
    add_layer_norm_backward,
    add_layer_norm_forward,
    add_layer_norm_jvp,
    add_rms_norm_backward,
    add_rms_norm_forward,
    add_rms_norm_jvp,
    layer_norm_backward,
    layer_norm_forward,
    layer_norm_jvp,
    layer_norm_quant,
    rms_norm_backward,
    rms_norm_forward,
    rms_norm_jvp,
    rms_norm_quant,
)

__version__ = "0.1.0"

__all__ = [
    "AddNormCache",
    "GradcheckError",
    "GradcheckInconclusive",
    "GradcheckReport",
    "LayerNorm",
    "NormCache",
    "RMSNorm",
    "__version__",
    "add_layer_norm_backward",
    "add_layer_norm_forward",
    "add_layer_norm_jvp",
    "add_rms_norm_backward",
    "add_rms_norm_forward",
    "add_rms_norm_jvp",
    "check_vjp",
    "layer_norm_backward",
    "layer_norm_forward",
    "layer_norm_jvp",
    "layer_norm_quant",
    "rms_norm_backward",
    "rms_norm_forward",
    "rms_norm_jvp",
    "rms_norm_quant",
]
