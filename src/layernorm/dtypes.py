"""The one table of the floating dtypes layernorm computes with.

Every other module asks this table for a dtype's item size, compute dtype, torch name and
floating-point parameters; none lists dtypes of its own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

__all__ = ["DTYPES", "DType", "NAMES", "available", "compute_dtype", "float8_spacing", "info",
           "is_half", "resolve", "widest_compute_dtype"]


@dataclass(frozen=True)
class DType:
    """One floating dtype.

    Attributes:
        name: NumPy's name for it (bfloat16 is ml_dtypes').
        itemsize: bytes per element.
        compute: the dtype statistics and arithmetic use for it: half inputs compute in
            float32, where x**2 neither overflows (float16 beyond 256) nor loses 8 bits.
        torch: the name of the matching ``torch`` dtype (``getattr(torch, .torch)``).
        significand_bits: p, the implicit leading bit included (unit roundoff 2**-p).
        subnormal: the spacing of the subnormal numbers, 2**(emin - p + 1).
        largest: the largest finite value.
    """

    name: str
    itemsize: int
    compute: str
    torch: str
    significand_bits: int
    subnormal: float
    largest: float

    @property
    def half(self) -> bool:
        """True for the 16-bit dtypes, which compute in float32."""
        return self.itemsize == 2


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float16", 2, "float32", "float16", 11, 2.0**-24, 65504.0),
    DType("bfloat16", 2, "float32", "bfloat16", 8, 2.0**-133, 3.3895313892515355e38),
    DType("float32", 4, "float32", "float32", 24, 2.0**-149, 3.4028234663852886e38),
    DType("float64", 8, "float64", "float64", 53, 2.0**-1074, 1.7976931348623157e308),
)}
NAMES = tuple(DTYPES)


def info(dtype: object) -> DType:
    """The table's row for ``dtype`` (a name, a NumPy dtype or a torch dtype)."""
    name = str(dtype).removeprefix("torch.") if not isinstance(dtype, str) else dtype
    name = np.dtype(dtype).name if not isinstance(dtype, str) and name not in DTYPES else name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(NAMES)}, got {dtype!r}") from None


def is_half(dtype: np.dtype) -> bool:
    """True for float16 and bfloat16 (ml_dtypes), the dtypes computed in float32."""
    d = DTYPES.get(np.dtype(dtype).name)
    return d is not None and d.half


@functools.cache  # dtype.name is formed anew on each access (microseconds)
def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The NumPy dtype statistics and arithmetic use for inputs of ``dtype``."""
    d = DTYPES.get(np.dtype(dtype).name)
    return np.dtype(dtype) if d is None else np.dtype(d.compute)


@functools.cache
def widest_compute_dtype(*dtypes: np.dtype) -> np.dtype:
    """The widest of the compute dtypes of ``dtypes`` (where an add-norm forms x + residual)."""
    return max((compute_dtype(d) for d in dtypes), key=lambda d: d.itemsize)


def resolve(name: str) -> np.dtype:
    """The NumPy dtype called ``name``; bfloat16 comes from ml_dtypes (optional)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(NAMES)}, got {name!r}")
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ImportError("bfloat16 needs ml_dtypes: pip install ml_dtypes") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def available() -> list[str]:
    """Names of the dtypes usable here (bfloat16 only with ml_dtypes installed)."""
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return [n for n in NAMES if n != "bfloat16"]
    return list(NAMES)


def float8_spacing(v: np.ndarray) -> np.ndarray:
    """The spacing of float8_e4m3fn's values at each of ``v`` (float32 or float64, |v| <= 448),
    in v's dtype: 2**(e - 3) in the binade [2**e, 2**(e + 1)) (3 stored significand bits), and
    the subnormals' 2**-9 below 2**-6. A power of two, so scaling by it is exact."""
    with np.errstate(invalid="ignore"):
        _, e = np.frexp(v)  # |v| = m 2**e, 1/2 <= m < 1: the binade is 2**(e - 1)
    return np.ldexp(np.ones_like(v), np.maximum(e - 1, -6) - 3)
