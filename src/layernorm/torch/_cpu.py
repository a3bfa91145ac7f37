"""The fused Numba kernels (:mod:`layernorm.cpu.kernels`) on CPU tensors, in place.

A contiguous tensor is handed to the kernels as a NumPy view of its own memory (float16 and
bfloat16 as their bits, which is how the kernels take half dtypes), and the outputs are fresh
tensors the kernels write through the same kind of view: no copies of x, residual, dy or dh
when they are contiguous. The statistics are the CPU kernels' own: ``stats`` (M, NSTATS)
float64 per row and ``check`` (M,) int64, a checksum of each normalized row's bits that the
backward recomputes (a second guard behind autograd's version counters).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ..cpu import kernels
from ..cpu.kernels import NSTATS

__all__ = ["backward", "compute_dtype", "forward", "stats_shapes"]

_STORAGE = {torch.float16: np.dtype(np.uint16), torch.bfloat16: np.dtype(np.int16),
            torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
            torch.int64: np.dtype(np.uint64)}  # halves as their bits; checksums unsigned


class _Memory:
    """A tensor's memory described to NumPy by the array interface: NumPy reads and writes it
    in place, and the tensor is left as it was (``Tensor.numpy()`` would mark its storage as
    not resizable for good, which FSDP2, freeing a gathered parameter, cannot accept)."""

    def __init__(self, t: Tensor) -> None:
        self.__array_interface__ = {
            "data": (t.data_ptr(), False), "shape": tuple(t.shape),
            "typestr": _STORAGE[t.dtype].str, "version": 3,
        }


def _np(t: Tensor) -> np.ndarray:
    """A NumPy view of contiguous CPU tensor ``t``'s memory as the kernels store it (halves as
    their bits, int64 as uint64). Valid while ``t`` lives: only within one kernel call."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return np.asarray(_Memory(t))


_BIG = 4 << 20  # bytes: from here on NumPy asks the kernel for transparent huge pages


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A new (M, D) output. A large one is allocated by NumPy, which advises the kernel to back
    it with transparent huge pages (torch's CPU allocator does not, unless THP_MEM_ALLOC_ENABLE
    is set): the kernels' first touch of fresh output pages then faults in a few large pages
    instead of thousands of small ones. Such a tensor's storage cannot be resized, which
    activations and gradients never need."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _BIG:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.empty(shape, _STORAGE[dtype])).view(dtype)


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any of ``dtypes`` is float64, else float32: where every backend's kernels
    compute, and the dtype of their statistics."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _scalar(dtype: torch.dtype) -> np.generic:
    """A NumPy zero of ``dtype`` (a compute dtype): tells the kernels where to add."""
    return np.float64(0) if dtype == torch.float64 else np.float32(0)


def _scale(weight: Tensor | None, d: int, cdt: torch.dtype, zero_centered_gamma: bool) -> Tensor:
    """(D,) the scale in the compute dtype: weight, 1 + weight, or ones; always a new tensor."""
    if weight is None:
        return torch.ones(d, dtype=cdt)
    scale = weight.detach().to(cdt, copy=True)
    return scale.add_(1) if zero_centered_gamma else scale


def stats_shapes(m: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the two statistics tensors of ``m`` rows: stats (float64), check (int64)."""
    return (m, NSTATS), (m,)


def forward(x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None,
            eps: float, centred: bool, zero_centered_gamma: bool, h_dtype: torch.dtype,
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """y (M, D) in x's dtype, h (M, D) in ``h_dtype`` (an empty (0,) without residual), stats
    (M, NSTATS) float64 and check (M,) int64; x and residual (M, D) any float dtypes."""
    m, d = x.shape
    x = x.contiguous()
    cdt = compute_dtype(h_dtype if residual is not None else x.dtype)
    y = _empty((m, d), x.dtype)
    stats = torch.empty(stats_shapes(m)[0], dtype=torch.float64)
    check = torch.empty(stats_shapes(m)[1], dtype=torch.int64)
    scale = _scale(weight, d, cdt, zero_centered_gamma)
    shift = torch.zeros(d, dtype=cdt) if bias is None else bias.detach().to(cdt, copy=True)
    if residual is not None:
        residual = residual.contiguous()
        h = _empty((m, d), h_dtype)
        r2, h2 = _np(residual), _np(h)
        zp = _scalar(compute_dtype(x.dtype, residual.dtype, h_dtype))
    else:
        h = x.new_empty((0,))
        r2 = h2 = np.empty((m, 0), _STORAGE[x.dtype])
        zp = _scalar(cdt)
    if m:
        kernels.forward_kernel(_np(x), r2, zp, _np(scale), _np(shift), eps, centred, _np(y), h2,
                               _np(stats), _np(check))
    return y, h, stats, check


def backward(dy: Tensor, dh: Tensor | None, xn: Tensor, weight: Tensor | None,
             bias: Tensor | None, stats: Tensor, check: Tensor, centred: bool,
             zero_centered_gamma: bool, x_dtype: torch.dtype | None,
             residual_dtype: torch.dtype | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dx, dresidual (an empty (0,) for a plain norm), dweight, dbias (empty without them).

    xn is what the forward normalized: x, or h for an add-norm (``residual_dtype`` given); dx
    comes back in ``x_dtype`` (xn's dtype when None), dresidual in ``residual_dtype``.
    """
    m, d = xn.shape
    xn = xn.contiguous()
    cdt = compute_dtype(xn.dtype)
    scale = _scale(weight, d, cdt, zero_centered_gamma)
    dy = dy.contiguous() if compute_dtype(dy.dtype) == cdt else dy.to(cdt).contiguous()
    dx = _empty((m, d), xn.dtype if x_dtype is None else x_dtype)
    if residual_dtype is not None:
        adt = compute_dtype(dx.dtype, residual_dtype, cdt)  # where dh and the norm's dx are summed
        dres = _empty((m, d), residual_dtype)
        dres2 = _np(dres)
        if dh is not None:
            dh = dh.contiguous() if compute_dtype(dh.dtype) == adt else dh.to(adt).contiguous()
    else:
        adt = cdt
        dres = xn.new_empty((0,))
        dres2 = np.empty((m, 0), _STORAGE[dx.dtype])
    # absent dh and dresidual: (M, 0) stand-ins typed as a dh of h's dtype and a dresidual of
    # dx's are passed, so that one compiled kernel serves both (as in layernorm.cpu.api)
    dh2 = np.empty((m, 0), _STORAGE[xn.dtype if adt == cdt else adt]) if dh is None else _np(dh)
    partial = np.empty((kernels.n_chunks(m), 2, d))  # (C, 2, D) float64
    ok = np.empty(m, np.bool_)
    if m:
        kernels.backward_kernel(_np(xn), _np(dy), dh2, _scalar(adt), _np(scale), _np(stats),
                                _np(check), centred, _np(dx), dres2, partial, ok)
    if not ok.all():
        raise ValueError(
            f"the normalized input changed between the forward and the backward (row "
            f"{int(np.argmin(ok))} first): the backward would differentiate a forward that "
            f"did not run"
        )
    sums = np.zeros((2, d))  # (2, D) float64: dweight, dbias
    if m:
        kernels.reduce_chunks(partial, sums)
    sums_t = torch.from_numpy(sums)
    dw = xn.new_empty((0,)) if weight is None else sums_t[0].to(weight.dtype, copy=True)
    db = xn.new_empty((0,)) if bias is None else sums_t[1].to(bias.dtype, copy=True)
    return dx, dres, dw, db
