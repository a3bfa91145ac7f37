"""Cost model: FLOPs, bytes moved, memory held and roofline time of layer norm (pure Python).

``layernorm cost`` (:mod:`layernorm.commands.cost`) prints the model for given shapes and dtypes.

For M rows of length D, elements of ``itemsize`` bytes, statistics in a compute dtype of
``compute_itemsize`` bytes (4 for float16/bfloat16/float32 inputs, 8 for float64):

Time is Θ(M·D) in both directions: each element takes a fixed number of operations
(``FLOPS_PER_ELEMENT``) and each row a few more (``FLOPS_PER_ROW``: 1/sqrt and divisions).

Bytes. Any implementation must move at least the *minimal bytes*: the forward reads x
and writes y, the backward reads x and dy and writes dx, 2·M·D·itemsize and 3·M·D·itemsize
(the headline figures), plus the parameters and per-row statistics (``extras``). The
unfused NumPy reference moves far more: each NumPy expression is a pass over an (M, D)
array, listed in ``REFERENCE_PASSES`` with the arrays it reads and writes. A fused kernel
moves the minimal bytes when a row stays in cache between its passes.

Memory. The reference's cache holds xhat (M·D), rstd (M) and a copy of gamma (D) in the
compute dtype. Peak
memory of a call is the most it has allocated at once, its results included, as counted
in ``_reference_peak``; the temporaries are that peak less what the call returns.
``tests/test_cost.py`` checks both and the cache size against ``tracemalloc``.

Roofline: time >= max(bytes / bandwidth, flops / peak_flops). At about one FLOP per byte,
far below any CPU's or GPU's FLOP-to-byte balance (tens), layer norm is bandwidth-bound, so
the figure of merit of a kernel is its achieved bandwidth over the minimal bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "FLOPS_PER_ELEMENT",
    "REFERENCE_PASSES",
    "Cost",
    "cost",
    "minimal_bytes",
    "roofline_seconds",
]

_STREAMS = {"fwd": 2, "bwd": 3}  # (M, D) tensors read or written: x, y / x, dy, dx

# Operations per element, by the formulas in layernorm.reference (affine included):
# fwd: sum for mean, subtract, sum for the correction, subtract, square, sum, scale by rstd,
#      gamma multiply, beta add;
# bwd: dbeta add, dy·xhat, dgamma add, dy·gamma, ·gamma for g·xhat, two row sums,
#      subtract mean(g), xhat·mean(g·xhat), subtract, scale by rstd.
FLOPS_PER_ELEMENT = {"fwd": 9, "bwd": 11}
FLOPS_PER_ROW = {"fwd": 5, "bwd": 3}

# The NumPy reference, one entry per pass over an (M, D) array:
# (what it computes, (M, D) arrays read, (M, D) arrays written, needs gamma, needs beta).
# None for a flag means the pass runs either way. Reads and writes are in the compute dtype,
# except the reads of x and dy and the write of y and dx, which are in the input dtype.
REFERENCE_PASSES: dict[str, list[tuple[str, int, int, bool | None, bool | None]]] = {
    "fwd": [
        ("copy x into the working array", 1, 1, None, None),
        ("mean", 1, 0, None, None),
        ("subtract mean", 1, 1, None, None),
        ("mean of centred values (correction)", 1, 0, None, None),
        ("subtract correction", 1, 1, None, None),
        ("square", 1, 1, None, None),
        ("mean of squares", 1, 0, None, None),
        ("scale by rstd (xhat, in place)", 1, 1, None, None),
        ("y = xhat * gamma", 1, 1, True, None),
        ("y = copy of xhat", 1, 1, False, None),
        ("y += beta", 1, 1, None, True),
    ],
    "bwd": [
        ("dbeta = sum of dy over rows", 1, 0, None, True),
        ("dy * xhat", 2, 1, None, None),
        ("dgamma = sum of dy * xhat over rows", 1, 0, True, None),
        ("g = dy * gamma", 1, 1, True, None),
        ("g = copy of dy", 1, 1, False, None),
        ("g * xhat = (dy * xhat) * gamma, in place", 1, 1, True, None),
        ("mean(g)", 1, 0, None, None),
        ("mean(g * xhat)", 1, 0, None, None),
        ("g -= mean(g)", 1, 1, None, None),
        ("xhat * mean(g * xhat)", 1, 1, None, None),
        ("g -= that", 2, 1, None, None),
        ("g *= rstd (dx, in place)", 1, 1, None, None),
    ],
}


def _check_pass(pass_: str) -> None:
    if pass_ not in _STREAMS:
        raise ValueError(f"pass_ must be 'fwd' or 'bwd', got {pass_!r}")


def minimal_bytes(
    pass_: str, M: int, D: int, itemsize: int, *, affine: bool = True, extras: bool = False
) -> int:
    """Bytes a single fused pass must move.

    Args:
        pass_: ``"fwd"`` or ``"bwd"``.
        M, D: rows and row length.
        itemsize: bytes per element of x (and y, dy, dx).
        affine: gamma and beta present (counted only with ``extras``).
        extras: add the parameters (read; gradients written in the backward) and the
            float32 per-row statistics mean and rstd (written forward, read backward).
    """
    _check_pass(pass_)
    total = _STREAMS[pass_] * M * D * itemsize
    if extras:
        params = 2 * D * itemsize if affine else 0
        total += params * (2 if pass_ == "bwd" else 1) + 2 * M * 4
    return total


def _compute_itemsize(itemsize: int) -> int:
    return 8 if itemsize == 8 else 4


def _reference_bytes(pass_: str, M: int, D: int, itemsize: int, gamma: bool, beta: bool) -> int:
    """Bytes the NumPy reference moves over (M, D) arrays, from REFERENCE_PASSES."""
    cs = _compute_itemsize(itemsize)
    total = 0
    for _, reads, writes, need_g, need_b in REFERENCE_PASSES[pass_]:
        if (need_g is not None and need_g != gamma) or (need_b is not None and need_b != beta):
            continue
        total += (reads + writes) * M * D * cs
    if itemsize != cs:
        # half precision: the forward's copy reads x at itemsize, and y is cast in one more
        # pass; the backward casts dy up and dx down, a pass each
        fix = (itemsize - cs) + (cs + itemsize) if pass_ == "fwd" else 2 * (cs + itemsize)
        total += fix * M * D
    return total


def _reference_peak(pass_: str, M: int, D: int, itemsize: int, affine: bool) -> int:
    """Peak bytes allocated during one reference call, beyond what existed before it.

    Forward: the working array that becomes xhat, plus either the squares or y (never both
    alive); half-precision inputs add the cast of y. Backward: dy·xhat and g (which becomes
    dx); half-precision inputs add the float32 copy of dy and the cast of dx.
    O(M) and O(D) vectors (means, rstd, the float64 sums for dgamma/dbeta) are included.
    """
    _check_pass(pass_)
    cs = _compute_itemsize(itemsize)
    md = M * D
    if pass_ == "fwd":
        peak = 2 * md * cs + 4 * M * cs
        if itemsize != cs:
            peak += md * itemsize
        return peak
    peak = 2 * md * cs + 2 * M * cs + (4 * D * 8 if affine else 0)
    if itemsize != cs:
        peak += md * cs + md * itemsize
    return peak


@dataclass(frozen=True)
class Cost:
    """The model's figures for one call; bytes and FLOPs are integers."""

    pass_: str
    M: int
    D: int
    itemsize: int
    flops: int
    minimal_bytes: int
    minimal_bytes_with_extras: int
    reference_bytes: int
    cache_bytes: int
    reference_peak_bytes: int

    @property
    def reference_temporary_bytes(self) -> int:
        """Peak memory of the reference less what it returns (y and the cache, or dx)."""
        md = self.M * self.D
        returned = md * self.itemsize + (self.cache_bytes if self.pass_ == "fwd" else 0)
        return self.reference_peak_bytes - returned

    @property
    def intensity(self) -> float:
        """FLOPs per minimal byte."""
        return self.flops / self.minimal_bytes

    @property
    def reference_traffic_ratio(self) -> float:
        """How many times the minimal bytes the unfused reference moves."""
        return self.reference_bytes / self.minimal_bytes

    def roofline_seconds(self, bandwidth: float, peak_flops: float | None = None) -> float:
        """Lower bound on time for a fused kernel: see :func:`roofline_seconds`."""
        return roofline_seconds(self.minimal_bytes, self.flops, bandwidth, peak_flops)


def roofline_seconds(
    nbytes: int, flops: int, bandwidth: float, peak_flops: float | None = None
) -> float:
    """max(bytes / bandwidth, flops / peak_flops); bandwidth in bytes/s, peak in FLOP/s."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive (bytes/s), got {bandwidth}")
    t = nbytes / bandwidth
    if peak_flops is not None:
        if peak_flops <= 0:
            raise ValueError(f"peak_flops must be positive (FLOP/s), got {peak_flops}")
        t = max(t, flops / peak_flops)
    return t


def cost(
    pass_: str, M: int, D: int, itemsize: int, *, gamma: bool = True, beta: bool = True
) -> Cost:
    """The model for one forward (``"fwd"``) or backward (``"bwd"``) over (M, D).

    Args:
        itemsize: bytes per element of x: 2 (float16/bfloat16), 4 (float32), 8 (float64).
        gamma, beta: whether the parameters are present.
    """
    _check_pass(pass_)
    if itemsize not in (2, 4, 8):
        raise ValueError(f"itemsize must be 2, 4 or 8, got {itemsize}")
    if M < 0 or D < 1:
        raise ValueError(f"need M >= 0 and D >= 1, got M={M}, D={D}")
    cs = _compute_itemsize(itemsize)
    affine = gamma or beta
    return Cost(
        pass_=pass_,
        M=M,
        D=D,
        itemsize=itemsize,
        flops=FLOPS_PER_ELEMENT[pass_] * M * D + FLOPS_PER_ROW[pass_] * M,
        minimal_bytes=minimal_bytes(pass_, M, D, itemsize),
        minimal_bytes_with_extras=minimal_bytes(pass_, M, D, itemsize, affine=affine,
                                                extras=True),
        reference_bytes=_reference_bytes(pass_, M, D, itemsize, gamma, beta),
        cache_bytes=(M * D + M + (D if gamma else 0)) * cs,
        reference_peak_bytes=_reference_peak(pass_, M, D, itemsize, affine),
    )
