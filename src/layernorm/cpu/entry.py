"""The kernels' entry points as C functions, and the split of their rows over threads.

:func:`forward_rows`, :func:`backward_chunks`, :func:`backward_y_chunks` (the
memory-efficient backward, from y) and :func:`reduce_chunks` of :mod:`.kernels` are compiled
as C functions (Numba ``cfunc``) of raw pointers and sizes, one per combination of storage
types, on first use and cached on disk. Two callers share the same machine code:

* the NumPy API (:mod:`.api`) and the PyTorch API without its C++ operator call them through
  ctypes, which releases the GIL, on the calling thread or split over a small thread pool
  (:func:`run`);
* the C++ operator of :mod:`layernorm.torch` calls them by address (:func:`address`) inside
  ``at::parallel_for``, on torch's own threads.

Neither runs Numba's parallel layer, so nothing here is unsafe after ``fork`` and two Python
threads may call at once.

The storage types: float32 and float64 as themselves, float16 as its bits (``u16``) and bfloat16
as its bits (``i16``). A compiled kernel is named by its kind and the storage type of each
role, e.g. ``forward x=f32 r=f32 h=f32 t=f32 a=f32`` (:func:`forward_key`,
:func:`backward_key`, :func:`backward_y_key`); the C++ operator asks for one with the dtypes of
its tensors (:func:`resolve`).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from numba import cfunc, types

from . import kernels

__all__ = ["address", "backward_key", "backward_y_key", "ctypes_fn", "forward_key", "pointer",
           "resolve", "run", "split"]

# storage code -> the Numba type of the stored values
_TYPES = {
    "f32": types.float32,
    "f64": types.float64,
    "u16": types.uint16,  # float16 bits
    "i16": types.int16,  # bfloat16 bits
}
# dtype name -> storage code; the half dtypes by their own names or their bits' names
_CODES = {"float32": "f32", "float64": "f64", "float16": "u16", "bfloat16": "i16",
          "uint16": "u16", "int16": "i16"}

# the storage types each entry point is compiled for, by role, in order
ROLES = {
    "forward": ("x", "r", "h", "t", "a", "g", "b"),
    "backward": ("x", "dy", "dh", "dx", "dr", "t", "a"),
    "backward_y": ("y", "dy", "dh", "dx", "dr", "t", "a"),
    "reduce": (),
}

_P = types.CPointer
_I = types.int64


def forward_key(x: str, r: str | None, h: str | None, t: str, a: str, g: str | None = None,
                b: str | None = None) -> str:
    """The name of the forward compiled for these dtypes (names such as 'bfloat16'): x's, the
    residual's and h's (None for a plain norm), the compute dtype t, the add's a, and gamma's
    and beta's as stored (None: absent, or already in t)."""
    return _key("forward", x=x, r=r or x, h=h or x, t=t, a=a, g=g or t, b=b or t)


def backward_key(x: str, dy: str, dh: str | None, dx: str, dr: str | None, t: str,
                 a: str) -> str:
    """The name of the backward compiled for these dtypes: the normalized input's (x, or h of
    an add-norm), dy's, dh's and dresidual's (None where absent), dx's, t and a. An absent
    dh or dresidual is named as the common present one, so one compiled kernel serves both."""
    return _key("backward", x=x, dy=dy, dh=dh or (x if a == t else a), dx=dx, dr=dr or dx,
                t=t, a=a)


def backward_y_key(y: str, dy: str, dh: str | None, dx: str, dr: str | None, t: str,
                   a: str) -> str:
    """The name of the memory-efficient backward (from y) compiled for these dtypes: y's (x's
    dtype), dy's, dh's and dresidual's (None where absent), dx's, t and a, as for
    :func:`backward_key`; an absent dh is named as dy when the add computes in t (dy is stored
    in a dtype that computes in t), else as a."""
    return _key("backward_y", y=y, dy=dy, dh=dh or (dy if a == t else a), dx=dx, dr=dr or dx,
                t=t, a=a)


def _key(kind: str, **names: str) -> str:
    return " ".join([kind, *(f"{role}={_CODES[names[role]]}" for role in ROLES[kind])])


def resolve(request: str) -> int:
    """The address of the entry point a request names: 'forward', 'backward', 'backward_y' or
    'reduce', then role=dtype-name pairs in any order, 'none' for an absent array. How the C++
    operator asks."""
    kind, *rest = request.split()
    names = {role: (None if name == "none" else name)
             for role, name in (part.split("=") for part in rest)}
    if kind == "forward":
        return address(forward_key(**names))
    if kind == "backward":
        return address(backward_key(**names))
    if kind == "backward_y":
        return address(backward_y_key(**names))
    return address("reduce")


def _signature(kind: str, codes: dict[str, str]):
    t = {role: _TYPES[code] for role, code in codes.items()}
    if kind == "forward":
        return types.void(_P(t["x"]), _P(t["r"]), _P(t["h"]), _P(t["x"]), _P(t["a"]), _P(t["t"]),
                          _P(t["g"]), _P(t["b"]), types.float64, _I, _P(types.float64),
                          _P(types.uint64), _I, _I, _I, _I, _I, _I, _I, _I, _I)
    if kind == "backward":
        return types.void(_P(t["x"]), _P(t["dy"]), _P(t["dh"]), _P(t["dx"]), _P(t["dr"]),
                          _P(t["a"]), _P(t["t"]), _P(types.float64), _P(types.uint64), _I,
                          _P(types.float64), _P(types.boolean), _I, _I, _I, _I, _I, _I, _I, _I)
    if kind == "backward_y":
        # y, dy, dh, dx, dr, a, scale, shift, keep, kept, rows, xrows, stats, flags, partial,
        # m, d, dhc, drc, k, r, c, c0, c1
        return types.void(_P(t["y"]), _P(t["dy"]), _P(t["dh"]), _P(t["dx"]), _P(t["dr"]),
                          _P(t["a"]), _P(t["t"]), _P(t["t"]), _P(types.int64), _P(t["t"]),
                          _P(types.int64), _P(t["t"]), _P(types.float64), _I,
                          _P(types.float64), _I, _I, _I, _I, _I, _I, _I, _I, _I)
    return types.void(_P(types.float64), _P(types.float64), _I, _I)


# the wrappers live in kernels.py: Numba's disk cache of a function is invalidated by changes
# to its own file only, so wrappers elsewhere would keep compiled copies of old kernels
_PY = {"forward": kernels.forward_c, "backward": kernels.backward_c,
       "backward_y": kernels.backward_y_c, "reduce": kernels.reduce_c}
_compiled: dict[str, object] = {}
_compile_lock = threading.Lock()


def compiled(key: str):
    """The compiled entry point named ``key`` (see :func:`forward_key`): a Numba ``CFunc``,
    compiled on first use in this process (from the disk cache after the first time)."""
    fn = _compiled.get(key)
    if fn is None:
        kind, *rest = key.split()
        codes = dict(part.split("=") for part in rest)
        if kind not in ROLES or set(codes) != set(ROLES[kind]) or not set(
                codes.values()) <= set(_TYPES):
            raise ValueError(f"no CPU kernel is named {key!r}")
        with _compile_lock:
            fn = _compiled.get(key)
            if fn is None:
                fn = cfunc(_signature(kind, codes), cache=True)(_PY[kind])
                _compiled[key] = fn
    return fn


def address(key: str) -> int:
    """The machine address of the entry point named ``key``: what the C++ operator calls."""
    return compiled(key).address


# --- the rows over threads ----------------------------------------------------------------

# Work below this many elements runs on the calling thread. Through this module's pool (the
# NumPy API) a second thread costs tens of microseconds, a row of 4096 float32 about half a
# microsecond of arithmetic; torch's OpenMP threads, which the C++ operator uses, are woken in
# a few microseconds (eight rows of 4096 took 8.5 us split over 2 threads, 9.8 us on one).
SERIAL_ELEMENTS = 1 << 18
OPENMP_SERIAL_ELEMENTS = 1 << 14

_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pool_lock = threading.Lock()


def _after_fork() -> None:  # a lock held by another thread at fork stays held in the child
    global _pool_lock, _compile_lock
    _pool_lock, _compile_lock = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def _executor() -> ThreadPoolExecutor:
    """This process's pool (a forked child makes its own: the parent's threads are not in it)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1),
                                       thread_name_prefix="layernorm")
            _pool_pid = os.getpid()
        return _pool


def split(n: int, elements: int, threads: int) -> list[tuple[int, int]]:
    """[0, n) as contiguous ranges, one per thread used: at most ``threads``, and one when the
    call's ``elements`` are too few to pay for waking another."""
    k = max(1, min(threads, n, elements // SERIAL_ELEMENTS))
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def run(fn: Callable[..., None], args: Sequence[object], n: int, elements: int,
        threads: int) -> None:
    """Call ``fn(*args, lo, hi)`` over ranges covering [0, n): on the calling thread, or on up
    to ``threads`` threads (the calling thread one of them). ``fn`` is a ctypes function that
    releases the GIL, so the ranges run at once."""
    parts = split(n, elements, threads)
    futures: list[Future] = [_executor().submit(fn, *args, lo, hi) for lo, hi in parts[1:]]
    try:
        fn(*args, *parts[0])
    finally:  # the other parts write the caller's arrays: never return before they are done
        for f in futures:
            f.result()


def pointer(a: np.ndarray) -> int:
    """The address of ``a``'s memory, 0 for an empty array (the kernels index no element of
    one)."""
    return a.ctypes.data if a.size else 0


_CTYPES = {types.int64: ctypes.c_int64, types.float64: ctypes.c_double,
           types.float32: ctypes.c_float}
_callers: dict[str, Callable[..., None]] = {}


def ctypes_fn(key: str) -> Callable[..., None]:
    """The entry point named ``key`` as a ctypes function taking addresses as ints (ctypes
    releases the GIL around the call)."""
    fn = _callers.get(key)
    if fn is None:
        cf = compiled(key)
        args = [ctypes.c_void_p if isinstance(a, types.CPointer) else _CTYPES[a]
                for a in cf._sig.args]
        fn = _callers[key] = ctypes.CFUNCTYPE(None, *args)(cf.address)
    return fn


