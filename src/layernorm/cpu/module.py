"""Stateful fused modules: :class:`layernorm.LayerNorm` and :class:`layernorm.RMSNorm` on the
fused CPU kernels.

Each call returns fresh arrays, as the reference modules do. ``reuse_buffers=True`` opts in to
writing y and dx into the module's own buffers, overwritten by the next call: faster for
outputs over about 32 MB (a fresh one is page-faulted on every call), and safe only where
nothing keeps a previous output (docs/cpu-kernels.md).

``memory_efficient=True`` keeps y (read-only) instead of x, as the reference modules do
(:class:`layernorm.cpu.CpuOutputCache`). With it, y is fresh on every call even with
``reuse_buffers=True``: the cache reads y in the backward, and the next layer keeps it as its
input, so no later forward may write over it; dx still goes to the module's buffer.
"""

from __future__ import annotations

import numpy as np

from .. import reference
from .._validate import as_float_array, check_module_input, check_x, overlaps
from ..family import NORMS
from .api import _BACKWARD, _FORWARD, CpuOutputCache

__all__ = ["LayerNorm", "RMSNorm"]


class _Fused:
    """The fused forward/backward of a reference module, with optional buffer reuse."""

    norm: str
    _cache: object

    def _setup(self, reuse_buffers: bool) -> None:
        if not isinstance(reuse_buffers, bool):
            raise TypeError(f"reuse_buffers must be True or False, got {reuse_buffers!r}")
        self.reuse_buffers = reuse_buffers
        self._buffers: dict[str, np.ndarray] = {}

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: np.dtype,
                avoid: tuple[object, ...]) -> np.ndarray | None:
        """The buffer ``name`` when reusing buffers (reallocated when its shape or dtype
        changes or it overlaps an array or Region in ``avoid``), else None: a fresh output."""
        if not self.reuse_buffers:
            return None
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype or overlaps(buf, avoid):
            buf = self._buffers[name] = np.empty(shape, dtype)
        return buf

    def _params(self) -> dict[str, np.ndarray]:
        if NORMS[self.norm].centred:
            return {"gamma": self.gamma, "beta": self.beta}
        return {"gamma": self.gamma}

    def forward(self, x: np.ndarray) -> np.ndarray:
        """y for x of shape (..., D); keeps the cache for :meth:`backward`."""
        x = check_x(x)
        params = self._params()
        check_module_input(x, self.D, params)
        # memory-efficient: y is the cache's, never a reused buffer (module docstring)
        out = None if self.memory_efficient else self._buffer("y", x.shape, x.dtype, (x,))
        y, self._cache = _FORWARD[self.norm](x, *params.values(), self.eps,
                                             zero_centered_gamma=self.zero_centered_gamma,
                                             out=out, memory_efficient=self.memory_efficient)
        return y

    __call__ = forward

    def backward(self, dy: np.ndarray) -> np.ndarray:
        """dx for the last :meth:`forward`; sets the parameters' gradients."""
        if self._cache is None:
            raise RuntimeError(f"{type(self).__name__}.backward called before forward")
        cache = self._cache
        dy = as_float_array(dy, "dy")
        kept = cache.y if isinstance(cache, CpuOutputCache) else cache.x  # what it reads
        out = self._buffer("dx", cache.x_shape, cache.x_dtype, (dy, kept, *cache.inputs))
        dx, *grads = _BACKWARD[self.norm](dy, cache, out=out)
        self.dgamma = grads[0]
        if NORMS[self.norm].centred:
            self.dbeta = grads[1]
        return dx

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, fused CPU)"


class LayerNorm(_Fused, reference.LayerNorm):
    """:class:`layernorm.LayerNorm` on the fused kernels (``reuse_buffers`` and
    ``memory_efficient``: module docstring).

    The cache refers to x: the backward raises ValueError if x changed since the forward
    (memory-efficient: it keeps y, read-only, instead).
    """

    norm = "layer_norm"

    def __init__(self, D: int, eps: float = 1e-5, *, zero_centered_gamma: bool = False,
                 memory_efficient: bool = False, reuse_buffers: bool = False) -> None:
        super().__init__(D, eps, zero_centered_gamma=zero_centered_gamma,
                         memory_efficient=memory_efficient)
        self._setup(reuse_buffers)


class RMSNorm(_Fused, reference.RMSNorm):
    """:class:`layernorm.RMSNorm` on the fused kernels (``reuse_buffers`` and
    ``memory_efficient``: module docstring).

    The cache refers to x: the backward raises ValueError if x changed since the forward
    (memory-efficient: it keeps y, read-only, instead).
    """

    norm = "rms_norm"

    def __init__(self, D: int, eps: float = 1e-6, *, zero_centered_gamma: bool = False,
                 memory_efficient: bool = False, reuse_buffers: bool = False) -> None:
        super().__init__(D, eps, zero_centered_gamma=zero_centered_gamma,
                         memory_efficient=memory_efficient)
        self._setup(reuse_buffers)
