"""Outputs of the NumPy API from memory that earlier outputs' owners have freed.

A fresh large array costs its first touch: the operating system faults in and zeroes every
page as the kernel writes it, which took longer than the kernel itself (an add-norm's forward
without ``out=`` 3.5-28 ms where the same call with ``out=`` took 0.3-1.5 ms). So a large output
(:data:`MIN_BYTES` and more) is a view of a block from a pool: when the last array on a block
is gone, the block goes back to the pool (up to :data:`CAP_BYTES` held), and the next output
of its size reuses it, pages already present. A block is never handed out while any array on
it lives. New blocks are private anonymous memory (a forked child gets its own copy, as of
any other memory) advised to use huge pages.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import warnings
import weakref

import numpy as np

__all__ = ["CAP_BYTES", "MIN_BYTES", "empty", "held_bytes", "pool_cap"]

MIN_BYTES = 1 << 20
_BLOCK = 2 << 20  # block sizes are whole huge pages


def pool_cap() -> int:
    """The most bytes of freed outputs a pool keeps (this one, and the C++ operator's of
    ``layernorm.torch``): ``LAYERNORM_POOL_MB`` MiB (0 turns the pools off), else an eighth of
    the machine's memory, at most 1 GiB. A value that is not a whole number is reported in one
    warning and the default is used."""
    value = os.environ.get("LAYERNORM_POOL_MB")
    if value is not None:
        if value.strip().isdigit():
            return int(value) << 20
        warnings.warn(f"LAYERNORM_POOL_MB must be a whole number of MiB, got {value!r}: the "
                      f"default is used", RuntimeWarning, stacklevel=2)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 8 << 30
    return min(1 << 30, memory // 8)


CAP_BYTES = pool_cap()

_free: dict[int, list[mmap.mmap]] = {}
_held = 0
# reentrant: a finalizer that returns a block can run inside this module's own allocations,
# on the thread that holds the lock (a garbage collection started there)
_lock = threading.RLock()


def _after_fork() -> None:  # a lock held by another thread at fork stays held in the child
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork)


def _give_back(n: int, block: mmap.mmap) -> None:
    global _held
    with _lock:
        if _held + n <= CAP_BYTES:
            _free.setdefault(n, []).append(block)
            _held += n
    # else the block is dropped: it is unmapped once the last array's buffer is released


def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A new C-contiguous array, as ``np.empty``: from the pool when large."""
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < MIN_BYTES or CAP_BYTES == 0:
        return np.empty(shape, dtype)
    n = -(-nbytes // _BLOCK) * _BLOCK
    global _held
    with _lock:
        blocks = _free.get(n)
        block = blocks.pop() if blocks else None
        if block is not None:
            _held -= n
    if block is None:
        block = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            block.madvise(mmap.MADV_HUGEPAGE)
    owner = np.frombuffer(block, dtype, count=count)  # every view of it keeps it alive
    weakref.finalize(owner, _give_back, n, block)
    return owner.reshape(shape)


def held_bytes() -> int:
    """Bytes of freed blocks the pool holds now."""
    with _lock:
        return _held
