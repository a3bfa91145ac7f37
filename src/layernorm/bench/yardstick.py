"""The bandwidth yardstick: a copy on torch's threads, which every timed pass is compared with.

A pass's quality is its GB/s on minimal bytes over the GB/s of this copy of an array of the
same size, with the same threads, timed in the same rounds (:mod:`layernorm.bench.harness`),
counting read and write.

The copy is the CPU engine's (``layernorm_cpu::copy_into``, csrc/forward.cpp): parallel over
blocks of BLOCK items of the flattened array, not over rows, so that it uses every thread
whatever the number of rows (a row-parallel copy of one long row would run on one thread). Its
stores are ordinary ones, as the kernels' are: each written cache line is first read
(write-allocate), so copy and kernels pay for their writes alike (a ``memcpy`` of a large
block may bypass the cache, which no kernel here does). The bits move as unsigned integers of
the item's width, so one loop serves every dtype of a size. ``python tools/copy_yardsticks.py``
times it beside the other copies a machine has (docs/cpu-kernels.md).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

try:
    import torch

    from ..torch import _ops
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "layernorm.bench.yardstick needs torch and the CPU engine: install the `torch` extra "
        "from a checkout, pip install -e '.[torch]'"
    ) from exc
if not _ops.NATIVE:  # pragma: no cover - exercised only without a compiler
    raise ImportError("layernorm.bench.yardstick needs the CPU engine, which is not built here")

__all__ = ["BLOCK", "copier", "copy"]

BLOCK = 1 << 14  # items per parallel block (engine::kCopyBlock): 64 KiB of float32


def copier(src: np.ndarray, dst: np.ndarray) -> Callable[[], None]:
    """A call that does dst[...] = src with torch's threads: the yardstick for memory
    bandwidth, its arguments checked and wrapped once, so that a timed call is the copy and
    the operator's dispatch alone.

    Args:
        src, dst: C-contiguous arrays of one shape and dtype (any number of axes).
    """
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"src and dst must match: {src.shape} {src.dtype} vs {dst.shape} "
                         f"{dst.dtype}")
    if not (src.flags.c_contiguous and dst.flags.c_contiguous):
        raise ValueError("src and dst must be C-contiguous")
    bits = np.dtype(f"u{src.itemsize}")
    s = torch.from_numpy(src.reshape(-1).view(bits))  # (n,)
    d = torch.from_numpy(dst.reshape(-1).view(bits))
    op = torch.ops.layernorm_cpu.copy_into.default
    return lambda: op(s, d)


def copy(src: np.ndarray, dst: np.ndarray) -> None:
    """dst[...] = src with torch's threads (:func:`copier`)."""
    copier(src, dst)()
