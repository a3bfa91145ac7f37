"""Argument checks and the dtype policy shared by every backend.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind,
wrong value) with a message that names the argument and what was wrong. Nothing here
modifies its input.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = [
    "as_float_array",
    "check_eps",
    "check_param",
    "compute_dtype",
    "is_half",
]


def is_half(dtype: np.dtype) -> bool:
    """True for float16 and bfloat16 (ml_dtypes), the dtypes computed in float32."""
    return dtype == np.float16 or dtype.name == "bfloat16"


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype statistics and arithmetic use for inputs of ``dtype``.

    float64 -> float64, float32 -> float32, float16/bfloat16 -> float32: statistics
    never live in half precision, where x**2 overflows for |x| > 256 (float16).
    """
    return np.dtype(np.float32) if is_half(dtype) else np.dtype(dtype)


def _is_float_dtype(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype.name == "bfloat16"


def as_float_array(a: object, name: str) -> np.ndarray:
    """``a`` as an ndarray of a floating dtype, without copying an ndarray."""
    if isinstance(a, np.ndarray):
        arr = a
    else:
        try:
            arr = np.asarray(a)
        except Exception as exc:  # e.g. ragged nested lists
            raise TypeError(f"{name} must be array-like, got {type(a).__name__}: {exc}") from None
    if not _is_float_dtype(arr.dtype):
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), "
            f"got dtype {arr.dtype}"
        )
    return arr


def check_eps(eps: object) -> float:
    """``eps`` as a Python float, or an error if it is not a finite positive number."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}: {eps!r}")
    value = float(eps)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"eps must be a finite positive number, got {value!r}")
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
