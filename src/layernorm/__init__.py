"""layernorm: layer normalization with a hand-derived backward and the tools that prove it.

``import layernorm`` needs NumPy alone; the fused backends live in ``layernorm.cpu``
(numba) and ``layernorm.gpu`` (torch + triton) and are imported only when used.
"""

from .gradcheck import GradcheckError, GradcheckInconclusive, GradcheckReport, check_vjp
from .reference import LayerNorm, LayerNormCache, layer_norm_backward, layer_norm_forward

__version__ = "0.1.0"

__all__ = [
    "GradcheckError",
    "GradcheckInconclusive",
    "GradcheckReport",
    "LayerNorm",
    "LayerNormCache",
    "__version__",
    "check_vjp",
    "layer_norm_backward",
    "layer_norm_forward",
]
