"""The quantized norms' spec (docs/derivation.md, "Quantized output") as tests for any path:
:class:`QuantSpec`, which tests/torch_api/test_quant.py runs on the NumPy reference and
``layernorm.torch``'s CPU op (the C++ engine, or the NumPy fallback in the fallback pass of
``make test``) and tests/gpu/test_gpu_quant.py on the Triton kernels.

The oracles are independent of the code under test: y from the float64 formulas, max|y| / qmax
in float64, int8 rounding by NumPy's rint, float8 rounding by ml_dtypes' cast; and values
chosen so the expected result is known exactly. Each backend is held to the same tolerances
(``layernorm.tolerances``: "quant-scale", :func:`assert_quantized`).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import layernorm as ln
import layernorm.torch as lt
from layernorm.reference.quant import QUANT_DTYPES
from layernorm.tolerances import assert_close, assert_quantized

F8 = ml_dtypes.float8_e4m3fn
QDTYPES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64,
                "bfloat16": torch.bfloat16, "float16": torch.float16}


def _to_torch(a: np.ndarray | None) -> torch.Tensor | None:
    if a is None:
        return None
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _values(q: object) -> np.ndarray:
    """A quantized output's values as float64 (-0.0 and 0.0 alike)."""
    if isinstance(q, torch.Tensor):
        return q.to(torch.float64).numpy()
    return np.asarray(q).astype(np.float64)


def norm_quant(backend: str, centred: bool, x: np.ndarray, gamma=None, beta=None, eps=None,
               *, dtype: str = "int8", residual=None, scale=None, **kw) -> tuple:
    """(q values, scales[, h]) as float64/float32 arrays from ``backend`` on NumPy inputs:
    "reference" (NumPy), "torch" (``layernorm.torch`` on CPU tensors) or "triton" (the Triton
    launcher, on CPU tensors under the interpreter, or on CUDA)."""
    if eps is None:
        eps = 1e-5 if centred else 1e-6
    if backend == "triton":
        out = _triton(centred, x, gamma, beta, eps, dtype, residual, scale, **kw)
    elif backend == "reference":
        f = ln.layer_norm_quant if centred else ln.rms_norm_quant
        args = (x, gamma, beta, eps) if centred else (x, gamma, eps)
        out = f(*args, dtype=dtype, residual=residual, scale=scale, **kw)
    else:
        t = _to_torch
        d = x.shape[-1]
        if kw.get("residual_dtype") is not None:
            kw["residual_dtype"] = getattr(torch, kw["residual_dtype"])
        sc = None if scale is None else torch.from_numpy(np.array(scale, dtype=np.float32))
        if centred:
            out = lt.layer_norm_quant(t(x), (d,), t(gamma), t(beta), eps, dtype=QDTYPES[dtype],
                                      residual=t(residual), scale=sc, **kw)
        else:
            out = lt.rms_norm_quant(t(x), (d,), t(gamma), eps, dtype=QDTYPES[dtype],
                                    residual=t(residual), scale=sc, **kw)
        out = tuple(o if i != 2 else o.to(torch.float64) for i, o in enumerate(out))
    q, s, *h = out
    s = s.numpy() if isinstance(s, torch.Tensor) else s
    h = [np.asarray(h[0].numpy() if isinstance(h[0], torch.Tensor) else h[0],
                    dtype=np.float64)] if h else []
    return (_values(q), np.asarray(s), *h)


def _triton(centred: bool, x, gamma, beta, eps: float, dtype: str, residual, scale,
            group_size=None, scale_ub=None, residual_dtype=None) -> tuple:
    from triton_cases import DEVICE

    from layernorm.gpu import launch

    def t(a):
        return None if a is None else _to_torch(a).to(DEVICE)

    def as_tensor(v):
        return None if v is None else torch.tensor(np.float32(v), device=DEVICE).reshape(1)

    limits = QUANT_DTYPES[dtype]
    h_dtype = None if residual_dtype is None else getattr(torch, residual_dtype)
    q, s, h = launch.forward_quant(
        t(x), t(residual), t(gamma), t(beta), eps, centred=centred, float8=dtype != "int8",
        h_dtype=h_dtype, scale=as_tensor(scale), group_size=group_size,
        scale_ub=as_tensor(scale_ub), qmax=limits.qmax, min_scale=limits.min_scale)
    if scale is not None:
        s = s.reshape(np.shape(scale))
    out = (q.cpu(), s.cpu())
    return out if h is None else (*out, h.cpu().to(torch.float64))


def y64(x: np.ndarray, gamma, beta, eps: float, centred: bool) -> np.ndarray:
    """The norm's y in float64 from the formula: the oracle's y."""
    v = x.astype(np.float64)
    if centred:
        v = v - v.mean(-1, keepdims=True)
    y = v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps)
    if gamma is not None:
        y = y * gamma.astype(np.float64)
    if beta is not None:
        y = y + beta.astype(np.float64)
    return y


def oracle(y: np.ndarray, dtype: str, group: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(q values, scales) of y (M, D) float64: max|y| / qmax per group, then y / s rounded by
    rint (int8) or by ml_dtypes' cast (float8) after saturation."""
    row = QUANT_DTYPES[dtype]
    m, d = y.shape
    g = group or d
    yg = y.reshape(m, d // g, g)
    s = np.maximum(np.abs(yg).max(-1) / row.qmax, row.min_scale)  # (M, G) float64
    v = np.clip(yg / s.astype(np.float32)[..., None], -row.qmax, row.qmax)
    q = np.rint(v) if dtype == "int8" else v.astype(np.float32).astype(F8).astype(np.float64)
    return q.reshape(m, d), s


def _data(dtype: str, shape: tuple[int, int], seed: int, centred: bool) -> tuple:
    rng = np.random.default_rng(seed)
    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x = (rng.standard_normal(shape) * 2 + (3 if centred else 0)).astype(npdt)
    gamma = (1 + 0.5 * rng.standard_normal(shape[1])).astype(npdt)
    beta = (0.3 * rng.standard_normal(shape[1])).astype(npdt) if centred else None
    return x, gamma, beta


# Values y / s whose rounding is known: ties go to even, and beyond qmax q saturates.
INT8_CASES = [(0.5, 0), (1.5, 2), (2.5, 2), (-0.5, 0), (-2.5, -2), (126.5, 126), (127.4, 127),
              (200.0, 127), (-1e30, -127), (np.inf, 127), (-np.inf, -127), (np.nan, 0)]


# float8_e4m3fn: 1.0625 is the tie between 1 and 1.125 (to 1, even); 1.1875 between 1.125 and
# 1.25 (to 1.25); 2**-10 the tie between 0 and the smallest subnormal 2**-9 (to 0); 3 2**-10
# between 2**-9 and 2**-8 (to 2**-8); 464 and up saturate at 448, never NaN or inf.
F8_CASES = [(1.0625, 1.0), (1.1875, 1.25), (2.0**-10, 0.0), (3 * 2.0**-10, 2.0**-8),
            (-1.0625, -1.0), (440.0, 448.0), (1e6, 448.0), (-np.inf, -448.0),
            (np.inf, 448.0), (np.nan, np.nan), (0.0, 0.0), (2.0**-6, 2.0**-6)]


EXACT_D = 100  # at least this many values a row: whole vectors and a ragged tail in every path


def _tiled(values: list, expected: list) -> tuple[list, list]:
    """``values`` and ``expected`` repeated to at least EXACT_D entries (both alike), so that
    the cases reach the CPU's full vectors (not only a loop's scalar tail) and Triton's long
    path (rows over 64 there) with a ragged last block."""
    n = max(len(values), EXACT_D)
    return list(np.resize(np.array(values, object), n)), list(np.resize(np.array(expected,
                                                                                 object), n))


def _exact_y(values: list[float], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """x and gamma whose RMSNorm (eps = 0) is exactly ``values``: x of ones has rstd 1, so
    y = gamma."""
    npdt = np.dtype(dtype)
    return np.ones((1, len(values)), npdt), np.array(values, npdt)


def _division_cases(qdtype: str) -> tuple[np.float32, np.ndarray]:
    """(s, y): a float32 scale and float32 values y, each with q(y / s) (a true division)
    different from q(y * float32(1 / s)): values at (or an ulp from) a rounding boundary of the
    dtype's grid, times s."""
    f = np.float32
    if qdtype == "int8":
        s = f(0.13102272152900696)
        bounds = np.arange(-126, 126) + 0.5
    else:
        s = f(0.19568340480327606)
        grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(F8).astype(np.float64)))
        grid = grid[np.isfinite(grid)]
        bounds = (grid[1:] + grid[:-1]) / 2
    y = (s * bounds.astype(f)).astype(f)
    y = np.concatenate([y, np.nextafter(y, f(1e9)), np.nextafter(y, f(-1e9))])

    def q(v):
        return np.rint(v) if qdtype == "int8" else v.astype(F8).astype(np.float64)

    differ = q(y / s) != q(y * (f(1) / s))
    return s, y[differ]


class QuantSpec:
    """The spec's tests for any path: a test module subclasses it as Test... with a
    ``backend`` fixture naming the path (:func:`norm_quant`'s), and may make the shapes
    smaller (Triton's interpreter is slow)."""

    ORACLE_SHAPE = (48, 384)  # (M, D) of the comparison with the oracle: D/64, D/128 groups
    BATCH_SHAPE = (37, 1024)  # (M, D) of the batch-invariance test

    @pytest.mark.parametrize("centred", [False, True], ids=["rms", "layer"])
    @pytest.mark.parametrize("qdtype", QDTYPES)
    @pytest.mark.parametrize("group", [None, 64, 128])
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
    def test_scales_and_q_match_the_float64_oracle(self, backend, centred, qdtype, group, dtype):
        """Protects the spec's arithmetic: scales within 1e-6 of max|y| / qmax from float64 y, q
        within one step of round(y / s) and equal in >= 99.9% of elements, for every norm, input
        dtype, output dtype and scale granularity."""
        x, gamma, beta = _data(dtype, self.ORACLE_SHAPE, 1, centred)
        eps = 1e-5
        q, s = norm_quant(backend, centred, x, gamma, beta, eps, dtype=qdtype, group_size=group)
        want_q, want_s = oracle(y64(x, gamma, beta, eps, centred), qdtype, group)
        assert s.dtype == np.float32 and s.shape == want_s.shape
        assert_close(s, want_s, "float32", "quant-scale", name="scales")
        assert_quantized(q, want_q, qdtype)

    @pytest.mark.parametrize("dtype", ["float32", "float64"])
    @pytest.mark.parametrize("qdtype,cases", [("int8", INT8_CASES), ("float8_e4m3fn", F8_CASES)],
                             ids=["int8", "float8"])
    def test_rounding_is_to_nearest_even_and_saturates(self, backend, dtype, qdtype, cases):
        """Protects the encodings: known ties, saturation, inf and NaN for a static scale of 1."""
        values, expected = _tiled([v for v, _ in cases], [w for _, w in cases])
        x, gamma = _exact_y(values, dtype)
        q, s = norm_quant(backend, False, x, gamma, eps=0.0, dtype=qdtype,
                          scale=np.array(1.0, np.float32))
        np.testing.assert_array_equal(q[0], np.array(expected, np.float64))

    @pytest.mark.parametrize("qdtype", QDTYPES)
    def test_q_divides_by_the_scale(self, backend, qdtype):
        """Protects the true division: values where y / s and y * (1 / s) round to different q
        (at a rounding boundary of the grid) get the division's, for a static scale."""
        s, y = _division_cases(qdtype)
        assert y.size >= 3  # the cases exist: a multiply by the reciprocal would fail here
        want = np.rint(y / s) if qdtype == "int8" else (y / s).astype(F8).astype(np.float64)
        values, expected = _tiled(list(y), list(want))
        x, gamma = _exact_y(values, "float32")
        q, _ = norm_quant(backend, False, x, gamma, eps=0.0, dtype=qdtype, scale=np.array(s))
        np.testing.assert_array_equal(q[0], np.array(expected, np.float64))

    @pytest.mark.parametrize("dtype", ["float32", "float64"])
    def test_float8_matches_ml_dtypes_everywhere_in_range(self, backend, dtype):
        """Protects the float8 encoding across its range: every float8 value, every midpoint
        between neighbours and the float32 numbers either side of it, as ml_dtypes rounds them."""
        grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(F8).astype(np.float64)))
        grid = grid[np.isfinite(grid)]
        mids = (grid[1:] + grid[:-1]) / 2
        v = np.concatenate([grid, mids, np.nextafter(mids.astype(np.float32), np.float32(0)),
                            np.nextafter(mids.astype(np.float32), np.float32(1e9))])
        v = np.concatenate([v, -v]).astype(np.float32)
        x, gamma = _exact_y(v.tolist(), dtype)
        q, _ = norm_quant(backend, False, x, gamma, eps=0.0, dtype="float8_e4m3fn",
                          scale=np.array(1.0, np.float32))
        np.testing.assert_array_equal(q[0], v.astype(F8).astype(np.float64))

    def test_float64_y_is_rounded_once(self, backend):
        """Protects one rounding from y's precision: a float64 y just above a float8 tie, which a
        detour through float32 would put on the tie (and round to even, below), rounds up."""
        v, want = _tiled([1.0625 + 2.0**-40, -(1.0625 + 2.0**-40), 2.0**-10 + 2.0**-60],
                         [1.125, -1.125, 2.0**-9])
        x, gamma = _exact_y(v, "float64")
        q, _ = norm_quant(backend, False, x, gamma, eps=0.0, dtype="float8_e4m3fn",
                          scale=np.array(1.0, np.float32))
        np.testing.assert_array_equal(q[0], np.array(want, np.float64))

    @pytest.mark.parametrize("qdtype", QDTYPES)
    def test_zero_rows_get_the_smallest_scale(self, backend, qdtype):
        """Protects min_scale: a row of zeros (LayerNorm of a constant row, no beta) gets
        FLT_EPSILON (int8) or 1 / (448 * 512) (float8), and q = 0."""
        x = np.full((2, 128), 3.0, np.float32)
        q, s = norm_quant(backend, True, x, dtype=qdtype)
        want = {"int8": 2.0**-23, "float8_e4m3fn": np.float32(1 / (448 * 512))}[qdtype]
        np.testing.assert_array_equal(s, np.full((2, 1), want, np.float32))
        np.testing.assert_array_equal(q, 0.0)

    @pytest.mark.parametrize("qdtype", QDTYPES)
    def test_scale_ub_bounds_the_scale(self, backend, qdtype):
        """Protects scale_ub: a token whose max|y| exceeds it gets scale_ub / qmax, its largest
        values saturate, and a token below it is unchanged."""
        x = np.zeros((2, 128), np.float32)
        x[0, :2] = [10.0, -10.0]  # RMSNorm y = +-sqrt(64) at those two channels
        x[1] = np.linspace(-1, 1, 128, dtype=np.float32)
        qmax = QUANT_DTYPES[qdtype].qmax
        q, s = norm_quant(backend, False, x, eps=0.0, dtype=qdtype, scale_ub=2.0)
        q0, s0 = norm_quant(backend, False, x, eps=0.0, dtype=qdtype)
        assert s[0, 0] == np.float32(np.float32(2.0) / np.float32(qmax))
        assert (q[0, 0], q[0, 1]) == (qmax, -qmax)
        assert s[1, 0] == s0[1, 0] and np.array_equal(q[1], q0[1])

    @pytest.mark.parametrize("qdtype", QDTYPES)
    def test_non_finite_values_flag_their_token_or_group_alone(self, backend, qdtype):
        """Protects the non-finite rule: a NaN row gets NaN scales and q = 0 (int8) or NaN (float8)
        throughout; a group whose y overflows to inf (a huge gamma) gets an inf scale (scale_ub
        or not) and the same fill; every other token and group is as without them."""
        x, gamma, _ = _data("float32", (3, 256), 2, False)
        fill = 0.0 if qdtype == "int8" else np.nan
        xn = x.copy()
        xn[1, 7] = np.nan
        q, s = norm_quant(backend, False, xn, gamma, dtype=qdtype, group_size=64)
        q0, s0 = norm_quant(backend, False, x, gamma, dtype=qdtype, group_size=64)
        assert np.isnan(s[1]).all() and np.array_equal(q[1], np.full(256, fill), equal_nan=True)
        np.testing.assert_array_equal(q[[0, 2]], q0[[0, 2]])
        np.testing.assert_array_equal(s[[0, 2]], s0[[0, 2]])
        g = gamma.copy()
        g[70] = 3e38  # y overflows float32 in group 1 of every row where |xhat| > 1.14
        x[:, 70] = 4.0
        q, s = norm_quant(backend, False, x, g, dtype=qdtype, group_size=64)
        q0, s0 = norm_quant(backend, False, x, gamma, dtype=qdtype, group_size=64)
        assert np.isinf(s[:, 1]).all()
        # scale_ub bounds a finite max|y| only: the inf group stays flagged
        assert np.isinf(norm_quant(backend, False, x, g, dtype=qdtype, group_size=64,
                                   scale_ub=1.0)[1][:, 1]).all()
        assert np.array_equal(q[:, 64:128], np.full((3, 64), fill), equal_nan=True)
        keep = np.r_[0:64, 128:256]
        np.testing.assert_array_equal(q[:, keep], q0[:, keep])
        np.testing.assert_array_equal(s[:, [0, 2, 3]], s0[:, [0, 2, 3]])

    @pytest.mark.parametrize("group", [None, 128])
    def test_a_rows_result_does_not_depend_on_the_batch(self, backend, group):
        """Protects batch invariance: each row's q and scales equal those of the row alone."""
        x, gamma, beta = _data("bfloat16", self.BATCH_SHAPE, 3, True)
        m = x.shape[0]
        q, s = norm_quant(backend, True, x, gamma, beta, dtype="float8_e4m3fn", group_size=group)
        for i in (0, m // 2, m - 1):
            qi, si = norm_quant(backend, True, x[i:i + 1], gamma, beta, dtype="float8_e4m3fn",
                                group_size=group)
            np.testing.assert_array_equal(qi[0], q[i])
            np.testing.assert_array_equal(si[0], s[i])

    @pytest.mark.parametrize("qdtype", QDTYPES)
    @pytest.mark.parametrize("centred", [False, True], ids=["rms", "layer"])
    def test_a_ragged_row_per_token(self, backend, qdtype, centred):
        """Protects per-token scales over a row that fills no whole vector or block: D = 100
        (a ragged tail on the CPU and on Triton's long path), against the oracle."""
        x, gamma, beta = _data("float32", (5, 100), 8, centred)
        q, s = norm_quant(backend, centred, x, gamma, beta, 1e-5, dtype=qdtype)
        want_q, want_s = oracle(y64(x, gamma, beta, 1e-5, centred), qdtype, None)
        assert_close(s, want_s, "float32", "quant-scale", name="scales")
        assert_quantized(q, want_q, qdtype)

    @pytest.mark.parametrize("qdtype", QDTYPES)
    def test_static_scale(self, backend, qdtype):
        """Protects the static scale: q = round(y / scale) for every row (the oracle's, scale
        given), and the scales returned are a copy of it."""
        x, gamma, _ = _data("float32", (16, 256), 4, False)
        scale = np.array([0.03], np.float32)
        q, s = norm_quant(backend, False, x, gamma, dtype=qdtype, scale=scale)
        y = y64(x, gamma, None, 1e-6, False)
        v = np.clip(y / np.float64(scale[0]), -QUANT_DTYPES[qdtype].qmax, QUANT_DTYPES[qdtype].qmax)
        want = np.rint(v) if qdtype == "int8" else v.astype(np.float32).astype(F8).astype(float)
        assert_quantized(q, want, qdtype)
        np.testing.assert_array_equal(s, scale)
        assert not np.shares_memory(s, scale)

    @pytest.mark.parametrize("residual_dtype", [None, "float32"])
    def test_residual_is_added_rounded_and_returned(self, backend, residual_dtype):
        """Protects the fused add: h = x + residual rounded once to residual_dtype (x's by default)
        is returned, and q and the scales are those of the norm of h as rounded."""
        x, gamma, _ = _data("bfloat16", (8, 256), 5, False)
        r, _, _ = _data("bfloat16", (8, 256), 6, False)
        kw = {} if residual_dtype is None else {"residual_dtype": residual_dtype}
        q, s, h = norm_quant(backend, False, x, gamma, dtype="int8", residual=r, **kw)
        want_h = (x.astype(np.float32) + r.astype(np.float32))
        if residual_dtype is None:
            want_h = want_h.astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(h, want_h.astype(np.float64))
        want_q, want_s = oracle(y64(want_h, gamma, None, 1e-6, False), "int8", None)
        assert_close(s, want_s, "float32", "quant-scale", name="scales")
        assert_quantized(q, want_q, "int8")

    def test_inputs_are_not_modified(self, backend):
        """Protects the caller's arrays: x, residual, gamma, beta and the scales read only."""
        x, gamma, beta = _data("float32", (4, 128), 7, True)
        r = x[::-1].copy()
        scale = np.array(0.05, np.float32)
        before = [a.copy() for a in (x, r, gamma, beta, scale)]
        norm_quant(backend, True, x, gamma, beta, residual=r, dtype="float8_e4m3fn")
        norm_quant(backend, True, x, gamma, beta, residual=r, scale=scale)
        for a, b in zip((x, r, gamma, beta, scale), before, strict=True):
            np.testing.assert_array_equal(a, b)
