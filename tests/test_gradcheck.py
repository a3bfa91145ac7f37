"""check_vjp: it accepts right gradients of any function and rejects planted bugs."""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln

RNG = np.random.default_rng(7)
NAMES = ("x", "gamma", "beta")


def f(x, gamma, beta):
    return ln.layer_norm_forward(x, gamma, beta)[0]


def vjp(x, gamma, beta, dy):
    return ln.layer_norm_backward(dy, ln.layer_norm_forward(x, gamma, beta)[1])


def _planted(bug):
    """A layer-norm backward with one realistic mistake in it."""

    def broken(x, gamma, beta, dy):
        d = x.shape[-1]
        y, cache = ln.layer_norm_forward(x, gamma, beta)
        xhat, rstd = cache.xhat, cache.rstd[:, None]  # (M, D), (M, 1)
        dy2 = dy.reshape(-1, d)
        g = dy2 * gamma  # (M, D)
        mean_g = g.mean(1, keepdims=True)
        mean_gx = (g * xhat).mean(1, keepdims=True)
        if bug == "missing mean(g)":
            dx = rstd * (g - xhat * mean_gx)
        elif bug == "missing xhat*mean(g*xhat)":
            dx = rstd * (g - mean_g)
        else:
            dx = rstd * (g - mean_g - xhat * mean_gx)
        dgamma = (dy2 * xhat).sum(0)
        dbeta = dy2.sum(0)
        if bug == "dx scaled by 1.001":
            dx = dx * 1.001
        elif bug == "dgamma off by 0.1% of its max":
            dgamma = dgamma.copy()
            dgamma[5] += 1e-3 * np.abs(dgamma).max()
        elif bug == "dbeta scaled by 0.999":
            dbeta = dbeta * 0.999
        return dx.reshape(x.shape), dgamma, dbeta

    return broken


BUGS = {
    "missing mean(g)": "x",
    "missing xhat*mean(g*xhat)": "x",
    "dx scaled by 1.001": "x",
    "dgamma off by 0.1% of its max": "gamma",
    "dbeta scaled by 0.999": "beta",
}


def _point(shape=(6, 48)):
    return RNG.standard_normal(shape) * 1.5 + 0.2, RNG.standard_normal(shape[-1]), \
        RNG.standard_normal(shape[-1])


@pytest.mark.parametrize("mode", ["fast", "full"])
@pytest.mark.parametrize("bug", list(BUGS))
def test_planted_bug_is_rejected(bug, mode):
    """Protects the checker's power: each realistic backward bug is caught and located."""
    args = _point()
    with pytest.raises(ln.GradcheckError) as info:
        ln.check_vjp(f, _planted(bug), args, mode=mode, names=NAMES)
    err = info.value
    assert err.arg == BUGS[bug]
    assert BUGS[bug] in str(err)
    assert abs(err.analytic - err.numerical) > err.tolerance
    if bug == "dgamma off by 0.1% of its max":
        assert err.index == (5,)


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_correct_backward_passes_with_report(mode):
    """Protects against false alarms, and the report's content."""
    args = _point()
    assert _planted("none")(*args, np.ones((6, 48)))[0].shape == (6, 48)
    report = ln.check_vjp(f, _planted("none"), args, mode=mode, names=NAMES)
    assert report.mode == mode
    assert [a.name for a in report.args] == list(NAMES)
    assert all(0 <= a.max_abs_err <= a.tolerance for a in report.args)
    assert report.max_rel_err < 1e-7


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_report_repr_is_one_line_per_argument_with_plain_floats(mode):
    """Protects the report's repr: it printed ``tolerance=np.float64(...)`` on one long line; it
    is a header, then one line per argument naming it, with plain floats."""
    report = ln.check_vjp(f, vjp, _point(), mode=mode, names=NAMES)
    lines = repr(report).splitlines()
    assert "np.float64(" not in repr(report) and str(report) == repr(report)
    assert lines[0].startswith(f"GradcheckReport(mode='{mode}', 3 arguments, max abs err ")
    for line, name in zip(lines[1:], NAMES, strict=True):  # one line per argument
        assert line.startswith(f"  ArgReport('{name}', ") and "tolerance " in line


def test_works_for_other_functions():
    """Protects genericity: a function of three arguments that is not layer norm."""

    def g(a, b, c):
        return np.sin(a) @ b + np.exp(c)  # (3, 4) @ (4, 2) + (3, 2)

    def g_vjp(a, b, c, dout):
        return (np.cos(a) * (dout @ b.T), np.sin(a).T @ dout, np.exp(c) * dout)

    args = (RNG.standard_normal((3, 4)), RNG.standard_normal((4, 2)), RNG.standard_normal((3, 2)))
    for mode in ("fast", "full"):
        ln.check_vjp(g, g_vjp, args, mode=mode)

    def g_vjp_wrong(a, b, c, dout):
        da, db, dc = g_vjp(a, b, c, dout)
        return da, db.T.T * 1.01, dc

    with pytest.raises(ln.GradcheckError, match="arg1"):
        ln.check_vjp(g, g_vjp_wrong, args)


def test_constants_pass_through_and_none_gradient_is_allowed_for_them():
    """Protects non-array arguments: passed as is, their gradient may be None."""

    def h(x, power):
        return x**power

    def h_vjp(x, power, dout):
        return power * x ** (power - 1) * dout, None

    ln.check_vjp(h, h_vjp, (RNG.random(5) + 0.5, 3), mode="full")


def test_never_mutates_caller_arrays_even_on_error():
    """Protects the caller's data: f may write its arguments, and may raise mid-check."""
    x = RNG.standard_normal((3, 4))
    before = x.copy()
    calls = []

    def nasty(a):
        a *= 2.0  # writes its argument in place
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("boom")
        return a

    with pytest.raises(RuntimeError, match="boom"):
        ln.check_vjp(nasty, lambda a, d: (2 * d,), (x,))
    np.testing.assert_array_equal(x, before)


def test_non_contiguous_arguments():
    """Protects strided arrays: a transposed, sliced x checks like its contiguous copy."""
    x = RNG.standard_normal((40, 12)).T[:, ::2]  # (12, 20) non-contiguous
    gamma, beta = RNG.standard_normal(20), RNG.standard_normal(20)
    assert not x.flags.c_contiguous
    for mode in ("fast", "full"):
        ln.check_vjp(f, vjp, (x, gamma, beta), mode=mode)


def test_fast_mode_cost_is_independent_of_size():
    """Protects fast mode's cost: 1 + 2·(args)·(directions) evaluations of f for any size,
    which is what makes (8, 512, 1024) a matter of seconds."""
    counts = {"f": 0, "vjp": 0}

    def counted_f(*a):
        counts["f"] += 1
        return f(*a)

    def counted_vjp(*a):
        counts["vjp"] += 1
        return vjp(*a)

    ln.check_vjp(counted_f, counted_vjp, _point((16, 256)), n_directions=2)
    assert counts == {"f": 1 + 2 * 3 * 2, "vjp": 2}


def test_full_mode_samples_large_arguments():
    """Protects max_elements: a large argument is checked on a sample of that size."""
    report = ln.check_vjp(f, vjp, _point((10, 64)), mode="full", max_elements=50)
    assert [a.n_checked for a in report.args] == [50, 50, 50]


def test_seed_makes_runs_reproducible():
    """Protects the private RNG: the same seed gives the same report."""
    args = _point()
    r1 = ln.check_vjp(f, vjp, args, seed=3)
    r2 = ln.check_vjp(f, vjp, args, seed=3)
    assert r1 == r2


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"mode": "slow"}, ValueError, "mode"),
        ({"n_directions": 0}, ValueError, "n_directions"),
        ({"max_elements": 0}, ValueError, "max_elements"),
        ({"eps": -1.0}, ValueError, "eps"),
        ({"rtol": -1.0}, ValueError, "rtol"),
        ({"names": ("a",)}, ValueError, "names"),
        ({"eps": "1e-6"}, TypeError, "eps must be a real number"),
        ({"eps": True}, TypeError, "eps must be a real number"),
        ({"atol": "x"}, TypeError, "atol must be a real number"),
        ({"rtol": float("inf")}, ValueError, "rtol must be finite"),
        ({"max_elements": True}, TypeError, "max_elements must be an integer"),
        ({"n_directions": np.int64(0)}, ValueError, "n_directions"),
        ({"seed": -1}, ValueError, "seed"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    """Protects clear errors for misuse of the checker itself."""
    with pytest.raises(exc, match=match):
        ln.check_vjp(f, vjp, _point(), **kwargs)


def test_bad_vjp_results():
    """Protects clear errors when f_vjp returns the wrong shape or None for an array."""
    args = _point()
    with pytest.raises(ValueError, match="gamma.*shape"):
        ln.check_vjp(f, lambda x, g, b, d: (vjp(x, g, b, d)[0], np.ones(3), np.ones(48)), args,
                     names=NAMES)
    with pytest.raises(TypeError, match="None for beta"):
        ln.check_vjp(f, lambda x, g, b, d: (*vjp(x, g, b, d)[:2], None), args, names=NAMES)
    with pytest.raises(TypeError, match="one gradient per argument"):
        ln.check_vjp(f, lambda x, g, b, d: vjp(x, g, b, d)[:2], args, names=NAMES)
    with pytest.raises(TypeError, match="args must be a tuple"):
        ln.check_vjp(f, vjp, args[0])


@pytest.mark.parametrize("bug", list(BUGS))
def test_planted_bug_is_rejected_at_a_large_shape(bug):
    """Protects fast mode's power at scale: its tolerance follows the typical size of
    (vᵀJ)·u, which shrinks like 1/√n, so bugs stay visible for a million elements."""
    x = RNG.standard_normal((8, 128, 1024))
    gamma, beta = RNG.standard_normal(1024), RNG.standard_normal(1024)
    with pytest.raises(ln.GradcheckError) as info:
        ln.check_vjp(f, _planted(bug), (x, gamma, beta), names=NAMES, max_elements=64)
    assert info.value.arg == BUGS[bug]


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_subtle_bug_is_rejected(mode):
    """Protects the tolerance from growing loose: dx off by 1e-5 relative is still caught."""

    def slightly_off(x, gamma, beta, dy):
        dx, dg, db = vjp(x, gamma, beta, dy)
        return dx * (1 + 1e-5), dg, db

    with pytest.raises(ln.GradcheckError, match="for x"):
        ln.check_vjp(f, slightly_off, _point(), mode=mode, names=NAMES)


@pytest.mark.parametrize("mode", ["fast", "full"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_gradients_are_rejected(mode, bad):
    """Protects against NaN/inf passing silently (NaN compares false with any tolerance)."""

    def poisoned(x, gamma, beta, dy):
        dx, dg, db = vjp(x, gamma, beta, dy)
        return dx * bad, dg, db

    with pytest.raises(ln.GradcheckError, match="for x"):
        ln.check_vjp(f, poisoned, _point(), mode=mode, names=NAMES)


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_no_false_alarm_at_a_large_offset(mode):
    """Protects the step rule: x = 1e4 + N(0, 1) is stepped against its spread, not its size,
    and the rounding of x ± h·u is not counted as error."""
    x = 1e4 + RNG.standard_normal((16, 64))
    ln.check_vjp(f, vjp, (x, RNG.standard_normal(64), RNG.standard_normal(64)), mode=mode)


def test_user_step_is_used():
    """Protects eps and the extrapolation: with a step of 0.5, x³'s truncation error (h² =
    0.25) is removed exactly by extrapolating from h and h/2, so the check passes; x⁵'s is not
    (h⁴/4 remains, while the two steps differ by 7.5·a²·h²): inconclusive, never a failure of
    the right gradient nor a pass of a wrong one."""
    x = np.array([1.0, 2.0, 3.0])
    cube_vjp = lambda a, d: (3 * a**2 * d,)  # noqa: E731
    ln.check_vjp(lambda a: a**3, cube_vjp, (x,), mode="full")
    ln.check_vjp(lambda a: a**3, cube_vjp, (x,), mode="full", eps=0.5)
    fifth_vjp = lambda a, d: (5 * a**4 * d,)  # noqa: E731
    ln.check_vjp(lambda a: a**5, fifth_vjp, (x,), mode="full")
    with pytest.raises(ln.GradcheckInconclusive, match="not smooth on the scale of the step"):
        ln.check_vjp(lambda a: a**5, fifth_vjp, (x,), mode="full", eps=0.5)
    with pytest.raises(ln.GradcheckError):  # eps too large hides nothing of a real bug
        ln.check_vjp(lambda a: a**5, lambda a, d: (4 * a**4 * d,), (x,), mode="full", eps=0.5)


def test_readme_quick_start_catches_a_bug():
    """Protects the README example: data drawn with seed 0 must not blind the checker
    (its private generator is salted, so v is not proportional to x)."""
    x = np.random.default_rng(0).standard_normal((4, 16, 64))
    gamma, beta = np.ones(64), np.zeros(64)

    def off(x, g, b, dy):
        dx, dg, db = vjp(x, g, b, dy)
        return dx * 1.001, dg, db

    with pytest.raises(ln.GradcheckError):
        ln.check_vjp(f, off, (x, gamma, beta), mode="fast")


def _ln_with_shift(shift):
    """Layer norm plus a constant shift of the output, and a VJP that returns zero for x and
    gamma (dbeta right): the gradients of x and gamma are wrong."""

    def fwd(x, gamma, beta):
        return f(x, gamma, beta) + shift

    def zero_vjp(x, gamma, beta, dy):
        return np.zeros_like(x), np.zeros_like(gamma), dy.sum(0)

    return fwd, zero_vjp


@pytest.mark.parametrize("mode", ["fast", "full"])
@pytest.mark.parametrize("shift", [1e10, 1e20])
def test_large_constant_output_never_passes_a_wrong_gradient(mode, shift):
    """Protects against a silent pass: with beta + 1e10 (or 1e20) in the output, its rounding
    hid the derivative and a zero gradient for x and gamma passed; now the check fails or says
    it cannot judge (GradcheckInconclusive), and a right gradient never fails."""
    rng = np.random.default_rng(4)
    args = (rng.standard_normal((4, 16)), rng.standard_normal(16), rng.standard_normal(16))
    fwd, zero_vjp = _ln_with_shift(shift)
    with pytest.raises((ln.GradcheckError, ln.GradcheckInconclusive)) as info:
        ln.check_vjp(fwd, zero_vjp, args, mode=mode, names=NAMES)
    assert info.value.arg in ("x", "gamma")
    if shift == 1e20:  # nothing of the derivative survives in the output: never a verdict
        with pytest.raises(ln.GradcheckInconclusive, match="large constant part"):
            ln.check_vjp(fwd, vjp, args, mode=mode, names=NAMES)


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_report_shows_the_round_off_allowance(mode):
    """Protects the report: the tolerance it shows is the one used, round-off included (full
    mode showed 1e-10 while allowing 0.4)."""
    rng = np.random.default_rng(5)
    args = (rng.standard_normal((4, 16)), rng.standard_normal(16), rng.standard_normal(16))
    fwd, _ = _ln_with_shift(1e3)
    report = ln.check_vjp(fwd, vjp, args, mode=mode, names=NAMES)
    for a in report.args:
        assert 0 < a.roundoff <= a.tolerance and a.max_abs_err <= a.tolerance
    assert report.args[0].roundoff > 1e-10  # the shift's rounding, beyond the default atol


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_right_gradients_of_curved_functions_pass(mode):
    """Protects against false alarms from truncation: sin(a) with |a| ~ 1e3 gets a step of
    6e-3 from its spread; its h² error (6e-6 relative) failed right gradients (33% of draws in
    fast mode, 98% in full). Extrapolating from h and h/2 removes it."""
    for seed in range(5):
        a = 1e3 * np.random.default_rng(seed).standard_normal((3, 7))
        ln.check_vjp(np.sin, lambda a, d: (np.cos(a) * d,), (a,), mode=mode, seed=seed)
    with pytest.raises(ln.GradcheckError):  # and a gradient 1e-4 off still fails
        ln.check_vjp(np.sin, lambda a, d: (np.cos(a) * d * (1 + 1e-4),), (a,), mode=mode)


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_empty_argument_has_nothing_to_check(mode):
    """Protects empty arguments: a ZeroDivisionError in fast mode; now n_checked = 0, while the
    gradient's shape is still checked and the other arguments are checked as usual."""
    e, b = np.zeros((0, 3)), np.random.default_rng(6).standard_normal(3)

    def g(e, b):
        return np.sin(b) + e.sum()

    report = ln.check_vjp(g, lambda e, b, d: (np.zeros((0, 3)), np.cos(b) * d), (e, b), mode=mode)
    assert [a.n_checked for a in report.args] == [0, 2 if mode == "fast" else 3]
    with pytest.raises(ValueError, match="arg0 has shape"):
        ln.check_vjp(g, lambda e, b, d: (np.zeros(3), np.cos(b) * d), (e, b), mode=mode)


def test_outputs_that_cannot_be_differentiated_are_refused():
    """Protects clear errors for f's output: None was blamed on the gradient ("numerical nan"),
    and integer, bool and complex outputs and complex gradients were accepted with the imaginary
    part dropped."""
    a = np.random.default_rng(7).standard_normal(4)
    ident = lambda a, d: (d,)  # noqa: E731
    with pytest.raises(TypeError, match="f's output is None"):
        ln.check_vjp(lambda a: None, ident, (a,))
    for bad, dtype in ((lambda a: a > 0, "bool"), (lambda a: a.astype(int), "int64"),
                       (lambda a: a * 1j, "complex128")):
        with pytest.raises(TypeError, match=f"real floating dtype.*got {dtype}"):
            ln.check_vjp(bad, ident, (a,))
    with pytest.raises(TypeError, match="gradient for arg0 must be real numbers"):
        ln.check_vjp(lambda a: 2 * a, lambda a, d: (2j * d,), (a,))


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_tuple_outputs_of_different_shapes(mode):
    """Protects several outputs (a raw NumPy error before): f returns (y, h), the cotangent
    reaches f_vjp as (dy, dh), and a wrong term is caught. The example is the residual add
    before a norm: h = x + r, y = layer_norm(h)."""
    rng = np.random.default_rng(8)
    x, r = rng.standard_normal((3, 8)), rng.standard_normal((3, 8))
    g = rng.standard_normal(8)

    def add_norm(x, r):
        h = x + r
        return ln.layer_norm_forward(h, g)[0], h.sum(0)  # (3, 8) and (8,)

    def add_norm_vjp(x, r, dout, drop_dh=False):
        dy, dsum = dout
        dx = ln.layer_norm_backward(dy, ln.layer_norm_forward(x + r, g)[1])[0]
        if not drop_dh:
            dx = dx + dsum  # h.sum(0)'s cotangent reaches every row of h
        return dx, dx

    ln.check_vjp(add_norm, add_norm_vjp, (x, r), mode=mode)
    with pytest.raises(ln.GradcheckError):
        ln.check_vjp(add_norm, lambda x, r, d: add_norm_vjp(x, r, d, True), (x, r), mode=mode)


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_a_step_that_rounds_away_never_passes(mode):
    """Protects large arguments: where a ± h·u rounds to a, both sides were exactly 0 and any
    gradient passed (x = 1e12 + 1e-3·N(0, 1) with dx = -3 times the right one; a - 1e12 with
    gradient 2). Now the step is widened, and what it still cannot judge is inconclusive."""
    rng = np.random.default_rng(9)
    x = 1e12 + 1e-3 * rng.standard_normal((4, 16))
    args = (x, rng.standard_normal(16), rng.standard_normal(16))

    def tripled(x, gamma, beta, dy):
        dx, dg, db = vjp(x, gamma, beta, dy)
        return -3 * dx, dg, db

    with pytest.raises((ln.GradcheckError, ln.GradcheckInconclusive)) as info:
        ln.check_vjp(f, tripled, args, mode=mode, names=NAMES)
    assert info.value.arg == "x"
    with pytest.raises(ln.GradcheckError):
        ln.check_vjp(lambda a: a - 1e12, lambda a, v: (2 * v,), (np.full(3, 1e12),), mode=mode)
    with pytest.raises(ln.GradcheckInconclusive, match="rounds away"):
        ln.check_vjp(lambda a: a - 1e15, lambda a, v: (v,), (np.full(3, 1e18),), mode=mode)


def test_a_small_constant_part_cannot_hide_a_one_percent_error():
    """Protects fast mode's power beside round-off: sin(a) + 3e5 with a gradient 1% off passed
    (seed 293) when the round-off allowance could reach 1e-3 of the typical size and both random
    directions happened to see a small derivative."""
    a = np.random.default_rng(293).standard_normal((4, 12))
    with pytest.raises((ln.GradcheckError, ln.GradcheckInconclusive)):
        ln.check_vjp(lambda a: np.sin(a) + 3e5, lambda a, v: (1.01 * np.cos(a) * v,), (a,),
                     mode="fast", seed=293)


@pytest.mark.filterwarnings("ignore:invalid value encountered in sqrt")
@pytest.mark.parametrize("mode", ["fast", "full"])
def test_a_step_outside_the_domain_is_inconclusive(mode):
    """Protects the verdict at a domain's edge: sqrt at 1e-6, where a - h < 0 gives NaN, cannot
    be judged there; that is not the gradient's fault."""
    a = np.array([1e-6, 1.0, 4.0])
    with pytest.raises(ln.GradcheckInconclusive, match="not finite"):
        ln.check_vjp(np.sqrt, lambda a, v: (0.5 / np.sqrt(a) * v,), (a,), mode=mode)


def _relu_vjp(at_zero):
    return lambda a, v: (np.where(a > 0, 1.0, np.where(a == 0, at_zero, 0.0)) * v,)


KINKS = {  # name: (f, a VJP whose value at the kink is one of the one-sided derivatives)
    "max(a, 0), 0 at 0": (lambda a: np.maximum(a, 0), _relu_vjp(0.0)),
    "max(a, 0), 1 at 0": (lambda a: np.maximum(a, 0), _relu_vjp(1.0)),
    "|a|, 1 at 0": (np.abs, lambda a, v: (np.where(a >= 0, 1.0, -1.0) * v,)),
    "|a| + a², -1 at 0": (lambda a: np.abs(a) + a * a,
                          lambda a, v: ((np.where(a > 0, 1.0, -1.0) + 2 * a) * v,)),
}


@pytest.mark.parametrize("mode", ["fast", "full"])
@pytest.mark.parametrize("kink", list(KINKS))
def test_a_kink_is_inconclusive(kink, mode):
    """Protects the verdict at a kink: max(a, 0) and |a| at an exact 0 are inconclusive, not a
    GradcheckError. Central differences at h and h/2 agree there (on the mean of the one-sided
    derivatives), so the forward and backward differences, which disagree by the same amount
    at both steps, decide it. It costs no evaluation of f beyond the retry at h/2
    that every failing comparison makes."""
    f, f_vjp = KINKS[kink]
    a = np.array([0.0, 1.5, -2.0, 0.0, 0.7])
    with pytest.raises(ln.GradcheckInconclusive, match="kink") as info:
        ln.check_vjp(f, f_vjp, (a,), mode=mode)
    assert info.value.arg == "arg0" and info.value.hidden > 1e-3
    calls = []

    def counted(a):
        calls.append(1)
        return f(a)

    with pytest.raises(ln.GradcheckInconclusive, match="kink"):
        ln.check_vjp(counted, f_vjp, (np.zeros(1),), mode="full")
    assert len(calls) == 1 + 2 + 2  # the point, a ± h, a ± h/2


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_the_mean_of_the_one_sided_derivatives_passes_at_a_kink(mode):
    """Protects what the module docstring states: at a kink, central differences measure the
    mean of the two one-sided derivatives, so sign(0) = 0 for |a|, or 1/2 for max(a, 0) at 0,
    passes."""
    a = np.array([0.0, 1.5, -2.0, 0.0, 0.7])
    ln.check_vjp(np.abs, lambda a, v: (np.sign(a) * v,), (a,), mode=mode)
    ln.check_vjp(lambda a: np.maximum(a, 0), _relu_vjp(0.5), (a,), mode=mode)


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_smooth_functions_at_zero_keep_their_verdicts(mode):
    """Protects the kink test from excusing wrong gradients: a smooth function at the same
    points (its forward and backward differences disagree too, by an amount that halves with
    the step) passes its right gradient and fails one 1% off, or off by a constant at 0; so
    does a wrong gradient beside a kink in full mode, which checks each element."""
    a = np.array([0.0, 1.5, -2.0, 0.0, 0.7])
    f = lambda a: a * a + np.sin(a)  # noqa: E731
    ln.check_vjp(f, lambda a, v: ((2 * a + np.cos(a)) * v,), (a,), mode=mode)
    for wrong in (lambda a, v: (1.01 * (2 * a + np.cos(a)) * v,),
                  lambda a, v: ((2 * a + np.cos(a) + (a == 0)) * v,)):
        with pytest.raises(ln.GradcheckError):
            ln.check_vjp(f, wrong, (a,), mode=mode)
    if mode == "full":
        with pytest.raises(ln.GradcheckError, match=r"index \(2,\)"):
            ln.check_vjp(lambda a: np.maximum(a, 0), lambda a, v: ((a >= 0) * v + (a < -1) * v,),
                         (a,), mode=mode)
