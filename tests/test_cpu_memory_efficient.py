"""The memory-efficient mode of the fused CPU kernels: the backward reads y, not x.

Against the reference's memory-efficient mode, the float64 oracle and the default mode, for
every norm and dtype; the recovery's arithmetic bit for bit (float32's reciprocal and its
unbiased dgamma, float64's division); the hard cases of the recovery rule and the float64
paths; the rows kept whole (var < eps under a shift) wherever they fall; the same bits on 1,
2 and 3 threads; what the cache holds and refuses; the modules; and the Python kernels of the
torch ops."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from layernorm import cpu, recovery  # noqa: E402 - after the skip
from layernorm import reference as ref  # noqa: E402
from layernorm.dtypes import DTYPES as TABLE  # noqa: E402
from layernorm.dtypes import compute_dtype  # noqa: E402
from layernorm.family import NORMS  # noqa: E402
from layernorm.numerics import exact_norm, relative_error, unit_roundoff  # noqa: E402
from layernorm.tolerances import assert_close  # noqa: E402

DTYPES = ["float64", "float32", "float16", "bfloat16"]
RNG = np.random.default_rng(2024)


def _args(norm, x, gamma, beta, residual=None):
    """The forward's arguments of ``norm`` in its order: x, [residual], gamma, [beta]."""
    args = [x] + ([residual] if norm.residual else []) + [gamma]
    return args + [beta] if norm.centred else args


def _engine_block():
    """The engine's block of channels (``kBlock`` in engine/csrc/engine.h)."""
    import re
    from pathlib import Path

    import layernorm.engine

    header = Path(layernorm.engine.__file__).with_name("csrc") / "engine.h"
    return int(re.search(r"kBlock = (\d+);", header.read_text()).group(1))


def _size(a):
    return 1.0 if a is None else float(np.max(np.abs(np.asarray(a, np.float64))))


def _weights(d, dt, zero_centered=False):
    """gamma (with a zero scale at channel 5) and beta (with |beta| > 4|scale| at channel 7),
    so that some channels are kept and the rest recovered."""
    gamma = (RNG.standard_normal(d) * 0.3 + (0.0 if zero_centered else 1.0)).astype(dt)
    gamma[5] = -1.0 if zero_centered else 0.0
    beta = RNG.standard_normal(d).astype(dt)
    beta[7] = 40.0
    return gamma, beta


def _cache_keep(cache):
    return cache.norm.keep if isinstance(cache, ref.AddNormCache) else cache.keep


def _cache_rows(cache):
    return cache.norm.rows if isinstance(cache, ref.AddNormCache) else cache.rows


def _flatten(norm, args, rows):
    """Make ``rows`` of what ``norm`` normalizes constant in place (x, or h = x + residual
    with the residual's rows zero): var = 0 there, rows to keep whole under a shift."""
    x = args[0]
    x[rows] = x[rows, :1]
    if norm.residual:
        args[1][rows] = 0


def _near_oracle_and_reference(norm, args, cot, dt, run_norm, float64_oracle, results_close,
                               **kw):
    """The fused memory-efficient results of ``norm`` (keywords ``kw``) within the table of the
    float64 oracle and of the reference's memory-efficient mode, each on the scale of its
    oracle result; returns (the results, those scales)."""
    got = run_norm(cpu, norm, args, cot, memory_efficient=True, **kw)
    want = float64_oracle(norm, args, cot, **kw).results
    scales = {k: _size(w) for k, w in want.items()}
    results_close(got, want, dt, scales=scales, what="oracle")
    results_close(got, run_norm(ref, norm, args, cot, memory_efficient=True, **kw), dt,
                  scales=scales, what="reference")
    return got, scales


def _coarsest(*dtypes):
    """The table's name of the least precise of ``dtypes``."""
    return min((TABLE[np.dtype(t).name] for t in dtypes), key=lambda r: r.significand_bits).name


def _bits(results):
    return {k: None if v is None else v.tobytes() for k, v in results.items()}


# --- against the reference, the oracle and the default mode ---------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("name", list(NORMS))
def test_matches_the_reference_memory_efficient_mode(name, zero_centered, dtype, dtype_or_skip,
                                                      run_norm, float64_oracle, results_close):
    """Protects the fused backward from y for every norm and dtype: its gradients (and y, h)
    within the tolerance table of the reference's memory-efficient mode, of the float64
    oracle and of the fused default mode, with one channel kept for a zero scale and one
    (LayerNorm) for a large beta; D = 300 runs tiles and leftover rows over two chunks."""
    dt = dtype_or_skip(dtype)
    norm = NORMS[name]
    d = 300
    x = (0.5 + 2.0 * RNG.standard_normal((2, 35, d))).astype(dt)
    gamma, beta = _weights(d, dt, zero_centered)
    residual = RNG.standard_normal(x.shape).astype(dt)
    args = _args(norm, x, gamma, beta, residual)
    cot = [RNG.standard_normal(x.shape).astype(dt) for _ in norm.forward_outputs]
    kw = {"zero_centered_gamma": zero_centered}
    got, scales = _near_oracle_and_reference(norm, args, cot, dt, run_norm, float64_oracle,
                                             results_close, **kw)
    results_close(got, run_norm(cpu, norm, args, cot, **kw), dt, scales=scales, what="default")
    *_, cache = getattr(cpu, f"{name}_forward")(*args, memory_efficient=True, **kw)
    assert 5 in cache.keep and (7 in cache.keep) == norm.centred


@pytest.mark.parametrize("name, has_gamma, has_beta", [
    (name, has_gamma, has_beta) for name in NORMS
    for has_gamma, has_beta in [(False, False), (True, False), (False, True)]
    if NORMS[name].centred or not has_beta])  # an RMSNorm has no beta
def test_gamma_and_beta_optional(name, has_gamma, has_beta, family_inputs, run_norm,
                                 float64_oracle, results_close):
    """Protects the absent parameters: scale = ones and shift = zeros where gamma or beta is
    None (nothing is kept), their gradients None, the rest within the table."""
    norm = NORMS[name]
    args, cot = family_inputs(norm, (37, 130), "float32")
    n = 2 if norm.residual else 1
    args[n] = args[n] if has_gamma else None
    if norm.centred:
        args[n + 1] = args[n + 1] if has_beta else None
    got = run_norm(cpu, norm, args, cot, memory_efficient=True)
    want = float64_oracle(norm, args, cot).results
    results_close(got, want, "float32", scales={k: _size(w) for k, w in want.items()})
    assert (got["dgamma"] is None) == (not has_gamma)
    *_, cache = getattr(cpu, f"{name}_forward")(*args, memory_efficient=True)
    assert cache.keep.size == 0 and cache.kept.shape == (37, 0)


@pytest.mark.parametrize("x_dtype, residual_dtype", [
    ("bfloat16", "float32"), ("float16", "float32"), ("float32", "float64"),
    ("float64", "float32"), ("float32", "bfloat16")])
@pytest.mark.parametrize("name", ["add_layer_norm", "add_rms_norm"])
def test_add_norms_with_another_residual_dtype(name, x_dtype, residual_dtype, dtype_or_skip,
                                               run_norm, float64_oracle, results_close):
    """Protects the add-norms' dtypes: y in x's dtype recovered in h's compute dtype (float32
    y for a float64 stream, float64 y for a float32 one), dh added in the add's dtype, dx in
    x's dtype and dresidual in residual's; against the oracle and the reference's mode, each
    result to the tolerance of the least precise of its dtype, h's compute dtype and y's
    dtype (xhat is recovered from y as rounded)."""
    xt, rt = dtype_or_skip(x_dtype), dtype_or_skip(residual_dtype)
    norm = NORMS[name]
    d = 96
    x = (0.5 + RNG.standard_normal((21, d))).astype(xt)
    residual = RNG.standard_normal(x.shape).astype(rt)
    gamma, beta = _weights(d, xt)
    args = _args(norm, x, gamma, beta, residual)
    cot = [RNG.standard_normal(x.shape).astype(xt), RNG.standard_normal(x.shape).astype(rt)]
    kw = {"residual_dtype": residual_dtype}
    got = run_norm(cpu, norm, args, cot, memory_efficient=True, **kw)
    assert got["dx"].dtype == xt and got["dresidual"].dtype == rt and got["y"].dtype == xt
    want = float64_oracle(norm, args, cot, residual_dtype=residual_dtype).results
    mine = run_norm(ref, norm, args, cot, memory_efficient=True, **kw)
    for k, g in got.items():
        tol = _coarsest(g.dtype, compute_dtype(rt), xt)
        q = "param" if k.startswith(("dgamma", "dbeta")) else "out"
        assert_close(g, want[k], tol, q, scale=_size(want[k]), name=f"oracle {k}")
        assert_close(g, mine[k], tol, q, scale=_size(want[k]), name=f"reference {k}")


@pytest.mark.parametrize("name", ["add_layer_norm", "add_rms_norm"])
def test_add_norms_without_dh(name, family_inputs, run_norm, float64_oracle, results_close):
    """Protects dh = None: dx = dresidual = the norm's dx alone."""
    norm = NORMS[name]
    args, (dy, _) = family_inputs(norm, (33, 70), "float32")
    got = run_norm(cpu, norm, args, [dy, None], memory_efficient=True)
    want = float64_oracle(norm, args, [dy, None]).results
    results_close(got, want, "float32", scales={k: _size(w) for k, w in want.items()})


# --- the arithmetic, bit for bit ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("m", [4, 5])
def test_xhat_is_recovered_by_the_kernels_arithmetic(m, dtype, dtype_or_skip):
    """Protects the recovery's arithmetic: with dy = 1 on one row and 0 elsewhere, dgamma is
    that row's xhat as the kernel forms it, times the chunk's unbiasing factor. In T = float32
    xhat = (T(y) - shift) * r with r = 1 / scale rounded to float32, and dgamma's partial is
    multiplied by 1 / (scale * r) in float64; in float64 xhat = (y - shift) / scale. The kept
    channels give the kept xhat. In a tile (m = 4) and on a leftover row (m = 5, last row).
    Where dgamma holds T's bits, the plain division and the uncorrected reciprocal each differ
    from it on some channels here, so either formula in the kernel would fail."""
    dt = dtype_or_skip(dtype)
    d = 1000
    t = np.float64 if dtype == "float64" else np.float32
    x = (0.3 + RNG.standard_normal((m, d))).astype(dt)
    gamma = (1 + 0.2 * RNG.standard_normal(d)).astype(dt)
    beta = (0.3 * RNG.standard_normal(d)).astype(dt)
    gamma[[3, 500]] = 0.0  # kept
    y, cache = cpu.layer_norm_forward(x, gamma, beta, memory_efficient=True)
    assert {3, 500} <= set(cache.keep.tolist())
    row = m - 1
    dy = np.zeros(x.shape, dt)
    dy[row] = 1
    _, dgamma, _ = cpu.layer_norm_backward(dy, cache)
    scale, shift = gamma.astype(t), beta.astype(t)
    with np.errstate(divide="ignore", invalid="ignore"):
        division = (y[row].astype(t) - shift) / scale  # (D,) IEEE, in T
        r = t(1) / scale
        reciprocal = (y[row].astype(t) - shift) * r
        corr = 1 / (scale.astype(np.float64) * r.astype(np.float64))
    want = division.copy() if t == np.float64 else reciprocal.astype(np.float64) * corr
    for v in (want, division, reciprocal):
        v[cache.keep] = cache.kept[row]
    got = dgamma.astype(np.float64)
    np.testing.assert_array_equal(got, want.astype(dt).astype(np.float64))
    if dt == t == np.float32:  # dgamma holds T's bits: either other formula would show
        assert not np.array_equal(got, division.astype(np.float64))
        assert not np.array_equal(got, reciprocal.astype(np.float64))
    if dt == t == np.float64:
        assert not np.array_equal(got, reciprocal)


def _param_sizes(dy, ex):
    """The size of each dgamma and dbeta column's terms, for their "param" tolerance: the
    largest over columns of sum |dy * xhat| and of sum |dy|."""
    a = np.abs(dy.astype(np.float64))
    return float((a * np.abs(ex.xhat)).sum(0).max()), float(a.sum(0).max())


def _grads_on_threads(norm, args, cot, cpu_threads, run_norm):
    """The memory-efficient mode's results on 1, 2 and 3 threads, checked to have the same
    bits on each; returns those of 1 thread."""
    runs = []
    for n in (1, 2, 3):
        with cpu_threads(n):
            runs.append(run_norm(cpu, norm, args, cot, memory_efficient=True))
    assert _bits(runs[1]) == _bits(runs[0]) and _bits(runs[2]) == _bits(runs[0])
    return runs[0]


def test_dgamma_dbeta_through_a_float64_row_and_a_kept_channel(run_norm, cpu_threads):
    """Protects dgamma and dbeta of the backward from y through the row tiles and chunks,
    with a row on the float64 path (its float32 sums overflow: its statistics are scaled) and a
    kept channel (a zero gamma): within float32's "param" tolerance of the exact sums (scale:
    the columns' sums of |dy * xhat|), the same bits on 1, 2 and 3 threads."""
    m, d = 203, 300
    x = (0.5 + RNG.standard_normal((m, d))).astype(np.float32)
    x[77] = 3e38  # its float32 sums overflow: SCALE != 1, the float64 path
    x[77, ::2] = -3e38
    gamma = (1 + 0.3 * RNG.standard_normal(d)).astype(np.float32)
    gamma[11] = 0.0
    beta = RNG.standard_normal(d).astype(np.float32)
    dy = RNG.standard_normal((m, d)).astype(np.float32)
    _, cache = cpu.layer_norm_forward(x, gamma, beta, memory_efficient=True)
    assert cache.stats[77, cpu.SCALE] < 2.0**-100 and 11 in cache.keep
    got = _grads_on_threads(NORMS["layer_norm"], [x, gamma, beta], [dy], cpu_threads, run_norm)
    ex = exact_norm(x, gamma, beta, 1e-5, dy)
    size_g, size_b = _param_sizes(dy, ex)
    assert_close(got["dgamma"], ex.dgamma, "float32", "param", scale=size_g, name="dgamma")
    assert_close(got["dbeta"], ex.dbeta, "float32", "param", scale=size_b, name="dbeta")


@pytest.mark.parametrize("name", list(NORMS))
def test_bitwise_identical_across_thread_counts(name, family_inputs, run_norm, cpu_threads):
    """Protects the fixed chunking of the backward from y: 1, 2 and 3 threads give equal bits
    (the parameters' gradients included), with kept channels and rows kept whole; the rows
    are split over the threads even at this size."""
    norm = NORMS[name]
    args, cot = family_inputs(norm, (300, 520), "float32")
    n = 2 if norm.residual else 1
    args[n][[4, 9]] = 0.0  # kept
    _flatten(norm, args, [3, 40, 41, 150, 299])  # rows kept whole (LayerNorms)
    _grads_on_threads(norm, args, cot, cpu_threads, run_norm)


# --- the hard cases --------------------------------------------------------------------------

def _hard_weights(case, d, dt):
    """(gamma, beta) of one of the rule's hard cases, in ``dt`` (beta clipped to a quarter of
    y's largest value: float16 tops out at 65504)."""
    signs = np.where(np.arange(d) % 2, 1.0, -1.0)
    spread = np.geomspace(1e-4, 1e4, d) * signs  # gamma from 1e-4 to 1e4
    if case == "zero":  # gamma = 0 exactly on every fifth channel
        gamma, beta = 1.0 + 0.2 * RNG.standard_normal(d), RNG.standard_normal(d)
        gamma[::5] = 0.0
    else:
        gamma, beta = spread, (1e4 * spread if case == "shifted" else np.zeros(d))
    top = recovery.limits(dt)[1]
    return gamma.astype(dt), np.clip(beta, -top / 4, top / 4).astype(dt)


@pytest.mark.parametrize("case", ["zero", "spread", "shifted"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "add_layer_norm"])
def test_hard_cases_of_the_rule(name, dtype, case, dtype_or_skip, run_norm, float64_oracle,
                                results_close):
    """Protects the rule's cases in the fused kernels: gamma = 0 exactly on every fifth
    channel (``zero``), gamma spanning 1e-4 to 1e4 with beta = 0 (``spread``), and beta = 1e4
    * gamma (``shifted``: every channel of LayerNorm kept): the kept set is
    recovery.kept_channels of the cache's scale and shift and the reference's, and every
    result is within the table of the float64 oracle and of the reference's mode."""
    dt = dtype_or_skip(dtype)
    norm = NORMS[name]
    d = 40
    gamma, beta = _hard_weights(case, d, dt)
    x = (0.5 + RNG.standard_normal((9, d))).astype(dt)
    args = _args(norm, x, gamma, beta, RNG.standard_normal(x.shape).astype(dt))
    cot = [RNG.standard_normal(x.shape).astype(dt) for _ in norm.forward_outputs]
    *_, cache = getattr(cpu, f"{name}_forward")(*args, memory_efficient=True)
    keep = cache.keep.tolist()
    assert keep == recovery.kept_channels(cache.scale, cache.shift, dt, d).tolist()
    assert keep == _cache_keep(getattr(ref, f"{name}_forward")(*args,
                                                               memory_efficient=True)[-1]).tolist()
    if case == "zero":
        assert set(range(0, d, 5)) <= set(keep)
    if case == "shifted" and norm.centred:
        assert len(keep) == d
    _near_oracle_and_reference(norm, args, cot, dt, run_norm, float64_oracle, results_close)


@pytest.mark.parametrize("name, shifted", [("layer_norm", True), ("layer_norm", False),
                                           ("rms_norm", False)])  # RMSNorm has no beta
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kept_channels_in_one_block_of_many(name, dtype, shifted, dtype_or_skip, run_norm,
                                            float64_oracle, results_close):
    """Protects sweep 1's choice, block by block, of whether to mask the kept channels' terms,
    the mask row filled in the right blocks, and the sweeps that read no shift row where the
    shift is 0 on every recovered channel (RMSNorm, or LayerNorm with beta = 0): rows of
    channels (three blocks of the engine's kBlock), two kept: one in the last block because its
    scale would overflow y (3e37 * sqrt(D) > largest / 2; y up to about 1e38, so its term
    left unmasked moves dx past float32's tolerance), one in the middle block with scale 0
    (whose mask, read unfilled, would be whatever the memory held). 9 rows: two tiles and a
    leftover row."""
    dt = dtype_or_skip(dtype)
    norm = NORMS[name]
    block = _engine_block()
    d, k, z = 2 * block + block // 2, 2 * block + 50, block + block // 2
    assert d > 2 * block and (k // block, z // block) == (2, 1)
    gamma = (1 + 0.1 * RNG.standard_normal(d)).astype(dt)
    gamma[k] = 3e37
    gamma[z] = 0.0
    beta = (0.3 * RNG.standard_normal(d) if shifted else np.zeros(d)).astype(dt)
    x = (0.5 + RNG.standard_normal((9, d))).astype(dt)
    args = _args(norm, x, gamma, beta)
    cot = [RNG.standard_normal(x.shape).astype(dt)]
    *_, cache = getattr(cpu, f"{name}_forward")(*args, memory_efficient=True)
    assert cache.keep.tolist() == [z, k]
    _near_oracle_and_reference(norm, args, cot, dt, run_norm, float64_oracle, results_close)


@pytest.mark.parametrize("dtype, big", [("float32", 1e30), ("float64", 1e300)])
@pytest.mark.parametrize("name", list(NORMS))
def test_rows_near_the_top_of_the_range(name, dtype, big, run_norm, float64_oracle,
                                        results_close):
    """Protects the float64 path from y: rows near 1e30 (float32) and 1e300 (float64), whose
    sums overflow T (SCALE != 1, rstd = RSTD * SCALE tiny), between ordinary rows, with a kept
    channel; and dy near the top of the range on an ordinary row, whose T sums of the
    backward overflow. Every result within the table of the float64 oracle."""
    norm = NORMS[name]
    dt = np.dtype(dtype)
    d = 64
    x = (0.5 + RNG.standard_normal((10, d)))
    x[3] = big * (1 + 0.1 * RNG.standard_normal(d))
    x[6] = big * RNG.standard_normal(d)
    x = x.astype(dt)
    gamma, beta = _weights(d, dt)
    residual = np.zeros(x.shape, dt)
    args = _args(norm, x, gamma, beta, residual)
    cot = [RNG.standard_normal(x.shape).astype(dt) for _ in norm.forward_outputs]
    cot[0][8] *= dt.type(np.finfo(dt).max / 64)  # dx stays finite; the T sums do not
    *_, cache = getattr(cpu, f"{name}_forward")(*args, memory_efficient=True)
    assert cache.stats[3, cpu.SCALE] < 1 and cache.stats[6, cpu.SCALE] < 1
    got = run_norm(cpu, norm, args, cot, memory_efficient=True)
    want = float64_oracle(norm, args, cot).results
    for k in ("dx", "dresidual"):
        if k in got:
            # dx's size follows each row's rstd * dy: compare row by row
            for i in range(x.shape[0]):
                assert_close(got[k][i], want[k][i], dt, "out", scale=_size(want[k][i]),
                             name=f"{k} row {i}")
    rest = {k: v for k, v in got.items() if k not in ("dx", "dresidual")}
    results_close(rest, {k: want[k] for k in rest}, dt,
                  scales={k: _size(want[k]) for k in rest})
    assert all(np.all(np.isfinite(v)) for v in got.values() if v is not None)


def test_a_kept_channel_whose_y_overflows():
    """Protects a kept channel whose y is inf (a scale too large for y's dtype, the rule's
    second clause): the row takes the float64 path and its gradients are those of the
    reference's mode, with no NaN from recovering inf / inf. dy is small enough that every
    true gradient is finite in float16 (dx on channel 10 is about 30000 * dy * rstd)."""
    d = 64
    rng = np.random.default_rng(2)
    x = (0.5 + rng.standard_normal((8, d))).astype(np.float16)
    x[2, 10] = 40.0  # xhat near sqrt(D) = 8 on channel 10
    gamma = np.ones(d, np.float16)
    gamma[10] = 30000.0  # y = 30000 * xhat overflows float16
    beta = np.zeros(d, np.float16)
    dy = (rng.standard_normal(x.shape) / 64).astype(np.float16)
    y, cache = cpu.layer_norm_forward(x, gamma, beta, memory_efficient=True)
    assert np.isinf(y[2, 10]) and 10 in cache.keep
    got = cpu.layer_norm_backward(dy, cache)
    want = ref.layer_norm_backward(dy, ref.layer_norm_forward(x, gamma, beta,
                                                              memory_efficient=True)[1])
    for g, w in zip(got, want, strict=True):
        assert np.all(np.isfinite(g))
        assert_close(g, w, "float16", "param" if g.ndim == 1 else "out", scale=_size(w))


def test_constant_and_nan_rows():
    """Protects the edge rows: a constant row (xhat = 0, y = beta) recovers xhat = 0 exactly;
    a NaN row stays NaN without touching the other rows' dx."""
    d = 50
    x = (0.5 + RNG.standard_normal((9, d))).astype(np.float32)
    x[2] = 7.0
    x[5, 3] = np.nan
    gamma, beta = _weights(d, np.float32)
    dy = RNG.standard_normal(x.shape).astype(np.float32)
    _, cache = cpu.layer_norm_forward(x, gamma, beta, memory_efficient=True)
    dx, _, _ = cpu.layer_norm_backward(dy, cache)
    dx0, _, _ = cpu.layer_norm_backward(dy, cpu.layer_norm_forward(x, gamma, beta)[1])
    assert np.all(np.isnan(dx[5])) and np.all(np.isnan(dx0[5]))
    ok = np.arange(9) != 5
    assert_close(dx[ok], dx0[ok], "float32", scale=_size(dx0[ok]))


# --- the rows kept whole -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rows_of_small_variance_are_kept_whole_under_a_shift(dtype):
    """Protects the rows' rule in the fused kernels: rows with var < eps (nearly constant: x +
    residual rounded apart) keep their whole xhat when beta is non-zero, so dgamma summed over
    such rows alone keeps its relative accuracy (within 4u of the exact oracle's; recovered
    through beta it is off by ~MARGIN*u of sum|dy|, relatively 1e-5 in float32); with beta = 0
    nothing is kept."""
    dt = np.dtype(dtype)
    d = 64
    v = np.repeat(RNG.uniform(-100, 100, (6, 1)), d, axis=1)  # constant rows
    residual = (v * RNG.uniform(0.2, 0.8, v.shape)).astype(dt)
    x = (v - residual).astype(dt)  # h = x + residual: 1-ulp noise around v
    gamma = (1 + 0.2 * RNG.standard_normal(d)).astype(dt)
    dy = RNG.standard_normal(v.shape).astype(dt)
    for beta, rows in ((RNG.standard_normal(d).astype(dt), 6), (np.zeros(d, dt), 0)):
        _, h, cache = cpu.add_layer_norm_forward(x, residual, gamma, beta,
                                                 memory_efficient=True)
        assert cache.rows.tolist() == list(range(rows)) and cache.xrows.shape == (rows, d)
        ex = exact_norm(h, gamma, beta, 1e-5, dy)
        _, _, dgamma, _ = cpu.add_layer_norm_backward(dy, None, cache)
        assert relative_error(dgamma, ex.dgamma) < 4 * unit_roundoff(dt)


def test_the_kept_rows_follow_recovery():
    """Protects the rule's inputs in the NumPy API: the rows kept are recovery.kept_rows of
    the cache's rstd (RSTD * SCALE, float64), eps, shift and keep: the rows of var < eps
    (zero, constant, eps/10) and not those of var = 10 eps or var = 1, the same as the
    reference's; none for RMSNorm, none with beta = 0, and none where beta is non-zero only on
    kept channels; xrows their xhat, the reference's within float32's rounding."""
    d, eps = 40, 1e-5
    x = RNG.standard_normal((12, d))
    x[1] = 0.0
    x[4] = -7.5
    for i, var in ((6, eps / 10), (8, 10 * eps), (9, eps / 4)):
        z = RNG.standard_normal(d)
        x[i] = 2.0 + np.sqrt(var) * (z - z.mean()) / z.std()
    x = x.astype(np.float32)
    gamma, beta = _weights(d, np.float32)
    _, cache = cpu.layer_norm_forward(x, gamma, beta, eps, memory_efficient=True)
    assert cache.rows.tolist() == [1, 4, 6, 9]
    want = recovery.kept_rows(cache.rstd, eps, cache.shift, cache.keep)
    assert cache.rows.tolist() == want.tolist()
    mine = ref.layer_norm_forward(x, gamma, beta, eps, memory_efficient=True)[1]
    assert cache.rows.tolist() == mine.rows.tolist()
    assert_close(cache.xrows, mine.xhat_rows, "float32", scale=1.0)
    assert cpu.rms_norm_forward(x, gamma, eps, memory_efficient=True)[1].rows.size == 0
    only_kept = np.zeros(d, np.float32)
    only_kept[cache.keep] = beta[cache.keep]  # a shift on the kept channels alone
    for b in (np.zeros(d, np.float32), only_kept):
        c = cpu.layer_norm_forward(x, gamma, b, eps, memory_efficient=True)[1]
        assert c.rows.size == 0 and c.xrows.shape == (0, d)


@pytest.mark.skipif(not cpu.api._engine(), reason="the C++ engine is not built here")
def test_rows_kept_whole_anywhere_in_the_chunks(run_norm, cpu_threads):
    """Protects where the kernel meets the rows kept whole: the first and last rows, inside a
    tile, a whole tile, the leftover rows and both sides of the chunks' boundaries, beside a
    kept channel and a row on the float64 path (dy near the top of the range): dgamma and
    dbeta within float32's "param" tolerance of the exact sums, dx within its "out" tolerance
    row by row, the same bits on 1, 2 and 3 threads."""
    import torch

    m, d = 203, 300
    c = torch.ops.layernorm_cpu._n_chunks(m)  # the engine's row chunks
    starts = [k * m // c for k in range(c)]
    assert c == 4 and starts == [0, 50, 101, 152]
    whole = [0, 5, 12, 13, 14, 15, 49, 50, 100, 101, 151, 152, 200, 202]
    x = (0.5 + RNG.standard_normal((m, d))).astype(np.float32)
    x[whole] = RNG.uniform(-10, 10, (len(whole), 1)).astype(np.float32)
    noisy = whole[1:]  # 1-ulp noise (var < eps), where recovery would give another xhat
    x[noisy, ::3] = np.nextafter(x[noisy, ::3], np.float32(np.inf))
    gamma = (1 + 0.03 * RNG.standard_normal(d)).astype(np.float32)
    gamma[11] = 0.0
    beta = RNG.standard_normal(d).astype(np.float32)
    dy = RNG.standard_normal((m, d)).astype(np.float32)
    # rows 14 (kept whole) and 60: sum(dy * scale) overflows float32, dx does not: the
    # float64 path
    dy[[14, 60]] = (1.5e36 * (1 + 0.01 * RNG.standard_normal((2, d)))).astype(np.float32)
    _, cache = cpu.layer_norm_forward(x, gamma, beta, memory_efficient=True)
    assert cache.rows.tolist() == whole and 11 in cache.keep
    got = _grads_on_threads(NORMS["layer_norm"], [x, gamma, beta], [dy], cpu_threads, run_norm)
    ex = exact_norm(x, gamma, beta, 1e-5, dy)
    size_g, size_b = _param_sizes(dy, ex)
    assert_close(got["dgamma"], ex.dgamma, "float32", "param", scale=size_g, name="dgamma")
    assert_close(got["dbeta"], ex.dbeta, "float32", "param", scale=size_b, name="dbeta")
    for i in range(m):
        assert_close(got["dx"][i], ex.dx[i], "float32", scale=_size(ex.dx[i]),
                     name=f"dx row {i}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(NORMS))
def test_rows_kept_whole_match_the_reference(name, dtype, dtype_or_skip, run_norm,
                                             float64_oracle, results_close):
    """Protects the rows kept whole in every norm and dtype: constant rows among ordinary
    ones (in tiles and leftover rows), with a kept channel, give every result within the
    table of the float64 oracle and of the reference's memory-efficient mode, and the kept
    set is the reference's (none for the RMSNorms, which have no shift)."""
    dt = dtype_or_skip(dtype)
    norm = NORMS[name]
    d = 96
    x = (0.5 + 2.0 * RNG.standard_normal((23, d))).astype(dt)
    gamma, beta = _weights(d, dt)
    residual = RNG.standard_normal(x.shape).astype(dt)
    args = _args(norm, x, gamma, beta, residual)
    _flatten(norm, args, [2, 8, 9, 10, 11, 21])
    cot = [RNG.standard_normal(x.shape).astype(dt) for _ in norm.forward_outputs]
    *_, cache = getattr(cpu, f"{name}_forward")(*args, memory_efficient=True)
    mine = getattr(ref, f"{name}_forward")(*args, memory_efficient=True)[-1]
    assert cache.rows.tolist() == ([2, 8, 9, 10, 11, 21] if norm.centred else [])
    assert cache.rows.tolist() == _cache_rows(mine).tolist()
    _near_oracle_and_reference(norm, args, cot, dt, run_norm, float64_oracle, results_close)


# --- the cache, the arguments, the inputs ---------------------------------------------------

def test_cache_holds_y_stats_and_the_kept_channels():
    """Protects the cache: a CpuOutputCache holding the returned y (the same memory,
    read-only), the statistics, copies of scale and shift, the kept channels and their xhat
    (the reference's within float32's tolerance); nbytes counts stats, keep, kept, scale and
    shift, not y; no reference to x, which may change after the forward."""
    d = 30
    x = (0.5 + RNG.standard_normal((10, d))).astype(np.float32)
    gamma, beta = _weights(d, np.float32)
    dy = RNG.standard_normal(x.shape).astype(np.float32)
    y, cache = cpu.layer_norm_forward(x, gamma, beta, memory_efficient=True)
    assert isinstance(cache, cpu.CpuOutputCache)
    assert np.shares_memory(cache.y, y) and not np.shares_memory(cache.y, x)
    assert not y.flags.writeable and not cache.y.flags.writeable
    assert not np.shares_memory(cache.scale, gamma) and not np.shares_memory(cache.shift, beta)
    want = ref.layer_norm_forward(x, gamma, beta, memory_efficient=True)[1]
    np.testing.assert_array_equal(cache.keep, want.keep)
    assert cache.kept.dtype == np.float32 and cache.kept.shape == (10, want.keep.size)
    assert_close(cache.kept, want.xhat_kept, "float32", scale=_size(want.xhat_kept))
    np.testing.assert_allclose(cache.rstd, want.rstd, rtol=1e-6)
    k = cache.keep.size
    assert cache.rows.size == 0 and cache.xrows.shape == (0, d)  # no row of var < eps
    assert cache.nbytes == cpu.NSTATS * 10 * 8 + 8 * k + 4 * 10 * k + 2 * 4 * d
    x2 = x.copy()
    x2[[2, 7]] = 3.0  # two constant rows: kept whole
    _, c2 = cpu.layer_norm_forward(x2, gamma, beta, memory_efficient=True)
    assert c2.rows.tolist() == [2, 7] and c2.xrows.dtype == np.float32
    assert c2.keep.tolist() == cache.keep.tolist()
    assert c2.nbytes - cache.nbytes == 8 * 2 + 2 * d * 4
    before = cpu.layer_norm_backward(dy, cache)
    x[...] = 0  # x is not kept
    gamma[...] = 0
    beta[...] = 0
    after = cpu.layer_norm_backward(dy, cache)
    assert _bits(dict(enumerate(before))) == _bits(dict(enumerate(after)))


@pytest.mark.parametrize("name", list(NORMS))
def test_out_cannot_be_combined_with_memory_efficient(name, family_inputs):
    """Protects the cache's y: out= with memory_efficient=True raises ValueError naming both
    (the caller's out array could change before the backward); out_h= is allowed."""
    norm = NORMS[name]
    args, _ = family_inputs(norm, (4, 16), "float32")
    fwd = getattr(cpu, f"{name}_forward")
    with pytest.raises(ValueError, match="out=.*memory_efficient=True"):
        fwd(*args, memory_efficient=True, out=np.empty_like(args[0]))
    if norm.residual:
        h = np.empty_like(args[0])
        _, got_h, _ = fwd(*args, memory_efficient=True, out_h=h)
        assert got_h is h
    with pytest.raises(TypeError, match="memory_efficient must be True or False"):
        fwd(*args, memory_efficient=1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(NORMS))
def test_inputs_are_never_modified(name, dtype, family_inputs):
    """Protects the caller's arrays: the forward and backward of the mode write none of x,
    residual, gamma, beta, dy and dh (nor y, which is read-only)."""
    norm = NORMS[name]
    args, cot = family_inputs(norm, (13, 50), dtype)
    before = [a.tobytes() for a in (*args, *cot)]
    *outs, cache = getattr(cpu, f"{name}_forward")(*args, memory_efficient=True)
    y = outs[0].tobytes()
    getattr(cpu, f"{name}_backward")(*cot, cache)
    assert [a.tobytes() for a in (*args, *cot)] == before
    assert outs[0].tobytes() == y


def test_wrong_caches_raise_clear_errors(family_inputs):
    """Protects the backwards' checks with the new cache: another norm's CpuOutputCache, the
    reference's OutputCache and a dy of another shape are refused by name."""
    (x, g, b), (dy,) = family_inputs(NORMS["layer_norm"], (5, 12), "float32")
    _, cache = cpu.layer_norm_forward(x, g, b, memory_efficient=True)
    with pytest.raises(ValueError, match="cache must come from layernorm.cpu.rms_norm_forward"):
        cpu.rms_norm_backward(dy, cache)
    with pytest.raises(TypeError, match="CpuNormCache or CpuOutputCache"):
        cpu.layer_norm_backward(dy, ref.layer_norm_forward(x, g, b, memory_efficient=True)[1])
    with pytest.raises(ValueError, match="dy must have the shape"):
        cpu.layer_norm_backward(dy[:4], cache)


def test_out_of_the_backward_is_checked(family_inputs):
    """Protects the backward's out= in the mode: a fresh array is filled and returned; y
    (read-only) and dy are refused."""
    (x, g, b), (dy,) = family_inputs(NORMS["layer_norm"], (5, 12), "float32")
    y, cache = cpu.layer_norm_forward(x, g, b, memory_efficient=True)
    out = np.empty_like(x)
    dx, _, _ = cpu.layer_norm_backward(dy, cache, out=out)
    assert dx is out
    with pytest.raises(ValueError, match="writeable"):
        cpu.layer_norm_backward(dy, cache, out=y)
    with pytest.raises(ValueError, match="must not overlap"):
        cpu.layer_norm_backward(dy, cache, out=dy)


def test_zero_rows():
    """Protects M = 0: empty outputs, zero parameter gradients."""
    x = np.empty((0, 8), np.float32)
    g = np.ones(8, np.float32)
    y, cache = cpu.layer_norm_forward(x, g, g, memory_efficient=True)
    dx, dg, db = cpu.layer_norm_backward(np.empty_like(x), cache)
    assert dx.shape == (0, 8) and not dg.any() and not db.any()


# --- the modules -----------------------------------------------------------------------------

@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("cls", ["LayerNorm", "RMSNorm"])
def test_modules_memory_efficient(cls, reuse):
    """Protects the modules' option: memory_efficient=True gives the functions' results and a
    read-only y; with reuse_buffers=True y is still fresh on every call (the cache and the
    next layer read it), so an earlier y is unchanged by a later forward, while dx reuses the
    module's buffer."""
    d = 24
    mod = getattr(cpu, cls)(d, memory_efficient=True, reuse_buffers=reuse)
    assert "memory_efficient=True" in repr(mod)
    x1 = RNG.standard_normal((6, d)).astype(np.float32)
    x2 = RNG.standard_normal((6, d)).astype(np.float32)
    dy = RNG.standard_normal((6, d)).astype(np.float32)
    y1 = mod(x1)
    y1_bits = y1.tobytes()
    assert not y1.flags.writeable and isinstance(mod._cache, cpu.CpuOutputCache)
    dx1 = mod.backward(dy)
    y2 = mod(x2)
    assert not np.shares_memory(y1, y2) and y1.tobytes() == y1_bits
    dx2 = mod.backward(dy)
    assert np.shares_memory(dx1, dx2) == reuse
    fwd = getattr(cpu, "layer_norm_forward" if cls == "LayerNorm" else "rms_norm_forward")
    params = [mod.gamma, mod.beta] if cls == "LayerNorm" else [mod.gamma]
    want_y, cache = fwd(x2, *params, mod.eps, memory_efficient=True)
    want_dx = getattr(cpu, fwd.__name__.replace("forward", "backward"))(dy, cache)[0]
    assert y2.tobytes() == want_y.tobytes() and dx2.tobytes() == want_dx.tobytes()


# --- the torch ops' kernels where the engine is missing -----------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("name", list(NORMS))
def test_torch_fallback_kernels_match_the_reference(name, dtype, dtype_or_skip):
    """Protects the ops' fallback kernels (layernorm.torch._fallback: fwd_y and bwd_y on
    tensors, where the engine is missing): the kept channels and
    the rows kept whole (six constant rows, LayerNorms only) of the reference, and dx,
    dresidual, dweight, dbias within the table of the reference's memory-efficient mode; an
    add-norm with dh and a float32 residual stream."""
    torch = pytest.importorskip("torch")
    from layernorm.torch import _fallback

    dt = dtype_or_skip(dtype)
    tdt = getattr(torch, dtype)
    norm = NORMS[name]
    d = 72
    x = (0.5 + RNG.standard_normal((3, 11, d))).astype(dt)
    gamma, beta = _weights(d, dt)
    residual = RNG.standard_normal(x.shape).astype(np.float32)
    dy = RNG.standard_normal(x.shape).astype(dt)
    dh = RNG.standard_normal(x.shape).astype(np.float32)

    def t(a, to=tdt):  # bfloat16 through float32, exactly
        return torch.from_numpy(np.asarray(a, np.float32 if a.dtype.name == "bfloat16"
                                           else a.dtype)).to(to)

    x[:, 4:6] = 3.0  # rows 4, 5, 15, 16, 26, 27 constant: kept whole under beta
    residual[:, 4:6] = 0.0
    xt, rt = t(x), t(residual, torch.float32)
    w, b = t(gamma), t(beta) if norm.centred else None
    h_dtype = torch.float32 if norm.residual else None
    y, h, stats, s1, keep, kept, rows, xrows = _fallback._fwd_y(
        xt, rt if norm.residual else None, w, b, norm.eps, norm.centred, False, h_dtype)
    dx, dres, dw, db = _fallback._bwd_y(
        t(dy), t(dh, torch.float32) if norm.residual else None, y, w, b, stats, s1, keep, kept,
        rows, xrows, norm.centred, False, tdt if norm.residual else None, h_dtype)
    if norm.residual:
        args = _args(norm, x, gamma, beta, residual)
        *_, cache = getattr(ref, f"{name}_forward")(*args, residual_dtype="float32",
                                                    memory_efficient=True)
        want = getattr(ref, f"{name}_backward")(dy, dh, cache)
        got = [dx, dres, dw, db][:len(want)]
    else:
        *_, cache = getattr(ref, f"{name}_forward")(*_args(norm, x, gamma, beta),
                                                    memory_efficient=True)
        want = getattr(ref, f"{name}_backward")(dy, cache)
        got = [dx, dw, db][:len(want)]
    np.testing.assert_array_equal(keep.numpy(), _cache_keep(cache))
    np.testing.assert_array_equal(rows.numpy(), _cache_rows(cache))
    assert rows.tolist() == ([4, 5, 15, 16, 26, 27] if norm.centred else [])
    assert xrows.shape == (rows.numel(), d) and xrows.dtype == kept.dtype
    tol = "float32" if norm.residual and dtype == "float64" else dtype
    for g, wnt, what in zip(got, want, ("dx", "dresidual/dgamma", "dgamma/dbeta", "dbeta"),
                            strict=False):
        g = g.float().numpy() if g.dtype == torch.bfloat16 else g.numpy()
        assert_close(g, wnt, tol, "param" if g.ndim == 1 else "out", scale=_size(wnt),
                     name=what)
    assert dx.dtype == tdt and kept.dtype == (torch.float64 if dtype == "float64" and
                                              not norm.residual else torch.float32)


@pytest.mark.parametrize("memory", ["numpy", "pool", "torch"])
def test_the_cache_keeps_no_input_alive(memory):
    """Protects the mode's saving: the cache of a memory-efficient add-norm holds neither x nor
    the residual alive, whatever memory the residual lives in (NumPy's own, the package's pool
    of outputs, as the h of a previous layer, or a torch tensor's), and while the residual does
    live, a backward's out= on it is refused."""
    import gc
    import weakref

    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    d = 512  # (512, 512) float32: 1 MiB, so a previous layer's h comes from the pool
    x = rng.standard_normal((d, d)).astype(np.float32)
    dy = rng.standard_normal((d, d)).astype(np.float32)
    if memory == "numpy":
        owner = rng.standard_normal((d, d)).astype(np.float32)
        residual = owner
    elif memory == "pool":
        owner = residual = cpu.add_layer_norm_forward(x, x)[1]
    else:
        owner = torch.from_numpy(rng.standard_normal((d, d)).astype(np.float32))
        residual = owner.numpy()
    _, _, cache = cpu.add_layer_norm_forward(x, residual, memory_efficient=True)
    with pytest.raises(ValueError, match="must not overlap"):
        cpu.add_layer_norm_backward(dy, None, cache, out_dresidual=residual)
    gone = weakref.ref(owner)
    del owner, residual
    gc.collect()
    assert gone() is None, f"the cache keeps the {memory} residual alive"
    assert cpu.add_layer_norm_backward(dy, None, cache)[0].shape == (d, d)
