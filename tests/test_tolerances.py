"""The one comparison helper: the bound it applies, and what it says when it fails."""

from __future__ import annotations

import numpy as np
import pytest

from layernorm.tolerances import assert_close, compare, tolerance


def test_bound_is_atol_times_scale_plus_rtol_plus_subnormal_spacing():
    """Protects the rule every comparison uses: |got - want| <= atol*scale + rtol*|want| +
    2 subnormal spacings (+ floor), elementwise."""
    t = tolerance("float32")
    want = np.array([0.0, 1.0, 100.0])
    bound = t.atol * 10 + t.rtol * np.abs(want) + 2 * 2.0**-149
    assert compare(want + 0.99 * bound, want, "float32", scale=10).ok
    c = compare(want + [0, 0, 1.01 * bound[2]], want, "float32", scale=10)
    assert not c.ok and c.index == (2,) and c.bound == pytest.approx(bound[2])
    assert compare(want + 1.9 * bound, want, "float32", scale=10, floor=float(bound.max())).ok
    assert not compare(want + 1.9 * bound, want, "float32", scale=10).ok
    assert compare(np.array([3 * 2.0**-149]), np.array([2.0**-149]), "float32", scale=0).ok


def test_non_finite_values():
    """Protects against NaN passing and inf being misjudged: NaN or inf where the answer is
    finite fails; beyond the dtype's range, inf of the answer's sign is right; NaN matches NaN."""
    assert not compare(np.array([np.nan]), np.array([1.0]), "float32").ok
    assert not compare(np.array([np.inf]), np.array([1.0]), "float32").ok
    assert compare(np.array([np.inf]), np.array([7e4]), "float16").ok
    assert not compare(np.array([-np.inf]), np.array([7e4]), "float16").ok
    assert compare(np.array([np.nan, -np.inf]), np.array([np.nan, -np.inf]), "float64").ok


def test_assert_close_names_the_result_and_handles_none():
    """Protects the failure message (name, element, values) and None for absent gradients."""
    assert_close(None, None, "float64")
    with pytest.raises(AssertionError, match="one is None"):
        assert_close(np.zeros(2), None, "float64")
    with pytest.raises(AssertionError, match=r"dgamma \[float64 param\] at \(1,\)"):
        assert_close(np.array([1.0, 2.0]), np.array([1.0, 3.0]), "float64", "param",
                     name="dgamma")
