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
    """Protects eps: a step of 0.5 on x³ has truncation error h² = 0.25 and must fail."""
    x = np.array([1.0, 2.0, 3.0])
    cube_vjp = lambda a, d: (3 * a**2 * d,)  # noqa: E731
    ln.check_vjp(lambda a: a**3, cube_vjp, (x,), mode="full")
    with pytest.raises(ln.GradcheckError):
        ln.check_vjp(lambda a: a**3, cube_vjp, (x,), mode="full", eps=0.5)


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
