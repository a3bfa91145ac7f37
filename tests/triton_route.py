"""The CUDA code path on a machine without a GPU: the ops' CPU tensors through the Triton
launchers, in Triton's interpreter (TRITON_INTERPRET=1 set before triton is first imported).

A test helper, not part of the package: for the duration of :func:`triton_on_cpu` the Triton
functions are registered as the ops' CPU kernels, and the forwards' fake implementations give
the CUDA layout of the statistics, over the usual ones; leaving restores both.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from layernorm.torch import _ops


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Run the ops' CPU tensors through the Triton kernels in Triton's interpreter."""
    from layernorm.gpu import kernels

    if not kernels.INTERPRET:
        raise RuntimeError("triton_on_cpu needs TRITON_INTERPRET=1 set before triton is imported")
    lib = torch.library.Library("layernorm", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid")
        for name, fn in _ops.triton_kernels:
            lib.impl(name, fn, "CPU", allow_override=True)
        torch.library.register_fake(
            "layernorm::fwd", lambda x, residual, w, b, eps, c, z, h_dtype:
            _ops.fwd_shapes(x, residual, h_dtype, True), lib=lib, allow_override=True)
        torch.library.register_fake(
            "layernorm::fwd_y", lambda x, residual, w, b, eps, c, z, h_dtype:
            _ops.fwd_y_shapes(x, residual, h_dtype, True), lib=lib,
            allow_override=True)
    try:
        yield
    finally:
        lib._destroy()
