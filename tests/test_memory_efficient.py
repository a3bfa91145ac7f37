"""The memory-efficient mode of the NumPy reference: the backward recovers xhat from y.

Against the float64 oracle in every dtype, finite differences in float64, the exact oracle's
error against the default mode's, the hard cases of the recovery rule (gamma = 0, gamma from
1e-4 to 1e4, beta = 1e4 * gamma, half dtypes) and what the cache holds."""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln
from layernorm import recovery
from layernorm import reference as ref
from layernorm.family import NORMS
from layernorm.numerics import exact_norm, relative_error, unit_roundoff
from layernorm.tolerances import assert_close

RNG = np.random.default_rng(77)
DTYPES = ["float64", "float32", "float16", "bfloat16"]


def _args(norm, x, gamma, beta, residual=None):
    """The forward's arguments of ``norm`` in its order: x, [residual], gamma, [beta]."""
    args = [x] + ([residual] if norm.residual else []) + [gamma]
    return args + [beta] if norm.centred else args


def _size(a):
    return float(np.max(np.abs(np.asarray(a, np.float64))))


# --- against the float64 oracle and the default mode, every norm and dtype ----------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("name", list(NORMS))
def test_against_the_float64_oracle(name, zero_centered, dtype, dtype_or_skip, run_norm,
                                    float64_oracle, results_close):
    """Protects the memory-efficient backward of every norm in every dtype: y, dx, dgamma
    (dbeta, dresidual) within the table's tolerance of the float64 oracle, with weights that
    keep some channels (a zero gamma, a large beta) and recover the rest."""
    dt = dtype_or_skip(dtype)
    norm = NORMS[name]
    d = 48
    x = (0.5 + 2.0 * RNG.standard_normal((3, 2, d))).astype(dt)
    gamma = (RNG.standard_normal(d) * 0.3 + (0.0 if zero_centered else 1.0)).astype(dt)
    gamma[5] = -1.0 if zero_centered else 0.0  # scale 0: kept
    beta = RNG.standard_normal(d).astype(dt)
    beta[7] = 40.0  # |beta| > 4 |scale|: kept
    residual = RNG.standard_normal(x.shape).astype(dt)
    args = _args(norm, x, gamma, beta, residual)
    cot = [RNG.standard_normal(x.shape).astype(dt) for _ in norm.forward_outputs]
    kw = {"zero_centered_gamma": zero_centered}
    got = run_norm(ln, norm, args, cot, memory_efficient=True, **kw)
    want = float64_oracle(norm, args, cot, **kw).results
    results_close(got, want, dt, scales={k: _size(w) for k, w in want.items()})
    cache = getattr(ref, f"{name}_forward")(*args, memory_efficient=True, **kw)[-1]
    keep = (cache.norm if norm.residual else cache).keep
    assert 5 in keep and (7 in keep) == norm.centred


def _adversarial(dtype):
    """Inputs of the suite's kind for ``dtype``: (name, x (M, D))."""
    rows = [("N(0, 1)", RNG.standard_normal((4, 1024))),
            ("1e4 + N(0, 1)", 1e4 + RNG.standard_normal((4, 1024))),
            ("zero variance", np.repeat(RNG.uniform(-100, 100, (4, 1)), 1024, axis=1))]
    big = 1e200 if dtype == "float64" else 1e20
    rows.append(("squares overflow", big + 0.1 * big * RNG.standard_normal((4, 1024))))
    if dtype == "float64":
        rows.append(("1e8 + N(0, 0.01)", 1e8 + 0.01 * RNG.standard_normal((4, 1024))))
    return rows


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_error_within_twice_the_default_modes(name, dtype):
    """Protects the mode's accuracy goal: against the exact oracle, dx, dgamma and dbeta of
    the memory-efficient backward are within 2x the default mode's errors on adversarial rows,
    gamma = 1 + N(0, 0.25) and beta ~ N(0, 1) as in `layernorm stability`. An error below one
    unit in the last place (2u relative) counts as one unit, as the final rounding alone can
    make it; in float64, where no wider type makes t = y - beta and dy * t exact, below two
    units (recovery adds two roundings to the default's: measured up to 2.3 units where the
    default has 1)."""
    norm = NORMS[name]
    dt = np.dtype(dtype)
    u = unit_roundoff(dt)
    fwd, bwd = getattr(ref, f"{name}_forward"), getattr(ref, f"{name}_backward")
    for case, xs in _adversarial(dtype):
        x = xs.astype(dt)
        d = x.shape[1]
        gamma = (1 + 0.5 * RNG.standard_normal(d)).astype(dt)
        beta = RNG.standard_normal(d).astype(dt)
        dy = RNG.standard_normal(x.shape).astype(dt)
        params = [gamma, beta] if norm.centred else [gamma]
        ex = exact_norm(x, gamma, beta if norm.centred else None, norm.eps, dy,
                        centred=norm.centred)
        default = bwd(dy, fwd(x, *params)[1])
        me = bwd(dy, fwd(x, *params, memory_efficient=True)[1])
        for what, a, b, want in zip(("dx", "dgamma", "dbeta"), default, me,
                                    (ex.dx, ex.dgamma, ex.dbeta), strict=False):
            e0, e1 = relative_error(a, want), relative_error(b, want)
            floor = (4 if dtype == "float64" else 2) * u
            assert e1 <= 2 * max(e0, floor), f"{case} {what}: {e1:.2e} vs default {e0:.2e}"


# --- finite differences ----------------------------------------------------------------------

def _pair(name, zero_centered):
    """f and its memory-efficient vjp for check_vjp (the add-norms: (y, h) and (dy, dh))."""
    fwd, bwd = getattr(ref, f"{name}_forward"), getattr(ref, f"{name}_backward")
    kw = {"zero_centered_gamma": zero_centered, "memory_efficient": True}
    if NORMS[name].residual:
        def f(*args):
            return fwd(*args, **kw)[:2]

        def vjp(*args):
            *args, (dy, dh) = args
            return bwd(dy, dh, fwd(*args, **kw)[2])
    else:
        def f(*args):
            return fwd(*args, **kw)[0]

        def vjp(*args):
            *args, dy = args
            return bwd(dy, fwd(*args, **kw)[1])
    return f, vjp


@pytest.mark.parametrize("mode", ["fast", "full"])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("name", list(NORMS))
def test_check_vjp_passes_the_memory_efficient_backward(name, zero_centered, mode):
    """Protects the derivation of the backward from y (docs/derivation.md): central
    differences of the forward agree with it in float64, for x, residual, gamma and beta, with
    one channel kept (a zero scale) and the rest recovered."""
    norm = NORMS[name]
    rng = np.random.default_rng(9)
    d = 12
    values = {"x": 1.5 * rng.standard_normal((4, d)) - 0.2,
              "residual": rng.standard_normal((4, d)) + 0.7,
              "gamma": 0.5 * rng.standard_normal(d) + (0.0 if zero_centered else 0.8),
              "beta": 0.3 * rng.standard_normal(d)}
    values["gamma"][3] = -1.0 if zero_centered else 0.0
    names = ("x", "residual", "gamma", "beta")
    used = tuple(n for n in names if n in ("x", "gamma") or (n == "residual" and norm.residual)
                 or (n == "beta" and norm.centred))
    f, vjp = _pair(name, zero_centered)
    report = ln.check_vjp(f, vjp, tuple(values[n] for n in used), mode=mode, names=used)
    assert report.max_rel_err < 1e-7


# --- the hard cases of the rule -------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "add_layer_norm"])
def test_hard_cases_stay_within_the_tolerance_table(name, dtype, dtype_or_skip, run_norm,
                                                    float64_oracle, results_close):
    """Protects the rule's purpose: gamma = 0 exactly, gamma spanning 1e-4 to 1e4 with
    beta = 0 and with beta = 1e4 * gamma, in every dtype (half dtypes recover from a rounded
    y): every gradient within the tolerance table of the float64 oracle, and the kept set is
    the one the rule names (all channels for beta = 1e4 * gamma, none for beta = 0)."""
    dt = dtype_or_skip(dtype)
    norm = NORMS[name]
    d = 40
    span = np.geomspace(1e-4, 1e4, d) * np.where(np.arange(d) % 2, 1.0, -1.0)
    zero = np.where(np.arange(d) % 5 == 0, 0.0, 1.0 + 0.2 * RNG.standard_normal(d))
    cases = {"gamma = 0 on every fifth channel": (zero, RNG.standard_normal(d)),
             "gamma from 1e-4 to 1e4, beta = 0": (span, np.zeros(d)),
             "beta = 1e4 * gamma": (span, 1e4 * span)}
    top = recovery.limits(dt)[1]
    for case, (g64, b64) in cases.items():
        gamma = g64.astype(dt)
        beta = np.clip(b64, -top / 4, top / 4).astype(dt)  # float16 tops out at 65504
        x = (0.5 + RNG.standard_normal((6, d))).astype(dt)
        residual = RNG.standard_normal(x.shape).astype(dt)
        args = _args(norm, x, gamma, beta, residual)
        cot = [RNG.standard_normal(x.shape).astype(dt) for _ in norm.forward_outputs]
        *_, cache = getattr(ref, f"{name}_forward")(*args, memory_efficient=True)
        c = cache.norm if norm.residual else cache
        want_keep = recovery.kept_channels(c.scale, c.shift, dt, d)
        np.testing.assert_array_equal(c.keep, want_keep)
        if case.startswith("gamma = 0"):
            assert set(range(0, d, 5)) <= set(c.keep.tolist()), case
        if case.endswith("beta = 0") and dtype != "float16":
            assert c.keep.size == 0, case  # every such scale is recoverable
        if case.startswith("beta = 1e4") and norm.centred:
            assert c.keep.size == d, case
        got = run_norm(ln, norm, args, cot, memory_efficient=True)
        want = float64_oracle(norm, args, cot).results
        scales = {k: _size(w) for k, w in want.items()}
        results_close(got, want, dt, scales=scales, what=case)


def test_the_rule_keeps_what_it_cannot_recover():
    """Protects each clause of recovery's rule: a zero or NaN scale, |shift| > MARGIN*|scale|,
    a scale below y's smallest normal, and a scale whose y could overflow are kept; ordinary
    weights (and none at all) keep nothing."""
    m = recovery.MARGIN
    tiny32, top32 = recovery.limits(np.float32)
    assert tiny32 == np.finfo(np.float32).smallest_normal and top32 == np.finfo(np.float32).max
    d = 16
    scale = np.ones(d)
    shift = np.zeros(d)
    scale[0] = 0.0
    scale[1] = np.nan
    scale[2], shift[2] = 1.0, m * 1.0001  # just beyond the margin
    scale[3], shift[3] = 1.0, m  # on it: recovered
    scale[4] = tiny32 / (2 * m)  # MARGIN * scale below tiny
    scale[5] = top32 / 4  # times sqrt(16) = 4: y could reach top32
    shift[6] = np.inf
    keep = recovery.kept_channels(scale, shift, np.float32, d)
    np.testing.assert_array_equal(keep, [0, 1, 2, 4, 5, 6])
    assert keep.dtype == np.int64
    assert recovery.kept_channels(None, None, np.float32, d).size == 0
    rng = np.random.default_rng(1)
    ordinary = 1 + 0.2 * rng.standard_normal(1024)
    assert recovery.kept_channels(ordinary, 0.1 * rng.standard_normal(1024), "bfloat16",
                                  1024).size == 0


# --- what the cache holds -------------------------------------------------------------------

@pytest.mark.parametrize("name", list(NORMS))
def test_the_cache_holds_y_and_the_statistics_not_x_or_xhat(name):
    """Protects the mode's memory: the cache holds the returned y (read-only, not a copy),
    rstd, the parameter copies and the kept channels, and no (M, D) array of its own; an
    add-norm's cache holds neither h nor x. nbytes counts exactly those."""
    norm = NORMS[name]
    x = RNG.standard_normal((8, 32)).astype(np.float32)
    gamma = np.ones(32, np.float32)
    gamma[[3, 9]] = 0.0
    args = _args(norm, x, gamma, np.zeros(32, np.float32), RNG.standard_normal(x.shape))
    *outs, cache = getattr(ref, f"{name}_forward")(*args, memory_efficient=True)
    y = outs[0]
    c = cache.norm if norm.residual else cache
    assert isinstance(c, ref.OutputCache)
    assert c.y is y and not y.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        y[0, 0] = 1.0
    if norm.residual:
        assert outs[1].flags.writeable  # h is the caller's to change
    np.testing.assert_array_equal(c.keep, [3, 9])
    assert c.xhat_kept.shape == (8, 2) and c.rstd.shape == (8,)
    arrays = [c.rstd, c.keep, c.xhat_kept, c.scale] + ([c.shift] if norm.centred else [])
    assert c.nbytes == sum(a.nbytes for a in arrays) == 8 * 4 + 2 * 8 + 16 * 4 + 32 * 4 * (
        2 if norm.centred else 1)
    default = getattr(ref, f"{name}_forward")(*args)[-1]
    assert (default.norm if norm.residual else default).nbytes - c.nbytes == 8 * 32 * 4 - 16 * 4 \
        - 2 * 8 - (32 * 4 if norm.centred else 0)


def test_modules_take_the_mode():
    """Protects the stateful modules' option: the same y and gradients as the default mode
    within float64 rounding, its flag checked and shown in the repr."""
    x = RNG.standard_normal((5, 24))
    dy = RNG.standard_normal((5, 24))
    for cls in (ref.LayerNorm, ref.RMSNorm):
        a, b = cls(24), cls(24, memory_efficient=True)
        a.gamma = b.gamma = 1 + 0.3 * RNG.standard_normal(24)
        np.testing.assert_array_equal(a.forward(x), b.forward(x))
        assert_close(b.backward(dy), a.backward(dy), "float64", name="dx")
        assert_close(b.dgamma, a.dgamma, "float64", "param", name="dgamma")
        assert "memory_efficient=True" in repr(b) and "memory_efficient" not in repr(a)
        with pytest.raises(TypeError, match="memory_efficient must be True or False"):
            cls(24, memory_efficient="yes")
    with pytest.raises(TypeError, match="memory_efficient must be True or False"):
        ref.layer_norm_forward(x, memory_efficient=1)


def test_rows_of_small_variance_are_kept_whole_under_a_shift():
    """Protects the rows' rule: rows with var < eps (nearly constant: x + residual rounded
    apart) keep their whole xhat when beta is non-zero, so dgamma summed over such rows alone
    keeps its relative accuracy (recovered through beta it would be off by ~MARGIN*u of
    sum|dy|, relatively 1e-5 here); with beta = 0 nothing is kept and recovery is exact."""
    d = 64
    v = np.repeat(RNG.uniform(-100, 100, (6, 1)), d, axis=1)  # constant rows
    residual = (v * RNG.uniform(0.2, 0.8, v.shape)).astype(np.float32)
    x = (v - residual).astype(np.float32)  # h = x + residual: 1-ulp noise around v
    gamma = (1 + 0.2 * RNG.standard_normal(d)).astype(np.float32)
    dy = RNG.standard_normal(v.shape).astype(np.float32)
    for beta, rows in ((RNG.standard_normal(d).astype(np.float32), 6),
                       (np.zeros(d, np.float32), 0)):
        _, h, cache = ref.add_layer_norm_forward(x, residual, gamma, beta,
                                                 memory_efficient=True)
        assert cache.norm.rows.size == rows and cache.norm.xhat_rows.shape == (rows, d)
        ex = exact_norm(h, gamma, beta, 1e-5, dy)
        _, _, dgamma, _ = ref.add_layer_norm_backward(dy, None, cache)
        assert relative_error(dgamma, ex.dgamma) < 4 * unit_roundoff(np.float32)
