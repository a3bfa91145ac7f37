"""The reference's forward-mode derivatives (``*_jvp``), checked by finite differences.

Protects: t_y (and t_h) of every family member, with and without zero-centred gamma, against
central differences of the forward through :func:`layernorm.check_vjp`, the same checker as
the backward: forward mode gives the Jacobian J column by column (J·e_k), whose transpose
applied to the checker's cotangent v is vᵀJ. Also: the JVP and the backward are adjoint
(vᵀ(J·u) = (Jᵀv)·u), linear in the tangents, and refuse what they cannot use.
"""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln
import layernorm.reference as ref
from layernorm.family import NORMS
from layernorm.tolerances import assert_close

M, D = 3, 6


def _point(norm, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    args = [rng.standard_normal((M, D)) * 2 + 0.5]
    if norm.residual:
        args.append(rng.standard_normal((M, D)))
    return args + [rng.standard_normal(D) for _ in norm.params]


def _split(norm, args):
    n = 2 if norm.residual else 1
    return args[:n], args[n:]


def _forward(norm, zcg):
    def f(*args):
        ins, params = _split(norm, args)
        out = getattr(ref, f"{norm.name}_forward")(*ins, *params, zero_centered_gamma=zcg)
        return out[0] if len(out) == 2 else tuple(out[:2])
    return f


def _jvp(norm, zcg, args, tangents):
    """The reference's forward-mode derivative at ``args`` along ``tangents`` (one per arg)."""
    ins, params = _split(norm, args)
    cache = getattr(ref, f"{norm.name}_forward")(*ins, *params, zero_centered_gamma=zcg)[-1]
    return getattr(ref, f"{norm.name}_jvp")(cache, *tangents)


def _vjp_from_jvp(norm, zcg):
    """f_vjp for check_vjp assembled from JVPs: entry k of vᵀJ is v · (J e_k)."""
    def f_vjp(*args_and_v):
        *args, v = args_and_v
        vs = v if isinstance(v, tuple) else (v,)
        grads = []
        for i, a in enumerate(args):
            g = np.zeros_like(a)
            for k in np.ndindex(a.shape):
                tangents = [np.zeros_like(b) if j == i else None for j, b in enumerate(args)]
                tangents[i][k] = 1.0
                col = _jvp(norm, zcg, args, tangents)
                cols = col if isinstance(col, tuple) else (col,)
                g[k] = sum(float(np.sum(c * w)) for c, w in zip(cols, vs, strict=True))
            grads.append(g)
        return grads
    return f_vjp


@pytest.mark.parametrize("zcg", [False, True], ids=["gamma", "1+gamma"])
@pytest.mark.parametrize("name", sorted(NORMS))
def test_jvp_matches_finite_differences(name: str, zcg: bool) -> None:
    """Every column of the forward-mode Jacobian, by central differences (full mode)."""
    norm = NORMS[name]
    args = _point(norm)
    report = ln.check_vjp(_forward(norm, zcg), _vjp_from_jvp(norm, zcg), args, mode="full",
                          max_elements=None)
    assert len(report.args) == len(args)


def test_a_wrong_tangent_fails_the_check(monkeypatch) -> None:
    """The check has power: a forward mode without the projection xhat·mean(xhat·u) (as a
    derivation that forgot rstd's dependence on x would give) fails it."""
    norm = NORMS["rms_norm"]

    def wrong(cache, tx, tgamma=None):
        t = 0 if tx is None else tx * cache.rstd[:, None] * cache.scale
        return t + (0 if tgamma is None else tgamma * cache.xhat)

    monkeypatch.setattr(ref, "rms_norm_jvp", wrong)
    with pytest.raises(ln.GradcheckError):
        ln.check_vjp(_forward(norm, False), _vjp_from_jvp(norm, False), _point(norm),
                     mode="full", max_elements=None)


@pytest.mark.parametrize("name", sorted(NORMS))
def test_jvp_is_the_adjoint_of_the_backward(name: str) -> None:
    """vᵀ(J·u) = (Jᵀ·v)·u for random u and v, the backward giving Jᵀ·v: the two modes
    differentiate the same function."""
    norm = NORMS[name]
    args = _point(norm, seed=1)
    rng = np.random.default_rng(2)
    tangents = [rng.standard_normal(a.shape) for a in args]
    cot = [rng.standard_normal((M, D)) for _ in norm.forward_outputs]
    ins, params = _split(norm, args)
    *_, cache = getattr(ref, f"{norm.name}_forward")(*ins, *params)
    t = getattr(ref, f"{norm.name}_jvp")(cache, *tangents)
    grads = getattr(ref, f"{norm.name}_backward")(*cot, cache)
    ts = t if isinstance(t, tuple) else (t,)
    # an add-norm's backward returns dx and dresidual (one per input), then the parameters'
    lhs = sum(float(np.sum(a * b)) for a, b in zip(ts, cot, strict=True))
    rhs = sum(float(np.sum(a * b)) for a, b in zip(grads, tangents, strict=True))
    assert_close(np.array(lhs), np.array(rhs), "float64", scale=abs(rhs) + 1.0,
                 name="v.(J u) against (J^T v).u")


def test_jvp_is_linear_and_rounds_once() -> None:
    """Twice the tangents give exactly twice t_y (float64), and a float32 forward's t_y is the
    float64 computation's rounded once, within the float32 tolerance."""
    args = _point(NORMS["layer_norm"])
    rng = np.random.default_rng(3)
    tangents = [rng.standard_normal(a.shape) for a in args]
    t1 = _jvp(NORMS["layer_norm"], False, args, tangents)
    t2 = _jvp(NORMS["layer_norm"], False, args, [2 * t for t in tangents])
    np.testing.assert_array_equal(t2, 2 * t1)
    a32 = [a.astype(np.float32) for a in args]
    t32 = _jvp(NORMS["layer_norm"], False, a32, [t.astype(np.float32) for t in tangents])
    want = _jvp(NORMS["layer_norm"], False, [a.astype(np.float64) for a in a32],
                [t.astype(np.float32).astype(np.float64) for t in tangents])
    assert t32.dtype == np.float32
    assert_close(t32, want, "float32", scale=float(np.abs(want).max()), name="t_y")


def test_jvp_refuses_what_it_cannot_use() -> None:
    """A memory-efficient cache, a tangent of an absent parameter and a tangent of the wrong
    shape each raise, naming the argument."""
    x = np.random.default_rng(0).standard_normal((M, D))
    _, me = ln.layer_norm_forward(x, np.ones(D), memory_efficient=True)
    with pytest.raises(TypeError, match="memory_efficient=False"):
        ln.layer_norm_jvp(me, x)
    _, cache = ln.layer_norm_forward(x)
    with pytest.raises(ValueError, match="tgamma must be None"):
        ln.layer_norm_jvp(cache, x, np.ones(D))
    with pytest.raises(ValueError, match="tx must have the shape"):
        ln.layer_norm_jvp(cache, x[:, :2])
    _, cache = ln.rms_norm_forward(x)
    with pytest.raises(ValueError, match="an RMS norm"):
        ln.layer_norm_jvp(cache, x)
