"""The rest of the family in the NumPy reference: RMSNorm, zero-centred gamma and the fused
residual add, against the float64 oracle (tests/conftest.py), finite differences, planted
bugs, and the exact properties (fused = unfused, batch invariance, inputs never modified)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import layernorm as ln
from layernorm.family import NORMS
from layernorm.tolerances import assert_close

RNG = np.random.default_rng(2024)
DTYPES = ["float64", "float32", "float16", "bfloat16"]


def _rand(shape, dtype, scale=1.0, offset=0.0):
    return (offset + scale * RNG.standard_normal(shape)).astype(dtype)


def _size(a):
    return float(np.max(np.abs(np.asarray(a, np.float64))))


# --- each forward and backward against the float64 oracle, in every dtype ------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_norms_against_float64_oracle(kind, zero_centered, dtype, dtype_or_skip, run_norm,
                                      float64_oracle, results_close):
    """Protects rms_norm_forward/backward (and layer_norm with zero_centered_gamma) in every
    dtype: y, dx, dgamma (dbeta) within the table's tolerance of the float64 oracle on the same
    rounded inputs, returned in the inputs' dtypes."""
    dt = dtype_or_skip(dtype)
    norm = NORMS[kind]
    shape = (2, 3, 40)
    x, dy = _rand(shape, dt, 2.0, 0.5), _rand(shape, dt)
    gamma = _rand(40, dt, 0.3, 0.0 if zero_centered else 1.0)
    beta = _rand(40, dt) if kind == "layer_norm" else None
    args = [x, gamma, beta] if kind == "layer_norm" else [x, gamma]
    kw = {"zero_centered_gamma": zero_centered}
    got = run_norm(ln, norm, args, [dy], **kw)
    # rms_norm_backward returns (dx, dgamma), layer_norm_backward (dx, dgamma, dbeta)
    assert list(got) == (["y", "dx", "dgamma", "dbeta"] if kind == "layer_norm" else
                         ["y", "dx", "dgamma"])
    want = float64_oracle(norm, args, [dy], **kw).results
    assert got["y"].dtype == got["dx"].dtype == got["dgamma"].dtype == dt
    results_close(got, want, dt, scales={k: _size(w) for k, w in want.items()})


ADD_DTYPES = [  # (x, residual, residual_dtype)
    ("float64", "float64", None),
    ("float32", "float32", None),
    ("float16", "float16", None),
    ("bfloat16", "bfloat16", None),
    ("bfloat16", "float32", "float32"),
    ("float16", "bfloat16", "float32"),
    ("float32", "float16", "float64"),
    # h narrower than x: y and dx are still rounded once, from float32, to x's dtype
    ("float32", "float32", "bfloat16"),
]


@pytest.mark.parametrize("x_name,res_name,h_name", ADD_DTYPES)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_add_norms_against_float64_oracle(kind, x_name, res_name, h_name, dtype_or_skip,
                                          run_norm, float64_oracle, results_close):
    """Protects add_layer_norm/add_rms_norm in every dtype and mixed dtypes: h = x + residual
    in residual_dtype, y = norm(h) in x's dtype, dx = dresidual = dh + dnorm in x's and
    residual's dtypes, all within tolerance of the float64 oracle."""
    xdt, rdt = dtype_or_skip(x_name), dtype_or_skip(res_name)
    hdt = xdt if h_name is None else dtype_or_skip(h_name)
    norm = NORMS[f"add_{kind}"]
    shape = (5, 33)
    x, residual = _rand(shape, xdt), _rand(shape, rdt, 3.0, 1.0)
    dy, dh = _rand(shape, xdt), _rand(shape, hdt)
    gamma = _rand(33, xdt, 0.5, 1.0)
    beta = _rand(33, xdt) if kind == "layer_norm" else None
    args = [x, residual, gamma, beta] if kind == "layer_norm" else [x, residual, gamma]
    got = run_norm(ln, norm, args, [dy, dh], residual_dtype=h_name)
    assert tuple(got[k].dtype for k in ("y", "h", "dx", "dresidual", "dgamma")) == \
        (xdt, hdt, xdt, rdt, xdt)

    h_want = x.astype(np.float64) + residual.astype(np.float64)  # exact in float64 here
    assert_close(got["h"], h_want, hdt, scale=_size(h_want), name="h")
    # the norm reads the rounded h: the oracle does too; dx = dresidual = dh + the norm's dx
    want = float64_oracle(norm, args, [dy, dh], residual_dtype=h_name).results
    np.testing.assert_array_equal(want.pop("h"), got.pop("h").astype(np.float64))
    # each in its own dtype's tolerance (y, dx, dgamma: x's; dresidual: residual's), no finer
    # than h's compute dtype
    results_close(got, want, scales={k: _size(w) for k, w in want.items()}, h_dtype=hdt)


def test_parameter_gradients_are_none_exactly_when_the_parameter_is():
    """Protects the return contract of the new backwards: dgamma (dbeta) None iff gamma
    (beta) was None, and the tuple lengths (dx, dgamma); (dx, dresidual, dgamma[, dbeta])."""
    x, r, dy = _rand((3, 6), np.float64), _rand((3, 6), np.float64), _rand((3, 6), np.float64)
    g, b = _rand(6, np.float64), _rand(6, np.float64)
    for gamma in (g, None):
        out = ln.rms_norm_backward(dy, ln.rms_norm_forward(x, gamma)[1])
        assert len(out) == 2 and (out[1] is None) == (gamma is None)
        out = ln.add_rms_norm_backward(dy, None, ln.add_rms_norm_forward(x, r, gamma)[2])
        assert len(out) == 3 and (out[2] is None) == (gamma is None)
        for beta in (b, None):
            out = ln.add_layer_norm_backward(dy, dy, ln.add_layer_norm_forward(x, r, gamma,
                                                                               beta)[2])
            assert len(out) == 4 and (out[2] is None) == (gamma is None)
            assert (out[3] is None) == (beta is None)


# --- finite differences, and planted bugs both modes must reject ---------------------------

ARGS = {
    "layer_norm": ("x", "gamma", "beta"),
    "rms_norm": ("x", "gamma"),
    "add_layer_norm": ("x", "residual", "gamma", "beta"),
    "add_rms_norm": ("x", "residual", "gamma"),
}


def _pair(kind, zero_centered):
    """f(*args) and f_vjp(*args, dout) of ``kind`` for check_vjp; the add-norms return (y, h)
    and take (dy, dh)."""
    fwd, bwd = getattr(ln, f"{kind}_forward"), getattr(ln, f"{kind}_backward")
    if kind.startswith("add_"):
        def f(*args):
            return fwd(*args, zero_centered_gamma=zero_centered)[:2]

        def vjp(*args):
            *args, (dy, dh) = args
            return bwd(dy, dh, fwd(*args, zero_centered_gamma=zero_centered)[2])
    else:
        def f(*args):
            return fwd(*args, zero_centered_gamma=zero_centered)[0]

        def vjp(*args):
            *args, dy = args
            return bwd(dy, fwd(*args, zero_centered_gamma=zero_centered)[1])
    return f, vjp


def _point(kind, shape=(4, 12), seed=5):
    """A float64 point for ``kind``'s arguments: x, [residual], gamma, [beta]."""
    rng = np.random.default_rng(seed)
    d = shape[-1]
    values = {"x": 1.5 * rng.standard_normal(shape) - 0.2,
              "residual": rng.standard_normal(shape) + 0.7,
              "gamma": 0.5 * rng.standard_normal(d) + 0.3,
              "beta": rng.standard_normal(d)}
    return tuple(values[n] for n in ARGS[kind])


@pytest.mark.parametrize("mode", ["fast", "full"])
@pytest.mark.parametrize("kind,zero_centered", [
    ("rms_norm", False), ("rms_norm", True), ("layer_norm", True),
    ("add_layer_norm", False), ("add_layer_norm", True),
    ("add_rms_norm", False), ("add_rms_norm", True),
])
def test_check_vjp_passes_every_new_function(kind, zero_centered, mode):
    """Protects every new backward (gamma, beta and residual included) against central
    differences of its forward, in float64, in both modes of check_vjp."""
    f, vjp = _pair(kind, zero_centered)
    report = ln.check_vjp(f, vjp, _point(kind), mode=mode, names=ARGS[kind])
    assert report.max_rel_err < 1e-7


def _rms_dx_without_projection(x, gamma, dy):
    cache = ln.rms_norm_forward(x, gamma)[1]
    dgamma = ln.rms_norm_backward(dy, cache)[1]
    return cache.rstd[:, None] * dy * cache.scale, dgamma


def _add_dx_without_dh(x, residual, gamma, dout):
    dy, dh = dout
    cache = ln.add_rms_norm_forward(x, residual, gamma)[2]
    dnorm, _, dgamma = ln.add_rms_norm_backward(dy, None, cache)
    return dnorm, ln.add_rms_norm_backward(dy, dh, cache)[1], dgamma


def _add_dresidual_only_dh(x, residual, gamma, beta, dout):
    dy, dh = dout
    dx, _, dgamma, dbeta = ln.add_layer_norm_backward(
        dy, dh, ln.add_layer_norm_forward(x, residual, gamma, beta)[2])
    return dx, dh, dgamma, dbeta


def _zero_centered_dgamma_times_scale(x, gamma, dy):
    cache = ln.rms_norm_forward(x, gamma, zero_centered_gamma=True)[1]
    dx, dgamma = ln.rms_norm_backward(dy, cache)
    return dx, dgamma * cache.scale


PLANTED = {  # bug: (kind, zero_centered, broken vjp, the argument check_vjp must name)
    "RMSNorm dx without xhat*mean(g*xhat)": ("rms_norm", False, _rms_dx_without_projection, "x"),
    "add-norm dx without dh": ("add_rms_norm", False, _add_dx_without_dh, "x"),
    "dresidual = dh, not dx": ("add_layer_norm", False, _add_dresidual_only_dh, "residual"),
    "zero-centred dgamma times 1 + gamma": ("rms_norm", True, _zero_centered_dgamma_times_scale,
                                            "gamma"),
}


@pytest.mark.parametrize("mode", ["fast", "full"])
@pytest.mark.parametrize("bug", list(PLANTED))
def test_check_vjp_rejects_planted_bugs(bug, mode):
    """Protects the tests above from passing wrong gradients: each realistic mistake in a new
    backward is rejected by check_vjp in both modes, naming the argument it breaks."""
    kind, zero_centered, broken, arg = PLANTED[bug]
    f, _ = _pair(kind, zero_centered)
    with pytest.raises(ln.GradcheckError) as err:
        ln.check_vjp(f, broken, _point(kind), mode=mode, names=ARGS[kind])
    assert err.value.arg == arg


# --- zero-centred gamma ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_zero_centered_equals_explicit_scale_in_float64(kind):
    """Protects zero_centered_gamma: in float64, gamma with the flag gives bitwise the results
    of 1 + gamma without it (the same arithmetic), and the same dgamma (d(1+gamma)/dgamma = 1)."""
    fwd, bwd = getattr(ln, f"{kind}_forward"), getattr(ln, f"{kind}_backward")
    args = list(_point(kind, (3, 17)))
    i = ARGS[kind].index("gamma")
    dy = RNG.standard_normal((3, 17))
    grads = ((dy, dy * 0.5) if kind.startswith("add_") else (dy,))
    zc_out = fwd(*args, zero_centered_gamma=True)
    explicit = args.copy()
    explicit[i] = 1.0 + args[i]
    ex_out = fwd(*explicit)
    for a, b in zip(zc_out[:-1], ex_out[:-1], strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(bwd(*grads, zc_out[-1]), bwd(*grads, ex_out[-1]), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_zero_centered_scale_is_formed_in_float32_for_bfloat16(kind, dtype_or_skip,
                                                               float64_oracle):
    """Protects 1 + gamma from rounding to bfloat16: with gamma = 2**-10 (1 + 2**-10 is not a
    bfloat16), the cache's scale is exactly 1 + 2**-10 in float32, and y and dx differ from
    those of gamma rounded to bfloat16 first (which is 1, erasing gamma)."""
    bf16 = dtype_or_skip("bfloat16")
    fwd, bwd = getattr(ln, f"{kind}_forward"), getattr(ln, f"{kind}_backward")
    x, dy = _rand((8, 256), bf16, 2.0), _rand((8, 256), bf16)
    gamma = np.full(256, 2.0**-10, dtype=bf16)
    rounded_first = (1.0 + gamma.astype(np.float32)).astype(bf16)
    assert np.all(rounded_first == 1)
    y, cache = fwd(x, gamma, zero_centered_gamma=True)
    assert cache.scale.dtype == np.float32 and np.all(cache.scale == np.float32(1 + 2.0**-10))
    y1, cache1 = fwd(x, rounded_first)
    assert not np.array_equal(y, y1)
    assert not np.array_equal(bwd(dy, cache)[0], bwd(dy, cache1)[0])
    # and y is right: the float64 oracle with the unrounded 1 + gamma
    args = [x, gamma, None] if kind == "layer_norm" else [x, gamma]
    want = float64_oracle(NORMS[kind], args, [dy], zero_centered_gamma=True).results["y"]
    assert_close(y, want, bf16, scale=_size(want), name="y")


# --- the fused residual add -----------------------------------------------------------------

FUSED_DTYPES = [  # (x, residual, residual_dtype): h is as wide as y's compute, or x's dtype
    ("float64", "float64", None),
    ("float32", "float32", None),
    ("bfloat16", "bfloat16", None),
    ("float16", "float16", None),
    ("bfloat16", "float32", "float32"),
    ("float16", "float32", "float32"),
    ("float64", "float16", "float32"),
]


@pytest.mark.parametrize("x_name,res_name,h_name", FUSED_DTYPES)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_fused_add_equals_unfused_composition(kind, x_name, res_name, h_name, dtype_or_skip):
    """Protects the fusion: h is x + residual rounded once to residual_dtype, and y is bitwise
    the norm of that h (layer_norm_forward(h) or rms_norm_forward(h)) cast to x's dtype."""
    xdt, rdt = dtype_or_skip(x_name), dtype_or_skip(res_name)
    hdt = xdt if h_name is None else dtype_or_skip(h_name)
    x, residual = _rand((6, 50), xdt), _rand((6, 50), rdt, 4.0)
    gamma, beta = _rand(50, xdt), _rand(50, xdt)
    params = (gamma, beta) if kind == "layer_norm" else (gamma,)
    y, h, _ = getattr(ln, f"add_{kind}_forward")(x, residual, *params, residual_dtype=h_name,
                                                 zero_centered_gamma=True)
    wide = np.float64 if np.float64 in (xdt, rdt, hdt) else np.float32
    h_want = (x.astype(wide) + residual.astype(wide)).astype(hdt)
    y_want = getattr(ln, f"{kind}_forward")(h_want, *params, zero_centered_gamma=True)[0]
    assert h.dtype == hdt and y.dtype == xdt
    np.testing.assert_array_equal(h, h_want)
    np.testing.assert_array_equal(y, y_want.astype(xdt))


def test_bfloat16_x_with_a_float32_residual_stream(dtype_or_skip):
    """Protects the mixed-precision block: bfloat16 x, float32 residual, residual_dtype float32
    keeps h in float32 (not rounded through bfloat16), y and dx in bfloat16, dresidual float32."""
    bf16 = dtype_or_skip("bfloat16")
    x, residual = _rand((4, 64), bf16), _rand((4, 64), np.float32)
    y, h, cache = ln.add_rms_norm_forward(x, residual, np.ones(64, bf16), residual_dtype="float32")
    assert h.dtype == np.float32 and y.dtype == bf16
    np.testing.assert_array_equal(h, x.astype(np.float32) + residual)
    assert not np.array_equal(h, h.astype(bf16).astype(np.float32))  # h kept float32 bits
    dx, dresidual, dgamma = ln.add_rms_norm_backward(_rand((4, 64), bf16),
                                                     _rand((4, 64), np.float32), cache)
    assert dx.dtype == bf16 and dresidual.dtype == np.float32 and dgamma.dtype == bf16
    # both are the one float32 total, each rounded once
    np.testing.assert_array_equal(dx, dresidual.astype(bf16))


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_dh_none_is_dh_zero_and_outputs_are_distinct(kind, dtype, dtype_or_skip):
    """Protects dh = None (h used only by the norm): the same as dh = 0, bitwise; and dx and
    dresidual are distinct fresh arrays, aliasing neither each other, dy, dh nor the cache,
    even when x and residual share the compute dtype (where a lazy cast would alias)."""
    dt = dtype_or_skip(dtype)
    x, residual, dy = _rand((3, 20), dt), _rand((3, 20), dt), _rand((3, 20), dt)
    fwd, bwd = getattr(ln, f"add_{kind}_forward"), getattr(ln, f"add_{kind}_backward")
    _, _, cache = fwd(x, residual, _rand(20, dt))
    none = bwd(dy, None, cache)
    zero = bwd(dy, np.zeros((3, 20), dt), cache)
    for a, b in zip(none, zero, strict=True):
        np.testing.assert_array_equal(a, b)
    dh = _rand((3, 20), dt)
    dx, dresidual = bwd(dy, dh, cache)[:2]
    assert dx.dtype == dresidual.dtype == dt
    np.testing.assert_array_equal(dx, dresidual)
    for a in (dresidual, dy, dh, cache.norm.xhat, cache.norm.rstd, cache.norm.scale):
        assert not np.shares_memory(dx, a)
    for a in (dy, dh, cache.norm.xhat):
        assert not np.shares_memory(dresidual, a)


# --- overflow, batch invariance, inputs ------------------------------------------------------

@pytest.mark.parametrize("dtype,size,prescale", [
    ("float32", 1e30, 0),   # mean(x**2) overflows float32 (and bfloat16) beyond ~1.8e19/sqrt(D)
    ("bfloat16", 1e30, 0),
    ("float64", 1e300, -1000),  # and float64 beyond ~1.3e154/sqrt(D)
])
def test_rms_norm_rows_whose_squares_overflow(dtype, size, prescale, dtype_or_skip,
                                              float64_oracle):
    """Protects RMSNorm's power-of-two rescaling: rows of |x| ~ 1e30 (float32, bfloat16) and
    1e300 (float64), whose squares overflow, beside ordinary rows, give y and dx within
    tolerance of the oracle. For float64 the oracle uses y(x) = y(s*x) and dx(x) = s*dx(s*x)
    with s = 2**prescale, exact for a power of two (eps*s**2 < 1e-600 changes nothing)."""
    dt = dtype_or_skip(dtype)
    x = _rand((4, 64), dt, size)
    x[1] = _rand(64, dt)  # an ordinary row among them
    with np.errstate(over="ignore"):
        squares = np.square(x.astype(np.float64 if dt == np.float64 else np.float32)).sum(1)
    assert np.all(np.isinf(squares) == [True, False, True, True])
    gamma, dy = _rand(64, dt, 0.5, 1.0), _rand((4, 64), dt)
    y, cache = ln.rms_norm_forward(x, gamma)
    dx, dgamma = ln.rms_norm_backward(dy, cache)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx))
    dgamma_rows = []
    for r in range(4):  # one oracle call per row: each has its own s
        s = 2.0**prescale if r != 1 else 1.0
        want = float64_oracle(NORMS["rms_norm"], [x[r:r + 1].astype(np.float64) * s, gamma],
                              [dy[r:r + 1]], eps=1e-6 * s * s).results
        assert_close(y[r], want["y"][0], dt, scale=_size(want["y"]), name=f"y row {r}")
        w = want["dx"][0] * s  # dx's size differs by 30 (300) orders of magnitude between rows
        assert_close(dx[r], w, dt, scale=_size(w), name=f"dx row {r}")
        dgamma_rows.append(want["dgamma"])
    want_dgamma = np.array([math.fsum(col) for col in np.transpose(dgamma_rows)])
    assert_close(dgamma, want_dgamma, dt, "param", scale=_size(want_dgamma), name="dgamma")


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_batch_invariance(kind, dtype, dtype_or_skip):
    """Protects per-row independence: a row's y and dx (and h, dresidual) are bitwise the same
    alone (M = 1), among 7 rows, and among 64 rows that include an overflowing row, at any
    position."""
    dt = dtype_or_skip(dtype)
    d = 100
    fwd, bwd = getattr(ln, f"{kind}_forward"), getattr(ln, f"{kind}_backward")
    add = kind.startswith("add_")
    params = [_rand(d, dt)] + ([_rand(d, dt)] if "layer" in kind else [])
    row = {n: _rand(d, dt, 2.0, 0.5) for n in ("x", "residual", "dy", "dh")}

    def run(m, at):
        batch = {n: _rand((m, d), dt, 2.0, 0.5) for n in row}
        if m > 7:
            batch["x"][0] = _rand(d, dt, 1e30 if dt != np.float64 else 1e300)
        for n in row:
            batch[n][at] = row[n]
        with np.errstate(over="ignore"):
            if add:
                y, h, cache = fwd(batch["x"], batch["residual"], *params)
                outs = (y, h, *bwd(batch["dy"], batch["dh"], cache)[:2])
            else:
                y, cache = fwd(batch["x"], *params)
                outs = (y, bwd(batch["dy"], cache)[0])
        return [o[at] for o in outs]

    alone = run(1, 0)
    for m, at in [(7, 0), (7, 3), (7, 6), (64, 1), (64, 50), (64, 63)]:
        for a, b in zip(alone, run(m, at), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"M = {m}, row {at}")


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_inputs_are_never_modified(dtype):
    """Protects the caller's arrays: x, residual, gamma, beta, dy and dh are read-only here
    (any write would raise) and keep their values through every new forward and backward."""
    dt = np.dtype(dtype)
    arrays = {n: _rand((5, 16), dt) for n in ("x", "residual", "dy", "dh")}
    arrays.update(gamma=_rand(16, dt), beta=_rand(16, dt))
    saved = {n: a.copy() for n, a in arrays.items()}
    for a in arrays.values():
        a.setflags(write=False)
    x, r, g, b, dy, dh = (arrays[n] for n in ("x", "residual", "gamma", "beta", "dy", "dh"))
    for zc in (False, True):
        ln.rms_norm_backward(dy, ln.rms_norm_forward(x, g, zero_centered_gamma=zc)[1])
        ln.layer_norm_backward(dy, ln.layer_norm_forward(x, g, b, zero_centered_gamma=zc)[1])
        for h_name in (None, "float32", "float64"):
            cache = ln.add_rms_norm_forward(x, r, g, residual_dtype=h_name,
                                            zero_centered_gamma=zc)[2]
            ln.add_rms_norm_backward(dy, dh, cache)
            cache = ln.add_layer_norm_forward(x, r, g, b, residual_dtype=h_name,
                                              zero_centered_gamma=zc)[2]
            ln.add_layer_norm_backward(dy, dh, cache)
    for n, a in arrays.items():
        np.testing.assert_array_equal(a, saved[n], err_msg=n)


X = np.random.default_rng(0).standard_normal((3, 4))
_, _RMS = ln.rms_norm_forward(X)
_, _LN = ln.layer_norm_forward(X)
_, _, _ADD_RMS = ln.add_rms_norm_forward(X, X)
_, _, _ADD_LN = ln.add_layer_norm_forward(X, X)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: ln.rms_norm_forward(X, np.ones(5)), ValueError, r"gamma must have shape \(4,\)"),
    (lambda: ln.rms_norm_forward(X, np.ones(4, np.int64)), TypeError,
     "gamma must have a floating dtype"),
    (lambda: ln.rms_norm_forward(X.astype(np.int32)), TypeError, "x must have a floating dtype"),
    (lambda: ln.rms_norm_forward(X, eps=-1.0), ValueError, "eps must be a finite number >= 0"),
    (lambda: ln.rms_norm_forward(X, zero_centered_gamma=1), TypeError,
     "zero_centered_gamma must be True or False"),
    (lambda: ln.layer_norm_forward(X, zero_centered_gamma=None), TypeError,
     "zero_centered_gamma must be True or False"),
    (lambda: ln.add_layer_norm_forward(X, np.ones((3, 5))), ValueError,
     r"residual must have the shape of x, \(3, 4\)"),
    (lambda: ln.add_rms_norm_forward(X, np.ones(4)), ValueError, "residual must have the shape"),
    (lambda: ln.add_rms_norm_forward(X, np.ones((3, 4), np.int64)), TypeError,
     "residual must have a floating dtype"),
    (lambda: ln.add_rms_norm_forward(X, X, residual_dtype="int32"), ValueError,
     "residual_dtype must be one of float16, bfloat16, float32, float64"),
    (lambda: ln.add_layer_norm_forward(X, X, residual_dtype=np.int32), ValueError,
     "residual_dtype must be one of"),
    (lambda: ln.add_layer_norm_forward(X, X, residual_dtype=4), TypeError,
     "residual_dtype must be None, a dtype name or a NumPy dtype"),
    (lambda: ln.add_layer_norm_forward(X, X, eps=-1.0), ValueError, "eps must be"),
    (lambda: ln.add_rms_norm_backward(X, np.ones((3, 5)), _ADD_RMS), ValueError,
     r"dh must have the shape of the forward's h, \(3, 4\)"),
    (lambda: ln.add_layer_norm_backward(X, np.ones((3, 4), bool), _ADD_LN), TypeError,
     "dh must have a floating dtype"),
    (lambda: ln.add_layer_norm_backward(np.ones((4, 3)), None, _ADD_LN), ValueError,
     "dy must have the shape"),
    (lambda: ln.rms_norm_backward(np.ones((3, 5)), _RMS), ValueError, "dy must have the shape"),
    (lambda: ln.rms_norm_backward(X, _LN), ValueError,
     "cache must be the NormCache or OutputCache returned by rms_norm_forward, got the cache "
     "of a layer norm"),
    (lambda: ln.layer_norm_backward(X, _RMS), ValueError,
     "cache must be the NormCache or OutputCache returned by layer_norm_forward, got the "
     "cache of an RMS"),
    (lambda: ln.add_layer_norm_backward(X, None, _ADD_RMS), ValueError,
     "cache must be the AddNormCache returned by add_layer_norm_forward"),
    (lambda: ln.rms_norm_backward(X, _ADD_RMS), TypeError,
     "cache must be the NormCache or OutputCache returned by rms_norm_forward, got AddNormCache"),
    (lambda: ln.add_rms_norm_backward(X, None, _RMS), TypeError,
     "cache must be the AddNormCache returned by add_rms_norm_forward, got NormCache"),
    (lambda: ln.RMSNorm(0), ValueError, "D must be >= 1"),
    (lambda: ln.RMSNorm(2.5), TypeError, "D must be an integer"),
    (lambda: ln.RMSNorm(4, eps=-1), ValueError, "eps must be a finite number >= 0"),
    (lambda: ln.LayerNorm(4, zero_centered_gamma="yes"), TypeError,
     "zero_centered_gamma must be True or False"),
])
def test_bad_input_names_the_argument(call, exc, match):
    """Protects the error contract of the new functions and modules: bad shapes, dtypes, eps,
    residual_dtype, dh and caches raise ValueError/TypeError naming the argument."""
    with pytest.raises(exc, match=match):
        call()


# --- caches and modules ----------------------------------------------------------------------

def test_caches_hold_xhat_rstd_and_the_scale_in_the_compute_dtype():
    """Protects what the caches hold: an RMSNorm NormCache has xhat (M, D), rstd (M,) and a
    copy of 1 + gamma in float32 for float16 input; nbytes counts exactly those; an
    AddNormCache holds the norm's cache of h and nothing more."""
    x = _rand((2, 5, 8), np.float16)
    gamma = _rand(8, np.float16)
    y, cache = ln.rms_norm_forward(x, gamma, zero_centered_gamma=True)
    assert isinstance(cache, ln.NormCache) and not cache.centred
    assert cache.xhat.shape == (10, 8) and cache.rstd.shape == (10,)
    assert cache.xhat.dtype == cache.rstd.dtype == cache.scale.dtype == np.float32
    np.testing.assert_array_equal(cache.scale, gamma.astype(np.float32) + 1)
    assert cache.nbytes == (10 * 8 + 10 + 8) * 4
    assert not np.shares_memory(y, cache.xhat)
    g32 = _rand(8, np.float32)
    _, plain = ln.rms_norm_forward(x.astype(np.float32), g32)
    assert not np.shares_memory(plain.scale, g32)  # a copy even where no cast is needed
    _, h, add = ln.add_layer_norm_forward(x, x, gamma, residual_dtype="float64")
    assert isinstance(add, ln.AddNormCache) and add.norm.centred
    assert add.norm.xhat.dtype == np.float64 and add.norm.x_dtype == np.float64
    assert (add.dx_dtype, add.dresidual_dtype) == (np.float16, np.float16)
    assert add.nbytes == add.norm.nbytes == (10 * 8 + 10 + 8) * 8


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_module(zero_centered):
    """Protects the RMSNorm module: gamma starts at ones (zeros with zero_centered_gamma, the
    same scale), forward/backward equal the functions bitwise, dgamma is stored, and a
    backward before any forward is refused."""
    m = ln.RMSNorm(16, zero_centered_gamma=zero_centered)
    assert m.eps == 1e-6 and m.gamma.shape == (16,)
    assert np.all(m.gamma == (0.0 if zero_centered else 1.0))
    x, dy = _rand((4, 16), np.float64), _rand((4, 16), np.float64)
    np.testing.assert_array_equal(m.forward(x), ln.rms_norm_forward(x)[0])  # scale 1 either way
    m.gamma = _rand(16, np.float64)
    y = m(x)
    dx = m.backward(dy)
    y_want, cache = ln.rms_norm_forward(x, m.gamma, 1e-6, zero_centered_gamma=zero_centered)
    dx_want, dgamma_want = ln.rms_norm_backward(dy, cache)
    for got, want in ((y, y_want), (dx, dx_want), (m.dgamma, dgamma_want)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(RuntimeError, match="RMSNorm.backward called before forward"):
        ln.RMSNorm(3).backward(np.ones((1, 3)))


def test_layer_norm_module_zero_centered():
    """Protects LayerNorm(zero_centered_gamma=True): gamma starts at zeros, beta at zeros, and
    the module computes with scale 1 + gamma."""
    m = ln.LayerNorm(8, zero_centered_gamma=True)
    assert np.all(m.gamma == 0) and np.all(m.beta == 0)
    assert repr(m) == "LayerNorm(D=8, eps=1e-05, zero_centered_gamma=True)"
    m.gamma = _rand(8, np.float64)
    x, dy = _rand((3, 8), np.float64), _rand((3, 8), np.float64)
    y, dx = m(x), m.backward(dy)
    y_want, cache = ln.layer_norm_forward(x, 1 + m.gamma, m.beta)  # the same float64 scale
    want = (y_want, *ln.layer_norm_backward(dy, cache))
    for got, w in zip((y, dx, m.dgamma, m.dbeta), want, strict=True):
        np.testing.assert_array_equal(got, w)
