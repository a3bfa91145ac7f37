"""Argument checks and the dtype policy shared by every backend.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind,
wrong value) with a message that names the argument and what was wrong. Nothing here
modifies its input.
"""

from __future__ import annotations

import functools
import math
import mmap
import numbers
import weakref
from collections.abc import Callable

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # NumPy < 2
    from numpy import byte_bounds

from .dtypes import NAMES, resolve

__all__ = [
    "Region",
    "as_float_array",
    "check_dtype",
    "check_dy",
    "check_eps",
    "check_flag",
    "check_module_input",
    "check_out",
    "check_param",
    "check_shape",
    "check_x",
    "is_float_dtype",
    "overlaps",
    "parse_shape",
    "region",
    "shape_extents",
]


@functools.cache  # dtype.name is formed anew on each access (microseconds)
def is_float_dtype(dtype: np.dtype) -> bool:
    """True for the dtypes layernorm computes with: float16, bfloat16, float32, float64."""
    return dtype.name in NAMES


def as_float_array(a: object, name: str) -> np.ndarray:
    """``a`` as a plain ndarray of a supported floating dtype in native byte order, without
    copying a native ndarray.

    Masked arrays and matrices are refused rather than silently reinterpreted; other
    ndarray subclasses are viewed as plain arrays.
    """
    if isinstance(a, (np.ma.MaskedArray, np.matrix)):
        raise TypeError(f"{name} must be a plain array, got {type(a).__name__} (not supported)")
    try:
        arr = np.asarray(a)
    except Exception as exc:  # e.g. ragged nested lists
        raise TypeError(f"{name} must be array-like, got {type(a).__name__}: {exc}") from None
    if not is_float_dtype(arr.dtype):
        raise TypeError(
            f"{name} must have a floating dtype ({', '.join(NAMES)}), "
            f"got dtype {arr.dtype}"
        )
    if not arr.dtype.isnative:  # e.g. '>f4' read from a file: compute on a native copy
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return arr


def shape_extents(dims: object, shown: object = None) -> tuple[int, ...]:
    """``dims`` once it is a shape as every command takes one: a tuple or list of at least two
    positive integer extents, the rows M (the product of the leading extents) and the
    normalized length D. ValueError naming ``shown`` (default ``dims``) otherwise."""
    shown = dims if shown is None else shown
    if not (isinstance(dims, (tuple, list))
            and all(isinstance(d, int) and not isinstance(d, bool) for d in dims)):
        raise ValueError(f"shape must be a tuple of integer extents, got {shown!r}")
    if len(dims) < 2:
        raise ValueError(f"shape needs at least two positive extents, the rows and the row "
                         f"length (like 4096x1024 or 8x512x768), got {shown!r}")
    if min(dims) < 1:
        raise ValueError(f"shape extents must be >= 1, got {shown!r}")
    return tuple(dims)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"4096x1024"`` or ``"8x512x768"`` -> its extents (:func:`shape_extents`), the one rule
    for a shape given as text: sizes joined by ``x``. ValueError naming the problem."""
    parts = text.strip().lower().split("x")
    if not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"shape must be sizes joined by 'x', like 4096x1024, got {text!r}")
    return shape_extents(tuple(int(p) for p in parts), text)


def check_x(x: object) -> np.ndarray:
    """``x`` as a floating array with at least one axis and a non-empty last axis."""
    x = as_float_array(x, "x")
    if x.ndim == 0:
        raise ValueError("x must have at least one axis (the normalized axis D), got a scalar")
    if x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last axis (D >= 1), got shape {x.shape}")
    return x


def check_dy(dy: object, cache: object, cache_type: type | tuple[type, ...],
             producer: str) -> np.ndarray:
    """``dy`` as a floating array of the forward's shape, once ``cache`` is a ``cache_type``
    (or one of several)."""
    if not isinstance(cache, cache_type):
        types = cache_type if isinstance(cache_type, tuple) else (cache_type,)
        raise TypeError(
            f"cache must be the {' or '.join(t.__name__ for t in types)} returned by "
            f"{producer}, got {type(cache).__name__}"
        )
    dy = as_float_array(dy, "dy")
    if dy.shape != cache.x_shape:
        raise ValueError(
            f"dy must have the shape of the forward's x and y, {cache.x_shape}; got {dy.shape} "
            f"(is this cache from another call?)"
        )
    return dy


def check_eps(eps: object) -> float:
    """``eps`` as a Python float, or an error if it is not a finite number >= 0.

    The one eps rule of every API, torch's own: eps = 0 is allowed (a constant row then has
    var + eps = 0 and gives NaN on the CPU, as torch's norms do; the CUDA kernels give y = beta
    there, docs/gpu-fusion.md), and so is an eps that the compute dtype rounds to 0 or to inf
    (it is added as that dtype's value of it, in every CPU backend alike).
    """
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}: {eps!r}")
    value = float(eps)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"eps must be a finite number >= 0, got {value!r}")
    return value


def check_param(p: object, name: str, d: int) -> np.ndarray | None:
    """``gamma``/``beta``: None, or a floating array of shape (d,)."""
    if p is None:
        return None
    arr = as_float_array(p, name)
    if arr.shape != (d,):
        raise ValueError(
            f"{name} must have shape ({d},) to match the last axis of x, got shape {arr.shape}"
        )
    return arr


def check_module_input(x: np.ndarray, d: int, params: dict[str, object]) -> None:
    """For a module of size ``d``: each of its parameters (name -> array, or None) of shape
    (d,), and x (already through :func:`check_x`) with a last axis of d.

    Checked before the functions' own checks, which know x but not the module: they would
    blame a right parameter for a wrong x, and beta for a gamma that matches a wrong x.
    """
    for name, p in params.items():
        if p is None:
            continue
        shape = p.shape if isinstance(p, np.ndarray) else as_float_array(p, name).shape
        if shape != (d,):
            raise ValueError(f"{name} must have shape ({d},), the module's D, got shape {shape}")
    if x.shape[-1] != d:
        raise ValueError(f"x must have a last axis of {d}, the module's D, got shape {x.shape}")


def check_shape(a: object, name: str, shape: tuple[int, ...], of: str) -> np.ndarray:
    """``a`` (``residual``, ``dh``) as a floating array of ``shape``, the shape of ``of``."""
    arr = as_float_array(a, name)
    if arr.shape != shape:
        raise ValueError(f"{name} must have the shape of {of}, {shape}; got {arr.shape}")
    return arr


def check_flag(value: object, name: str) -> bool:
    """``value`` as a bool; only True and False (NumPy's included) are accepted."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}: {value!r}")
    return bool(value)


def check_dtype(value: object, name: str, default: np.dtype) -> np.dtype:
    """``value`` (None for ``default``, a dtype name, or a NumPy dtype or scalar type) as one of
    the supported floating dtypes."""
    if value is None:
        return np.dtype(default)
    if isinstance(value, str):
        if value not in NAMES:
            raise ValueError(f"{name} must be one of {', '.join(NAMES)}, got {value!r}")
        return resolve(value)
    if not isinstance(value, (np.dtype, type)):
        raise TypeError(f"{name} must be None, a dtype name or a NumPy dtype, "
                        f"got {type(value).__name__}: {value!r}")
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise TypeError(f"{name} must be None, a dtype name or a NumPy dtype, got {value!r}") \
            from None
    if not is_float_dtype(dtype):
        raise ValueError(f"{name} must be one of {', '.join(NAMES)}, got dtype {dtype}")
    return dtype if dtype.isnative else dtype.newbyteorder("=")


class Region:
    """A caller's array, remembered without keeping it alive.

    Memory NumPy owns (the package's pooled outputs included, whose block returns to the pool
    when the array owning it dies) is followed with weak references: the array itself while
    the caller holds it, else the array that owns its memory while that lives (all of that
    memory: a conservative stand-in for the part the caller passed), else nothing. Foreign
    memory (a torch tensor's, a buffer's, seen through ``np.asarray``) is remembered as its byte
    span for good: its owner may be an alias of the caller's object, so nothing says when the
    memory is freed, and an ``out=`` on memory reused since is refused rather than an overlap
    missed. Only a backward with ``out=`` reads a Region.
    """

    __slots__ = ("_owner", "_span", "_view")

    def __init__(self, view: Callable[[], object], owner: Callable[[], object],
                 span: tuple[int, int] | None = None) -> None:
        self._view, self._owner, self._span = view, owner, span

    def overlaps(self, a: np.ndarray) -> bool:
        """Whether ``a`` may share memory with the caller's array, while that memory lives."""
        if self._span is not None:
            if self._owner() is None or a.size == 0:
                return False
            start, stop = byte_bounds(a)
            return start < self._span[1] and self._span[0] < stop
        arr = self._view()
        arr = arr if arr is not None else self._owner()
        return arr is not None and np.may_share_memory(a, arr)


def _always() -> bool:
    return True


def region(a: object) -> Region | None:
    """The :class:`Region` of ``a``, or None when ``a`` is not a non-empty ndarray."""
    if not isinstance(a, np.ndarray) or a.size == 0:
        return None
    owner = a
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    if owner.base is None or isinstance(owner.base, mmap.mmap):  # NumPy's, or the pool's
        return Region(weakref.ref(a), weakref.ref(owner))
    # foreign memory: its owner may be an alias of the caller's object (torch hands NumPy a new
    # Tensor object on the same storage), so nothing tells when the memory is freed
    return Region(_always, _always, byte_bounds(a))


def overlaps(a: np.ndarray, others: tuple[object, ...]) -> bool:
    """Whether ``a`` may share memory with any of ``others`` (arrays, Regions; others ignored).

    Byte spans are compared, as ``np.may_share_memory`` does: interleaved strided arrays count
    as overlapping.
    """
    for o in others:
        if isinstance(o, Region):
            if o.overlaps(a):
                return True
        elif isinstance(o, np.ndarray) and np.may_share_memory(a, o):
            return True
    return False


def check_out(out: object, shape: tuple[int, ...], dtype: np.dtype, name: str,
              others: tuple[object, ...], why: str) -> np.ndarray:
    """``out`` as a writeable C-contiguous ndarray of ``shape`` and ``dtype`` that overlaps
    none of ``others`` (the caller's arrays, as given, and their Regions)."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(out).__name__}")
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"{name} must have shape {shape} and dtype {dtype}, got shape "
                         f"{out.shape} and dtype {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name} must be C-contiguous and writeable")
    if overlaps(out, others):
        raise ValueError(f"{name} must not overlap the inputs or parameters {why}")
    return out
