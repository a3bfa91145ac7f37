"""The Triton kernels of the family (layernorm.gpu.kernels) through their launchers
(layernorm.gpu.launch), against the float64 oracle of the definition on the same rounded inputs.

On a machine with CUDA these run on the GPU; otherwise in Triton's interpreter on CPU tensors
(conftest.py sets TRITON_INTERPRET=1), with shapes kept small because the interpreter is slow.
Long rows are tested on small shapes by lowering the plan limits (the ``path`` fixture of
conftest.py); the shared cases are in triton_cases.py.
Tolerances come from layernorm.tolerances: y, h, dx and dresidual are "out" results, dw and db
sums over rows ("gpu-param": float32 partial sums; float64 data sums in float64, "param").
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from grids import pairwise  # noqa: E402
from triton_cases import (  # noqa: E402
    DEVICE,
    DTYPE_NAMES,
    OVERFLOW_IS_AN_ANSWER,
    SHORT_D,
    Case,
    dtype_name,
    make_case,
    poisoned_empty,
    rescaled_rows,
    strided,
    torch_dtype,
)

from layernorm.dtypes import DTYPES  # noqa: E402
from layernorm.family import NORMS  # noqa: E402
from layernorm.gpu import forward, kernels, launch  # noqa: E402

# every buffer the launchers allocate starts as NaN (conftest.py)
pytestmark = pytest.mark.usefixtures("poisoned_outputs")

PATHS = ["short", "long"]  # the values of the path fixture (conftest.py)
# Where what is tested works the same for every norm on a path (the launch plan and the
# dw/db partials are the path's): each norm on one path, each path with a plain norm and an
# add-norm, a LayerNorm and an RMSNorm.
EACH_NORM_ONE_PATH = [("layer_norm", "short"), ("add_rms_norm", "short"), ("rms_norm", "long"),
                      ("add_layer_norm", "long")]


@pytest.mark.parametrize("name", list(NORMS))
def test_outputs_start_poisoned(name, monkeypatch):
    """Protects the poisoning: every result of the forward and the backward is a buffer that
    was NaN before the kernels ran (so the oracle checks see any element left unwritten),
    and every element was then written."""
    poisoned: set[int] = set()

    def recording(*args, **kw):
        t = poisoned_empty(*args, **kw)
        poisoned.add(t.data_ptr())
        return t

    monkeypatch.setattr(launch.torch, "empty", recording)
    got, mean, rstd = make_case(name, 5, SHORT_D, "bfloat16").run()
    results = [t for t in (*got.values(), mean, rstd) if t is not None]
    assert len(results) == len(got) + 2
    for t in results:
        assert t.data_ptr() in poisoned and not torch.isnan(t).any()


# --- the family against the oracle ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", list(NORMS))
def test_family_matches_the_oracle(name, dtype, path, check):
    """Protects every kernel of the family, in each dtype, on both paths: y, h, dx, dresidual,
    dw and db within the table of the float64 oracle, in their dtypes (float64 data in float64,
    with float64 statistics)."""
    check(make_case(name, 9, path, dtype))


@pytest.mark.parametrize("name", ["layer_norm", "add_rms_norm"])
def test_long_rows_at_their_real_size(name, check):
    """Protects the long-row kernels with their real plan (no limit lowered): D = 10,000 (two
    rows), past both passes' short-row limits, is looped over in blocks of LONG_BLOCK, never
    held whole; the last block is ragged."""
    D = 10000
    assert launch.plan("fwd", D).long and launch.plan("bwd", D).long
    assert D > 2 * launch.LONG_BLOCK and D % launch.LONG_BLOCK
    check(make_case(name, 2, D, "bfloat16" if "add" in name else "float32"))


@pytest.mark.parametrize("name", ["layer_norm", "add_layer_norm"])
def test_large_offset_is_accurate(name, path, check):
    """Protects the corrected two-pass statistics (and the Chan merge of shifted block statistics
    on the long path): x = 1000 + 0.01 noise in float32, where the rounding error of a plain
    mean (~3e-5) would shift xhat by ~3e-3; a drift along the row makes block means differ."""
    case = make_case(name, 4, path, "float32", loc=1000.0, spread=0.01)
    case.x += torch.linspace(0, 0.05, path, device=DEVICE)
    check(case)


@pytest.mark.parametrize("name, affine", [(n, a) for n in NORMS for a in ("none", "weight", "bias")
                                           if NORMS[n].centred or a != "bias"])  # no RMS bias
def test_parameters_each_optional(name, affine, check):
    """Protects weight and bias being independently optional: an absent one gets no gradient
    (None), and the others are still right."""
    check(make_case(name, 6, SHORT_D, "float32", affine=affine))


@pytest.mark.parametrize("dtype,param_dtype", [("bfloat16", "float32"), ("float32", "bfloat16"),
                                               ("float16", "float64"), ("float64", "float16")])
@pytest.mark.parametrize("name", ["layer_norm", "add_rms_norm"])
def test_mixed_parameter_dtypes(name, dtype, param_dtype, check):
    """Protects parameters of another dtype than x: the scale is formed in the compute dtype,
    and dw/db come back in the parameters' own dtypes (float64 data accumulates in float64,
    the rest in float32; a float16 gradient of float64 sums is rounded once)."""
    check(make_case(name, 6, SHORT_D, dtype, param_dtype=param_dtype))


@pytest.mark.parametrize("dtype,param_dtype", [("bfloat16", None), ("float32", "bfloat16"),
                                               ("float64", None)])
@pytest.mark.parametrize("name", list(NORMS))
def test_zero_centered_gamma(name, dtype, param_dtype, check):
    """Protects zero_centered_gamma: the scale is 1 + weight formed in the compute dtype (a
    bfloat16 weight of 2**-10 gives a scale of 1 + 2**-10, where 1 + weight in bfloat16 is 1,
    a float32 y 1e-3 off), and dweight is not multiplied by it."""
    case = make_case(name, 6, SHORT_D, dtype, param_dtype=param_dtype, zero_centered_gamma=True)
    case.weight[0] = 2.0**-10
    check(case)


@pytest.mark.parametrize("name, path, h_dtype", pairwise(
    ["add_layer_norm", "add_rms_norm"], PATHS, ["float32", "bfloat16"]), indirect=["path"])
def test_float32_residual_stream_with_bfloat16_x(name, path, h_dtype, check):
    """Protects the add-norms' mixed dtypes, each h dtype on both paths: bfloat16 x on a
    float32 residual stream (h, its dtype, float32): h = x + residual exactly, y and dx in
    bfloat16, dresidual in float32, the statistics float32; and bfloat16 h from a float32
    residual, rounded once; all within the table of the oracle."""
    case = make_case(name, 6, path, "bfloat16", residual_dtype="float32", h_dtype=h_dtype)
    got = check(case)
    assert torch.equal(got["h"], (case.x.float() + case.residual).to(torch_dtype(h_dtype)))
    assert got["dx"].dtype == torch.bfloat16 and got["dresidual"].dtype == torch.float32


@pytest.mark.parametrize("x_dtype,r_dtype,h_dtype", [
    ("bfloat16", "bfloat16", "bfloat16"), ("float16", "float16", "float16"),
    ("float32", "float64", "float32"), ("float16", "bfloat16", "float32")])
def test_h_is_rounded_once(x_dtype, r_dtype, h_dtype, path):
    """Protects h = x + residual formed in the widest compute dtype and rounded once to h's
    dtype, bit for bit (also under the interpreter, whose own bfloat16 conversion truncates)."""
    case = make_case("add_layer_norm", 5, path, x_dtype, residual_dtype=r_dtype,
                     h_dtype=h_dtype)
    wide = torch.float64 if torch.float64 in (case.x.dtype, case.residual.dtype) else \
        torch.float32
    want = (case.x.to(wide) + case.residual.to(wide)).to(torch_dtype(h_dtype))
    _, h, _, _ = launch.forward(case.x, case.residual, case.weight, case.bias, case.eps,
                                centred=True, h_dtype=case.h_dtype)
    assert h.dtype == want.dtype and torch.equal(h, want)


@pytest.mark.parametrize("name, path, dh", pairwise(
    ["add_layer_norm", "add_rms_norm"], PATHS, [False, True]), indirect=["path"])
def test_dh_absent_or_present(name, path, dh, check):
    """Protects dh, each way on both paths: absent, dx = dresidual = the norm's gradient;
    present, dh (N(0, 1), the size of that gradient, so one left out is far outside the
    table) is added before the one rounding; either way dx and dresidual within the table of
    the oracle, in their dtypes."""
    got = check(make_case(name, 5, path, "float32", dh=dh))
    assert got["dx"].dtype == got["dresidual"].dtype == torch.float32


# --- layouts, M = 0 ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, path", EACH_NORM_ONE_PATH, indirect=["path"])
def test_row_strides(name, path):
    """Protects inputs read in place through their row stride (x, residual, dy, dh, and the h
    given back to the backward), on both paths, with and without a residual: bitwise the
    results of contiguous copies."""
    case = make_case(name, 5, path, "float32")
    want, mean, rstd = case.run()
    laid_out = Case(**{**case.__dict__, **{k: strided(getattr(case, k))
                                          for k in ("x", "residual", "dy", "dh")}})
    got, _, _ = laid_out.run()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    n = NORMS[name]
    xn = strided(want["h"] if n.residual else case.x)
    dx, *_ = launch.backward(strided(case.dy), strided(case.dh), xn, case.weight, case.bias,
                             mean, rstd, centred=n.centred, x_dtype=case.x.dtype,
                             residual_dtype=case.x.dtype if n.residual else None)
    assert torch.equal(dx, want["dx"])


@pytest.mark.parametrize("name", list(NORMS))
def test_empty_batch(name):
    """Protects M = 0: empty outputs of the right shapes and dtypes, zero parameter gradients,
    no launch."""
    case = make_case(name, 0, 16, "bfloat16", residual_dtype="float32", h_dtype="float32")
    got, mean, rstd = case.run()
    assert got["y"].shape == (0, 16) and got["dx"].shape == (0, 16)
    assert mean.shape == rstd.shape == (0,) and mean.dtype == torch.float32
    assert torch.equal(got["dgamma"], torch.zeros_like(case.weight))
    if NORMS[name].residual:
        assert got["h"].dtype == got["dresidual"].dtype == torch.float32


# --- exact facts: constant rows, rescaled rows ---------------------------------------------


def _constant_rows(case: Case) -> list[int]:
    """Make rows 1 and 3 of what ``case`` normalizes constant (0 for RMSNorm), with values whose
    D-fold sum is inexact; row 5 constant near the top of the range (LayerNorm), whose sum
    overflows. Returns the constant rows."""
    centred = case.norm.centred
    big = 0.9 * DTYPES[dtype_name(case.x.dtype)].largest
    values = {1: 0.1, 3: -3.3, 5: big} if centred else {1: 0.0, 3: 0.0}
    for r, v in values.items():
        case.x[r] = v
        if case.residual is not None:
            case.residual[r] = 0.0
    return list(values)


@pytest.mark.parametrize("name, dtype, path", pairwise(list(NORMS), DTYPE_NAMES, PATHS),
                         indirect=["path"])
@OVERFLOW_IS_AN_ANSWER
def test_constant_rows(name, dtype, path, check):
    """Protects constant rows (found by max == min, not by var == 0): y = bias exactly (0 for an
    RMSNorm row of zeros), mean = the row's value exactly, rstd = 1/sqrt(eps) correctly
    rounded, and the gradients of the oracle (dx = rstd·(g − mean(g)), finite), also for a
    constant row whose sum overflows."""
    case = make_case(name, 7, path, dtype)
    rows = _constant_rows(case)
    got, mean, rstd = case.run()
    check(case, rows_scaled=True, results=got)
    xn = got["h"] if case.norm.residual else case.x
    for r in rows:
        want_y = case.bias if case.norm.centred else torch.zeros_like(case.weight)
        assert torch.equal(got["y"][r], want_y.to(case.x.dtype)), r
        assert mean[r].item() == (xn[r, 0].item() if case.norm.centred else 0.0)
        sdt = np.float64 if mean.dtype == torch.float64 else np.float32
        assert rstd[r].item() == sdt(1) / np.sqrt(sdt(case.eps))
    assert all(torch.isfinite(v).all() for v in got.values() if v is not None)


@pytest.mark.parametrize("name, path", EACH_NORM_ONE_PATH, indirect=["path"])
@OVERFLOW_IS_AN_ANSWER
def test_constant_rows_with_eps_zero(name, path, check):
    """Protects eps = 0 (torch accepts it), LayerNorm and RMSNorm rows on both paths: a
    constant row gives y = bias (torch gives NaN), mean = its value and rstd = inf (as torch);
    its dx = inf·(g − mean(g)) is ±inf or NaN (the derivative is unbounded there), but no other
    row and no parameter gradient is touched."""
    case = make_case(name, 6, path, "float32", eps=0.0)
    rows = _constant_rows(case)
    got, mean, rstd = case.run()
    others = [r for r in range(6) if r not in rows]
    for r in rows:
        want_y = case.bias if case.norm.centred else torch.zeros_like(case.weight)
        assert torch.equal(got["y"][r], want_y) and rstd[r].item() == float("inf")
        assert not torch.isfinite(got["dx"][r]).any()
    assert torch.isfinite(got["y"]).all() and torch.isfinite(got["dx"][others]).all()
    assert torch.isfinite(got["dgamma"]).all()
    ok = make_case(name, 6, path, "float32", eps=0.0)
    ok.x, ok.dy = ok.x[others], ok.dy[others]
    if ok.residual is not None:
        ok.residual, ok.dh = ok.residual[others], ok.dh[others]
    check(ok)


@triton.jit
def _inexact_div(a, b):
    """a / b with a relative error of 2**-22: what the GPU's div.full.f32 is allowed."""
    return a / b * (1.0 + 2.0**-22)


@triton.jit
def _inexact_rsqrt(v):
    """1 / sqrt(v) with a relative error of 2**-22, as from sqrt.approx."""
    return 1.0 / tl.sqrt(v) * (1.0 - 2.0**-22)


@pytest.mark.skipif(not kernels.INTERPRET, reason="patches the interpreter's kernels")
@pytest.mark.parametrize("name", ["layer_norm", "add_layer_norm"])
def test_constant_rows_do_not_depend_on_division_rounding(name, path, monkeypatch):
    """Protects the constant-row rule against the GPU's arithmetic: with the row means' division
    and the square root made inexact (a relative error of 2**-22, as div.full and sqrt.approx
    may have), a constant row still gives xhat = 0, so y = 0 exactly without bias, and mean =
    its value; by the old rule (var == 0) its centred values came out nonzero and y ~ 1e-12."""
    # the names as the forward kernels look them up (their module's globals)
    monkeypatch.setattr(forward, "_div", _inexact_div)
    monkeypatch.setattr(forward, "_rsqrt", _inexact_rsqrt)
    case = make_case(name, 5, path, "float32", affine="weight")
    case.x[2] = 0.1
    if case.residual is not None:
        case.residual[2] = 0.0
    y, _, mean, _ = launch.forward(case.x, case.residual, case.weight, case.bias, case.eps,
                                   centred=True)
    assert torch.equal(y[2], torch.zeros_like(y[2]))
    assert mean[2].item() == np.float32(0.1)


@pytest.mark.parametrize("name, dtype, long", pairwise(
    list(NORMS), ["bfloat16", "float32", "float64"], [False, True]))
@OVERFLOW_IS_AN_ANSWER
def test_rows_whose_sums_overflow(name, dtype, long, monkeypatch, check):
    """Protects the power-of-two rescaling in both passes: a row of one 3e38 and seven -3e38
    (float32; 0.9 of the largest value in each dtype) has a finite y and, since the backward
    works on x * s as the forward did, finite dx (it was NaN) and finite dw/db in every column;
    all within the table of the oracle (dx per row, relative to its size), the other rows
    untouched. Short rows, and long ones (D = 8 in blocks of 4), each norm and dtype on both."""
    if long:
        monkeypatch.setattr(launch, "MAX_SHORT_D_FWD", 4)
        monkeypatch.setattr(launch, "MAX_SHORT_D_BWD", 4)
        monkeypatch.setattr(launch, "LONG_BLOCK", 4)
    assert launch.plan("fwd", 8).long == launch.plan("bwd", 8, wide=True).long == long
    case = make_case(name, 5, 8, dtype)
    rescaled_rows(case)
    got = check(case, rows_scaled=True)
    for k, v in got.items():
        if k != "h":
            assert torch.isfinite(v).all(), k


@pytest.mark.parametrize("name, path", EACH_NORM_ONE_PATH, indirect=["path"])
@OVERFLOW_IS_AN_ANSWER
def test_tiny_rows_with_eps_zero(name, path, check):
    """Protects rows whose var underflows when eps = 0, LayerNorm and RMSNorm rows on both
    paths: values near 1e-20 (var below the smallest normal float32) and subnormal ones are
    rescaled too, so y is the oracle's (not ±inf), dw finite; dx of the subnormal row, ~1e41,
    is inf in float32, as it should be."""
    case = make_case(name, 4, path, "float32", eps=0.0)
    g = torch.Generator().manual_seed(2)
    for r, size in ((1, 1e-20), (2, 1e-42)):
        case.x[r] = (torch.randn(path, generator=g) * size).to(DEVICE)
        if case.residual is not None:
            case.residual[r] = 0.0
    got = check(case, rows_scaled=True)
    assert torch.isfinite(got["y"]).all() and torch.isfinite(got["dgamma"]).all()


# --- batch invariance, determinism, statistics ---------------------------------------------


@pytest.mark.parametrize("name, path", EACH_NORM_ONE_PATH, indirect=["path"])
@OVERFLOW_IS_AN_ANSWER
def test_batch_invariance(name, path):
    """Protects a row's y and dx (and h, dresidual) not depending on M or on its neighbours:
    five rows alone, then the same rows at another place in a batch of 12 rows that share
    their tiles with a rescaled row, give bitwise the same results."""
    case = make_case(name, 5, path, "bfloat16")
    alone, _, _ = case.run()
    big = make_case(name, 12, path, "bfloat16", seed=3)
    big.weight, big.bias = case.weight, case.bias
    rescaled_rows(big)
    for k in ("x", "residual", "dy", "dh"):
        t = getattr(big, k)
        if t is not None:
            t[6:11] = getattr(case, k)
    batch, _, _ = big.run()
    for k in ("y", "h", "dx", "dresidual"):
        if k in alone:
            assert torch.equal(batch[k][6:11], alone[k]), k


@pytest.mark.parametrize("name, path", EACH_NORM_ONE_PATH, indirect=["path"])
def test_deterministic(name, path, partial_rows):
    """Protects bit-identical results run to run (no atomics): every output of two runs is
    bitwise equal, with several programs writing partial rows of dw and db (16 "SMs": three
    tiles of short rows, the last ragged; four chunks of two rows on the long path)."""
    case = make_case(name, 130 if path == SHORT_D else 8, path, "bfloat16")
    (first, m1, r1), (second, m2, r2) = case.run(), case.run()
    assert len(partial_rows) == 2 and min(partial_rows) > 1, partial_rows
    assert torch.equal(m1, m2) and torch.equal(r1, r2)
    for k in first:
        assert torch.equal(first[k], second[k]), k


@pytest.mark.parametrize("name, path", EACH_NORM_ONE_PATH, indirect=["path"])
def test_statistics(name, path):
    """Protects the statistics the forward saves: float32 for bfloat16 data, float64 for a
    float64 h (float64 data, or bfloat16 x on a float64 residual stream); the mean (zeros for
    RMSNorm) and rstd close to the float64 ones."""
    n = NORMS[name]
    for dtype, h_dtype, sdt in (("bfloat16", None, torch.float32),
                                ("bfloat16", "float64", torch.float64),
                                ("float64", None, torch.float64)):
        if h_dtype and not n.residual:
            continue
        case = make_case(name, 6, path, dtype, h_dtype=h_dtype)
        _, h, mean, rstd = launch.forward(case.x, case.residual, case.weight, case.bias,
                                          case.eps, centred=n.centred, h_dtype=case.h_dtype)
        assert mean.dtype == rstd.dtype == sdt
        xn = (h if n.residual else case.x).double().cpu().numpy()
        want_mean = xn.mean(1) if n.centred else np.zeros(6)
        ms = ((xn - want_mean[:, None]) ** 2).mean(1)
        # Not table entries: the table bounds results, not the saved statistics; these are
        # the compute dtype's accuracy for sums of D terms.
        tol = 1e-12 if sdt == torch.float64 else 1e-6
        np.testing.assert_allclose(mean.cpu().numpy(), want_mean, atol=tol, rtol=tol)
        np.testing.assert_allclose(rstd.cpu().numpy(), 1 / np.sqrt(ms + case.eps), atol=tol,
                                   rtol=10 * tol)


# --- plans and bad input ----------------------------------------------------------------------


def test_float64_plans_are_half_size():
    """Protects the float64 plans (two registers per value): every limit, tile and block is
    halved, with the same warps per element."""
    for pass_, limit in (("fwd", launch.MAX_SHORT_D_FWD), ("bwd", launch.MAX_SHORT_D_BWD)):
        assert not launch.plan(pass_, limit // 2, wide=True).long
        assert launch.plan(pass_, limit // 2 + 1, wide=True).long
        narrow, wide = launch.plan(pass_, 256), launch.plan(pass_, 256, wide=True)
        assert wide.rows * 2 == narrow.rows and wide.num_warps == narrow.num_warps
        assert launch.plan(pass_, 10**6, wide=True).block * 2 == launch.LONG_BLOCK


def test_bad_input():
    """Protects the launchers' contract: what would be read wrong (a bias for RMSNorm, a shape
    mismatch, a column stride, statistics of another dtype, negative eps) is an error naming
    the argument, not a silent result."""
    case = make_case("layer_norm", 4, 8, "float32")
    x, w, b = case.x, case.weight, case.bias
    with pytest.raises(ValueError, match="bias"):
        launch.forward(x, None, w, b, 1e-5, centred=False)
    with pytest.raises(ValueError, match="residual"):
        launch.forward(x, x[:3], w, b, 1e-5, centred=True)
    with pytest.raises(ValueError, match="x must have unit column stride"):
        launch.forward(x.t().contiguous().t(), None, w, b, 1e-5, centred=True)
    with pytest.raises(ValueError, match="weight"):
        launch.forward(x, None, w[:7], b, 1e-5, centred=True)
    with pytest.raises(ValueError, match="eps"):
        launch.forward(x, None, w, b, -1.0, centred=True)
    _, _, mean, rstd = launch.forward(x, None, w, b, 1e-5, centred=True)
    with pytest.raises(ValueError, match="mean and rstd"):
        launch.backward(case.dy.double(), None, x.double(), w, b, mean, rstd, centred=True)
    with pytest.raises(ValueError, match="dh"):
        launch.backward(case.dy, case.dy, x, w, b, mean, rstd, centred=True)
