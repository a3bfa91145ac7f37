"""The differential fuzz of the Triton kernels (layernorm.gpu) against the exact oracle: the
property of tests/test_fuzz.py, with fewer examples because Triton's interpreter is slow on
the CPU (on a CUDA machine the same test runs on the GPU)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fuzzing import Problem, budget, draw_problem, scales  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from layernorm.gpu import kernels, layer_norm  # noqa: E402
from layernorm.tolerances import assert_close  # noqa: E402

# Drawn extremes may have a true result beyond float16's range (inf), and Triton's interpreter
# computes masked-out lanes too: NumPy warns of both.
OVERFLOW_IS_AN_ANSWER = pytest.mark.filterwarnings(
    "ignore:(overflow|invalid value|divide by zero) encountered")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _tensor(a: np.ndarray | None) -> torch.Tensor | None:
    """The same values as a tensor on DEVICE (through float32: exact for every dtype here)."""
    if a is None:
        return None
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    return t.to(DEVICE, TORCH_DTYPES[a.dtype.name]).requires_grad_()


def _numpy(t: torch.Tensor | None, dtype: np.dtype) -> np.ndarray | None:
    return None if t is None else t.detach().float().cpu().numpy().astype(dtype)


def _run(p: Problem) -> tuple:
    x, gamma, beta = (_tensor(a) for a in (p.x, p.gamma, p.beta))
    if p.layout == "strided":  # a row stride other than D: the kernels take it as it is
        wide = torch.zeros((*x.shape[:-1], 2 * x.shape[-1]), dtype=x.dtype, device=DEVICE)
        wide[..., ::2] = x.detach()
        x = wide[..., ::2].requires_grad_()
        x.retain_grad()
    y = layer_norm(x, (p.x.shape[-1],), gamma, beta, p.eps)
    y.backward(_tensor(p.dy).detach())
    return (_numpy(y, p.dtype), _numpy(x.grad, p.dtype),
            None if gamma is None else _numpy(gamma.grad, p.dtype),
            None if beta is None else _numpy(beta.grad, p.dtype))


# Triton's interpreter rounds float32 subnormals to bfloat16 wrongly (-8.8e-41 comes out as
# -1.07e-38; torch and the hardware round it right): under the interpreter, bfloat16 results
# below the smallest normal number are only known to within it.
_FLOOR = {"bfloat16": 2 * 2.0**-126} if kernels.INTERPRET else {}


@OVERFLOW_IS_AN_ANSWER
@budget(100)
@given(data=st.data())
def test_triton_kernels_match_the_exact_oracle(data):
    """Protects the Triton kernels on any input they take (float32, float16, bfloat16, M = 0
    and D = 1 included, values up to the dtype's limits): y, dx, dgamma and dbeta within the
    tolerance table of the exact answer (dgamma/dbeta under the float32-accumulation
    "gpu-param" entries)."""
    p = draw_problem(data, dtypes=tuple(TORCH_DTYPES), max_elements=1024)
    p = Problem(np.ascontiguousarray(p.x), p.gamma, p.beta, np.ascontiguousarray(p.dy), p.eps,
                p.kind, "strided" if p.layout == "strided" else "C")
    y, dx, dgamma, dbeta = _run(p)
    ex = p.exact()
    sc = scales(p, ex)
    floor = _FLOOR.get(p.dtype.name, 0.0)
    assert_close(y, ex.y, p.dtype, "out", scale=sc.y, floor=floor, name="y")
    assert_close(dx, ex.dx, p.dtype, "out", scale=sc.dx, floor=floor, name="dx")
    assert_close(dgamma, None if p.gamma is None else ex.dgamma, p.dtype, "gpu-param",
                 scale=sc.dgamma, floor=floor, name="dgamma")
    assert_close(dbeta, None if p.beta is None else ex.dbeta, p.dtype, "gpu-param",
                 scale=sc.dbeta, floor=floor, name="dbeta")
