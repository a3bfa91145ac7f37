"""The standing differential fuzz: every CPU backend against the exact oracle, and check_vjp
against planted bugs, on drawn shapes (M = 0 and D = 1 included), dtypes, memory layouts and
values up to each dtype's limits. The Triton kernels have their own in tests/gpu/.

CI runs a fixed set of examples (tests/fuzzing.py says how many and how to run more:
LAYERNORM_FUZZ=long).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from fuzzing import Problem, budget, draw_problem, scales
from hypothesis import given
from hypothesis import strategies as st

import layernorm as ln
from layernorm import reference
from layernorm.tolerances import assert_close

# Drawn extremes may have a true result beyond float16's range: inf, with NumPy's warning.
OVERFLOW_IS_AN_ANSWER = pytest.mark.filterwarnings("ignore:overflow encountered in cast")
BACKENDS = ["reference"]
if importlib.util.find_spec("numba") is not None:
    BACKENDS.append("cpu")


def _module(backend: str):
    if backend == "cpu":
        from layernorm import cpu

        return cpu
    return reference


def _param(a: np.ndarray | None) -> np.ndarray | None:
    return None if a is None else a.copy()


def _check_against_oracle(p: Problem, got: tuple, what: str) -> None:
    ex = p.exact()
    sc = scales(p, ex)
    y, dx, dgamma, dbeta = got
    assert y.shape == dx.shape == p.x.shape and y.dtype == dx.dtype == p.dtype, what
    assert_close(y, ex.y, p.dtype, "out", scale=sc.y, name=f"{what} y")
    assert_close(dx, ex.dx, p.dtype, "out", scale=sc.dx, name=f"{what} dx")
    assert_close(dgamma, None if p.gamma is None else ex.dgamma, p.dtype, "param",
                 scale=sc.dgamma, name=f"{what} dgamma")
    assert_close(dbeta, None if p.beta is None else ex.dbeta, p.dtype, "param",
                 scale=sc.dbeta, name=f"{what} dbeta")


@pytest.mark.parametrize("backend", BACKENDS)
@OVERFLOW_IS_AN_ANSWER
@budget(2000)
@given(data=st.data())
def test_backend_matches_the_exact_oracle(backend, data):
    """Protects every backend on any input: y, dx, dgamma and dbeta within the tolerance table
    of the exact answer (scaled by the size of their terms), the caller's arrays untouched, and
    the backward is that of the forward that ran though gamma changes in place in between."""
    p = draw_problem(data)
    mod = _module(backend)
    before = [a.copy() for a in p.inputs()]
    gamma = _param(p.gamma)  # the forward's gamma, changed after it
    y, cache = mod.layer_norm_forward(p.x, gamma, p.beta, p.eps)
    if gamma is not None:
        gamma *= 3.0
    got = (y, *mod.layer_norm_backward(p.dy, cache))
    for a, b in zip(p.inputs(), before, strict=True):
        assert a.tobytes() == b.tobytes(), f"{backend} modified an input"
    _check_against_oracle(p, got, backend)


def _shared(a: np.ndarray, extra: int) -> tuple[np.ndarray, np.ndarray]:
    """A C-contiguous copy of ``a`` inside a larger buffer, and that buffer (flat)."""
    buf = np.zeros(a.size + extra, a.dtype)
    view = buf[:a.size].reshape(a.shape)
    view[...] = a
    return view, buf


@pytest.mark.skipif("cpu" not in BACKENDS, reason="needs numba")
@OVERFLOW_IS_AN_ANSWER
@budget(400)
@given(data=st.data())
def test_out_never_aliases_a_callers_array(data):
    """Protects the caller's arrays from out=: any out overlapping x, gamma, beta (forward) or
    dy and the forward's x, gamma, beta (backward) is refused, for every dtype, and leaves them
    as they were; an out next to them in the same buffer is fine and gives the same bits."""
    from layernorm import cpu

    p = draw_problem(data, max_elements=512)
    if p.x.size == 0:
        return
    n = p.x.size
    names = [k for k in ("x", "gamma", "beta", "dy") if getattr(p, k) is not None]
    victim = data.draw(st.sampled_from(names), label="victim")
    shift = data.draw(st.integers(0, getattr(p, victim).size - 1), label="overlap at")
    arrays = {k: getattr(p, k) for k in names}
    arrays[victim], buf = _shared(arrays[victim], n + shift)
    saved = {k: a.copy() for k, a in arrays.items()}
    inside = buf[shift:shift + n].reshape(p.x.shape)  # overlaps the victim
    beside = buf[arrays[victim].size:arrays[victim].size + n].reshape(p.x.shape)

    x, gamma, beta, dy = (arrays.get(k) for k in ("x", "gamma", "beta", "dy"))
    want_y, want_cache = cpu.layer_norm_forward(x, gamma, beta, p.eps)
    want = (want_y, *cpu.layer_norm_backward(dy, want_cache))
    if victim != "dy":
        with pytest.raises(ValueError, match="must not overlap"):
            cpu.layer_norm_forward(x, gamma, beta, p.eps, out=inside)
    y, cache = cpu.layer_norm_forward(x, gamma, beta, p.eps,
                                      out=beside if victim != "dy" else None)
    with pytest.raises(ValueError, match="must not overlap"):
        cpu.layer_norm_backward(dy, cache, out=inside)
    for k, a in arrays.items():
        assert a.tobytes() == saved[k].tobytes(), f"{k} was written"
    dx_out = np.empty_like(beside) if victim != "dy" else beside
    got = (y, *cpu.layer_norm_backward(dy, cache, out=dx_out))
    assert [a.tobytes() for a in got if a is not None] == \
        [a.tobytes() for a in want if a is not None]


# --- check_vjp: never a pass for a wrong gradient, never a failure for a right one --------


def _functions(rng: np.random.Generator, shape: tuple[int, int]) -> dict:
    """name -> (f, its VJP, argument shapes): smooth functions of one to three arguments."""
    m, d = shape
    gamma = rng.standard_normal(d)

    def ln_f(x, g, b):
        return ln.layer_norm_forward(x, g, b)[0]

    def ln_vjp(x, g, b, dy):
        return ln.layer_norm_backward(dy, ln.layer_norm_forward(x, g, b)[1])

    def add_norm(x, r):  # two outputs of different shapes
        return ln.layer_norm_forward(x + r, gamma)[0], x + r

    def add_norm_vjp(x, r, dout):
        dy, dh = dout
        dsum = ln.layer_norm_backward(dy, ln.layer_norm_forward(x + r, gamma)[1])[0] + dh
        return dsum, dsum

    return {
        "layer norm": (ln_f, ln_vjp, [shape, (d,), (d,)]),
        "sin": (np.sin, lambda a, v: (np.cos(a) * v,), [shape]),
        "cube": (lambda a: a**3, lambda a, v: (3 * a * a * v,), [shape]),
        "product": (lambda a, b: a * b, lambda a, b, v: (b * v, a * v), [shape, shape]),
        "matmul": (lambda a, b: a @ b, lambda a, b, v: (v @ b.T, a.T @ v), [shape, (d, m)]),
        "add + norm": (add_norm, add_norm_vjp, [shape, shape]),
    }


@budget(400)
@given(data=st.data())
def test_check_vjp_never_passes_a_wrong_gradient(data):
    """Protects check_vjp's verdicts on drawn functions, points (|a| up to 1e3, offsets) and
    constant shifts of the output (up to 1e12): a gradient changed by at least 1% (normwise) in
    one argument never passes (it fails, or the check says it cannot judge), and the right
    gradient never fails, and passes where nothing hides its derivative."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    shape = (data.draw(st.integers(1, 4), label="M"), data.draw(st.integers(1, 12), label="D"))
    name = data.draw(st.sampled_from(sorted(_functions(rng, shape))), label="function")
    f, vjp, arg_shapes = _functions(rng, shape)[name]
    spread = 10.0 ** data.draw(st.floats(-1, 3), label="log10 spread")
    offset = data.draw(st.sampled_from([0.0, 10.0, 1e3]), label="offset")
    args = tuple(offset + spread * rng.standard_normal(s) for s in arg_shapes)
    shift = data.draw(st.sampled_from([0.0, 1e4, 3e5, 1e8, 1e12]), label="output shift")
    mode = data.draw(st.sampled_from(["fast", "full"]), label="mode")

    def shifted(*a):
        out = f(*a)
        return tuple(o + shift for o in out) if isinstance(out, tuple) else out + shift

    if shift == 0 and offset == 0 and spread <= 10:  # nothing to hide the derivative: a verdict
        ln.check_vjp(shifted, vjp, args, mode=mode)
    else:
        try:
            ln.check_vjp(shifted, vjp, args, mode=mode)
        except ln.GradcheckInconclusive:
            pass  # no verdict is allowed here; a failure of the right gradient is not

    victim = data.draw(st.integers(0, len(args) - 1), label="wrong argument")
    bug = data.draw(st.sampled_from(["zero", "scaled", "one element"]), label="bug")
    factor = 1 + 10.0 ** data.draw(st.floats(-2, 0), label="log10 error")

    def wrong(*a):
        grads = [np.array(g, dtype=np.float64) for g in vjp(*a)]
        g = grads[victim]
        if bug == "zero":
            g[...] = 0.0
        elif bug == "scaled":
            g *= factor
        else:
            g.flat[int(np.argmax(np.abs(g)))] *= factor
        return tuple(grads)

    probe = rng.standard_normal(np.shape(f(*args))) if not isinstance(f(*args), tuple) \
        else tuple(rng.standard_normal(np.shape(o)) for o in f(*args))
    right, bad = vjp(*args, probe)[victim], wrong(*args, probe)[victim]
    if np.linalg.norm(bad - right) <= 1e-2 * np.linalg.norm(right):
        return  # the planted change is too small to count as a wrong gradient here
    with pytest.raises((ln.GradcheckError, ln.GradcheckInconclusive)):
        ln.check_vjp(shifted, wrong, args, mode=mode)
