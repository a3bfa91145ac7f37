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
from fuzzing import Problem, budget, draw_family, draw_problem, family_scales, scales
from hypothesis import given
from hypothesis import strategies as st

import layernorm as ln
from layernorm import reference
from layernorm.dtypes import resolve
from layernorm.family import NORMS
from layernorm.numerics import Exact
from layernorm.tolerances import assert_close

# Drawn extremes may have a true result beyond float16's range: inf, with NumPy's warning.
OVERFLOW_IS_AN_ANSWER = pytest.mark.filterwarnings("ignore:overflow encountered in cast")
BACKENDS = ["reference"]
if importlib.util.find_spec("torch") is not None:  # the fused CPU kernels: the C++ engine
    BACKENDS.append("cpu")


def _module(backend: str):
    if backend == "cpu":
        from layernorm import cpu

        return cpu
    return reference


def _param(a: np.ndarray | None) -> np.ndarray | None:
    return None if a is None else a.copy()


def _check_against_oracle(p: Problem, ex: Exact, got: tuple, what: str) -> None:
    """``got`` (y, dx, dgamma, dbeta of ``p``) against ``p``'s exact answer ``ex``."""
    sc = scales(p, ex)
    y, dx, dgamma, dbeta = got
    assert y.shape == dx.shape == p.x.shape and y.dtype == dx.dtype == p.dtype, what
    assert_close(y, ex.y, p.dtype, "out", scale=sc.y, name=f"{what} y")
    assert_close(dx, ex.dx, p.dtype, "out", scale=sc.dx, name=f"{what} dx")
    assert_close(dgamma, None if p.gamma is None else ex.dgamma, p.dtype, "param",
                 scale=sc.dgamma, name=f"{what} dgamma")
    assert_close(dbeta, None if p.beta is None else ex.dbeta, p.dtype, "param",
                 scale=sc.dbeta, name=f"{what} dbeta")


@OVERFLOW_IS_AN_ANSWER
@budget(500)
@given(data=st.data())
def test_backend_matches_the_exact_oracle(data):
    """Protects every backend on any input: y, dx, dgamma and dbeta within the tolerance table
    of the exact answer (scaled by the size of their terms), the caller's arrays untouched, and
    the backward is that of the forward that ran though gamma changes in place in between.
    Every backend runs on each drawn problem, against the one exact answer."""
    p = draw_problem(data)
    ex = p.exact()
    before = [a.copy() for a in p.inputs()]
    for backend in BACKENDS:
        mod = _module(backend)
        gamma = _param(p.gamma)  # the forward's gamma, changed after it
        y, cache = mod.layer_norm_forward(p.x, gamma, p.beta, p.eps)
        if gamma is not None:
            gamma *= 3.0
        got = (y, *mod.layer_norm_backward(p.dy, cache))
        for a, b in zip(p.inputs(), before, strict=True):
            assert a.tobytes() == b.tobytes(), f"{backend} modified an input"
        _check_against_oracle(p, ex, got, backend)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="needs torch (the C++ engine)")
@pytest.mark.parametrize("name", [n for n in NORMS if n != "layer_norm"])
@OVERFLOW_IS_AN_ANSWER
@budget(80)
@given(data=st.data())
def test_fused_family_matches_the_reference(name, data, run_norm, float64_oracle,
                                            results_close):
    """Protects every other fused member of the family (RMSNorm and both add-norms, with gamma
    or 1 + gamma, a residual drawn like x, h in x's dtype or float32) on any input: each result
    within the tolerance table of the float64 oracle of the reference's definition (scaled by
    the size of its terms; y and dx no more precise than h's compute dtype), h the reference's
    h bit for bit, and the caller's arrays untouched."""
    from layernorm import cpu

    norm = NORMS[name]
    p = draw_problem(data)
    args, cot, kw = draw_family(data, p, norm.residual, norm.centred)
    before = [None if a is None else a.tobytes() for a in (*args, *cot)]
    got = run_norm(cpu, norm, args, cot, eps=p.eps, **kw)
    after = [None if a is None else a.tobytes() for a in (*args, *cot)]
    assert after == before, f"{name} modified an input"
    h_dtype = p.dtype
    if norm.residual:
        h_dtype = resolve(kw["residual_dtype"]) if kw["residual_dtype"] else p.dtype
        want_h = getattr(reference, f"{name}_forward")(*args, eps=p.eps, **kw)[1]
        assert got["h"].dtype == want_h.dtype and got["h"].tobytes() == want_h.tobytes(), \
            "h is not the reference's x + residual, rounded once"
    o = float64_oracle(norm, args, cot, eps=p.eps, **kw)
    results_close(got, o.results, scales=family_scales(o), what=name, h_dtype=h_dtype)


def _shared(a: np.ndarray, extra: int) -> tuple[np.ndarray, np.ndarray]:
    """A C-contiguous copy of ``a`` inside a larger buffer, and that buffer (flat)."""
    buf = np.zeros(a.size + extra, a.dtype)
    view = buf[:a.size].reshape(a.shape)
    view[...] = a
    return view, buf


FORWARD_INPUTS = ("x", "residual", "gamma", "beta")  # the family's argument names, in order


def _out_never_aliases(data: st.DataObject, norm, run_norm) -> None:
    """The out= property below, for the fused ``norm``."""
    from layernorm import cpu

    p = draw_problem(data, max_elements=512)
    if p.x.size == 0:
        return
    n = p.x.size
    args, cot, kw = draw_family(data, p, norm.residual, norm.centred, residual_dtypes=(None,))
    fwd_names = [k for k in FORWARD_INPUTS if k in ("x", *norm.forward_inputs, *norm.params)]
    given_names = (*fwd_names, *("dy", "dh")[:len(cot)])
    arrays = {k: a for k, a in zip(given_names, (*args, *cot), strict=True) if a is not None}
    victim = data.draw(st.sampled_from(sorted(arrays)), label="victim")
    shift = data.draw(st.integers(0, arrays[victim].size - 1), label="overlap at")
    arrays[victim], buf = _shared(arrays[victim], n + shift)
    saved = {k: a.copy() for k, a in arrays.items()}
    inside = buf[shift:shift + n].reshape(p.x.shape)  # overlaps the victim
    beside = buf[arrays[victim].size:arrays[victim].size + n].reshape(p.x.shape)
    out_f = data.draw(st.sampled_from(["out", "out_h"] if norm.residual else ["out"]),
                      label="forward out")
    out_b = data.draw(st.sampled_from(["out", "out_dresidual"] if norm.residual else ["out"]),
                      label="backward out")
    fargs = [arrays.get(k) for k in fwd_names]
    cots = [arrays.get(k) for k in ("dy", "dh")[:len(cot)]]
    fwd = getattr(cpu, f"{norm.name}_forward")
    bwd = getattr(cpu, f"{norm.name}_backward")

    want = run_norm(cpu, norm, fargs, cots, eps=p.eps, **kw)
    forward_victim = victim in fwd_names
    if forward_victim:
        with pytest.raises(ValueError, match="must not overlap"):
            fwd(*fargs, eps=p.eps, **kw, **{out_f: inside})
    *outs, cache = fwd(*fargs, eps=p.eps, **kw, **({out_f: beside} if forward_victim else {}))
    with pytest.raises(ValueError, match="must not overlap"):
        bwd(*cots, cache, **{out_b: inside})
    for k, a in arrays.items():
        assert a.tobytes() == saved[k].tobytes(), f"{k} was written"
    grads = bwd(*cots, cache, **{out_b: np.empty_like(beside) if forward_victim else beside})
    assert [a.tobytes() for a in (*outs, *grads) if a is not None] == \
        [a.tobytes() for a in want.values() if a is not None]


@pytest.mark.skipif("cpu" not in BACKENDS, reason="needs torch (the C++ engine)")
@OVERFLOW_IS_AN_ANSWER
@budget(200)
@given(data=st.data())
def test_out_never_aliases_a_callers_array(data, run_norm):
    """Protects the caller's arrays from out=: any out overlapping x, gamma, beta (forward) or
    dy and the forward's x, gamma, beta (backward) is refused, for every dtype, and leaves them
    as they were; an out next to them in the same buffer is fine and gives the same bits."""
    _out_never_aliases(data, NORMS["layer_norm"], run_norm)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="needs torch (the C++ engine)")
@pytest.mark.parametrize("name", [n for n in NORMS if n != "layer_norm"])
@OVERFLOW_IS_AN_ANSWER
@budget(60)
@given(data=st.data())
def test_out_never_aliases_a_callers_array_in_the_family(name, data, run_norm):
    """Protects the caller's arrays from every out= of the other fused members (out, out_h;
    out, out_dresidual): one overlapping x, residual, gamma, beta (forward) or dy, dh and the
    forward's inputs (backward) is refused and writes nothing; one beside them gives the same
    bits as fresh outputs."""
    _out_never_aliases(data, NORMS[name], run_norm)


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


@budget(200)
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
