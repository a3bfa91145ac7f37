"""The fused CPU kernels against the exact oracle on rows chosen to expose their sums."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from layernorm import cpu  # noqa: E402 - after the skip
from layernorm.numerics import exact_norm, ulp_error  # noqa: E402

D = 4096
EPS = 1e-5


def _two_roundings(exact_y: np.ndarray) -> float:
    """The most y = fl(x * fl(rstd)) can be off in ulps at max|y|, with rstd exact before its
    rounding: two roundings to nearest of at most u = 2**-24 of |y| each, so 2u*Y in ulps of
    Y = max|y|, which is Y / 2**floor(log2 Y) ulps, in [1, 2)."""
    big = float(np.abs(exact_y).max())
    return big / 2.0 ** np.floor(np.log2(big))


@pytest.mark.parametrize("name, x", [
    # The reported case: nearly equal squares of about 1.6e9.
    ("4e4 + 1e-3*N(0, 1)", 4e4 + 1e-3 * np.random.default_rng(0).standard_normal((4, D))),
    # A constant whose float32 sums of squares round the same way at every step: 4.0 ulps
    # with the squares summed in float32 over AVX-512's 64 lanes, 17 over SSE's 8.
    ("constant 60.84041976928711", np.full((2, D), 60.84041976928711)),
])
def test_rms_norm_float32_rows_of_equal_squares(name, x):
    """Protects RMSNorm's float32 statistics: on rows whose squares are nearly equal, y is
    within the two roundings of y = x * rstd (under 2 ulps), whatever the CPU's vector width.
    Fails if the sum of squares goes back to float32 lanes, whose error grows with the number
    of terms each lane adds in sequence (BLOCK / lanes)."""
    x = x.astype(np.float32)
    exact = exact_norm(x, None, None, EPS, centred=False).y
    y = cpu.rms_norm_forward(x, None, EPS)[0]
    assert ulp_error(y, exact, np.float32) < _two_roundings(exact), name
