"""The fused CPU kernels of the whole family (layernorm.cpu) against the NumPy reference, and
their contracts: batch invariance, a changed input caught, safe modules."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("torch")

import layernorm as ln  # noqa: E402 - after the skip
from layernorm import cpu  # noqa: E402
from layernorm.dtypes import available, resolve  # noqa: E402
from layernorm.family import NORMS  # noqa: E402
from layernorm.tolerances import assert_close  # noqa: E402

DTYPES = available()


@pytest.fixture
def matches_reference(run_norm, results_close):
    """Runs the fused ``norm`` and the reference on the same arguments and asserts every result
    has the reference's shape and dtype and is within the table for ``dtype``; returns the
    fused results."""
    def check(norm, args, cot, dtype, **kw):
        got = run_norm(cpu, norm, args, cot, **kw)
        want = run_norm(ln, norm, args, cot, **kw)
        for name, g in got.items():
            assert g.shape == want[name].shape and g.dtype == want[name].dtype, name
        results_close(got, want, dtype)
        return got
    return check


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "1+gamma"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(NORMS))
def test_fused_matches_the_reference(name, dtype, zero_centered, family_inputs,
                                     matches_reference):
    """Protects every fused kernel of the family in every dtype, with gamma and with 1 + gamma:
    each output and gradient matches the reference on the same inputs within the tolerance
    table, in the reference's dtypes."""
    norm = NORMS[name]
    args, cot = family_inputs(norm, (3, 7, 300), dtype)
    matches_reference(norm, args, cot, dtype, zero_centered_gamma=zero_centered)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["default", "from-y"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(NORMS))
def test_the_numpy_fallback_matches_the_reference(name, dtype, memory_efficient, family_inputs,
                                                  matches_reference, monkeypatch):
    """Protects the NumPy API where the C++ engine is missing: with it turned off the NumPy
    fallback runs (both modes, every norm and dtype, a checksum verified in the default mode)
    and matches the reference within the tolerance table, as the engine's results do."""
    from layernorm.cpu import api

    monkeypatch.setattr(api, "_engine", lambda: None)
    norm = NORMS[name]
    args, cot = family_inputs(norm, (3, 7, 300), dtype, seed=4)
    matches_reference(norm, args, cot, dtype, memory_efficient=memory_efficient)


@pytest.mark.parametrize("name", ["add_layer_norm", "add_rms_norm"])
def test_add_norm_with_a_float32_residual_stream(name, family_inputs, run_norm,
                                                 matches_reference):
    """Protects mixed dtypes: bfloat16 activations on a float32 residual stream. h is the
    reference's h bit for bit (both round x + residual once), dresidual comes back float32."""
    if "bfloat16" not in DTYPES:
        pytest.skip("needs ml_dtypes")
    norm = NORMS[name]
    args, cot = family_inputs(norm, (5, 130), "bfloat16", residual_dtype="float32")
    kw = {"residual_dtype": "float32"}
    got = matches_reference(norm, args, cot, "bfloat16", **kw)
    want_h = run_norm(ln, norm, args, cot, **kw)["h"]
    assert got["h"].dtype == np.float32 and got["h"].tobytes() == want_h.tobytes()
    assert got["dresidual"].dtype == np.float32  # dresidual in the residual's dtype


@pytest.mark.parametrize("name", list(NORMS))
def test_a_rows_results_do_not_depend_on_the_batch(name, family_inputs, run_norm):
    """Protects batch invariance: a row's outputs and dx are bitwise the same whatever rows
    surround it and however many there are (M = 1, 7, 64; the tiled and row-by-row paths)."""
    norm = NORMS[name]
    args, cot = family_inputs(norm, (64, 200), "float32", seed=3)
    row = 5
    ref = run_norm(cpu, norm, [a[row:row + 1] if a.ndim == 2 else a for a in args],
                   [c[row:row + 1] for c in cot])
    for m, at in ((7, 2), (64, row), (64, 63)):
        rows = np.roll(np.arange(64), at - row)[:m]  # ``row`` lands at index ``at``
        got = run_norm(cpu, norm, [a[rows] if a.ndim == 2 else a for a in args],
                       [c[rows] for c in cot])
        for name in (*norm.forward_outputs, *norm.backward_outputs):
            assert got[name][at].tobytes() == ref[name][0].tobytes(), (name, m, at)


@pytest.mark.parametrize("name", list(NORMS))
def test_a_changed_input_is_caught_not_differentiated(name, family_inputs):
    """Protects the cache that refers to x (or h): changing one element between the forward
    and the backward raises ValueError instead of returning the gradient of another forward;
    changing gamma has no effect (the cache holds a copy); no input is ever written."""
    norm = NORMS[name]
    args, cot = family_inputs(norm, (9, 50), "float32", seed=4)
    before = [a.copy() for a in (*args, *cot)]
    fwd = getattr(cpu, f"{norm.name}_forward")
    bwd = getattr(cpu, f"{norm.name}_backward")
    *outs, cache = fwd(*args)
    want = bwd(*cot, cache)
    watched = outs[1] if norm.residual else args[0]  # h, or x
    watched[6, 17] = np.nextafter(watched[6, 17], np.float32(np.inf))
    with pytest.raises(ValueError, match="changed between the forward and the backward"):
        bwd(*cot, cache)
    watched[6, 17] = np.nextafter(watched[6, 17], np.float32(-np.inf))  # restored
    gamma = args[2 if norm.residual else 1]
    gamma[:] = 3  # an optimizer step between the forward and the backward
    got = bwd(*cot, cache)
    gamma[:] = before[2 if norm.residual else 1]
    assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want, strict=True))
    assert all(a.tobytes() == b.tobytes() for a, b in zip((*args, *cot), before, strict=True))


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm"])
def test_modules_return_fresh_arrays_unless_asked_to_reuse(module):
    """Protects the modules: by default a second forward leaves the first y (kept by a later
    layer) untouched; reuse_buffers=True reuses the buffers; zero_centered_gamma starts gamma
    at zeros; results match the reference module."""
    x = np.random.default_rng(5).standard_normal((6, 32)).astype(np.float32)
    mod, ref = getattr(cpu, module)(32), getattr(ln, module)(32)
    y1 = mod(x)
    assert_close(y1, ref(x), "float32", "out", name="y")
    assert_close(mod.backward(x), ref.backward(x), "float32", "out", name="dx")
    assert_close(mod.dgamma, ref.dgamma, "float32", "param", name="dgamma")
    kept = y1.copy()
    mod(x * 2)
    assert y1.tobytes() == kept.tobytes()
    reuse = getattr(cpu, module)(32, reuse_buffers=True)
    assert reuse(x) is reuse(x)
    zc = getattr(cpu, module)(32, zero_centered_gamma=True)
    assert not zc.gamma.any()
    assert_close(zc(x), ref(x), "float32", "out", name="y (1 + 0)")
    with pytest.raises(TypeError, match="reuse_buffers"):
        getattr(cpu, module)(32, reuse_buffers=1)


@pytest.mark.parametrize("dtype,big", [("float32", 1e30), ("float64", 1e300)])
def test_rms_rows_whose_squares_overflow(dtype, big, family_inputs, matches_reference):
    """Protects RMSNorm's power-of-two rescaling in the kernels: rows whose squares overflow
    the compute dtype match the reference (finite, within the table)."""
    norm = NORMS["rms_norm"]
    args, cot = family_inputs(norm, (6, 40), dtype, seed=6)
    args[0][2] *= big
    got = matches_reference(norm, args, cot, dtype)
    assert np.isfinite(got["y"]).all() and np.isfinite(got["dx"]).all()


def _bfloat16_exact(values: np.ndarray) -> np.ndarray:
    """float64 ``values`` rounded once to nearest even bfloat16, in exact rational arithmetic."""
    from fractions import Fraction

    out = []
    for v in values.tolist():
        if not math.isfinite(v):
            out.append(v)
            continue
        e = max(math.frexp(v)[1], -125) - 8  # the spacing of bfloat16 at v: 2**e
        q = Fraction(v) / Fraction(2) ** e
        n = math.floor(q)
        n += (q - n > Fraction(1, 2)) or (q - n == Fraction(1, 2) and n % 2 == 1)
        r = math.copysign(float(Fraction(n) * Fraction(2) ** e), v)  # -0.0 stays signed
        out.append(r if abs(r) <= 3.3895313892515355e38 else math.copysign(math.inf, v))
    return np.array(out).astype(resolve("bfloat16"))


def test_half_conversions_inside_the_kernels_round_once_to_nearest_even():
    """Protects the engine's float16/bfloat16 conversions: loading every 16-bit pattern is
    exact, and rounding float32 and float64 values (ties, subnormals, overflow, NaN included)
    to a half dtype gives the correctly rounded bits: NumPy's and ml_dtypes' for float32, and
    for float64 NumPy's (float16) and exact rational rounding (bfloat16: the engine goes through
    float32 rounded to odd, which must not round twice, as ml_dtypes' conversion does). Driven
    through an add-norm's h = x + residual with a residual of -0.0, which adds nothing (-0.0
    included), so h is x converted once to h's dtype."""
    def convert(src: np.ndarray, dtype: object) -> np.ndarray:
        neg_zero = np.full_like(src, -0.0)
        _, h, _ = cpu.add_rms_norm_forward(src[None], neg_zero[None], residual_dtype=dtype)
        return h[0]

    rng = np.random.default_rng(7)
    f32 = np.concatenate([
        rng.standard_normal(20000).astype(np.float32) * np.float32(1e3),
        np.ldexp(rng.integers(1, 2**12, 5000), rng.integers(-30, 20, 5000)).astype(np.float32),
        np.array([0.0, -0.0, np.inf, -np.inf, 65520.0, 65519.99, 3.4e38, 1e-8, 2**-25,
                  3 * 2**-26], np.float32),
    ])
    f64 = np.concatenate([f32.astype(np.float64) * (1 + 2.0**-30),
                          np.float64(1) + np.ldexp(1.0, -np.arange(1, 60)),
                          np.array([1e300, -1e-300, 2**-24 * (1 + 2**-40)])])
    for name in [n for n in ("float16", "bfloat16") if n in DTYPES]:
        dt = resolve(name)
        bits = np.arange(2**16, dtype=np.uint16).view(dt)  # every pattern
        wide = convert(bits, np.float32)
        want = bits.astype(np.float32)
        same = (wide.view(np.uint32) == want.view(np.uint32)) | (np.isnan(wide) & np.isnan(want))
        assert same.all(), (name, "load", np.flatnonzero(~same)[:5])
        for src in (f32, f64):
            if name == "bfloat16" and src.dtype == np.float64:
                want = _bfloat16_exact(src)  # ml_dtypes goes through float32: twice
            else:
                with np.errstate(over="ignore"):
                    want = src.astype(dt)
            got = convert(src, dt)
            nan = np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32))
            bad = (got.view(np.uint16) != want.view(np.uint16)) & ~nan
            assert not bad.any(), (name, src.dtype, np.flatnonzero(bad)[:5])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("change", ["negate", "double", "abs", "sign pattern"])
def test_whole_row_changes_are_caught_too(dtype, change):
    """Protects the checksum against changes that cancel in a weighted sum of bits: negating
    a row, scaling it by a power of two, taking |x| (each moves every element's bits by the same
    high bit or exponent step), and negating [a, -b, -c, d], whose bit changes cancel exactly
    for weights 1, 3, 5, 7. Each must raise, not return the gradient of another forward."""
    dt = resolve(dtype)
    rng = np.random.default_rng(9)
    x = (np.array([[1.0, -1.0, -1.0, 1.0]]) if change == "sign pattern"
         else rng.standard_normal((4, 768))).astype(dt)
    dy = np.ones_like(x)
    mod = cpu.LayerNorm(x.shape[1])
    mod(x)
    if change == "double":
        x *= 2
    elif change == "abs":
        np.abs(x, out=x)
    else:
        np.negative(x, out=x)
    with pytest.raises(ValueError, match="changed between the forward and the backward"):
        mod.backward(dy)


@pytest.mark.parametrize("residual_dtype", ["float32", "float16", "bfloat16"])
def test_add_norm_backward_computes_in_its_own_dtypes(residual_dtype):
    """Protects the add-norms' backward dtypes when h is narrower than x (float64): dy is
    rounded to h's compute dtype as the reference does, so D = 1 gives dx = 0 exactly; and dh is
    added in the add's dtype (float64 here), so with dy = 0, dx and dresidual are dh exactly."""
    if residual_dtype not in DTYPES:
        pytest.skip("needs ml_dtypes")
    rng = np.random.default_rng(10)
    x, r = rng.standard_normal((5, 1)), rng.standard_normal((5, 1))
    _, _, cache = cpu.add_layer_norm_forward(x, r, residual_dtype=residual_dtype)
    dx, dres, _, _ = cpu.add_layer_norm_backward(rng.standard_normal((5, 1)), None, cache)
    assert not dx.any() and not dres.any()
    x, r = rng.standard_normal((8, 64)), rng.standard_normal((8, 64))
    dh = 1 + 1e-4 * rng.standard_normal((8, 64))
    _, _, cache = cpu.add_layer_norm_forward(x, r, residual_dtype=residual_dtype)
    dx, dres, _, _ = cpu.add_layer_norm_backward(np.zeros((8, 64)), dh, cache)
    assert dx.tobytes() == dh.tobytes() and dres.tobytes() == dh.tobytes()
