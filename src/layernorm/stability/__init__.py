"""Measure the norms' numerical error against exact answers: the adversarial suite.

Seven tables, every error normwise, max|got - exact|/max|exact| (ulps: in the output dtype at
max|exact|), against the exact oracle (:func:`layernorm.numerics.exact_norm`, integer
arithmetic) unless the oracle column says otherwise:

1. Variance algorithms: the error of xhat = ((x - mean) - mean_lo)/sqrt(var + eps) when each
   algorithm of :mod:`layernorm.numerics` computes the statistics in the given dtype, and of
   the library's y = xhat (no gamma, beta) for an input of that dtype. Offset sweep
   x = offset + N(0, 1) for offsets 1e0 ... 1e14, tiny and zero variance, dynamic range,
   float16 extremes, long rows (D = 1e5).
2. LayerNorm in the library's backends (the NumPy reference and, where the C++ engine runs,
   the fused CPU kernels) on the targets: large offsets, zero-variance rows, values whose
   squares or sums overflow, values near the top of float64's range, long rows and many rows
   (M = 1e6, where the oracle is the float64 reference with math.fsum), with the target and
   pass/FAIL.
3. The backward's cancellation: dy chosen so that g = dy*gamma is close to span{1, xhat};
   the error of dx against kappa = max|g|*rstd/max|dx| for each way to compute it.
4. The rest of the family (RMSNorm, add+LayerNorm, add+RMSNorm) in both backends, every
   dtype, with the targets of table 2: large offsets, squares that overflow, dgamma over many
   rows; and zero-centred gamma for every norm.
5. The peers, each on the same inputs as ours (the fused CPU kernels): torch's eager
   F.layer_norm and F.rms_norm, the same under torch.compile, onnxruntime's fused CPU
   operators; y and, where the peer has a backward, dx, against the exact oracle and ours'
   targets: large mean with small variance, the rows of onnxruntime's tracker, constant rows,
   values near 1e30 (float32, bfloat16) and 1e300 (float64), float16 extremes, long rows. A
   peer that does not import here is shown absent, with the reason.
6. Speed of the reference and of the float64-arithmetic alternative.
7. The memory-efficient backward (y kept instead of x, xhat recovered from it): dx, dgamma
   and dbeta of each norm in both modes, in each backend, against the exact oracle, on
   adversarial rows and the hard cases of the recovery rule (gamma = 0, gamma from 1e-4 to
   1e4, beta = 1e4 * gamma); k, the channels the rule keeps; the memory-efficient error
   over the default's (the goal: at most 2x in float32 and float64); and the tolerance
   table's verdict (the target, in every dtype).

Exit status 1 if a target of ours in table 2, 4, 5 or 7 fails (the peers' misses are findings,
not failures). ``--quick`` shrinks the sizes of tables 1-4 and 6 (the report uses it); table 5
has sizes of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .._table import render
from ..family import NORMS
from .algorithms import OFFSETS, AlgoCase, algorithm_table
from .common import EXACT, FULL, FUSED, QUICK, Backend, Sizes, Table
from .mechanisms import cancellation_table, timing_table
from .memory_efficient import ME_TITLE, memory_efficient_table
from .peers import _PEER_RUN as _PEER_RUN
from .peers import (
    OURS,
    PEER_D,
    PEER_LONG_D,
    PEER_ROWS,
    PEER_TITLE,
    PEERS,
    PeerCase,
    absent_peers,
    peer_table,
)
from .peers import _one_torch_thread as _one_torch_thread
from .plot import plot_sweep
from .targets import FamilyCase, RefCase, family_table, reference_table

# The public names; the tests also read _PEER_RUN and _one_torch_thread from here.
__all__ = [
    "EXACT",
    "FULL",
    "FUSED",
    "ME_TITLE",
    "NORMS",
    "OFFSETS",
    "OURS",
    "PEERS",
    "PEER_D",
    "PEER_LONG_D",
    "PEER_ROWS",
    "PEER_TITLE",
    "QUICK",
    "AlgoCase",
    "Backend",
    "FamilyCase",
    "PeerCase",
    "RefCase",
    "Results",
    "Sizes",
    "Table",
    "absent_peers",
    "algorithm_table",
    "cancellation_table",
    "family_table",
    "format_table",
    "memory_efficient_table",
    "peer_table",
    "plot_sweep",
    "reference_table",
    "run_suite",
    "timing_table",
]


@dataclass
class Results:
    """The tables, the offset sweep for the plot and whether every target held."""

    tables: list[Table]
    # dtype -> series name -> [(offset, error)]
    sweep: dict[str, dict[str, list[tuple[float, float]]]]
    failed: list[str]
    # peer -> the cases of table 5 where it misses a target: (norm title, case, dtype)
    missed: dict[str, list[tuple[str, str, str]]] = field(default_factory=dict)


def run_suite(quick: bool = False, seed: int = 0, timing: bool = True, peers: bool = True
              ) -> Results:
    """Every table (without the peers' or the speed table when asked); deterministic for a
    given seed and the peers' versions (timings aside)."""
    sz = QUICK if quick else FULL
    rng = np.random.default_rng(seed)
    algorithms, sweep = algorithm_table(sz, rng)
    ref, failed = reference_table(sz, rng, seed)
    # The family draws from a stream of its own: the other tables do not depend on it.
    family, family_failed = family_table(sz, np.random.default_rng([seed, 3]))
    tables = [algorithms, ref, cancellation_table(sz, rng), family]
    failed += family_failed
    missed: dict[str, list[tuple[str, str, str]]] = {}
    if peers:  # a stream of its own too, and the same cases under --quick
        table, peers_failed, missed = peer_table(np.random.default_rng([seed, 5]))
        tables.append(table)
        failed += peers_failed
    if timing:
        tables.append(timing_table(sz, rng))
    me, me_failed = memory_efficient_table(sz, np.random.default_rng([seed, 7]))
    tables.append(me)
    failed += me_failed
    return Results(tables, sweep, failed, missed)


def format_table(table: Table, markdown: bool = False) -> str:
    title = f"**{table.title}**" if markdown else table.title
    lines = [title, "", render(table.head, table.rows, markdown)]
    if table.note:
        lines += ["", table.note]
    return "\n".join(lines)
