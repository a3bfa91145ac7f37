"""What only a GPU can show, at the sizes users run: tensors past 2**31 elements (64-bit
offsets), bit-identical results run to run on the real grid, and a row's results unchanged
when the batch around it changes size. Every output buffer starts as NaN (the
``poisoned_outputs`` fixture), so an element no kernel writes shows.

These need CUDA: the interpreter cannot hold gigabytes, and the grids here are sized from the
real SM count. They take about 40 GB of GPU memory at most (an add-norm past 2**31 elements:
eight bfloat16 tensors of 4 GiB).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from fuzzing import family_scales  # noqa: E402
from triton_cases import DEVICE, Case, to_numpy  # noqa: E402

from layernorm import tolerances  # noqa: E402
from layernorm.family import NORMS  # noqa: E402
from layernorm.gpu import launch  # noqa: E402

pytestmark = pytest.mark.usefixtures("poisoned_outputs")  # buffers start as NaN (conftest.py)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: gigabytes of data")
PAST_INT32 = 2**31  # elements: past every 32-bit offset
BATCH = 2**27  # elements of a batch that fills every SM several times over
ROW_WISE = ("y", "h", "dx", "dresidual")  # results of a row that depend on that row alone


@pytest.fixture(autouse=True)
def free_memory():
    """Each test's tensors are freed before the next test allocates its own."""
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def gpu_case(name: str, M: int, N: int, seed: int = 0) -> Case:
    """A bfloat16 :class:`Case` drawn on the GPU (a CPU draw of 2**31 float64 values would
    take 16 GB): x = 0.5 + 2 N(0, 1), weight near 1, the rest N(0, 1)."""
    n = NORMS[name]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def draw(shape, mean=0.0, std=1.0):
        t = torch.empty(shape, device=DEVICE, dtype=torch.bfloat16)
        return t.normal_(mean, std, generator=gen)

    return Case(n, draw((M, N), 0.5, 2.0), draw((M, N)) if n.residual else None,
                draw((N,), 1.0, 0.5), draw((N,), 0.0, 0.5) if n.centred else None,
                draw((M, N)), draw((M, N)) if n.residual else None, n.eps)


def rows_of(case: Case, rows: list[int]) -> Case:
    """The same problem on ``rows`` of ``case`` alone."""
    def pick(t):
        return None if t is None else t[rows]

    return Case(case.norm, pick(case.x), pick(case.residual), case.weight, case.bias,
                pick(case.dy), pick(case.dh), case.eps)


def assert_rows_match_oracle(case: Case, got: dict, rows: list[int], float64_oracle) -> None:
    """The row-wise results ``got`` of ``case`` on ``rows`` within the table of the float64
    oracle's on those rows."""
    small = rows_of(case, rows)
    o = small.oracle(float64_oracle)
    sizes = family_scales(o)
    for name in ROW_WISE:
        if name in got:
            dt, quantity = small.tolerance_dtype(name, got[name])
            tolerances.assert_close(to_numpy(got[name][rows]).astype(np.float64), o.results[name],
                                    dt, quantity, scale=sizes[name], name=f"{name}{rows}")


def parameter_gradients(case: Case, mean: torch.Tensor, rstd: torch.Tensor
                        ) -> dict[str, torch.Tensor]:
    """dgamma (and dbeta) summed in float64 on the device from the saved statistics, about
    2**24 elements at a time: the sums over rows of dy * xhat (and of dy), with xhat from x,
    or from h = x + residual rounded once to bfloat16 as the kernels store it."""
    M, N = case.x.shape
    dgamma = torch.zeros(N, dtype=torch.float64, device=DEVICE)
    dbeta = torch.zeros_like(dgamma)
    step = max(1, 2**24 // N)  # rows at a time
    for start in range(0, M, step):
        s = slice(start, start + step)
        xn = case.x[s].double()
        if case.norm.residual:
            xn = (xn + case.residual[s].double()).bfloat16().double()
        dy = case.dy[s].double()
        dgamma += (dy * ((xn - mean[s, None].double()) * rstd[s, None].double())).sum(0)
        dbeta += dy.sum(0)
    return {"dgamma": dgamma, "dbeta": dbeta} if case.norm.centred else {"dgamma": dgamma}


# Short rows packed four a tile, the longest row held whole in both passes, and a long row
# (looped in blocks): each with M * N past 2**31, so the last rows sit past every 32-bit offset.
@CUDA
@pytest.mark.parametrize("N", [1024, 4096, 16384])
@pytest.mark.parametrize("name", list(NORMS))
def test_offsets_past_two_to_the_31(name, N, float64_oracle):
    """Protects 64-bit offsets: with M * N > 2**31 bfloat16 elements, every element of every
    output is written (none left NaN), the first and last rows match the float64 oracle, and
    dgamma and dbeta match a float64 sum over all rows."""
    M = PAST_INT32 // N + 3
    case = gpu_case(name, M, N)
    got, mean, rstd = case.run()
    for k, t in got.items():
        assert not torch.isnan(t).any(), f"{k} has unwritten (NaN) elements"
    assert_rows_match_oracle(case, got, [0, M - 2, M - 1], float64_oracle)
    for k, want in parameter_gradients(case, mean, rstd).items():
        tolerances.assert_close(got[k].double().cpu().numpy(), want.cpu().numpy(), "bfloat16",
                                "gpu-param", scale=float(want.abs().max()), name=k)


@CUDA
@pytest.mark.parametrize("N", [4096, 65536])
@pytest.mark.parametrize("name", list(NORMS))
def test_bit_identical_at_scale(name, N):
    """Protects determinism on the real grid (every SM, partial sums of dgamma and dbeta over
    many programs): two runs give bitwise the same results, statistics included."""
    case = gpu_case(name, BATCH // N, N, seed=1)
    (first, m1, r1), (second, m2, r2) = case.run(), case.run()
    assert torch.equal(m1, m2) and torch.equal(r1, r2)
    for k in first:
        assert torch.equal(first[k], second[k]), k


@CUDA
@pytest.mark.parametrize("N", [4096, 65536])
@pytest.mark.parametrize("name", list(NORMS))
def test_batch_invariant_at_scale(name, N):
    """Protects batch invariance on the real grid: the first seven rows give bitwise the same
    y, h, dx and dresidual alone (a handful of programs) as inside a batch of 2**27
    elements (a persistent grid over every SM)."""
    case = gpu_case(name, BATCH // N, N, seed=2)
    rows = list(range(7))
    batch, _, _ = case.run()
    alone, _, _ = rows_of(case, rows).run()
    for k in ROW_WISE:
        if k in batch:
            assert torch.equal(batch[k][rows], alone[k]), k


def test_plans_cover_these_paths():
    """Protects what the sizes above exercise: 1024 packs several rows a tile, 4096 is the
    longest row both passes hold whole, 16384 and 65536 loop over blocks in both."""
    assert launch.plan("fwd", 1024).rows > 1 and launch.plan("bwd", 1024).rows > 1
    assert not launch.plan("fwd", 4096).long and not launch.plan("bwd", 4096).long
    assert launch.plan("fwd", 16384).long and launch.plan("bwd", 16384).long
