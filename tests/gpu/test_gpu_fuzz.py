"""The differential fuzz of the Triton kernels (layernorm.gpu.kernels) against the float64 oracle:
the property of tests/test_fuzz.py for every norm of the family, through the launchers, with
fewer examples because Triton's interpreter is slow on the CPU (on a CUDA machine the same test
runs on the GPU)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fuzzing import budget, draw_family, draw_problem  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from triton_cases import (  # noqa: E402 - the launchers' runner and comparison, shared
    DEVICE,
    OVERFLOW_IS_AN_ANSWER,
    Case,
    assert_matches_oracle,
    strided,
)

from layernorm.family import NORMS  # noqa: E402
from layernorm.gpu import kernels  # noqa: E402

# Triton's interpreter reads bfloat16 subnormals wrongly (-9.2e-41 comes in as -0.0; torch and
# the hardware read them right): under the interpreter, bfloat16 results are only known to
# within the smallest normal number. The kernels round bfloat16 results themselves there.
_FLOOR = {"bfloat16": 2 * 2.0**-126} if kernels.INTERPRET else {}


def _tensor(a: np.ndarray | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The same values as a C-contiguous tensor of ``shape`` on DEVICE in a's dtype (through
    float32, or float64 for float64: exact)."""
    if a is None:
        return None
    wide = np.float64 if a.dtype == np.float64 else np.float32
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=wide)).reshape(shape)
    return t.to(DEVICE, getattr(torch, a.dtype.name))


@OVERFLOW_IS_AN_ANSWER
@pytest.mark.parametrize("name", list(NORMS))
@budget(60)
@given(data=st.data())
def test_triton_family_matches_the_oracle(name, data, float64_oracle):
    """Protects every Triton kernel of the family on any input it takes (float16, bfloat16,
    float32, float64; M = 0 and D = 1 included; values up to the dtype's limits; constant
    rows; gamma or 1 + gamma; a residual drawn like x, h in x's dtype or float32; rows read
    through a row stride): y, h, dx, dresidual, dw and db within the tolerance table of the
    float64 oracle (scaled by the size of their terms)."""
    norm = NORMS[name]
    p = draw_problem(data, max_elements=1024)
    args, cot, kw = draw_family(data, p, norm.residual, norm.centred)
    D = p.x.shape[-1]
    rows = (int(np.prod(p.x.shape[:-1])), D)  # the launchers take (M, D)
    x, *rest = args
    residual = rest.pop(0) if norm.residual else None
    weight, bias = (rest + [None])[:2]
    lay = strided if p.layout == "strided" else (lambda t: t)  # a row stride, read in place
    h_dtype = kw.get("residual_dtype")
    case = Case(norm, lay(_tensor(x, rows)), lay(_tensor(residual, rows)),
                _tensor(weight, (D,)), _tensor(bias, (D,)), lay(_tensor(cot[0], rows)),
                lay(_tensor(cot[1], rows)) if norm.residual else None, p.eps,
                kw["zero_centered_gamma"], getattr(torch, h_dtype) if h_dtype else None)
    assert_matches_oracle(case, float64_oracle, floor=_FLOOR.get(p.dtype.name, 0.0))
