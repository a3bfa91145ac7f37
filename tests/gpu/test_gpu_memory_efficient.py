"""The memory-efficient backward of the Triton kernels (layernorm.gpu.launch.backward_from_y):
xhat recovered from y as (y - shift) / scale, the channels layernorm.recovery keeps read from
their own (M, k) store and the rows it keeps whole from their (r, D) store, against the
reference's memory-efficient backward.

The saves are what the library's memory-efficient forward on these kernels keeps
(layernorm.torch's CUDA forward from y, ``_ops._fwd_y_triton``): y, the true rstd, the kept
channels and their xhat, the rows kept whole and theirs. The reference (layernorm.reference
.*_forward(..., memory_efficient=True), then *_backward) is the definition; its forward must
keep the same channels and rows, and it is given the same saves (its OutputCache with y, rstd,
xhat_kept, rows and xhat_rows replaced by these), so the comparison is of the two backwards
alone. Tolerances as in test_gpu.py: dx and dresidual are "out" results, dw and db sums over
rows ("gpu-param"; "param" for float64 data).

As the other tests/gpu files: on CUDA when present, else in Triton's interpreter on CPU tensors
(conftest.py sets TRITON_INTERPRET=1), with small shapes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from grids import pairwise  # noqa: E402
from triton_cases import (  # noqa: E402
    DEVICE,
    DTYPE_NAMES,
    OVERFLOW_IS_AN_ANSWER,
    SHORT_D,
    Case,
    coarser,
    compute_name,
    dtype_name,
    make_case,
    rescaled_rows,
    strided,
    to_numpy,
)

from layernorm import reference as ref  # noqa: E402
from layernorm import tolerances  # noqa: E402
from layernorm.family import NORMS  # noqa: E402
from layernorm.gpu import launch  # noqa: E402
from layernorm.torch import _ops  # noqa: E402

# The interpreter divides in NumPy on every lane: y - shift over a zero scale on a kept channel
# (replaced by the kept value), and masked-out lanes; NumPy warns of both.
pytestmark = [
    pytest.mark.usefixtures("poisoned_outputs"),  # buffers start as NaN (conftest.py)
    pytest.mark.filterwarnings(
        "ignore:(divide by zero|invalid value) encountered in divide:RuntimeWarning"),
]


@dataclass
class Saves:
    """What the memory-efficient backward reads: y (x's dtype), rstd (M,), keep (k,) and kept
    (M, k) in the compute dtype T, rows (r,) and xhat_rows (r, D) in T (both None: the
    launcher's default, no rows kept whole)."""

    y: torch.Tensor
    rstd: torch.Tensor
    keep: torch.Tensor
    kept: torch.Tensor
    rows: torch.Tensor | None = None
    xhat_rows: torch.Tensor | None = None


def saves_of(case: Case) -> Saves:
    """What the library's memory-efficient forward on the Triton kernels keeps for ``case``
    (layernorm.torch's CUDA forward from y, here on the CPU tensors of the interpreter): y,
    the row's true rstd (the forward's rescaling folded back in), the kept channels and their
    xhat, the rows kept whole and theirs."""
    n = case.norm
    y, _, _, rstd, keep, kept, rows, xrows = _ops._fwd_y_triton(
        case.x, case.residual, case.weight, case.bias, case.eps, n.centred,
        case.zero_centered_gamma, case.h_dtype)
    return Saves(y, rstd, keep, kept, rows, xrows)


def forward_rstd(case: Case) -> torch.Tensor:
    """The Triton forward's own rstd of ``case``: negative on a row it rescaled (the
    statistics of xn * s, a mark the backward from y cannot complete)."""
    n = case.norm
    return launch.forward(case.x, case.residual, case.weight, case.bias, case.eps,
                          centred=n.centred, zero_centered_gamma=case.zero_centered_gamma,
                          h_dtype=case.h_dtype)[3]


def run_from_y(case: Case, saves: Saves) -> dict[str, torch.Tensor | None]:
    """backward_from_y on ``saves``, its results keyed as the reference's."""
    n = case.norm
    dx, dr, dw, db = launch.backward_from_y(
        case.dy, case.dh, saves.y, case.weight, case.bias, saves.rstd, saves.keep, saves.kept,
        centred=n.centred, zero_centered_gamma=case.zero_centered_gamma,
        x_dtype=case.x.dtype, residual_dtype=case.residual.dtype if n.residual else None,
        rows=saves.rows, xhat_rows=saves.xhat_rows)
    got = {"dx": dx, "dresidual": dr, "dgamma": dw, "dbeta": db}
    return {k: got[k] for k in _names(case)}


def _names(case: Case) -> tuple[str, ...]:
    n = case.norm
    return ("dx", *n.backward_outputs[1:], "dgamma", *(("dbeta",) if n.centred else ()))


@dataclass
class Want:
    """The reference's results on the same saves, and what the sizes of their terms are
    computed from: its cache of the norm (xhat recovered as the definition does)."""

    results: dict[str, np.ndarray | None]
    norm: ref.OutputCache
    dy: np.ndarray
    dh: np.ndarray | None


def reference(case: Case, saves: Saves, *, own_rows: bool = True) -> Want:
    """The reference's memory-efficient backward given ``saves``: its forward (which must keep
    the same channels, and when ``own_rows`` the same rows), its OutputCache with y, rstd,
    xhat_kept, rows and xhat_rows replaced by the saves' (no rows when they are None)."""
    n = case.norm
    name = n.name
    args = [to_numpy(case.x)] + ([to_numpy(case.residual)] if n.residual else [])
    args += [to_numpy(case.weight)] + ([to_numpy(case.bias)] if n.centred else [])
    kw = {"zero_centered_gamma": case.zero_centered_gamma, "memory_efficient": True}
    if n.residual and case.h_dtype is not None:
        kw["residual_dtype"] = dtype_name(case.h_dtype)
    cache = getattr(ref, f"{name}_forward")(*args, case.eps, **kw)[-1]
    norm = cache.norm if n.residual else cache
    keep = saves.keep.cpu().numpy()
    assert np.array_equal(norm.keep, keep), (norm.keep, keep)
    if saves.rows is None:
        rows = np.empty(0, np.int64)
        xhat_rows = np.empty((0, saves.y.shape[1]), to_numpy(saves.rstd).dtype)
    else:
        rows, xhat_rows = saves.rows.cpu().numpy(), to_numpy(saves.xhat_rows)
    if own_rows:
        assert np.array_equal(norm.rows, rows), (norm.rows, rows)
    norm = dataclasses.replace(norm, y=to_numpy(saves.y).reshape(norm.y.shape),
                               rstd=to_numpy(saves.rstd), xhat_kept=to_numpy(saves.kept),
                               rows=rows, xhat_rows=xhat_rows)
    dy, dh = to_numpy(case.dy), to_numpy(case.dh)
    if n.residual:
        out = getattr(ref, f"{name}_backward")(dy, dh, dataclasses.replace(cache, norm=norm))
    else:
        out = getattr(ref, f"{name}_backward")(dy, norm)
    return Want(dict(zip(_names(case), out, strict=True)), norm, dy, dh)


def _top(a: np.ndarray) -> float:
    a = a[np.isfinite(a)]
    return float(np.max(a)) if a.size else 0.0


def sizes(want: Want, rows: slice = slice(None)) -> dict[str, float]:
    """The size of the terms that make each result (the comparison's ``scale``), as
    tests/fuzzing.py's family_scales, from the reference's own terms on ``rows``: g = dy *
    scale, dx = dh + rstd * (g - [mean(g)] - xhat * mean(g * xhat)); |xhat| counts as at
    least 1."""
    c = want.norm
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        xhat = c.xhat().astype(np.float64)[rows]
        dy = want.dy.astype(np.float64)[rows]
        rstd = c.rstd.astype(np.float64)[rows, None]
        g = dy * (1.0 if c.scale is None else c.scale.astype(np.float64))
        dnorm = rstd * (np.abs(g) + (np.abs(g.mean(1, keepdims=True)) if c.centred else 0.0)
                        + np.abs(xhat) * np.abs(g * xhat).mean(1, keepdims=True))
        dh = 0.0 if want.dh is None else np.abs(want.dh.astype(np.float64))[rows]
        xhat1 = np.maximum(np.abs(xhat), 1.0)
        dx = _top(dnorm + dh)
        return {"dx": dx, "dresidual": dx,
                "dgamma": _top(np.nansum(np.abs(dy) * xhat1, axis=0)),
                "dbeta": _top(np.abs(dy).sum(0))}


def assert_matches_reference(case: Case, saves: Saves | None = None, *,
                             rows_scaled: bool = False, own_rows: bool = True
                             ) -> tuple[dict, Saves]:
    """Every result of backward_from_y on ``saves`` (default :func:`saves_of`) within the
    table of the reference's on the same saves, in the right dtype and shape (dx and
    dresidual per row, relative to the row's size, when ``rows_scaled``); returns ours.
    ``own_rows``: the reference's forward keeps the same rows whole as ``saves``."""
    saves = saves_of(case) if saves is None else saves
    got = run_from_y(case, saves)
    want = reference(case, saves, own_rows=own_rows)
    size = sizes(want)
    for name, g in got.items():
        w = want.results[name]
        if w is None:
            assert g is None, f"{name} should be None"
            continue
        ref_t = {"dx": case.x, "dresidual": case.residual, "dgamma": case.weight,
                 "dbeta": case.bias}[name]
        assert g.dtype == ref_t.dtype and tuple(g.shape) == w.shape, (name, g.dtype, g.shape)
        param = name in ("dgamma", "dbeta")
        dt = coarser(dtype_name(g.dtype), compute_name(saves.rstd.dtype))
        quantity = ("param" if dt == "float64" else "gpu-param") if param else "out"
        a = to_numpy(g).astype(np.float64)
        if rows_scaled and not param:
            for r in range(a.shape[0]):
                row_size = sizes(want, slice(r, r + 1))[name]
                tolerances.assert_close(a[r], w[r], dt, quantity, scale=row_size,
                                        name=f"{name}[{r}]")
        else:
            tolerances.assert_close(a, w, dt, quantity, scale=size[name], name=name)
    return got, saves


PATHS = ["short", "long"]  # the values of the path fixture (conftest.py)
# Where what is tested works the same for every norm on a path (the launch plan and the
# dw/db partials are the path's): each norm on one path, each path with a plain norm and an
# add-norm, a LayerNorm and an RMSNorm.
EACH_NORM_ONE_PATH = [("layer_norm", "short"), ("add_rms_norm", "short"), ("rms_norm", "long"),
                      ("add_layer_norm", "long")]


# --- every norm and dtype, both paths ---------------------------------------------------------


def _some_kept(case: Case) -> Case:
    """Channels of both kinds: a zero scale on channel 3 and |bias| = 40 on channel 5 (kept,
    the latter for LayerNorm), the rest recovered."""
    if case.weight is not None:
        case.weight[3] = -1.0 if case.zero_centered_gamma else 0.0
    if case.bias is not None:
        case.bias[5] = 40.0
    return case


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", list(NORMS))
def test_matches_the_reference(name, dtype, path):
    """Protects the memory-efficient backward of every norm in each dtype, on both paths: xhat
    recovered from y on most channels and read from kept on the others (a zero weight; a bias
    40 times the weight), dx, dresidual, dw and db within the table of the reference's
    memory-efficient backward on the same saves, in their dtypes."""
    case = _some_kept(make_case(name, 9, path, dtype))
    _, saves = assert_matches_reference(case)
    assert 3 in saves.keep.tolist() and (5 in saves.keep.tolist()) == case.norm.centred


@pytest.mark.parametrize("name, affine", [(n, a) for n in NORMS for a in ("none", "weight", "bias")
                                           if NORMS[n].centred or a != "bias"])  # no RMS bias
def test_parameters_each_optional(name, affine):
    """Protects weight and bias being independently optional: without weight the scale is 1
    (no division), without bias the shift is 0 (no subtraction), an absent parameter gets no
    gradient, and the rest is the reference's."""
    case = make_case(name, 6, SHORT_D, "float32", affine=affine)
    if case.bias is not None:
        case.bias[5] = 40.0  # kept: |bias| > 4 * 1
    _, saves = assert_matches_reference(case)
    assert saves.keep.tolist() == ([5] if affine == "bias" else [])


@pytest.mark.parametrize("dtype,param_dtype", [("bfloat16", None), ("float32", "bfloat16"),
                                               ("float64", None)])
@pytest.mark.parametrize("name", list(NORMS))
def test_zero_centered_gamma(name, dtype, param_dtype):
    """Protects zero_centered_gamma: the scale y is divided by is 1 + weight formed in the
    compute dtype (a bfloat16 weight of 2**-10 gives 1 + 2**-10, not 1), and a weight of -1
    (scale 0) is kept, not divided by."""
    case = make_case(name, 6, SHORT_D, dtype, param_dtype=param_dtype, zero_centered_gamma=True)
    case.weight[0] = 2.0**-10
    case.weight[2] = -1.0
    _, saves = assert_matches_reference(case)
    assert 2 in saves.keep.tolist() and 0 not in saves.keep.tolist()


@pytest.mark.parametrize("name, path, h_dtype", pairwise(
    ["add_layer_norm", "add_rms_norm"], PATHS, ["float32", "float64"]), indirect=["path"])
def test_add_norm_dtypes(name, path, h_dtype):
    """Protects the add-norms' dtypes, each h dtype on both paths: bfloat16 x (and y) on a
    float32 residual stream computes in float32 (T from kept) with dx in bfloat16 and dresidual
    in float32; bfloat16 x with a float64 h computes in float64 (T float64: the add in float64,
    so dresidual = dx + dh is not rounded to float32 first); within the table of the
    reference's."""
    case = _some_kept(make_case(name, 6, path, "bfloat16", residual_dtype="float32",
                                h_dtype=h_dtype))
    got, saves = assert_matches_reference(case)
    assert saves.kept.dtype == saves.rstd.dtype == getattr(torch, h_dtype)
    assert got["dx"].dtype == torch.bfloat16 and got["dresidual"].dtype == torch.float32


# --- the recovery's hard cases ----------------------------------------------------------------


@pytest.mark.parametrize("name, dtype, path", pairwise(list(NORMS), DTYPE_NAMES, PATHS),
                         indirect=["path"])
def test_zero_weights(name, dtype, path):
    """Protects channels whose scale is exactly 0 (y there is the bias, xhat lost): kept, so
    their dw = sum(dy * xhat) comes from kept, never from (y - bias) / 0 = NaN or inf, and dx
    (whose g is 0 there) is finite everywhere."""
    case = make_case(name, 7, path, dtype)
    zero = [0, 1, 4, path - 1]
    case.weight[zero] = 0.0
    got, saves = assert_matches_reference(case)
    assert set(zero) <= set(saves.keep.tolist())
    assert all(torch.isfinite(v).all() for v in got.values() if v is not None)
    assert (got["dgamma"][zero] != 0).all()


@pytest.mark.parametrize("name, dtype, path", pairwise(list(NORMS), DTYPE_NAMES, PATHS),
                         indirect=["path"])
@OVERFLOW_IS_AN_ANSWER
def test_weights_across_eight_decades(name, dtype, path):
    """Protects the division on weights from 1e-4 to 1e4 of either sign (bias N(0, 1)): small
    ones with |bias| > 4 |weight| kept, the rest recovered by a correctly rounded division;
    float16's large ones kept as well (|weight| sqrt(D) + |bias| past half its largest value,
    y could overflow)."""
    case = make_case(name, 6, path, dtype)
    g = torch.Generator().manual_seed(4)
    mag = torch.logspace(-4, 4, path, dtype=torch.float64)[torch.randperm(path, generator=g)]
    sign = torch.where(torch.rand(path, generator=g) < 0.5, -1.0, 1.0)
    case.weight.copy_((mag * sign).to(case.weight.dtype))
    if case.bias is not None:
        case.bias.copy_(torch.randn(path, generator=g, dtype=torch.float64))
    _, saves = assert_matches_reference(case)
    k = len(saves.keep)
    assert 0 < k < path if case.bias is not None else k == 0 or dtype == "float16"
    if dtype == "float16":
        big = (case.weight.abs() * path**0.5 > 32752).nonzero().flatten().tolist()
        assert big and set(big) <= set(saves.keep.tolist())


@pytest.mark.parametrize("name, dtype, path", pairwise(
    ["layer_norm", "add_layer_norm"], DTYPE_NAMES, PATHS), indirect=["path"])
def test_every_channel_kept(name, dtype, path):
    """Protects k = D: a bias of 1e4 times the weight (|shift / scale| = 1e4 > 4) keeps every
    channel, so xhat comes from kept alone, y only being read."""
    case = make_case(name, 6, path, dtype)
    case.bias.copy_((1e4 * case.weight.double()).to(case.bias.dtype))
    _, saves = assert_matches_reference(case)
    assert saves.keep.tolist() == list(range(path))


@pytest.mark.parametrize("name, dtype, path, affine", pairwise(
    list(NORMS), DTYPE_NAMES, PATHS, ["both", "none"]), indirect=["path"])
def test_nothing_kept(name, dtype, path, affine):
    """Protects k = 0 (weights at their initial values, weight = 1 and bias = 0; or no
    parameters), each way in every dtype, on both paths: xhat recovered on every channel, kept
    an (M, 0) tensor, no map; and the result is close to the default backward's (which
    rebuilds xhat from xn)."""
    case = make_case(name, 6, path, dtype, affine=affine)
    if case.weight is not None:
        case.weight.fill_(1.0)
    if case.bias is not None:
        case.bias.fill_(0.0)
    got, saves = assert_matches_reference(case)
    assert saves.keep.numel() == 0 and saves.kept.shape == (6, 0)
    y, h, mean, rstd = launch.forward(case.x, case.residual, case.weight, case.bias,
                                      case.eps, centred=case.norm.centred)
    n = case.norm
    default = launch.backward(case.dy, case.dh, h if n.residual else case.x, case.weight,
                              case.bias, mean, rstd, centred=n.centred,
                              x_dtype=case.x.dtype,
                              residual_dtype=case.residual.dtype if n.residual else None)
    size = float(default[0].double().abs().max())
    tol = tolerances.tolerance(coarser(dtype, compute_name(rstd.dtype)), "out")
    # both within the table of the truth, so within twice it of each other, plus y's own
    # rounding carried into xhat (u * |xhat|, |xhat| <= sqrt(D))
    u = 2.0 ** -(1 + {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}[dtype])
    diff = float((got["dx"].double() - default[0].double()).abs().max())
    assert diff <= (2 * tol.atol + 2 * tol.rtol + 4 * u * path**0.5) * size, (diff, size)


# --- rows the forward rescaled, constant rows --------------------------------------------------


@pytest.mark.parametrize("name, dtype, long", pairwise(
    list(NORMS), ["float32", "float64"], [False, True]))
@OVERFLOW_IS_AN_ANSWER
def test_rescaled_rows(name, dtype, long, monkeypatch):
    """Protects rows whose sums overflow (the forward's rstd negative, the statistics of
    xn * s): given rstd with s folded back in (s * |rstd|, what a memory-efficient forward
    keeps), dx matches the reference's row by row; given the forward's marked rstd, which y
    cannot complete, that row's dx is NaN (never a silently wrong value) and the other rows,
    dw and db are unchanged. Short rows, and long ones (D = 8 in blocks of 4), each norm and
    dtype on both."""
    if long:
        monkeypatch.setattr(launch, "MAX_SHORT_D_BWD", 4)
        monkeypatch.setattr(launch, "LONG_BLOCK", 4)
    assert launch.plan("bwd", 8, wide=True).long == long
    case = make_case(name, 5, 8, dtype)
    rescaled_rows(case)
    good, saves = assert_matches_reference(case, rows_scaled=True)
    marked = forward_rstd(case)
    rescaled = (marked < 0).nonzero().flatten().tolist()
    assert rescaled == [0, 2, 3]
    assert torch.equal(saves.rstd[[1, 4]], marked[[1, 4]])  # the others' own rstd
    bad = run_from_y(case, dataclasses.replace(saves, rstd=marked))
    for k, v in bad.items():
        if k in ("dx", "dresidual"):
            assert torch.isnan(v[rescaled]).all(), k
            assert torch.equal(v[[1, 4]], good[k][[1, 4]]), k
        else:
            assert torch.equal(v, good[k]), k


@pytest.mark.parametrize("name, path", EACH_NORM_ONE_PATH, indirect=["path"])
def test_constant_rows(name, path):
    """Protects constant rows, LayerNorm and RMSNorm ones on both paths (y = bias, xhat = 0
    recovered exactly on channels whose bias is a float32 value: y - shift = 0): dx = rstd *
    (g - mean(g)) as in the reference, finite, with rstd = 1/sqrt(eps)."""
    case = make_case(name, 5, path, "float32")
    for r, v in ((1, 0.1), (3, -3.3)) if case.norm.centred else ((1, 0.0), (3, 0.0)):
        case.x[r] = v
        if case.residual is not None:
            case.residual[r] = 0.0
    got, _ = assert_matches_reference(case, rows_scaled=True)
    assert all(torch.isfinite(v).all() for v in got.values() if v is not None)


# --- rows kept whole ------------------------------------------------------------------------------


class LaunchSpy:
    """A backward kernel whose launches record their HAS_ROWS flag in ``seen``."""

    def __init__(self, kernel, seen: list[bool]):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kw):
            self.seen.append(kw["HAS_ROWS"])
            return launch(*args, **kw)
        return run


@pytest.fixture
def has_rows(monkeypatch) -> list[bool]:
    """The HAS_ROWS flag of every backward kernel launched, in order."""
    seen: list[bool] = []
    for k in ("_bwd_short_kernel", "_bwd_long_rowstats_kernel", "_bwd_long_dx_kernel"):
        monkeypatch.setattr(launch, k, LaunchSpy(getattr(launch, k), seen))
    return seen


def _nearly_constant(case: Case, rows: list[int]) -> Case:
    """``rows`` of an add-norm made nearly constant: h = v + k ulps of h's dtype (k in -2..2),
    x = v * U(0.2, 0.8) rounded to x's dtype and residual = h - x rounded to its own, so
    x + residual is h up to the residual's rounding (var ~ (u v)**2, far below eps).
    v = +-U(1, 2): xhat ~ u * v / sqrt(eps) is then ~1e-3 of what recovery through a bias of
    N(0, 0.5) loses (u * |bias / scale|). h's dtype is float32 or float64."""
    g = torch.Generator().manual_seed(7)
    D = case.x.shape[1]
    hdt = case.h_dtype or case.x.dtype
    for r in rows:
        v = ((1.0 + torch.rand((), generator=g, dtype=torch.float64)) * (-1.0) ** r).to(hdt)
        ulp = torch.nextafter(v, torch.tensor(float("inf"), dtype=hdt)) - v
        h = (v + torch.randint(-2, 3, (D,), generator=g).to(hdt) * ulp).double()
        x = (h * (0.2 + 0.6 * torch.rand(D, generator=g, dtype=torch.float64))).to(case.x.dtype)
        case.x[r] = x.to(DEVICE)
        case.residual[r] = (h - x.double()).to(DEVICE, case.residual.dtype)
    return case


def _mixed_precision(dtype: str) -> dict[str, str]:
    """bfloat16 activations on a float32 residual stream with float32 parameters (y is
    bfloat16, T float32); the other dtypes throughout."""
    if dtype != "bfloat16":
        return {}
    return {"residual_dtype": "float32", "h_dtype": "float32", "param_dtype": "float32"}


@pytest.mark.parametrize("dtype, path, whole", pairwise(
    ["float32", "bfloat16", "float64"], PATHS, ["some", "all"]), indirect=["path"])
def test_nearly_constant_rows_of_an_add_norm(dtype, path, whole, has_rows):
    """Protects the rows kept whole (recovery's "Rows") on an add-norm's nearly constant rows
    (var < eps under a non-zero bias): recovery.kept_rows names them, their xhat is read from
    xhat_rows, and every result is within the table of the reference's with the same rows, dx
    and dresidual row by row. In a batch of such rows alone ("all"), dgamma (sums of dy *
    xhat, xhat ~ 1e-3) is within the table relative to its own terms, sum |dy * xhat|:
    recovering xhat through the bias would be off by ~1e-3 of that in float32 and float64
    alike, and wholly for a bfloat16 y of a float32 stream. Tiles mixing both kinds of rows
    ("some"); short and long rows."""
    rows = [0, 2, 3, 5] if whole == "some" else list(range(6))
    case = _nearly_constant(make_case("add_layer_norm", 6, path, dtype,
                                      **_mixed_precision(dtype)), rows)
    got, saves = assert_matches_reference(case, rows_scaled=True)
    assert saves.rows.tolist() == rows and saves.xhat_rows.shape == (len(rows), path)
    assert has_rows and all(has_rows)
    if whole == "some":
        return
    want = reference(case, saves)
    xhat = want.norm.xhat().astype(np.float64)
    terms = float((np.abs(want.dy.astype(np.float64) * xhat).sum(0)).max())
    assert 0 < terms < 0.1 * np.abs(want.dy.astype(np.float64)).sum(0).max()
    dt = coarser(dtype_name(got["dgamma"].dtype), compute_name(saves.rstd.dtype))
    tolerances.assert_close(to_numpy(got["dgamma"]).astype(np.float64), want.results["dgamma"],
                            dt, "param" if dt == "float64" else "gpu-param", scale=terms,
                            name="dgamma")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_constant_rows_kept_whole(dtype, path):
    """Protects plain LayerNorm rows made constant (xhat = 0, y = bias rounded to y's dtype):
    kept whole (rows 1 and 3 of 5, by kept_rows), their xhat 0 read from xhat_rows, where a
    bfloat16 y of float32 parameters would recover (round(bias) - bias) / scale, ~1e-3, and
    dgamma would be off by that times dy; every result within the table of the reference's."""
    case = make_case("layer_norm", 5, path, dtype,
                     param_dtype="float32" if dtype == "bfloat16" else None)
    case.x[1], case.x[3] = 0.1, -3.3
    got, saves = assert_matches_reference(case, rows_scaled=True)
    assert saves.rows.tolist() == [1, 3] and not saves.xhat_rows.any()
    assert all(torch.isfinite(v).all() for v in got.values() if v is not None)


@pytest.mark.parametrize("name, dtype, path", pairwise(list(NORMS), DTYPE_NAMES, PATHS),
                         indirect=["path"])
def test_rows_read_whole(name, dtype, path, has_rows):
    """Protects how a row kept whole is read, whatever the rule chose, in every dtype on both
    paths: its xhat from its own row of xhat_rows on every channel (kept channels included), y
    unused. Rows 0, 3 and 4 of 6 given N(0, 1) values no y gives: dx and dresidual row by row,
    dw and db within the table of the reference's given the same rows; the other rows' dx and
    dresidual bit for bit those of the run without rows. (xhat_rows through a row stride:
    test_row_strides.)"""
    case = _some_kept(make_case(name, 6, path, dtype))
    base = saves_of(case)
    assert base.rows.numel() == 0 and base.keep.numel() > 0
    saves = _given_rows(base, [0, 3, 4])
    got, _ = assert_matches_reference(case, saves, rows_scaled=True, own_rows=False)
    assert has_rows and all(has_rows)
    plain = run_from_y(case, dataclasses.replace(saves, rows=None, xhat_rows=None))
    for k in ("dx", "dresidual"):
        if k in got:
            assert torch.equal(got[k][[1, 2, 5]], plain[k][[1, 2, 5]]), k
            assert not torch.equal(got[k][[0, 3, 4]], plain[k][[0, 3, 4]]), k


def _given_rows(saves: Saves, rows: list[int]) -> Saves:
    """``saves`` with ``rows`` kept whole: their xhat_rows N(0, 1) values no y gives
    (contiguous), and their entries of kept the same values, as a forward stores them."""
    g = torch.Generator().manual_seed(5)
    values = torch.randn((len(rows), saves.y.shape[1]), generator=g, dtype=torch.float64)
    values = values.to(DEVICE, saves.rstd.dtype)
    index = torch.tensor(rows, device=DEVICE)
    kept = saves.kept.clone()
    kept[index] = values[:, saves.keep]
    return dataclasses.replace(saves, kept=kept, rows=index, xhat_rows=values)


@pytest.mark.parametrize("name, path", EACH_NORM_ONE_PATH, indirect=["path"])
def test_no_rows_kept(name, path, has_rows):
    """Protects r = 0, on both paths: rows (0,) and xhat_rows (0, D) give bit for bit the
    results of rows = xhat_rows = None, every kernel launched with HAS_ROWS False (the code
    without rows)."""
    case = _some_kept(make_case(name, 6, path, "float32"))
    saves = saves_of(case)
    assert saves.rows.numel() == 0 and saves.xhat_rows.shape == (0, path)
    empty = run_from_y(case, saves)
    none = run_from_y(case, dataclasses.replace(saves, rows=None, xhat_rows=None))
    assert has_rows and not any(has_rows)
    for k in empty:
        assert torch.equal(empty[k], none[k]), k


def test_bad_rows():
    """Protects the launcher's contract on rows and xhat_rows: one without the other, rows not
    a (r,) int64 tensor on y's device or naming more rows than M, xhat_rows of another dtype
    than T, another shape than (r, D), a column stride or another device: an error naming the
    argument, not a silent result."""
    case = _some_kept(make_case("layer_norm", 4, 8, "float32"))
    s = saves_of(case)
    rows = torch.tensor([1, 2], device=DEVICE)
    xr = torch.zeros((2, 8), device=DEVICE)

    def call(**kw):
        a = {"dy": case.dy, "dh": None, "y": s.y, "weight": case.weight, "bias": case.bias,
             "rstd": s.rstd, "keep": s.keep, "kept": s.kept, "centred": True, "rows": rows,
             "xhat_rows": xr, **kw}
        return launch.backward_from_y(**a)

    call()
    for kw, match in (({"xhat_rows": None}, "xhat_rows is None"),
                      ({"rows": None}, "rows is None"),
                      ({"rows": rows.int()}, "rows must be"),
                      ({"rows": rows[None]}, "rows must be"),
                      ({"rows": rows.to("meta")}, "rows must be"),
                      ({"rows": torch.arange(5, device=DEVICE),
                        "xhat_rows": torch.zeros((5, 8), device=DEVICE)}, "more than M"),
                      ({"xhat_rows": xr.double()}, "xhat_rows must be torch.float32"),
                      ({"xhat_rows": xr[:, :7]}, "xhat_rows must be"),
                      ({"xhat_rows": xr[:1]}, "xhat_rows must be"),
                      ({"xhat_rows": torch.zeros((8, 2), device=DEVICE).t()}, "unit column"),
                      ({"xhat_rows": xr.to("meta")}, "xhat_rows must be on")):
        with pytest.raises((ValueError, TypeError), match=match):
            call(**kw)


# --- layouts, M = 0, determinism, bad input -----------------------------------------------------


@pytest.mark.parametrize("name, path", EACH_NORM_ONE_PATH, indirect=["path"])
def test_row_strides(name, path):
    """Protects y, dy, dh, kept and xhat_rows read in place through their row strides, on both
    paths, with and without a residual, without rows kept whole and with rows 0 and 3 of 5:
    bitwise the results of contiguous copies."""
    case = _some_kept(make_case(name, 5, path, "float32"))
    laid_out = Case(**{**case.__dict__, "dy": strided(case.dy), "dh": strided(case.dh)})
    base = saves_of(case)
    for saves in (base, _given_rows(base, [0, 3])):
        want = run_from_y(case, saves)
        wide = torch.full((5, saves.kept.shape[1] + 7), float("nan"), dtype=saves.kept.dtype,
                          device=DEVICE)
        wide[:, 2:2 + saves.kept.shape[1]] = saves.kept
        got = run_from_y(laid_out, dataclasses.replace(
            saves, y=strided(saves.y), kept=wide[:, 2:2 + saves.kept.shape[1]],
            xhat_rows=strided(saves.xhat_rows)))
        for k in want:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("name, path", EACH_NORM_ONE_PATH, indirect=["path"])
def test_deterministic(name, path, partial_rows):
    """Protects bit-identical results run to run with several programs writing partial rows
    of dw and db (16 "SMs": three tiles of short rows, the last ragged; four chunks of two
    rows on the long path)."""
    case = _some_kept(make_case(name, 130 if path == SHORT_D else 8, path, "bfloat16"))
    saves = saves_of(case)
    first, second = run_from_y(case, saves), run_from_y(case, saves)
    assert len(partial_rows) == 2 and min(partial_rows) > 1, partial_rows
    for k in first:
        assert torch.equal(first[k], second[k]), k


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
@pytest.mark.parametrize("name", list(NORMS))
def test_inputs_are_never_modified(name, dtype):
    """Protects the caller's tensors on the memory-efficient path of the Triton kernels: the
    library's forward from y (which finds the kept channels and the rows kept whole from the
    bias in the compute dtype, a no-op conversion for float64) and the backward from y leave
    x, residual, weight, bias, dy and dh bit for bit as they were, kept channels and rows kept
    whole included."""
    case = _some_kept(make_case(name, 6, SHORT_D, dtype))
    if case.norm.residual:
        case.x[2], case.residual[2] = 0.25, 0.0  # a constant row: kept whole under a bias
    else:
        case.x[2] = 0.25
    names = ("x", "residual", "weight", "bias", "dy", "dh")
    before = {k: getattr(case, k).clone() for k in names if getattr(case, k) is not None}
    saves = saves_of(case)
    assert saves.keep.numel() and (saves.rows.numel() > 0) == case.norm.centred
    run_from_y(case, saves)
    for k, t in before.items():
        assert torch.equal(getattr(case, k), t), f"{k} was modified"


@pytest.mark.parametrize("name", list(NORMS))
def test_empty_batch(name):
    """Protects M = 0: empty outputs of the right shapes and dtypes, zero parameter gradients,
    no launch."""
    case = _some_kept(make_case(name, 0, 16, "bfloat16", residual_dtype="float32",
                                h_dtype="float32"))
    keep = torch.tensor([3], dtype=torch.int64, device=DEVICE)
    saves = Saves(torch.empty((0, 16), dtype=torch.bfloat16, device=DEVICE),
                  torch.empty(0, device=DEVICE), keep, torch.empty((0, 1), device=DEVICE),
                  torch.empty(0, dtype=torch.int64, device=DEVICE),
                  torch.empty((0, 16), device=DEVICE))
    got = run_from_y(case, saves)
    assert got["dx"].shape == (0, 16) and got["dx"].dtype == torch.bfloat16
    assert torch.equal(got["dgamma"], torch.zeros_like(case.weight))
    if case.norm.residual:
        assert got["dresidual"].dtype == torch.float32


def test_bad_input():
    """Protects the launcher's contract: what would be read wrong (a bias for RMSNorm, dh
    without an add-norm, keep not int64, kept or rstd of another dtype or shape, more channels
    kept than there are) is an error naming the argument, not a silent result."""
    case = _some_kept(make_case("layer_norm", 4, 8, "float32"))
    s = saves_of(case)
    dy, w, b = case.dy, case.weight, case.bias

    def call(**kw):
        a = {"dy": dy, "dh": None, "y": s.y, "weight": w, "bias": b, "rstd": s.rstd,
             "keep": s.keep, "kept": s.kept, "centred": True, **kw}
        return launch.backward_from_y(**a)

    call()
    for kw, match in (({"centred": False}, "bias"), ({"dh": dy}, "dh"),
                      ({"keep": s.keep.int()}, "keep"),
                      ({"kept": s.kept.bfloat16()}, "kept must be float32 or float64"),
                      ({"kept": s.kept[:, :1]}, "kept must be"),
                      ({"kept": s.kept.double()}, "rstd"),
                      ({"rstd": s.rstd[:3]}, "rstd"),
                      ({"keep": torch.arange(9, device=DEVICE),
                        "kept": torch.zeros((4, 9), device=DEVICE)}, "more than D"),
                      ({"y": s.y[:, :7]}, "must have shape")):
        with pytest.raises((ValueError, TypeError), match=match):
            call(**kw)
