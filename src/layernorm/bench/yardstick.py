"""The bandwidth yardstick: a copy with Numba's threads, which every timed pass is compared with.

A pass's quality is its GB/s on minimal bytes over the GB/s of this copy of an array of the
same size, with the same threads, timed in the same rounds (:mod:`layernorm.bench.harness`),
counting read and write.

The copy is parallel over blocks of BLOCK items of the flattened array, not over rows, so that
it uses every thread whatever the number of rows (a row-parallel copy of one long row would run
on one thread). Its stores are ordinary ones, as the kernels' are: each written cache line is
first read (write-allocate), so copy and kernels pay for their writes alike. The bits move as
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

__all__ = ["BLOCK", "copy"]

BLOCK = 1 << 14  # items per parallel block: 64 KiB of float32, far above a thread's start-up


@njit(parallel=True, cache=True)
def _copy_kernel(src, dst):
    """dst[:] = src[:] for 1-D arrays of n items, in ceil(n / BLOCK) blocks over the threads."""
    n = src.shape[0]
    for b in prange((n + BLOCK - 1) // BLOCK):
        s = src[b * BLOCK:min((b + 1) * BLOCK, n)]  # (BLOCK,) or the shorter last block
        d = dst[b * BLOCK:min((b + 1) * BLOCK, n)]
        for j in range(s.shape[0]):  # from 0: no negative-index check, so LLVM vectorizes it
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
    bits = np.dtype(f"u{src.itemsize}")
    _copy_kernel(src.reshape(-1).view(bits), dst.reshape(-1).view(bits))  # (n,)
