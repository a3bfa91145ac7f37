"""The GPU tests run on CUDA when a device is present, else in Triton's interpreter on CPU tensors.

Triton picks the interpreter when a kernel is decorated, i.e. when layernorm.gpu.kernels is first
imported, so TRITON_INTERPRET is set here, at collection, before the test modules import it.
"""

from __future__ import annotations

import os

try:
    import torch
except ImportError:  # the test modules skip themselves
    torch = None

if torch is not None and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
