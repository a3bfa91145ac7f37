"""Bad input raises ValueError/TypeError naming the argument; nothing is modified."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import layernorm as ln
from layernorm.tolerances import assert_close

X = np.random.default_rng(0).standard_normal((3, 4))


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"gamma": np.ones(5)}, ValueError, r"gamma must have shape \(4,\)"),
        ({"beta": np.ones((1, 4))}, ValueError, r"beta must have shape \(4,\)"),
        ({"gamma": np.ones(4, dtype=np.int64)}, TypeError, "gamma must have a floating dtype"),
        ({"beta": np.ones(4, dtype=bool)}, TypeError, "beta must have a floating dtype"),
        ({"eps": -1e-5}, ValueError, r"eps must be a finite number >= 0, got -1e-05"),
        ({"eps": float("nan")}, ValueError, "eps must be a finite number >= 0"),
        ({"eps": float("inf")}, ValueError, "eps must be a finite number >= 0"),
        ({"eps": "1e-5"}, TypeError, "eps must be a real number"),
        ({"eps": True}, TypeError, "eps must be a real number"),
        ({"eps": None}, TypeError, "eps must be a real number"),
    ],
)
def test_bad_parameters(kwargs, exc, match):
    """Protects: wrong gamma/beta shapes and dtypes, and eps that is not finite and >= 0."""
    with pytest.raises(exc, match=match):
        ln.layer_norm_forward(X, **kwargs)


@pytest.mark.parametrize(
    "x,exc,match",
    [
        (np.float64(1.0), ValueError, "x must have at least one axis"),
        (np.ones((3, 0)), ValueError, r"x must have a non-empty last axis"),
        (np.ones((2, 3), dtype=np.int32), TypeError, "x must have a floating dtype"),
        (np.ones((2, 3), dtype=bool), TypeError, "x must have a floating dtype"),
        (np.ones((2, 3), dtype=complex), TypeError, "x must have a floating dtype"),
        (np.ones((2, 3), dtype=object), TypeError, "x must have a floating dtype"),
        ([[1, 2], [3]], TypeError, "x must be array-like"),
    ],
)
def test_bad_x(x, exc, match):
    """Protects: scalars, D = 0 and non-floating dtypes are refused with a named error."""
    with pytest.raises(exc, match=match):
        ln.layer_norm_forward(x)


def test_bad_dy_and_cache():
    """Protects the backward: dy of another shape or dtype kind, or a foreign cache."""
    y, cache = ln.layer_norm_forward(X, np.ones(4), np.zeros(4))
    with pytest.raises(ValueError, match=r"dy must have the shape of the forward's x"):
        ln.layer_norm_backward(np.ones((3, 5)), cache)
    with pytest.raises(ValueError, match=r"dy must have the shape"):
        ln.layer_norm_backward(np.ones((4, 3)), cache)
    with pytest.raises(TypeError, match="dy must have a floating dtype"):
        ln.layer_norm_backward(np.ones((3, 4), dtype=np.int64), cache)
    with pytest.raises(TypeError, match="cache must be the NormCache"):
        ln.layer_norm_backward(np.ones((3, 4)), {"xhat": None})
    _, other = ln.layer_norm_forward(np.ones((2, 4)))
    with pytest.raises(ValueError, match="another call"):
        ln.layer_norm_backward(np.ones((3, 4)), other)


def test_lists_are_accepted_and_inputs_never_modified():
    """Protects array-likes and the caller's data, including read-only inputs."""
    x = X.copy()
    x.setflags(write=False)
    g = np.ones(4)
    g.setflags(write=False)
    y, cache = ln.layer_norm_forward(x, g, None)
    dy = np.ones_like(y)
    dy.setflags(write=False)
    ln.layer_norm_backward(dy, cache)
    np.testing.assert_array_equal(x, X)
    y_list, _ = ln.layer_norm_forward(X.tolist())
    np.testing.assert_array_equal(y_list, ln.layer_norm_forward(X)[0])


def test_empty_leading_axis_is_fine():
    """Protects M = 0: no rows is a valid batch, not an error."""
    y, cache = ln.layer_norm_forward(np.ones((0, 4)), np.ones(4), np.zeros(4))
    dx, dg, db = ln.layer_norm_backward(np.ones((0, 4)), cache)
    assert y.shape == dx.shape == (0, 4)
    np.testing.assert_array_equal(dg, np.zeros(4))
    np.testing.assert_array_equal(db, np.zeros(4))


@pytest.mark.parametrize("dtype,eps", [("float32", 0.0), ("float32", 1e-50), ("float32", 1e39),
                                       ("float16", 1e-40), ("float64", 0.0)])
def test_one_eps_rule_in_every_api(dtype, eps):
    """Protects the one eps rule (finite and >= 0, torch's): eps = 0 and an eps the compute
    dtype rounds to 0 or to inf are accepted by the reference, the NumPy API and the torch API
    alike, and they agree: a constant row gives NaN where var + eps rounds to 0 (as torch's own
    norms do), y = beta where it rounds to inf, and the other rows are normalized as usual
    (within the table of x's dtype)."""
    x = np.array([[3.0, 3.0, 3.0, 3.0], [1.0, 2.0, 4.0, 8.0]], dtype)
    beta = np.full(4, 0.5, dtype)
    want, _ = ln.layer_norm_forward(x, None, beta, eps)
    rounded = np.float32(eps) if dtype != "float64" else eps
    if rounded == 0:
        assert np.isnan(want[0]).all()
    elif np.isinf(rounded):
        np.testing.assert_array_equal(want, np.broadcast_to(beta, x.shape))
    got = []
    if importlib.util.find_spec("torch") is not None:
        import torch

        import layernorm.torch as lt
        from layernorm import cpu

        got.append(cpu.layer_norm_forward(x, None, beta, eps)[0])
        t = lt.layer_norm(torch.from_numpy(x), 4, None, torch.from_numpy(beta), eps)
        got.append(t.numpy())
    for g in got:
        np.testing.assert_array_equal(np.isnan(g), np.isnan(want))
        assert_close(np.nan_to_num(g), np.nan_to_num(want), dtype, "out")


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix itself warns
@pytest.mark.parametrize("kind", ["masked", "matrix"])
def test_masked_arrays_and_matrices_are_refused(kind):
    """Protects against reinterpretation: a mask would change the statistics silently."""
    bad = np.ma.masked_array(X, mask=X > 1) if kind == "masked" else np.asmatrix(X)
    with pytest.raises(TypeError, match="x must be a plain array"):
        ln.layer_norm_forward(bad)


def test_unsupported_float_dtype_is_refused():
    """Protects the dtype list: long double is not one of the four supported dtypes."""
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        ln.layer_norm_forward(X.astype(np.longdouble))


@pytest.mark.parametrize("dtype", [">f2", ">f4", ">f8"])
def test_non_native_byte_order(dtype):
    """Protects big-endian inputs: computed like native ones (float16 still in float32)."""
    y, cache = ln.layer_norm_forward(X.astype(dtype), np.ones(4, dtype))
    want, want_cache = ln.layer_norm_forward(X.astype(dtype[1:]), np.ones(4, dtype[1:]))
    np.testing.assert_array_equal(y, want)
    assert cache.xhat.dtype == want_cache.xhat.dtype


_MODULE_CASES = {  # id: (parameter set, its value, x's last axis, the error)
    "(4,)": ("gamma", np.ones(4), 8,
             r"gamma must have shape \(8,\), the module's D, got shape \(4,\)"),
    "(8, 1)": ("gamma", np.ones((8, 1)), 8, r"gamma must have shape \(8,\).*got shape \(8, 1\)"),
    "0-d": ("gamma", np.float64(1.0), 8, r"gamma must have shape \(8,\).*got shape \(\)"),
    "list": ("gamma", [1.0] * 4, 8, r"gamma must have shape \(8,\).*got shape \(4,\)"),
    "beta (4,)": ("beta", np.ones(4), 8,
                  r"beta must have shape \(8,\), the module's D, got shape \(4,\)"),
    # a gamma that matches a wrong x: gamma is named, not the module's right beta
    "gamma matching x": ("gamma", np.ones(4), 4,
                         r"gamma must have shape \(8,\), the module's D, got shape \(4,\)"),
    # a wrong x: x is named, not the module's right gamma
    "x": (None, None, 4, r"x must have a last axis of 8, the module's D, got shape \(3, 4\)"),
}


@pytest.mark.parametrize(("norm", "case"), [
    (norm, case) for norm in ("LayerNorm", "RMSNorm") for case in _MODULE_CASES
    if not (norm == "RMSNorm" and _MODULE_CASES[case][0] == "beta")])
def test_a_module_names_the_parameter_that_does_not_fit_it(norm, case):
    """Protects the modules' errors (the reference's and the fused ones): with a parameter or
    x of the wrong shape for the module's D, the error names that argument, the module's shape
    and the one it got (the functions' checks, which know only x, blamed gamma for a wrong x
    and beta for a gamma matching a wrong x)."""
    attr, value, width, message = _MODULE_CASES[case]
    made = [lambda: getattr(ln, norm)(8)]
    if importlib.util.find_spec("torch") is not None:
        from layernorm import cpu

        made += [lambda reuse=reuse: getattr(cpu, norm)(8, reuse_buffers=reuse)
                 for reuse in (False, True)]
    for make in made:
        m = make()
        if attr is not None:
            setattr(m, attr, value)
        x = np.random.default_rng(1).standard_normal((3, width))
        with pytest.raises(ValueError, match=message):
            m.forward(x)
