"""Cost model of the family of norms: FLOPs, bytes moved, memory held and roofline time.

Pure Python. ``layernorm cost`` (:mod:`layernorm.commands.cost`) prints the model for given
norms, shapes and dtypes. The norm is a parameter (a name from :data:`layernorm.family.NORMS`).
Bytes and FLOPs are Python integers, exact for any M and D (NumPy integers are converted
first, so nothing wraps around); whether a machine could hold the arrays is the command's
question, not the model's.

For M rows of length D, every (M, D) array in one dtype of ``itemsize`` s bytes (the add-norms'
residual and h included), statistics and arithmetic in a compute dtype of c bytes (4 for
float16/bfloat16/float32 inputs, 8 for float64):

Time is Θ(M·D) in both directions: each element takes a fixed number of operations and each
row a few more (divisions by D, 1/sqrt). ``FLOPS`` lists them step by step, with the norms
that take each step: RMSNorm has no mean to subtract and no beta (forward 4 per element
against LayerNorm's 9; backward one row reduction fewer, 8 against 11); an add-norm adds
h = x + residual forward and dh to dx backward (one more each). The memory-efficient backward
takes one more with beta (t = y - beta), and with gamma xhat = t / scale in place of
(dy·xhat)·scale (the kept channels' and rows' few operations, and dgamma's one division per
channel, are left out).

Bytes. Any implementation must move at least the *minimal bytes*: the (M, D) arrays the pass
reads and writes, as :class:`layernorm.family.Norm` lists them (dh counted, though optional):

    norm            forward reads, writes      backward reads, writes            fwd    bwd
    LayerNorm       x; y                       x, dy; dx                         2MDs   3MDs
    RMSNorm         x; y                       x, dy; dx                         2MDs   3MDs
    add-norms       x, residual; y, h          h, dy, dh; dx, dresidual          4MDs   5MDs

plus, with ``extras``, the (D,) parameters (read; their gradients written in the backward)
and the float32 per-row statistics (mean and rstd; rstd alone for RMSNorm; written forward,
read backward). The unfused NumPy reference moves far more: each NumPy expression is a
pass over (M, D) arrays, listed in ``REFERENCE_PASSES`` with the arrays it reads and writes
and in which dtype. A fused kernel moves the minimal bytes when a row stays in cache
between its passes.

The memory-efficient mode (``memory_efficient=True``, keeping the xhat of ``kept`` = k
channels, :func:`layernorm.recovery.kept_channels`) changes what crosses from forward to
backward: the backward reads y where the default reads x (h), as many bytes in the model's
one dtype (y is in x's dtype, h in residual_dtype), and the forward writes, the backward
reads, the kept channels' xhat, M·k·c bytes more each way (and r·D·c for the r rows kept
whole, ``kept_rows``: rows with var < eps under a non-zero beta); the statistics are rstd
alone, and the int64 indices of what is kept are extras too. The reference's backward
recovers xhat from y: ``REFERENCE_PASSES`` has its passes, in float64 where it forms
t = y - beta and dy·t, and ``REFERENCE_KEPT_PASSES`` and ``REFERENCE_KEPT_ROW_PASSES`` those
over the (M, k) kept channels and the (r, D) kept rows.

Memory. The reference's cache holds xhat (M·D), rstd (M) and a copy of the scale (D) in the
compute dtype, for every norm: an add-norm's cache is the norm's cache of h and nothing more.
The memory-efficient cache holds rstd (M), the copies of the scale (D) and of the shift (D,
LayerNorm's beta), the k indices (8·k bytes) and the kept xhat (M·k), and as many for the r
kept rows (8·r, r·D): :func:`cache_bytes`.
Peak memory of a call is the most it has allocated at once, its results included, as
counted in ``_reference_peak``; the temporaries are that peak less what the call returns.
``tests/test_cost.py`` checks both and the cache size against ``tracemalloc``, for every norm
and both modes.

Roofline: time >= max(bytes / bandwidth, flops / peak_flops). At about one FLOP per byte,
far below any CPU's or GPU's FLOP-to-byte balance (tens), every norm of the family is
bandwidth-bound, so the figure of merit of a kernel is its achieved bandwidth over the
minimal bytes.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from . import family
from .family import Norm

__all__ = [
    "FLOPS",
    "REFERENCE_KEPT_PASSES",
    "REFERENCE_KEPT_ROW_PASSES",
    "REFERENCE_PASSES",
    "Cost",
    "cache_bytes",
    "cost",
    "flops",
    "minimal_bytes",
    "roofline_seconds",
]

# A step is taken when every condition in its set holds for the call. The conditions:
# centred / uncentred (LayerNorm / RMSNorm), residual (an add-norm) / plain, gamma / no gamma,
# beta / no beta, half (float16, bfloat16: computed in float32) / full, memory-efficient /
# default (the mode of the forward whose cache the backward reads).

# Operations of each step, by the formulas in layernorm.reference:
# (what, per element, per row, when).
FLOPS: dict[str, list[tuple[str, int, int, frozenset[str]]]] = {
    "fwd": [
        ("h = x + residual", 1, 0, frozenset({"residual"})),
        ("mean: sum, / D", 1, 1, frozenset({"centred"})),
        ("subtract mean", 1, 0, frozenset({"centred"})),
        ("correction: sum, / D", 1, 1, frozenset({"centred"})),
        ("subtract correction", 1, 0, frozenset({"centred"})),
        ("square", 1, 0, frozenset()),
        ("mean of squares: sum, / D", 1, 1, frozenset()),
        ("rstd = 1 / sqrt(... + eps)", 0, 2, frozenset()),
        ("scale by rstd (xhat)", 1, 0, frozenset()),
        ("y = xhat * gamma", 1, 0, frozenset({"gamma"})),
        ("y += beta", 1, 0, frozenset({"beta"})),
    ],
    "bwd": [
        ("t = y - beta (recovery)", 1, 0, frozenset({"memory-efficient", "beta"})),
        ("dbeta: add over rows", 1, 0, frozenset({"beta"})),
        ("dy * xhat (dy * t, which is g * xhat, recovering)", 1, 0, frozenset()),
        ("dgamma: add over rows", 1, 0, frozenset({"gamma"})),
        ("g = dy * gamma", 1, 0, frozenset({"gamma"})),
        ("g * xhat = (dy * xhat) * gamma", 1, 0, frozenset({"default", "gamma"})),
        ("xhat = t / gamma (recovery)", 1, 0, frozenset({"memory-efficient", "gamma"})),
        ("mean(g): sum, / D", 1, 1, frozenset({"centred"})),
        ("mean(g * xhat): sum, / D", 1, 1, frozenset()),
        ("g - mean(g)", 1, 0, frozenset({"centred"})),
        ("xhat * mean(g * xhat)", 1, 0, frozenset()),
        ("subtract that", 1, 0, frozenset()),
        ("scale by rstd (the norm's dx)", 1, 0, frozenset()),
        ("dx = dh + the norm's dx", 1, 0, frozenset({"residual"})),
    ],
}

# The NumPy reference, one entry per pass over (M, D) arrays:
# (what, arrays read, arrays written, when). Each array is a letter: "c" in the compute
# dtype, "s" in the input's dtype (the same for float32 and float64 inputs), "d" in float64
# (the memory-efficient backward's t = y - beta and dy * t, exact there for 16- and 32-bit y).
REFERENCE_PASSES: dict[str, list[tuple[str, str, str, frozenset[str]]]] = {
    "fwd": [
        ("h = x + residual, in the compute dtype", "ss", "c", frozenset({"residual"})),
        ("h rounded to its dtype", "c", "s", frozenset({"residual", "half"})),
        ("copy x (h) into the working array", "s", "c", frozenset()),
        ("mean", "c", "", frozenset({"centred"})),
        ("subtract mean", "c", "c", frozenset({"centred"})),
        ("mean of centred values (correction)", "c", "", frozenset({"centred"})),
        ("subtract correction", "c", "c", frozenset({"centred"})),
        ("square", "c", "c", frozenset()),
        ("mean of squares", "c", "", frozenset()),
        ("scale by rstd (xhat, in place)", "c", "c", frozenset()),
        ("y = xhat * scale", "c", "c", frozenset({"gamma"})),
        ("y = copy of xhat", "c", "c", frozenset({"no gamma"})),
        ("y += beta", "c", "c", frozenset({"beta"})),
        ("y rounded to the input dtype", "c", "s", frozenset({"half"})),
    ],
    "bwd": [
        ("dy to the compute dtype", "s", "c", frozenset({"half"})),
        ("t = y in float64", "s", "d", frozenset({"memory-efficient"})),
        ("t -= shift", "d", "d", frozenset({"memory-efficient", "beta"})),
        ("dbeta = sum of dy over rows", "c", "", frozenset({"beta"})),
        ("dy * xhat", "cc", "c", frozenset({"default"})),
        ("dy * t in float64 (g * xhat where recovered)", "cd", "d",
         frozenset({"memory-efficient"})),
        ("dgamma = sum of dy * xhat over rows", "c", "", frozenset({"default", "gamma"})),
        ("dgamma = sum of dy * t over rows, / scale", "d", "",
         frozenset({"memory-efficient", "gamma"})),
        ("t /= scale (xhat where recovered, in place)", "d", "d",
         frozenset({"memory-efficient", "gamma"})),
        ("g = dy * scale", "c", "c", frozenset({"gamma"})),
        ("g = copy of dy", "c", "c", frozenset({"no gamma"})),
        ("g * xhat = (dy * xhat) * scale, in place", "c", "c", frozenset({"default", "gamma"})),
        ("xhat = t rounded to the compute dtype", "d", "c", frozenset({"memory-efficient"})),
        ("mean(g)", "c", "", frozenset({"centred"})),
        ("mean(g * xhat)", "c", "", frozenset({"default"})),
        ("mean(g * xhat), from dy * t", "d", "", frozenset({"memory-efficient"})),
        ("g -= mean(g)", "c", "c", frozenset({"centred"})),
        ("xhat * mean(g * xhat)", "c", "c", frozenset()),
        ("g -= that", "cc", "c", frozenset()),
        ("g *= rstd (the norm's dx, in place)", "c", "c", frozenset()),
        ("dx rounded to the input dtype", "c", "s", frozenset({"plain", "half"})),
        ("total = the norm's dx + dh, in place", "cs", "c", frozenset({"residual"})),
        ("dx = the total in x's dtype (a copy)", "c", "s", frozenset({"residual"})),
        ("dresidual = the total in residual's dtype", "c", "s", frozenset({"residual", "half"})),
    ],
}

# The memory-efficient mode's passes over (M, k) arrays, k the kept channels, as in
# REFERENCE_PASSES (every entry is memory-efficient): the forward gathers xhat's kept
# columns; the backward forms dy * xhat there in float64 and writes it into dy * t, and
# writes the kept xhat into the recovered one.
REFERENCE_KEPT_PASSES: dict[str, list[tuple[str, str, str, frozenset[str]]]] = {
    "fwd": [
        ("gather xhat's kept channels", "c", "c", frozenset()),
    ],
    "bwd": [
        ("gather dy's kept channels", "c", "c", frozenset()),
        ("kept xhat in float64", "c", "d", frozenset()),
        ("dy * xhat there", "cd", "d", frozenset()),
        ("dgamma there = sum over rows", "d", "", frozenset({"gamma"})),
        ("times the scale (g * xhat)", "d", "d", frozenset({"gamma"})),
        ("written into dy * t", "d", "d", frozenset()),
        ("kept xhat written into the recovered xhat", "c", "c", frozenset()),
    ],
}

# And over the (r, D) arrays of the r rows kept whole (var < eps under a non-zero shift): the
# forward gathers them from xhat; the backward writes them into t in float64 (times the scale
# with gamma: a gather, the product and a scatter) and into the recovered xhat.
REFERENCE_KEPT_ROW_PASSES: dict[str, list[tuple[str, str, str, frozenset[str]]]] = {
    "fwd": [
        ("gather xhat's kept rows", "c", "c", frozenset()),
    ],
    "bwd": [
        ("kept rows' xhat into t, in float64", "c", "d", frozenset()),
        ("t there *= scale (gather, multiply, scatter)", "ddd", "ddd", frozenset({"gamma"})),
        ("kept rows' xhat written into the recovered xhat", "c", "c", frozenset()),
    ],
}


def _check_pass(pass_: str) -> None:
    if pass_ not in ("fwd", "bwd"):
        raise ValueError(f"pass_ must be 'fwd' or 'bwd', got {pass_!r}")


def _integer(value: object, name: str, least: int) -> int:
    """``value`` (M, D, itemsize) as a Python int >= least. NumPy integers are converted: the
    model's products of a large shape would wrap around in int64, and never do in Python."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}: {value!r}")
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    return int(value)


def _sizes(M: object, D: object, itemsize: object | None = None) -> tuple[int, ...]:
    """M >= 0, D >= 1 (and itemsize 2, 4 or 8) as Python ints."""
    sizes = (_integer(M, "M", 0), _integer(D, "D", 1))
    if itemsize is None:
        return sizes
    if _integer(itemsize, "itemsize", 1) not in (2, 4, 8):
        raise ValueError(f"itemsize must be 2, 4 or 8, got {itemsize}")
    return (*sizes, int(itemsize))


def _mode(memory_efficient: object, kept: object, kept_rows: object, M: int, D: int,
          shift: bool) -> tuple[bool, int, int]:
    """``memory_efficient`` as a bool, ``kept`` and ``kept_rows`` as Python ints in [0, D] and
    [0, M].

    kept counts the channels whose xhat the memory-efficient forward keeps
    (:func:`layernorm.recovery.kept_channels`), kept_rows the rows it keeps whole
    (:func:`layernorm.recovery.kept_rows`: var < eps under a non-zero shift, so only with
    beta). The default mode keeps xhat whole, so a nonzero count without
    ``memory_efficient`` is a mistake, not something to ignore.
    """
    if not (isinstance(memory_efficient, bool) or (type(memory_efficient).__module__ == "numpy"
                                                   and type(memory_efficient).__name__
                                                   in ("bool", "bool_"))):
        raise TypeError(f"memory_efficient must be a bool, got "
                        f"{type(memory_efficient).__name__}: {memory_efficient!r}")
    k = _integer(kept, "kept", 0)
    if k > D:
        raise ValueError(f"kept must be <= D = {D} (it counts channels), got {k}")
    r = _integer(kept_rows, "kept_rows", 0)
    if r > M:
        raise ValueError(f"kept_rows must be <= M = {M} (it counts rows), got {r}")
    for name, n, what in (("kept", k, "channels"), ("kept_rows", r, "rows")):
        if n and not memory_efficient:
            raise ValueError(f"{name} counts the {what} the memory-efficient mode keeps: it "
                             f"needs memory_efficient=True, got {name}={n} without it")
    if r and not shift:
        raise ValueError(f"kept_rows needs beta: rows are kept whole only under a non-zero "
                         f"shift, got kept_rows={r} without one")
    return bool(memory_efficient), k, r


def _facts(nm: Norm, gamma: bool, beta: bool, half: bool,
           memory_efficient: bool = False) -> frozenset[str]:
    """The conditions of FLOPS and REFERENCE_PASSES that hold for this call."""
    return frozenset({
        "centred" if nm.centred else "uncentred",
        "residual" if nm.residual else "plain",
        "gamma" if gamma else "no gamma",
        "beta" if beta else "no beta",
        "half" if half else "full",
        "memory-efficient" if memory_efficient else "default",
    })


def _streams(pass_: str, nm: Norm) -> int:
    """(M, D) arrays a fused pass of ``nm`` must read and write."""
    if pass_ == "fwd":
        return len(nm.forward_inputs) + len(nm.forward_outputs)
    return len(nm.backward_inputs) + len(nm.backward_outputs)


def minimal_bytes(
    pass_: str, M: int, D: int, itemsize: int, *, affine: bool = True, extras: bool = False,
    norm: str = "layer_norm", memory_efficient: bool = False, kept: int = 0,
    kept_rows: int = 0,
) -> int:
    """Bytes a single fused pass must move.

    Args:
        pass_: ``"fwd"`` or ``"bwd"``.
        M, D: rows (>= 0) and row length (>= 1), integers.
        itemsize: bytes per element of every (M, D) array (x, y, dy, dx; residual, h, dh,
            dresidual).
        affine: the parameters (gamma, and beta where the norm has one) are present; counted
            only with ``extras``.
        extras: add the parameters (read; gradients written in the backward) and the float32
            per-row statistics (mean and rstd, rstd alone for RMSNorm; written forward, read
            backward).
        norm: the family member (a name from :data:`layernorm.family.NORMS`).
        memory_efficient: the memory-efficient mode: the backward reads y instead of x (h),
            as many bytes in the model's one dtype; the forward writes, and the backward
            reads, the (M, kept) xhat of the kept channels and the (kept_rows, D) xhat of
            the kept rows in the compute dtype; with ``extras`` the statistics are rstd
            alone (xhat is recovered from y, so the mean is not needed), the kept channels'
            and rows' int64 indices are written and read too, and beta, counted read in both
            passes in either mode, is what this backward subtracts from y (the shift).
        kept: the number of kept channels, in [0, D]; only with ``memory_efficient``.
        kept_rows: the number of rows kept whole, in [0, M]; only with ``memory_efficient``
            and beta (``affine`` and a LayerNorm).
    """
    _check_pass(pass_)
    M, D, itemsize = _sizes(M, D, itemsize)
    nm = family.norm(norm)
    memory_efficient, kept, rows = _mode(memory_efficient, kept, kept_rows, M, D,
                                         affine and nm.centred)
    total = _streams(pass_, nm) * M * D * itemsize
    if memory_efficient:
        total += (M * kept + rows * D) * _compute_itemsize(itemsize)
    if extras:
        params = len(nm.params) * D * itemsize if affine else 0
        stats = (1 if memory_efficient else 2 if nm.centred else 1) * M * 4
        total += params * (2 if pass_ == "bwd" else 1) + stats + 8 * (kept + rows)
    return total


def flops(pass_: str, M: int, D: int, *, norm: str = "layer_norm", gamma: bool = True,
          beta: bool | None = None, memory_efficient: bool = False) -> int:
    """Floating-point operations of one pass over (M, D), by ``FLOPS`` (arguments as
    :func:`cost`)."""
    _check_pass(pass_)
    M, D = _sizes(M, D)
    memory_efficient, *_ = _mode(memory_efficient, 0, 0, M, D, False)
    nm = family.norm(norm)
    facts = _facts(nm, gamma, _beta(nm, beta), half=False,  # FLOPs do not depend on it
                   memory_efficient=memory_efficient)
    return sum(e * M * D + r * M for _, e, r, when in FLOPS[pass_] if when <= facts)


def _compute_itemsize(itemsize: int) -> int:
    return 8 if itemsize == 8 else 4


def _reference_bytes(pass_: str, nm: Norm, M: int, D: int, itemsize: int, gamma: bool,
                     beta: bool, memory_efficient: bool = False, kept: int = 0,
                     kept_rows: int = 0) -> int:
    """Bytes the NumPy reference moves over (M, D) arrays, from REFERENCE_PASSES, and in the
    memory-efficient mode over the (M, kept) arrays of the kept channels and the
    (kept_rows, D) arrays of the kept rows, from REFERENCE_KEPT_PASSES and
    REFERENCE_KEPT_ROW_PASSES."""
    size = {"c": _compute_itemsize(itemsize), "s": itemsize, "d": 8}
    facts = _facts(nm, gamma, beta, itemsize == 2, memory_efficient)

    def moved(passes: list[tuple[str, str, str, frozenset[str]]], elements: int) -> int:
        return sum(sum(size[a] for a in reads + writes) * elements
                   for _, reads, writes, when in passes if when <= facts)

    total = moved(REFERENCE_PASSES[pass_], M * D)
    if memory_efficient:
        total += moved(REFERENCE_KEPT_PASSES[pass_], M * kept)
        total += moved(REFERENCE_KEPT_ROW_PASSES[pass_], kept_rows * D)
    return total


def _reference_peak(pass_: str, nm: Norm, M: int, D: int, itemsize: int, gamma: bool,
                    beta: bool, memory_efficient: bool = False, kept: int = 0,
                    kept_rows: int = 0) -> int:
    """Peak bytes allocated during one reference call, beyond what existed before it.

    Forward: the working array that becomes xhat, plus either the squares or y (never both
    alive); half-precision inputs add the cast of y; an add-norm adds h, alive throughout.
    The memory-efficient forward forms the whole xhat all the same, then, while xhat and y
    (in its own dtype by then) are alive, applies the recovery rules (a few float64 (D,) and
    (M,) vectors) and gathers the (M, kept) xhat of the kept channels, the (kept_rows, D)
    xhat of the kept rows and their int64 indices: above the default peak in float32 and
    float64 as soon as anything is kept; in half precision only when the gathered arrays
    outgrow the float32 y freed before them.

    Backward: dy·xhat and g (which becomes the norm's dx); half-precision inputs add the
    float32 copy of dy, and a plain norm the cast of dx. An add-norm's dx and dresidual are
    made once dy·xhat is freed, within that peak. The memory-efficient backward holds
    instead t = y - beta and dy·t in float64, g, and xhat rounded from t in the compute dtype,
    with dy·xhat of the kept channels, (M, kept) in float64; before xhat is formed, the
    (M, kept) products with the scale (with gamma), the float64 operands of dy·xhat there, or
    the kept rows' float64 copies beside t can be the larger.

    O(M) and O(D) vectors (means, rstd, the float64 sums for dgamma and dbeta) are included.
    """
    c, s = _compute_itemsize(itemsize), itemsize
    md, mk, rd = M * D, M * kept, kept_rows * D
    half = itemsize != c
    if pass_ == "fwd":
        peak = 2 * md * c + 4 * M * c + (md * s if half else 0)
        if memory_efficient:
            xhat_and_y = md * c + md * s  # y in its own dtype by now
            peak = max(peak,
                       xhat_and_y + 4 * D * 8 + 3 * M * 8,  # the rules' float64 vectors
                       xhat_and_y + (mk + rd) * c + 8 * (kept + kept_rows))  # gathered
        if nm.residual:
            peak += md * s
        return peak
    cast = md * s if half and not nm.residual else 0  # dx rounded, while the rest is alive
    if memory_efficient:
        phases = [16 * md + 2 * md * c + 8 * mk + cast,  # t, dy·t, g, xhat; (M, k) dy·xhat
                  16 * md + (c + 16) * mk,  # t, dy·t; dy's kept channels, kept xhat in float64
                  8 * md + 16 * rd]  # t; the kept rows in float64, and times the scale
        if gamma:
            phases.append(16 * md + md * c + 16 * mk)  # t, dy·t, g; (M, k) dy·xhat, · scale
        peak = max(phases)
    else:
        peak = 2 * md * c + cast
    peak += 2 * M * c + 2 * D * 8 * (int(gamma) + int(beta))
    if half:
        peak += md * c  # dy in float32
    return peak


def cache_bytes(M: int, D: int, itemsize: int, *, norm: str = "layer_norm", gamma: bool = True,
                beta: bool | None = None, memory_efficient: bool = False, kept: int = 0,
                kept_rows: int = 0) -> int:
    """Bytes the reference's cache holds from forward to backward (arguments as :func:`cost`).

    Default (:class:`layernorm.reference.NormCache`): xhat (M·D), rstd (M) and the copy of
    the scale (D, with gamma), in the compute dtype of c bytes: (M·D + M + D)·c.
    Memory-efficient (:class:`layernorm.reference.OutputCache`): rstd (M), the copies of the
    scale (D, with gamma) and of the shift (D, with beta: LayerNorm's), the kept channels'
    indices (8·kept, int64) and their xhat (M·kept), the kept rows' indices (8·kept_rows)
    and their xhat (kept_rows·D): (M + D + D + M·kept + kept_rows·D)·c + 8·(kept +
    kept_rows). y is not counted: it is the forward's output, which the next layer holds
    anyway. An add-norm's cache is its norm's, in either mode.
    """
    M, D, itemsize = _sizes(M, D, itemsize)
    nm = family.norm(norm)
    beta = _beta(nm, beta)
    memory_efficient, kept, rows = _mode(memory_efficient, kept, kept_rows, M, D, beta)
    c = _compute_itemsize(itemsize)
    if memory_efficient:
        return ((M + D * (int(gamma) + int(beta)) + M * kept + rows * D) * c
                + 8 * (kept + rows))
    return (M * D + M + D * int(gamma)) * c


def _beta(nm: Norm, beta: bool | None) -> bool:
    """Whether beta is present: by default where the norm has one; an RMS norm has none."""
    if beta is None:
        return nm.centred
    if beta and not nm.centred:
        raise ValueError(f"{nm.name} has no beta, got beta=True")
    return bool(beta)


@dataclass(frozen=True)
class Cost:
    """The model's figures for one call; bytes and FLOPs are Python integers.

    ``cache_bytes`` is the cache of the call's mode (memory-efficient with
    ``memory_efficient``, keeping ``kept`` channels and ``kept_rows`` rows);
    ``default_cache_bytes`` the default mode's, for the same call.
    """

    norm: str
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
    memory_efficient: bool
    kept: int
    kept_rows: int
    default_cache_bytes: int

    @property
    def reference_temporary_bytes(self) -> int:
        """Peak memory of the reference less what it returns: y (and h) and the cache
        forward, dx (and dresidual) backward."""
        nm = family.norm(self.norm)
        outputs = nm.forward_outputs if self.pass_ == "fwd" else nm.backward_outputs
        returned = len(outputs) * self.M * self.D * self.itemsize
        return self.reference_peak_bytes - returned - (self.cache_bytes if self.pass_ == "fwd"
                                                       else 0)

    @property
    def cache_saved_bytes(self) -> int:
        """Bytes the cache holds less than the default mode's (0 in the default mode)."""
        return self.default_cache_bytes - self.cache_bytes

    @property
    def cache_saved_fraction(self) -> float:
        """``cache_saved_bytes`` over the default cache (0.0 for an empty one, M = 0 and no
        gamma)."""
        return self.cache_saved_bytes / self.default_cache_bytes if self.default_cache_bytes \
            else 0.0

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
    pass_: str, M: int, D: int, itemsize: int, *, norm: str = "layer_norm", gamma: bool = True,
    beta: bool | None = None, memory_efficient: bool = False, kept: int = 0,
    kept_rows: int = 0,
) -> Cost:
    """The model for one forward (``"fwd"``) or backward (``"bwd"``) of ``norm`` over (M, D).

    Args:
        M, D: rows (>= 0) and row length (>= 1), integers (TypeError for others).
        itemsize: bytes per element of x: 2 (float16/bfloat16), 4 (float32), 8 (float64).
        norm: the family member (a name from :data:`layernorm.family.NORMS`).
        gamma: whether gamma is present.
        beta: whether beta is present; default: where the norm has one (ValueError for
            beta=True with an RMS norm).
        memory_efficient: the mode of ``memory_efficient=True``: the cache keeps rstd, the
            parameters and the xhat of the kept channels and rows instead of xhat, and the
            backward recovers xhat from y (a bool; TypeError for others).
        kept: how many channels' xhat the memory-efficient forward keeps
            (:func:`layernorm.recovery.kept_channels`; 0 for weights at their initial
            values), an integer in [0, D]; ValueError for a nonzero kept without
            ``memory_efficient``.
        kept_rows: how many rows it keeps whole (:func:`layernorm.recovery.kept_rows`: rows
            with var < eps under a non-zero beta; 0 for most data), an integer in [0, M];
            ValueError for a nonzero kept_rows without ``memory_efficient`` or without beta.
    """
    _check_pass(pass_)
    M, D, itemsize = _sizes(M, D, itemsize)
    nm = family.norm(norm)
    beta = _beta(nm, beta)
    memory_efficient, kept, kept_rows = _mode(memory_efficient, kept, kept_rows, M, D, beta)
    mode = dict(memory_efficient=memory_efficient, kept=kept, kept_rows=kept_rows)
    return Cost(
        norm=nm.name,
        pass_=pass_,
        M=M,
        D=D,
        itemsize=itemsize,
        flops=flops(pass_, M, D, norm=nm.name, gamma=gamma, beta=beta,
                    memory_efficient=memory_efficient),
        minimal_bytes=minimal_bytes(pass_, M, D, itemsize, norm=nm.name, **mode),
        minimal_bytes_with_extras=minimal_bytes(pass_, M, D, itemsize, affine=gamma or beta,
                                                extras=True, norm=nm.name, **mode),
        reference_bytes=_reference_bytes(pass_, nm, M, D, itemsize, gamma, beta, **mode),
        cache_bytes=cache_bytes(M, D, itemsize, norm=nm.name, gamma=gamma, beta=beta, **mode),
        reference_peak_bytes=_reference_peak(pass_, nm, M, D, itemsize, gamma, beta, **mode),
        **mode,
        default_cache_bytes=cache_bytes(M, D, itemsize, norm=nm.name, gamma=gamma, beta=beta),
    )
