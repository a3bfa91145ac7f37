"""The bandwidth yardstick: a copy with Numba's threads, which every timed pass is compared with.

A pass's quality is its GB/s on minimal bytes over the GB/s of this copy of an array of the
same size, with the same threads, in the same run (counting read and write). The bits move as
unsigned integers of the item's width, so one compiled kernel serves every dtype of a size.
"""

from __future__ import annotations

import numpy as np

try:
    from numba import njit, prange
except ImportError as exc:  # pragma: no cover - exercised only without numba
    raise ImportError(
        "layernorm.bench.yardstick needs numba: install the `fast` extra from a checkout, "
        "pip install -e '.[fast]'"
    ) from exc

__all__ = ["copy"]


@njit(parallel=True, cache=True)
def _copy_kernel(src, dst):
    M = src.shape[0]
    for i in prange(M):
        s = src[i]  # (D,)
        d = dst[i]  # (D,)
        for j in range(s.shape[0]):
            d[j] = s[j]


def copy(src: np.ndarray, dst: np.ndarray) -> None:
    """dst[...] = src with Numba's threads: the yardstick for memory bandwidth.

    Args:
        src, dst: C-contiguous arrays of one shape and dtype (any number of axes).
    """
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"src and dst must match: {src.shape} {src.dtype} vs {dst.shape} "
                         f"{dst.dtype}")
    if not (src.flags.c_contiguous and dst.flags.c_contiguous):
        raise ValueError("src and dst must be C-contiguous")
    # One kernel per item size: the bits move as unsigned integers of the same width.
    bits = np.dtype(f"u{src.itemsize}")
    d = src.shape[-1] if src.ndim else 1
    view = src.reshape(-1, d).view(bits)  # (M, D)
    _copy_kernel(view, dst.reshape(view.shape).view(bits))
