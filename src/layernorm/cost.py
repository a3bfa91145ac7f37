"""Cost model of layer norm: FLOPs, bytes moved, memory held, roofline time (pure Python).

Counts are for M rows of length D with elements of ``itemsize`` bytes. Minimal bytes are
what any implementation must move: the forward reads x and writes y; the backward reads x
and dy and writes dx (the headline figures, 2·M·D·itemsize and 3·M·D·itemsize), plus the
parameters and the per-row statistics where ``extras=True``.
"""

from __future__ import annotations

__all__ = ["minimal_bytes"]

_STREAMS = {"fwd": 2, "bwd": 3}  # (M, D) tensors read or written: x, y / x, dy, dx


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
    if pass_ not in _STREAMS:
        raise ValueError(f"pass_ must be 'fwd' or 'bwd', got {pass_!r}")
    total = _STREAMS[pass_] * M * D * itemsize
    if extras:
        params = 2 * D * itemsize if affine else 0
        total += params * (2 if pass_ == "bwd" else 1) + 2 * M * 4
    return total
