"""``layernorm cost``: FLOPs, bytes moved, memory held and roofline time of each norm, per shape.

One Markdown row per shape, dtype, norm and pass, from the model of :mod:`layernorm.cost`;
``--norm`` (repeatable) picks norms, every norm of the family by default; with
``--bandwidth`` a roofline column. ``--memory-efficient`` models that mode (its cache, with
the default mode's beside it and the fraction saved, its peaks, bytes and FLOPs), keeping the
xhat of ``--kept`` channels (0 by default: weights at their initial values keep none). A
shape whose x alone would need more than :data:`MAX_BYTES` in a dtype asked for, a
``--kept`` above a shape's D, or ``--kept`` without ``--memory-efficient`` is a command-line
mistake (one line, exit status 2).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from .. import cost
from .._table import render
from .._validate import shape_extents
from ..dtypes import DTYPES, NAMES
from ..family import NORMS
from . import shape, usage_error

__all__ = ["DESCRIPTION", "MAX_BYTES", "add_arguments", "run", "table"]

DESCRIPTION = cost.__doc__  # the model, for --help

DEFAULT_SHAPES = ((4096, 768), (4096, 4096), (64, 65536))
DEFAULT_DTYPES = ("float32", "bfloat16")
# The most bytes x alone may need: 1 EiB, about a hundred times the memory of the largest
# computer, all its nodes together (about 10 PB). A shape beyond it is a mistake, not a model.
MAX_BYTES = 2**60


def table(shapes: Sequence[tuple[int, ...]], dtypes: list[str], bandwidth_gbs: float | None,
          norms: list[str] | None = None, *, memory_efficient: bool = False,
          kept: int = 0) -> str:
    """The model's figures as a Markdown table, one row per shape, dtype, norm and pass.

    ``shapes``: tuples of at least two extents (leading extents multiply into the rows M);
    ``norms``: names from :data:`layernorm.family.NORMS`, default all. With
    ``memory_efficient`` (keeping ``kept`` channels, at most every shape's D) the figures are
    that mode's, and two columns follow the cache: the default mode's cache and the fraction
    of it saved; both caches in MB to three decimals, since the memory-efficient one is
    O(M + D).
    """
    head = ["shape", "dtype", "norm", "pass", "GFLOP", "minimal MB", "reference MB",
            "ref/minimal", "cache MB", "peak MB", "FLOP/byte"]
    if memory_efficient:
        head[9:9] = ["default cache MB", "saved"]
    if bandwidth_gbs:
        head.append(f"roofline ms @ {bandwidth_gbs:g} GB/s")
    rows = []
    for dims in map(shape_extents, shapes):
        m, d, label = math.prod(dims[:-1]), dims[-1], "x".join(map(str, dims))
        for dtype in dtypes:
            for name in dict.fromkeys(norms or NORMS):  # each once, in the order given
                for p in ("fwd", "bwd"):
                    c = cost.cost(p, m, d, DTYPES[dtype].itemsize, norm=name,
                                  memory_efficient=memory_efficient, kept=kept)
                    row = [label, dtype, NORMS[name].title, p, f"{c.flops / 1e9:.3f}",
                           f"{c.minimal_bytes / 1e6:.1f}", f"{c.reference_bytes / 1e6:.1f}",
                           f"{c.reference_traffic_ratio:.1f}"]
                    if not memory_efficient:
                        row.append(f"{c.cache_bytes / 1e6:.1f}" if p == "fwd" else "-")
                    elif p == "fwd":
                        row += [f"{c.cache_bytes / 1e6:.3f}", f"{c.default_cache_bytes / 1e6:.3f}",
                                f"{c.cache_saved_fraction:.2%}"]
                    else:
                        row += ["-", "-", "-"]
                    row += [f"{c.reference_peak_bytes / 1e6:.1f}", f"{c.intensity:.2f}"]
                    if bandwidth_gbs:
                        row.append(f"{c.roofline_seconds(bandwidth_gbs * 1e9) * 1e3:.3f}")
                    rows.append(row)
    return render(head, rows, markdown=True)


def _bandwidth(text: str) -> float:
    """A finite positive number of GB/s, for argparse."""
    try:
        gbs = float(text)
    except ValueError:
        gbs = math.nan
    if not (math.isfinite(gbs) and gbs > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of GB/s, got {text!r}")
    return gbs


def _kept(text: str) -> int:
    """A number of kept channels: an integer >= 0, for argparse."""
    try:
        k = int(text)
    except ValueError:
        k = -1
    if k < 0:
        raise argparse.ArgumentTypeError(f"must be a number of channels, an integer >= 0, "
                                         f"got {text!r}")
    return k


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", action="append", type=shape,
                        help="MxD or AxBxD (repeatable); default "
                             + ", ".join("x".join(map(str, s)) for s in DEFAULT_SHAPES)
                             + "; refused where x alone would need more than 2^60 bytes "
                               "(1 EiB) in a dtype asked for, beyond the memory of any "
                               "computer")
    parser.add_argument("--dtype", action="append", choices=NAMES,
                        help="repeatable; default float32 and bfloat16")
    parser.add_argument("--norm", action="append", choices=list(NORMS),
                        help="repeatable; default every norm of the family")
    parser.add_argument("--bandwidth", type=_bandwidth, default=None,
                        help="GB/s for the roofline column (e.g. the copy bandwidth that "
                             "layernorm bench measures)")
    parser.add_argument("--memory-efficient", action="store_true",
                        help="model the memory-efficient mode (memory_efficient=True): the "
                             "cache keeps rstd and the parameters, not xhat; the default "
                             "mode's cache and the fraction saved are shown beside it")
    parser.add_argument("--kept", type=_kept, default=None, metavar="K",
                        help="with --memory-efficient: the number of channels whose xhat the "
                             "cache keeps (layernorm.recovery.kept_channels), at most each "
                             "shape's D; default 0, as for weights at their initial values")


def run(args: argparse.Namespace) -> int:
    shapes, dtypes = args.shape or list(DEFAULT_SHAPES), args.dtype or list(DEFAULT_DTYPES)
    for dims in shapes:
        for dtype in dtypes:
            nbytes = math.prod(dims) * DTYPES[dtype].itemsize
            if nbytes > MAX_BYTES:
                return usage_error("layernorm cost", (
                    f"argument --shape: {'x'.join(map(str, dims))} needs {nbytes:.3g} bytes "
                    f"for x alone in {dtype}, more than 2^60 (1 EiB), beyond the memory of "
                    f"any computer"))
    kept = args.kept or 0
    if args.kept is not None and not args.memory_efficient:
        return usage_error("layernorm cost", (
            "argument --kept: needs --memory-efficient (the default mode keeps xhat whole, "
            "every channel)"))
    for dims in shapes:
        if kept > dims[-1]:
            return usage_error("layernorm cost", (
                f"argument --kept: {kept} channels kept, more than D = {dims[-1]} of shape "
                f"{'x'.join(map(str, dims))}"))
    print(table(shapes, dtypes, args.bandwidth, args.norm, memory_efficient=args.memory_efficient,
                kept=kept))
    return 0
