"""tests/grids.py: the pairwise grids that the other tests' parametrizations are built from."""

from __future__ import annotations

import itertools

import pytest
from grids import pairwise

AXES = {
    "norm x dtype x path": (range(4), range(4), range(2)),
    "four of three": (range(3), range(3), range(3), range(3)),
    "five mixed": (range(4), range(4), range(2), range(2), range(3)),
}


@pytest.mark.parametrize("axes", AXES.values(), ids=AXES.keys())
def test_every_pair_of_values_is_in_a_case(axes):
    """Protects what a pairwise grid promises: each value of each axis meets each value of
    every other axis in some case, every case holds one value per axis, the same axes give
    the same cases, and there are far fewer cases than in the full cross."""
    cases = pairwise(*axes)
    assert all(len(c) == len(axes) and all(v in a for v, a in zip(c, axes, strict=True))
               for c in cases)
    for (i, a), (j, b) in itertools.combinations(enumerate(axes), 2):
        for u, v in itertools.product(a, b):
            assert any(c[i] == u and c[j] == v for c in cases), (i, u, j, v)
    assert cases == pairwise(*axes) and len(set(cases)) == len(cases)
    sizes = sorted(map(len, axes), reverse=True)
    assert sizes[0] * sizes[1] <= len(cases) <= 1.5 * sizes[0] * sizes[1]


def test_two_axes_are_the_full_product():
    """Protects the small grids: with two axes every combination is a case."""
    assert pairwise("ab", [1, 2]) == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    assert pairwise("ab", []) == []
