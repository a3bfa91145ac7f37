"""The reference's stateful modules for NumPy networks: :class:`LayerNorm` and :class:`RMSNorm`."""

from __future__ import annotations

import numpy as np

from .._validate import check_eps, check_flag, check_module_input, check_x
from .core import NormCache, OutputCache
from .functions import layer_norm_backward, layer_norm_forward, rms_norm_backward, rms_norm_forward


class _Norm:
    """What the stateful modules share: D, eps, gamma and the cache of the last forward.

    ``gamma`` starts at ones, or at zeros with ``zero_centered_gamma`` (float64, shape (D,));
    both mean scale = 1. With ``memory_efficient`` the cache keeps y, not xhat, and the
    forward's y is read-only.
    """

    def __init__(self, D: int, eps: float, zero_centered_gamma: bool,
                 memory_efficient: bool = False) -> None:
        if isinstance(D, bool) or not isinstance(D, (int, np.integer)):
            raise TypeError(f"D must be an integer, got {type(D).__name__}: {D!r}")
        if D < 1:
            raise ValueError(f"D must be >= 1, got {D}")
        self.D = int(D)
        self.eps = check_eps(eps)
        self.zero_centered_gamma = check_flag(zero_centered_gamma, "zero_centered_gamma")
        self.memory_efficient = check_flag(memory_efficient, "memory_efficient")
        self.gamma = np.zeros(self.D) if self.zero_centered_gamma else np.ones(self.D)
        self.dgamma: np.ndarray | None = None
        self._cache: NormCache | OutputCache | None = None

    def _last_cache(self) -> NormCache | OutputCache:
        if self._cache is None:
            raise RuntimeError(f"{type(self).__name__}.backward called before forward")
        return self._cache

    def __repr__(self) -> str:
        zc = ", zero_centered_gamma=True" if self.zero_centered_gamma else ""
        zc += ", memory_efficient=True" if self.memory_efficient else ""
        return f"{type(self).__name__}(D={self.D}, eps={self.eps}{zc})"


class LayerNorm(_Norm):
    """A stateful layer norm for NumPy networks.

    ``gamma`` starts at ones (zeros with ``zero_centered_gamma``) and ``beta`` at zeros
    (float64, shape (D,)). ``forward`` keeps the cache; ``backward`` returns dx and stores
    ``dgamma`` and ``dbeta``.
    """

    def __init__(self, D: int, eps: float = 1e-5, *, zero_centered_gamma: bool = False,
                 memory_efficient: bool = False) -> None:
        super().__init__(D, eps, zero_centered_gamma, memory_efficient)
        self.beta = np.zeros(self.D)
        self.dbeta: np.ndarray | None = None

    def forward(self, x: np.ndarray) -> np.ndarray:
        """y for x of shape (..., D); keeps the cache for :meth:`backward`."""
        x = check_x(x)
        check_module_input(x, self.D, {"gamma": self.gamma, "beta": self.beta})
        y, self._cache = layer_norm_forward(x, self.gamma, self.beta, self.eps,
                                            zero_centered_gamma=self.zero_centered_gamma,
                                            memory_efficient=self.memory_efficient)
        return y

    __call__ = forward

    def backward(self, dy: np.ndarray) -> np.ndarray:
        """dx for the last :meth:`forward`; sets ``dgamma`` and ``dbeta``."""
        dx, self.dgamma, self.dbeta = layer_norm_backward(dy, self._last_cache())
        return dx


class RMSNorm(_Norm):
    """A stateful RMS norm for NumPy networks.

    ``gamma`` starts at ones (zeros with ``zero_centered_gamma``), float64, shape (D,).
    ``forward`` keeps the cache; ``backward`` returns dx and stores ``dgamma``.
    """

    def __init__(self, D: int, eps: float = 1e-6, *, zero_centered_gamma: bool = False,
                 memory_efficient: bool = False) -> None:
        super().__init__(D, eps, zero_centered_gamma, memory_efficient)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """y for x of shape (..., D); keeps the cache for :meth:`backward`."""
        x = check_x(x)
        check_module_input(x, self.D, {"gamma": self.gamma})
        y, self._cache = rms_norm_forward(x, self.gamma, self.eps,
                                          zero_centered_gamma=self.zero_centered_gamma,
                                          memory_efficient=self.memory_efficient)
        return y

    __call__ = forward

    def backward(self, dy: np.ndarray) -> np.ndarray:
        """dx for the last :meth:`forward`; sets ``dgamma``."""
        dx, self.dgamma = rms_norm_backward(dy, self._last_cache())
        return dx
