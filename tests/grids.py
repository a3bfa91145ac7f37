"""Test grids smaller than the full cross product, for axes that do not interact.

    pairwise(*axes) -> list of tuples: every pair of values of any two axes in at least one
                       case (a covering array of strength 2)

A full cross of norm x dtype x path x mode runs every combination; where a bug would need
three of those values at once to show, pairwise cases still run every value of every axis
against every value of every other, in about the product of the two largest axes' sizes.
Keep the full cross where the axes do interact (each dtype of each kernel variant, say).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["pairwise"]


def pairwise(*axes: Sequence) -> list[tuple]:
    """Cases that hold every pair of values of any two of ``axes`` at least once, each case a
    tuple with one value per axis in the order given. Deterministic: the same axes give the
    same cases. With two axes or fewer this is the full product."""
    axes = [list(a) for a in axes]
    if any(not a for a in axes):
        return []
    if len(axes) <= 2:
        return list(itertools.product(*axes))
    # the two largest axes in full (all their pairs are needed anyway), the rest chosen per
    # case to cover the most pairs still missing, ties to the value used least so far
    order = sorted(range(len(axes)), key=lambda i: -len(axes[i]))
    missing = {(i, a, j, b) for i, j in itertools.combinations(range(len(axes)), 2)
               for a in range(len(axes[i])) for b in range(len(axes[j]))}
    used = [[0] * len(a) for a in axes]

    def gain(case: dict[int, int], i: int, v: int) -> int:
        return sum(((min(i, j), v if i < j else w, max(i, j), w if i < j else v) in missing)
                   for j, w in case.items())

    def complete(case: dict[int, int]) -> tuple:
        for i in order:
            if i not in case:
                case[i] = max(range(len(axes[i])),
                              key=lambda v: (gain(case, i, v), -used[i][v], -v))
        for i, j in itertools.combinations(range(len(axes)), 2):
            missing.discard((i, case[i], j, case[j]))
        for i, v in case.items():
            used[i][v] += 1
        return tuple(axes[i][case[i]] for i in range(len(axes)))

    first, second = order[0], order[1]
    cases = [complete({first: a, second: b})
             for a in range(len(axes[first])) for b in range(len(axes[second]))]
    while missing:
        i, a, j, b = min(missing)
        cases.append(complete({i: a, j: b}))
    return cases
