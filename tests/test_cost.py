"""The cost model of every norm agrees with measurement: tracemalloc peaks, the caches' nbytes,
the arrays a call reads and writes; and with the FLOPs and passes counted by hand."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from grids import pairwise

import layernorm as ln
from layernorm import cost
from layernorm.family import NORMS

RNG = np.random.default_rng(3)


def _dtype(name):
    if name == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.dtype(name)


def _peak(fn, *args):
    """Peak bytes traced while fn runs, beyond what was allocated before it.

    fn runs once untraced first: the first call in a process imports numpy.ma (NumPy loads
    it lazily; validation refuses masked arrays), about 1 MB that is not the model's business.
    """
    fn(*args)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = fn(*args)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return peak, out


# The model counts the arrays a call allocates; NumPy's small allocations (shape tuples,
# reduction buffers) and the O(M), O(D) vectors it rounds are the rest. Measured: within 4%.
PEAK_SLACK = 0.10


def _call(name, shape, dt, affine):
    """A reference call's arguments in dtype ``dt``: forward (x, [residual], gamma, [beta]),
    and the backward's cotangents (dy, [dh])."""
    nm = NORMS[name]
    d = shape[-1]
    args = [RNG.standard_normal(shape).astype(dt) for _ in nm.forward_inputs]
    args += [RNG.standard_normal(d).astype(dt) if affine else None for _ in nm.params]
    cot = [RNG.standard_normal(shape).astype(dt) for _ in nm.forward_outputs]
    return args, cot


def _functions(name):
    return getattr(ln, f"{name}_forward"), getattr(ln, f"{name}_backward")


@pytest.mark.parametrize("name, dtype, affine, shape", pairwise(
    list(NORMS), ["float64", "float32", "float16", "bfloat16"], [True, False],
    [(512, 256), (64, 4096)]))
def test_reference_peak_memory_matches_model(name, dtype, affine, shape):
    """Protects the memory model of every norm: measured peaks of forward and backward
    within PEAK_SLACK of the model, and the temporaries (peak less what is returned) too."""
    dt = _dtype(dtype)
    m, d = shape
    item = np.dtype(dt).itemsize
    fwd, bwd = _functions(name)
    args, cot = _call(name, shape, dt, affine)
    beta = affine and NORMS[name].centred

    peak_f, (*outs, cache) = _peak(fwd, *args)
    model_f = cost.cost("fwd", m, d, item, norm=name, gamma=affine, beta=beta)
    assert abs(peak_f - model_f.reference_peak_bytes) <= PEAK_SLACK * model_f.reference_peak_bytes
    returned = sum(o.nbytes for o in outs) + cache.nbytes
    assert abs((peak_f - returned) - model_f.reference_temporary_bytes) \
        <= PEAK_SLACK * model_f.reference_peak_bytes

    peak_b, grads = _peak(bwd, *cot, cache)
    model_b = cost.cost("bwd", m, d, item, norm=name, gamma=affine, beta=beta)
    assert abs(peak_b - model_b.reference_peak_bytes) <= PEAK_SLACK * model_b.reference_peak_bytes
    n_out = len(NORMS[name].backward_outputs)
    returned = sum(g.nbytes for g in grads[:n_out])
    assert abs((peak_b - returned) - model_b.reference_temporary_bytes) \
        <= PEAK_SLACK * model_b.reference_peak_bytes


@pytest.mark.parametrize("name, dtype, gamma", pairwise(
    list(NORMS), ["float64", "float32", "float16"], [True, False]))
def test_cache_nbytes_equals_model(name, dtype, gamma):
    """Protects the cache model of every norm: xhat (M·D), rstd (M) and the scale (D, with
    gamma) in the compute dtype, exactly; an add-norm's cache holds nothing more."""
    args, _ = _call(name, (3, 7, 33), np.dtype(dtype), gamma)
    *_, cache = _functions(name)[0](*args)
    model = cost.cost("fwd", 21, 33, np.dtype(dtype).itemsize, norm=name, gamma=gamma)
    assert cache.nbytes == model.cache_bytes


def _memory_efficient_call(name, shape, dt, weights):
    """A memory-efficient reference call's arguments and its cotangents. ``weights``: "none"
    (no gamma, no beta: nothing kept), "ordinary" (gamma = 1 + N(0, 0.1^2),
    beta = N(0, 0.1^2): nothing kept) or "zeros" (random gamma and beta, every other gamma 0:
    those channels kept, and some where |beta| > 4|gamma| too; the first quarter of the rows
    constant (h's, for an add-norm): var = 0 < eps, so kept whole under LayerNorm's beta)."""
    args, cot = _call(name, shape, dt, weights != "none")
    nm = NORMS[name]
    n_in = len(nm.forward_inputs)
    d = shape[-1]
    if weights == "ordinary":
        args[n_in:] = [(np.ones(d) if i == 0 else 0) + 0.1 * RNG.standard_normal(d)
                       for i in range(len(nm.params))]
        args[n_in:] = [a.astype(dt) for a in args[n_in:]]
    elif weights == "zeros":
        args[n_in][::2] = 0
        rows = math.prod(shape[:-1]) // 4
        for i, a in enumerate(args[:n_in]):  # x, [residual]: C-contiguous, so these are views
            a.reshape(-1, d)[:rows] = 1.5 if i == 0 else 0
    return args, cot


def _me_forward(name):
    fwd = _functions(name)[0]
    return lambda *args: fwd(*args, memory_efficient=True)


def _kept(cache):
    """What a memory-efficient cache keeps (the norm's, for an add-norm), as the model's
    arguments: the numbers of channels and of rows."""
    norm = getattr(cache, "norm", cache)
    return dict(kept=len(norm.keep), kept_rows=len(norm.rows))


@pytest.mark.parametrize("name, dtype, weights", pairwise(
    list(NORMS), ["float64", "float32", "float16", "bfloat16"], ["none", "ordinary", "zeros"]))
def test_memory_efficient_cache_nbytes_equals_model(name, dtype, weights):
    """Protects the memory-efficient cache model of every norm: the OutputCache's nbytes is
    rstd (M), the copies of the scale (D, with gamma) and of the shift (D, with beta:
    LayerNorm's), the kept channels' int64 indices and their xhat (M·k) in the compute dtype,
    and the rows kept whole (r·D, with their int64 indices), exactly, with nothing kept and
    with some channels and rows; y is not counted; an add-norm's cache holds nothing more.
    And the default cache's size beside it, for the saving."""
    dt = _dtype(dtype)
    args, _ = _memory_efficient_call(name, (3, 7, 34), dt, weights)
    *_, cache = _me_forward(name)(*args)
    kept = _kept(cache)
    assert (kept["kept"] > 0) == (weights == "zeros")
    assert (kept["kept_rows"] == 21 // 4) == (weights == "zeros" and NORMS[name].centred)
    affine = weights != "none"
    params = dict(norm=name, gamma=affine, beta=affine and NORMS[name].centred)
    model = cost.cost("fwd", 21, 34, np.dtype(dt).itemsize, **params, memory_efficient=True,
                      **kept)
    assert cache.nbytes == model.cache_bytes
    assert cache.nbytes == cost.cache_bytes(21, 34, np.dtype(dt).itemsize, **params,
                                            memory_efficient=True, **kept)
    *_, default = _functions(name)[0](*args)
    assert default.nbytes == model.default_cache_bytes
    assert model.cache_saved_bytes == default.nbytes - cache.nbytes


@pytest.mark.parametrize("name, dtype, weights, shape", pairwise(
    list(NORMS), ["float64", "float32", "float16", "bfloat16"], ["none", "zeros"],
    [(512, 256), (64, 4096)]))
def test_memory_efficient_peak_memory_matches_model(name, dtype, weights, shape):
    """Protects the memory model of the memory-efficient mode of every norm, as
    test_reference_peak_memory_matches_model does the default's: measured peaks of forward
    (which still forms the whole xhat, then gathers the kept channels) and backward (t = y -
    beta and dy·t in float64, g and the rounded xhat, the kept channels' products) within
    PEAK_SLACK of the model, and the temporaries (peak less what is returned: y, h and the
    OutputCache forward) too; with half the channels and (LayerNorms) a quarter of the rows
    kept, whose (M, k) and (r, D) arrays the model must count to stay within the slack."""
    dt = _dtype(dtype)
    m, d = shape
    item = np.dtype(dt).itemsize
    args, cot = _memory_efficient_call(name, shape, dt, weights)
    affine = weights != "none"
    beta = affine and NORMS[name].centred

    peak_f, (*outs, cache) = _peak(_me_forward(name), *args)
    kept = _kept(cache)
    assert (kept["kept"] >= d // 2) == affine and (kept["kept_rows"] == m // 4) == beta
    model_f = cost.cost("fwd", m, d, item, norm=name, gamma=affine, beta=beta,
                        memory_efficient=True, **kept)
    assert abs(peak_f - model_f.reference_peak_bytes) <= PEAK_SLACK * model_f.reference_peak_bytes
    returned = sum(o.nbytes for o in outs) + cache.nbytes
    assert abs((peak_f - returned) - model_f.reference_temporary_bytes) \
        <= PEAK_SLACK * model_f.reference_peak_bytes

    peak_b, grads = _peak(_functions(name)[1], *cot, cache)
    model_b = cost.cost("bwd", m, d, item, norm=name, gamma=affine, beta=beta,
                        memory_efficient=True, **kept)
    assert abs(peak_b - model_b.reference_peak_bytes) <= PEAK_SLACK * model_b.reference_peak_bytes
    n_out = len(NORMS[name].backward_outputs)
    returned = sum(g.nbytes for g in grads[:n_out])
    assert abs((peak_b - returned) - model_b.reference_temporary_bytes) \
        <= PEAK_SLACK * model_b.reference_peak_bytes


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_memory_efficient_minimal_bytes_are_the_arrays_a_call_reads_and_writes(name, pass_):
    """Protects the minimal bytes of the memory-efficient mode against the API: the backward
    reads y (the cache's) where the default reads x (h), and the forward writes, the backward
    reads, the kept channels' and rows' xhat (M·k and r·D, compute dtype); with extras, rstd
    alone (no mean) and their int64 indices besides the parameters (beta, the shift, read
    backward)."""
    nm = NORMS[name]
    m, d = 6, 40
    args, cot = _memory_efficient_call(name, (m, d), np.float32, "zeros")
    fwd, bwd = _me_forward(name), _functions(name)[1]
    *outs, cache = fwd(*args)
    norm_cache = getattr(cache, "norm", cache)
    grads = bwd(*cot, cache)
    n_in = len(nm.forward_inputs)
    kept = [norm_cache.xhat_kept, norm_cache.xhat_rows]
    if pass_ == "fwd":
        arrays = [*args[:n_in], *outs, *kept]  # x, [residual]; y, [h]; what is kept
        params = sum(p.nbytes for p in args[n_in:])
    else:
        # y, dy, [dh]; dx, [dresidual]; what is kept
        arrays = [norm_cache.y, *cot, *grads[:len(nm.backward_outputs)], *kept]
        params = sum(p.nbytes for p in args[n_in:]) + sum(g.nbytes for g in grads[-len(
            nm.params):])
    mode = dict(norm=name, memory_efficient=True, **_kept(cache))
    assert cost.minimal_bytes(pass_, m, d, 4, **mode) == sum(a.nbytes for a in arrays)
    indices = norm_cache.keep.nbytes + norm_cache.rows.nbytes
    assert cost.minimal_bytes(pass_, m, d, 4, extras=True, **mode) == \
        sum(a.nbytes for a in arrays) + params + norm_cache.rstd.nbytes + indices
    assert cost.minimal_bytes(pass_, m, d, 4, norm=name, memory_efficient=True) == \
        cost.minimal_bytes(pass_, m, d, 4, norm=name)  # y is x's size


def test_memory_efficient_flops_and_reference_passes():
    """Protects the FLOPs and the pass lists of the memory-efficient backward, counted by
    hand from layernorm.reference: t = y - beta adds one operation per element with beta, and
    xhat = t / scale takes the place of (dy·xhat)·scale with gamma (LayerNorm 12, RMSNorm 8);
    the forward is the default's. In float32, with gamma and beta, LayerNorm's backward drops
    dy·xhat, its column and row sums and (dy·xhat)·scale (28 bytes per element) and adds t = y
    in float64 and t - beta, dy·t, its sums, t / scale, xhat rounded from t (92): 36 float32
    arrays; per kept channel and row, 88 bytes more (dy there, xhat in float64, their product,
    its sum, times the scale, written back; the kept xhat written into the recovered one); per
    element of a row kept whole, 68 (REFERENCE_KEPT_ROW_PASSES)."""
    for name, per_element in {"layer_norm": 12, "rms_norm": 8, "add_layer_norm": 13,
                              "add_rms_norm": 9}.items():
        for pass_ in ("fwd", "bwd"):
            me = cost.flops(pass_, 100, 64, norm=name, memory_efficient=True)
            default = cost.flops(pass_, 100, 64, norm=name)
            assert me == default + (100 * 64 if pass_ == "bwd" and NORMS[name].centred else 0)
        assert cost.flops("bwd", 100, 64, norm=name, memory_efficient=True) // (100 * 64) \
            == per_element
    # without gamma nothing is divided and g = dy: only t = y - beta remains
    assert cost.flops("bwd", 1, 64, norm="rms_norm", gamma=False, memory_efficient=True) == \
        cost.flops("bwd", 1, 64, norm="rms_norm", gamma=False)

    m, d, k = 64, 1024, 100
    me = cost.cost("bwd", m, d, 4, memory_efficient=True)
    assert me.reference_bytes == 36 * 4 * m * d
    kept = cost.cost("bwd", m, d, 4, memory_efficient=True, kept=k)
    assert kept.reference_bytes - me.reference_bytes == 88 * m * k
    fwd = cost.cost("fwd", m, d, 4, memory_efficient=True, kept=k)
    assert fwd.reference_bytes == cost.cost("fwd", m, d, 4).reference_bytes + 8 * m * k
    # per element of a row kept whole: its xhat into t in float64 (12 bytes), t *= scale there
    # as a gather, the product and a scatter (48), its xhat into the recovered xhat (8)
    rows = cost.cost("bwd", m, d, 4, memory_efficient=True, kept_rows=3)
    assert rows.reference_bytes - me.reference_bytes == 68 * 3 * d
    assert cost.cost("fwd", m, d, 4, memory_efficient=True, kept_rows=3).reference_bytes == \
        cost.cost("fwd", m, d, 4).reference_bytes + 8 * 3 * d


def test_memory_efficient_saving():
    """Protects the derived figures: the saving is the default cache less the memory-efficient
    one, (M·D - M·k - r·D)·c - (D·c for LayerNorm's shift) - 8·(k + r); nothing in the default
    mode; and
    the backward's peak grows by what the recovery holds (t and dy·t in float64)."""
    c = cost.cost("fwd", 4096, 4096, 4, memory_efficient=True)
    assert c.cache_bytes == (4096 + 2 * 4096) * 4
    assert c.cache_saved_bytes == 4096 * 4096 * 4 - 4096 * 4
    assert c.cache_saved_fraction == pytest.approx(1 - 3 / 4097)
    rms = cost.cost("fwd", 4096, 4096, 2, norm="rms_norm", memory_efficient=True, kept=10)
    assert rms.cache_bytes == (4096 + 4096 + 4096 * 10) * 4 + 8 * 10
    assert cost.cost("fwd", 4096, 4096, 4).cache_saved_bytes == 0
    rows = cost.cost("fwd", 4096, 4096, 4, memory_efficient=True, kept_rows=2)
    assert rows.cache_bytes == (4096 + 2 * 4096 + 2 * 4096) * 4 + 8 * 2
    assert cost.cost("fwd", 0, 8, 4, gamma=False).cache_saved_fraction == 0.0
    default, me = (cost.cost("bwd", 4096, 4096, 4, memory_efficient=e) for e in (False, True))
    assert me.reference_peak_bytes - default.reference_peak_bytes == 16 * 4096 * 4096


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_minimal_bytes_are_the_arrays_a_call_reads_and_writes(name, pass_):
    """Protects the minimal bytes of every norm against the API: the (M, D) arrays the
    family lists for the pass (dh included), as the reference's call has them, sum to the
    model's figure; with extras, add the parameters (and their gradients backward) and
    the float32 statistics (mean and rstd; rstd alone for RMSNorm)."""
    nm = NORMS[name]
    m, d = 6, 40
    args, cot = _call(name, (m, d), np.float32, True)
    fwd, bwd = _functions(name)
    *outs, cache = fwd(*args)
    grads = bwd(*cot, cache)
    n_in = len(nm.forward_inputs)
    if pass_ == "fwd":
        arrays = [*args[:n_in], *outs]  # x, [residual]; y, [h]
        params = sum(p.nbytes for p in args[n_in:])
    else:
        h = outs[-1] if nm.residual else args[0]  # the backward reads x, or h
        arrays = [h, *cot, *grads[:len(nm.backward_outputs)]]  # x; dy, [dh]; dx, [dresidual]
        params = sum(p.nbytes for p in args[n_in:]) + sum(g.nbytes for g in grads[-len(
            nm.params):])
    assert len(arrays) == (len(nm.forward_inputs) + len(nm.forward_outputs) if pass_ == "fwd"
                           else len(nm.backward_inputs) + len(nm.backward_outputs))
    assert cost.minimal_bytes(pass_, m, d, 4, norm=name) == sum(a.nbytes for a in arrays)
    stats = (2 if nm.centred else 1) * m * 4
    assert cost.minimal_bytes(pass_, m, d, 4, norm=name, extras=True) == \
        sum(a.nbytes for a in arrays) + params + stats


def test_minimal_bytes_keeps_its_layer_norm_signature():
    """Protects the callers in layernorm.bench: without ``norm`` the figures are LayerNorm's
    (2·M·D·s forward, 3·M·D·s backward; 4·D·s of parameters and gradients and 8·M of
    statistics with extras)."""
    assert cost.minimal_bytes("fwd", 1000, 512, 2) == 2 * 1000 * 512 * 2
    assert cost.minimal_bytes("bwd", 1000, 512, 4) == 3 * 1000 * 512 * 4
    assert cost.minimal_bytes("bwd", 10, 8, 4, extras=True) == 3 * 80 * 4 + 4 * 8 * 4 + 80
    assert cost.minimal_bytes("bwd", 10, 8, 4, affine=False, extras=True) == 3 * 80 * 4 + 80


def test_flops_of_the_family():
    """Protects the FLOP counts, step by step from the formulas: per element, LayerNorm 9
    forward and 11 backward; RMSNorm has no centring and no beta (4) and one row reduction
    fewer backward (8); an add-norm one more each way (the add, dh + dx). Θ(M·D) for all,
    and about one FLOP per byte or less: bandwidth-bound."""
    per_element = {"layer_norm": (9, 11), "rms_norm": (4, 8), "add_layer_norm": (10, 12),
                   "add_rms_norm": (5, 9)}
    reductions = {"layer_norm": (3, 2), "rms_norm": (1, 1)}  # row sums, each with a / D
    for name, (f, b) in per_element.items():
        inner = "layer_norm" if NORMS[name].centred else "rms_norm"
        rf, rb = reductions[inner]
        m, d = 100, 64
        assert cost.flops("fwd", m, d, norm=name) == f * m * d + (rf + 2) * m  # + eps, 1/sqrt
        assert cost.flops("bwd", m, d, norm=name) == b * m * d + rb * m
        c1, c2 = cost.cost("fwd", m, d, 4, norm=name), cost.cost("fwd", 2 * m, 2 * d, 4, norm=name)
        assert c2.flops == pytest.approx(4 * c1.flops, rel=0.01)
        assert c1.intensity < 2
    # without gamma: no multiply by it, no dgamma; backward g = dy, so g·xhat is dy·xhat
    assert cost.flops("fwd", 1, 64, norm="rms_norm", gamma=False) == 3 * 64 + 3
    assert cost.flops("bwd", 1, 64, norm="rms_norm", gamma=False) == 5 * 64 + 1


def test_reference_moves_several_times_the_minimal_bytes():
    """Protects the pass lists, counted by hand from layernorm.reference (float32, with
    gamma and beta): LayerNorm 17 (M, D) arrays forward, 20 backward; RMSNorm 9 and 16; an
    add-norm its norm's plus the add (3) forward, and dh + dx (3) and dx's copy (2) backward."""
    arrays = {"layer_norm": (17, 20), "rms_norm": (9, 16), "add_layer_norm": (20, 25),
              "add_rms_norm": (12, 21)}
    for name, (f, b) in arrays.items():
        nm = NORMS[name]
        fwd, bwd = cost.cost("fwd", 64, 1024, 4, norm=name), cost.cost("bwd", 64, 1024, 4,
                                                                       norm=name)
        assert fwd.reference_traffic_ratio == pytest.approx(
            f / (len(nm.forward_inputs) + len(nm.forward_outputs)))
        assert bwd.reference_traffic_ratio == pytest.approx(
            b / (len(nm.backward_inputs) + len(nm.backward_outputs)))
    # half precision: x and y (dy and dx) cross in 2 bytes, and each is converted in a pass
    half = cost.cost("fwd", 64, 1024, 2)
    assert half.reference_bytes == (17 * 4 + (2 - 4) + (4 + 2)) * 64 * 1024


def test_roofline():
    """Protects the roofline: bandwidth-bound unless FLOPs dominate."""
    assert cost.roofline_seconds(1e9, 1e9, 1e10) == pytest.approx(0.1)
    assert cost.roofline_seconds(1e9, 1e12, 1e10, peak_flops=1e12) == pytest.approx(1.0)
    c = cost.cost("bwd", 4096, 4096, 2)
    assert c.roofline_seconds(1e12) == pytest.approx(3 * 4096 * 4096 * 2 / 1e12)
    with pytest.raises(ValueError, match="bandwidth"):
        cost.roofline_seconds(1, 1, 0)


def test_bad_arguments():
    """Protects clear errors for a pass, itemsize, size, norm or beta the model does not
    know."""
    with pytest.raises(ValueError, match="pass_"):
        cost.cost("sideways", 1, 1, 4)
    with pytest.raises(ValueError, match="norm must be one of"):
        cost.cost("fwd", 1, 1, 4, norm="batch_norm")
    with pytest.raises(ValueError, match="norm must be one of"):
        cost.minimal_bytes("fwd", 1, 1, 4, norm="batch_norm")
    with pytest.raises(ValueError, match="no beta"):
        cost.cost("fwd", 1, 1, 4, norm="rms_norm", beta=True)
    with pytest.raises(ValueError, match="itemsize"):
        cost.cost("fwd", 1, 1, 3)
    with pytest.raises(ValueError, match="D must be >= 1, got 0"):
        cost.cost("fwd", 1, 0, 4)


def test_bad_memory_efficient_arguments():
    """Protects clear errors for the mode's arguments, each naming it: kept an integer in
    [0, D] (it counts channels) and kept_rows one in [0, M], only with memory_efficient=True
    (the default mode keeps xhat whole: a nonzero count there is a mistake, not ignored), and
    kept_rows only with beta (rows are kept whole only under a shift); memory_efficient a
    bool."""
    with pytest.raises(TypeError, match="kept must be an integer"):
        cost.cost("fwd", 8, 16, 4, memory_efficient=True, kept=2.0)
    with pytest.raises(ValueError, match="kept must be >= 0, got -1"):
        cost.cost("fwd", 8, 16, 4, memory_efficient=True, kept=-1)
    with pytest.raises(ValueError, match="kept must be <= D = 16"):
        cost.cost("bwd", 8, 16, 4, memory_efficient=True, kept=17)
    with pytest.raises(ValueError, match="kept .* needs memory_efficient=True"):
        cost.cost("fwd", 8, 16, 4, kept=3)
    with pytest.raises(ValueError, match="kept .* needs memory_efficient=True"):
        cost.minimal_bytes("bwd", 8, 16, 4, kept=3)
    with pytest.raises(TypeError, match="memory_efficient must be a bool"):
        cost.cost("fwd", 8, 16, 4, memory_efficient="yes")
    assert cost.cost("fwd", 8, 16, 4, memory_efficient=np.True_, kept=np.int64(16)).kept == 16
    with pytest.raises(ValueError, match="kept_rows must be >= 0, got -1"):
        cost.cost("fwd", 8, 16, 4, memory_efficient=True, kept_rows=-1)
    with pytest.raises(ValueError, match="kept_rows must be <= M = 8"):
        cost.cost("fwd", 8, 16, 4, memory_efficient=True, kept_rows=9)
    with pytest.raises(ValueError, match="kept_rows .* needs memory_efficient=True"):
        cost.cost("bwd", 8, 16, 4, kept_rows=1)
    for call in (lambda: cost.cost("fwd", 8, 16, 4, norm="rms_norm", memory_efficient=True,
                                   kept_rows=1),
                 lambda: cost.cost("fwd", 8, 16, 4, beta=False, memory_efficient=True,
                                   kept_rows=1),
                 lambda: cost.minimal_bytes("fwd", 8, 16, 4, affine=False,
                                            memory_efficient=True, kept_rows=1)):
        with pytest.raises(ValueError, match="kept_rows needs beta"):
            call()
    assert cost.cost("fwd", 8, 16, 4, kept=0) == cost.cost("fwd", 8, 16, 4)


def test_cost_command_prints_the_model(capsys):
    """Protects `layernorm cost`: one row per shape, dtype, norm and pass, every norm by
    default, figures from the model; --norm picks norms."""
    from layernorm.commands import cli
    from layernorm.commands import cost as command

    assert cli.main(["cost", "--shape", "8x512x768", "--dtype", "float32", "--bandwidth",
                     "40"]) == 0
    out = capsys.readouterr().out
    for name, nm in NORMS.items():
        c = cost.cost("fwd", 4096, 768, 4, norm=name)
        assert f"| 8x512x768 | float32 | {nm.title} | fwd | {c.flops / 1e9:.3f} | " \
               f"{c.minimal_bytes / 1e6:.1f} |" in out
        assert f"{c.roofline_seconds(40e9) * 1e3:.3f}" in out
    assert out.count("| 8x512x768 |") == 2 * len(NORMS)

    assert cli.main(["cost", "--shape", "64x1024", "--norm", "rms_norm"]) == 0
    out = capsys.readouterr().out
    assert out.count("| RMSNorm |") == 4 and "LayerNorm" not in out  # 2 dtypes, 2 passes
    with pytest.raises(ValueError, match="at least two positive extents"):
        command.table([(4096,)], ["float32"], None)


def test_cost_command_prints_the_memory_efficient_model(capsys):
    """Protects `layernorm cost --memory-efficient [--kept K]`: every figure is the mode's, and
    the forward's rows show its cache, the default mode's and the fraction saved, to three
    decimals of MB (the mode's cache is O(M + D)); without the flag the table is the default
    mode's, with no such columns."""
    from layernorm.commands import cli

    argv = ["cost", "--shape", "8x512x768", "--dtype", "bfloat16", "--memory-efficient"]
    for kept in (0, 40):
        assert cli.main(argv + (["--kept", str(kept)] if kept else [])) == 0
        out = capsys.readouterr().out
        assert "| cache MB | default cache MB | saved | peak MB |" in out
        for name, nm in NORMS.items():
            f, b = (cost.cost(p, 4096, 768, 2, norm=name, memory_efficient=True, kept=kept)
                    for p in ("fwd", "bwd"))
            assert f"| 8x512x768 | bfloat16 | {nm.title} | fwd | {f.flops / 1e9:.3f} | " \
                   f"{f.minimal_bytes / 1e6:.1f} | {f.reference_bytes / 1e6:.1f} | " \
                   f"{f.reference_traffic_ratio:.1f} | {f.cache_bytes / 1e6:.3f} | " \
                   f"{f.default_cache_bytes / 1e6:.3f} | {f.cache_saved_fraction:.2%} | " \
                   f"{f.reference_peak_bytes / 1e6:.1f} |" in out
            assert f"| {nm.title} | bwd | {b.flops / 1e9:.3f} | {b.minimal_bytes / 1e6:.1f} | " \
                   f"{b.reference_bytes / 1e6:.1f} | {b.reference_traffic_ratio:.1f} | - | - | " \
                   f"- | {b.reference_peak_bytes / 1e6:.1f} |" in out
    assert cli.main(["cost", "--shape", "64x64"]) == 0
    assert "saved" not in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["--memory-efficient"],
    ["--norm", "layer_norm", "--memory-efficient", "--kept", "205"],
], ids=" ".join)
def test_complexity_memory_efficient_tables_are_what_the_command_prints(argv, capsys):
    """Protects docs/complexity.md's tables of the memory-efficient cache (section Memory):
    each is the output of the command quoted beside it."""
    from pathlib import Path

    from layernorm.commands import cli

    argv = ["cost", "--shape", "4096x4096", "--dtype", "float32", "--dtype", "bfloat16", *argv]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out.strip()
    text = (Path(__file__).resolve().parents[1] / "docs" / "complexity.md").read_text()
    assert f"`layernorm {' '.join(argv)}`" in " ".join(text.split())
    assert printed in text, "docs/complexity.md is stale: paste the command's table"


def test_sizes_are_exact_python_integers_whatever_their_type():
    """Protects the model's figures at large shapes: NumPy integer M and D, as int64, would
    wrap around past 2^63 (negative FLOPs for 1e10 x 1e10) and, as int32, past 2^31 with no
    warning; so M, D and itemsize are converted to Python ints first, and floats and bools are
    refused naming the argument."""
    big = cost.cost("fwd", np.int64(10**10), np.int64(10**10), np.int64(4))
    assert big == cost.cost("fwd", 10**10, 10**10, 4)
    assert type(big.flops) is int and type(big.reference_peak_bytes) is int
    assert big.flops == 9 * 10**20 + 5 * 10**10 and big.minimal_bytes == 8 * 10**20
    assert cost.flops("fwd", np.int32(2**20), np.int32(2**20)) == 9 * 2**40 + 5 * 2**20
    assert cost.minimal_bytes("bwd", np.int32(2**20), np.int32(2**20), 2) == 6 * 2**40
    for args, name in (((4096.0, 768, 4), "M"), ((4096, True, 4), "D"),
                       ((4096, 768, 4.0), "itemsize")):
        with pytest.raises(TypeError, match=f"{name} must be an integer"):
            cost.cost("fwd", *args)
    with pytest.raises(ValueError, match="M must be >= 0, got -1"):
        cost.flops("fwd", -1, 768)


def test_cost_command_refuses_a_shape_beyond_any_memory(capsys):
    """Protects `layernorm cost` from modelling what no computer holds: a shape whose x alone
    needs more than 2^60 bytes (1 EiB) in a dtype asked for is refused with one line naming
    --shape, the dtype and the bytes, exit status 2, not modelled as if it were a workload;
    2^60 bytes exactly is still modelled."""
    from layernorm.commands import cli
    from layernorm.commands import cost as command

    assert command.MAX_BYTES == 2**60
    for argv, dtype, nbytes in ((["--shape", "1000000000x1000000000"], "float32", "4e+18"),
                                (["--shape", "64x64", "--shape", "1073741824x536870912",
                                  "--dtype", "float16", "--dtype", "float64"], "float64",
                                 "4.61e+18")):
        assert cli.main(["cost", *argv]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1
        assert err.startswith("layernorm cost: error: argument --shape: ")
        assert f"needs {nbytes} bytes for x alone in {dtype}" in err and "2^60" in err
    assert cli.main(["cost", "--shape", "1073741824x536870912", "--dtype", "bfloat16"]) == 0
    assert "| 1073741824x536870912 | bfloat16 |" in capsys.readouterr().out
