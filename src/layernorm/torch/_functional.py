"""The four functions of the PyTorch API: arguments checked and flattened once, then one op.

Signatures and semantics follow ``torch.nn.functional.layer_norm`` and ``rms_norm``: the norm
runs over the trailing ``normalized_shape`` axes (flattened to D), ``eps=None`` for RMSNorm
means ``torch.finfo(T).eps`` of the compute dtype T of the normalized tensor (float32 for
16- and 32-bit inputs, float64 for float64), and eps = 0 is allowed. Meta tensors give the
outputs' shapes and dtypes; a normalized size of 0 gives empty outputs, as torch's norms do.
Bad arguments raise ``TypeError`` (wrong kind: complex dtypes, nested or sparse layouts) or
``ValueError`` (wrong value) naming the argument.

``memory_efficient=True`` is a training-time choice: where a gradient is needed, the
forward's autograd keeps y (the norm's output, which the next layer keeps anyway), the
statistics and xhat of the few channels y cannot give back, instead of x (h for an add-norm),
so a norm followed by a Linear keeps one (M, D) activation less; the backward recovers xhat
from y (``layernorm::fwd_y``; :mod:`layernorm.recovery` has the rule and its error). Its
backward cannot be differentiated again (create_graph=True raises). Where no gradient is
needed (inference, ``torch.no_grad``) it changes nothing.

Leaving PyTorch (docs/export.md): during an ONNX export (either of torch's exporters) the
functions compute with torch's standard operations (``F.layer_norm``, ``F.rms_norm``, the add
and the casts of the ops' dtypes), which the exporters translate to standard ONNX operators;
torch.export and torch.compile see the layernorm ops; under ``torch.jit.trace`` the training
op ``fwd`` is recorded whatever the grad mode, and nothing of x's rank. Under tracing and
torch.export ``memory_efficient`` is not applied: they record ``fwd``, as without it.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import sys
import warnings
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validate import check_eps
from . import _transforms
from ._dtypes import compute_dtype
from ._ops import fwd, fwd_y, norm, wide_residual_warning

__all__ = ["add_layer_norm", "add_rms_norm", "layer_norm", "rms_norm"]

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT_NAMES = "float16, bfloat16, float32 or float64"

# Autocast: torch runs layer_norm in float32 under CUDA autocast (its output is float32) and
# leaves rms_norm, and both norms on the CPU, in the input's dtype. (device type, centred) ->
# the dtype the norm's inputs are cast to under autocast; absent: no cast.
AUTOCAST = {("cuda", True): torch.float32}


def _check_tensor(t: object, name: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOATS:
        raise TypeError(f"{name} must have dtype {_FLOAT_NAMES}, got {t.dtype}"
                        + (" (complex tensors are not supported)" if t.is_complex() else ""))
    return t


def _check_layout(t: Tensor, name: str) -> None:
    if t.layout is not torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}: "
                        f"nested and sparse tensors are not supported")


def _check_device(x: Tensor, name: str) -> None:
    _check_layout(x, name)
    if not (x.is_cpu or x.is_cuda or x.is_meta):
        raise ValueError(f"{name} must be on a CPU, CUDA or meta device, got {x.device}")


def _normalized_shape(normalized_shape: object, x: Tensor, name: str) -> tuple[int, ...]:
    if type(normalized_shape) is int:  # the common cases first: they cost least to check
        shape = (normalized_shape,)
    elif type(normalized_shape) is tuple and len(normalized_shape) == 1 and type(
            normalized_shape[0]) is int:
        shape = normalized_shape
    elif type(normalized_shape) in (tuple, list, torch.Size) and all(
            type(d) is int for d in normalized_shape):
        shape = tuple(normalized_shape)
    else:
        scalar = isinstance(normalized_shape, numbers.Integral) and not isinstance(
            normalized_shape, bool)
        dims = (normalized_shape,) if scalar else normalized_shape
        if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or not all(
            isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in dims
        ):
            raise TypeError(
                f"normalized_shape must be an int or a sequence of ints, got "
                f"{normalized_shape!r}")
        shape = tuple(int(d) for d in dims)
    if not shape or min(shape) < 0:
        raise ValueError(
            f"normalized_shape must be non-empty with every size >= 0, got {shape}")
    if len(shape) == 1 and x.dim() >= 1 and x.shape[-1] == shape[0]:
        return shape
    if x.dim() < len(shape) or x.shape[x.dim() - len(shape):] != shape:
        raise ValueError(
            f"normalized_shape {shape} must equal the trailing axes of {name}, got {name} of "
            f"shape {tuple(x.shape)}")
    return shape


def _check_param(p: object, name: str, shape: tuple[int, ...], x: Tensor) -> Tensor | None:
    """``p``, of shape ``shape``, or None."""
    if p is None:
        return None
    p = _check_tensor(p, name)
    _check_layout(p, name)
    if p.shape != shape:
        raise ValueError(f"{name} must have shape normalized_shape = {shape}, got "
                         f"{tuple(p.shape)}")
    if p.device != x.device:
        raise ValueError(f"{name} must be on the input's device {x.device}, got {p.device}")
    return p


def default_eps(dtype: torch.dtype) -> float:
    """RMSNorm's eps for ``eps=None``, torch's rule: the machine epsilon of the compute dtype
    of a tensor of ``dtype`` (float32's for 16- and 32-bit dtypes, float64's for float64)."""
    return float(torch.finfo(compute_dtype(dtype)).eps)


def _check_eps(eps: object, dtype: torch.dtype) -> float:
    """eps by the one rule (:func:`layernorm._validate.check_eps`), None meaning the norm's
    default for ``dtype``."""
    if type(eps) is float and 0.0 <= eps < math.inf:  # the rule's common case (NaN fails it)
        return eps
    if eps is None:
        return default_eps(dtype)
    return check_eps(eps)


def _check_flag(flag: object, name: str) -> bool:
    if not isinstance(flag, bool):
        raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    return flag


def _checked(x: object, residual: object, normalized_shape: object, weight: object,
             bias: object, eps: object, zero_centered_gamma: object, residual_dtype: object,
             memory_efficient: object, x_name: str) -> tuple:
    """The arguments checked: (x, residual, shape, weight, bias, eps, zero_centered_gamma,
    h_dtype, memory_efficient), h_dtype None without a residual. Reads sizes and records
    nothing."""
    x = _check_tensor(x, x_name)
    _check_device(x, x_name)
    shape = _normalized_shape(normalized_shape, x, x_name)
    h_dtype = None
    if residual is not None:
        residual = _check_tensor(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got "
                             f"{tuple(residual.shape)}")
        _check_device(residual, "residual")
        if residual.device != x.device:
            raise ValueError(f"residual must be on x's device {x.device}, got "
                             f"{residual.device}")
        if residual_dtype is not None and residual_dtype not in FLOATS:
            raise TypeError(f"residual_dtype must be None or one of torch.{_FLOAT_NAMES}, got "
                            f"{residual_dtype!r}")
        h_dtype = x.dtype if residual_dtype is None else residual_dtype
    weight = _check_param(weight, "weight", shape, x)
    bias = _check_param(bias, "bias", shape, x)
    eps = _check_eps(eps, h_dtype or x.dtype)
    zero_centered_gamma = _check_flag(zero_centered_gamma, "zero_centered_gamma")
    memory_efficient = _check_flag(memory_efficient, "memory_efficient")
    return x, residual, shape, weight, bias, eps, zero_centered_gamma, h_dtype, memory_efficient


# How a call learns that it is being traced or exported, looked up once. torch.compiler's
# is_exporting arrived in torch 2.6: before it, no export is recognised (and the dynamo ONNX
# exporter meets our ops, which it cannot translate: docs/export.md). The tracing state is a
# torch internal, read and paused where it exists.
_get_tracing_state = getattr(torch._C, "_get_tracing_state", None)
_set_tracing_state = getattr(torch._C, "_set_tracing_state", None)
_is_exporting = getattr(torch.compiler, "is_exporting", None) or (lambda: False)
_is_compiling = torch.compiler.is_compiling
# None unless a trace is running (called on every call: the C function where there is one)
_tracing_state = _get_tracing_state or (lambda: True if torch.jit.is_tracing() else None)


def _onnx_exporting() -> bool:
    """An ONNX exporter is running. Dynamo's strict capture folds ``is_in_onnx_export()`` to
    False, so the dynamo exporter's own flag is read too (a module global, which dynamo reads as
    it is); imported here, on the rare calls that ask."""
    if torch.onnx.is_in_onnx_export():
        return True
    try:
        from torch.onnx._internal.exporter import _flags
    except ImportError:
        return False
    return bool(getattr(_flags, "_is_onnx_exporting", False))


@contextlib.contextmanager
def _trace_paused() -> Iterator[None]:
    # torch.jit.trace hands out sizes as tensors, so every check of one would warn that the
    # trace "might not generalize"; the checks record nothing the graph needs
    if _get_tracing_state is None or _set_tracing_state is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            yield
        return
    state = _get_tracing_state()
    _set_tracing_state(None)
    try:
        yield
    finally:
        _set_tracing_state(state)


def _traced_sizes(shape: object) -> object:
    """``shape`` with the sizes a trace hands out (``x.shape[-1]``: 0-d integer tensors) as
    the ints they hold; anything else as it is, for the checks to judge."""
    def size(d: object) -> object:
        if isinstance(d, Tensor) and d.dim() == 0 and not d.is_floating_point():
            return int(d)
        return d

    if isinstance(shape, (tuple, list)):
        return tuple(size(d) for d in shape)
    return size(shape)


def _to(t: Tensor, dtype: torch.dtype) -> Tensor:
    # a trace records even a cast to the same dtype (an ONNX Cast): none is asked for
    return t if t.dtype == dtype else t.to(dtype)


def _standard(centred: bool, x: Tensor, residual: Tensor | None, shape: tuple[int, ...],
              weight: Tensor | None, bias: Tensor | None, eps: float,
              zero_centered_gamma: bool, h_dtype: torch.dtype | None, rms_decomposed: bool,
              ) -> tuple[Tensor, Tensor | None]:
    """(y, h) as the ops define them, from torch's standard operations: what the ONNX
    exporters translate (to Add, Cast, LayerNormalization and RMSNormalization).

    The same dtypes as the kernels: h = x + residual formed in the widest compute dtype of the
    three and rounded to ``h_dtype``; the norm of x (or h as rounded) in its compute dtype,
    with the scale (1 + weight when zero-centred) and bias in it; y rounded to x's dtype.
    ``rms_decomposed``: RMSNorm as x·rsqrt(mean(x²) + eps)·scale, for the TorchScript-based
    exporter, which has no translation of ``aten::rms_norm``.
    """
    h = None
    if residual is not None:
        wide = compute_dtype(x.dtype, residual.dtype, h_dtype)
        h = _to(_to(x, wide) + _to(residual, wide), h_dtype)
    src = x if h is None else h
    cdt = compute_dtype(src.dtype)
    v = _to(src, cdt)
    scale = None if weight is None else _to(weight, cdt)
    if scale is not None and zero_centered_gamma:
        scale = scale + 1
    if centred:
        y = F.layer_norm(v, shape, scale, None if bias is None else _to(bias, cdt), eps)
    elif rms_decomposed:
        axes = tuple(range(-len(shape), 0))
        y = v * torch.rsqrt(v.square().mean(axes, keepdim=True) + eps)
        y = y if scale is None else y * scale
    else:
        y = F.rms_norm(v, shape, scale, eps)
    return _to(y, x.dtype), h


def _refuse_dtensors(x_name: str, x: Tensor, residual: Tensor | None, weight: Tensor | None,
                     bias: Tensor | None) -> None:
    """ValueError naming the first DTensor among the arguments: the memory-efficient op has no
    sharding strategy (which channels and rows it keeps are data-dependent sizes, which
    DTensor's propagation cannot shape). No DTensor exists before DTensor is imported."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return
    for name, t in ((x_name, x), ("residual", residual), ("weight", weight), ("bias", bias)):
        if isinstance(t, dtensor):
            raise ValueError(f"layernorm: memory_efficient=True does not support DTensor "
                             f"inputs ({name} is a DTensor); use memory_efficient=False, "
                             f"whose ops DTensor shards by rows")


def _norm(centred: bool, x: object, residual: object, normalized_shape: object,
          weight: object, bias: object, eps: object, zero_centered_gamma: object,
          residual_dtype: object, memory_efficient: object, x_name: str,
          ) -> tuple[Tensor, Tensor | None]:
    """(y, h) of the family member (centred, residual given), h None for a plain norm."""
    tracing = _tracing_state() is not None
    if tracing:
        with _trace_paused():
            checked = _checked(x, residual, _traced_sizes(normalized_shape), weight, bias, eps,
                               zero_centered_gamma, residual_dtype, memory_efficient, x_name)
    else:
        checked = _checked(x, residual, normalized_shape, weight, bias, eps,
                           zero_centered_gamma, residual_dtype, memory_efficient, x_name)
    x, residual, shape, weight, bias, eps, zero_centered_gamma, h_dtype, me = checked
    add = residual is not None

    if x.is_cuda:
        cast = AUTOCAST.get(("cuda", centred))
        if cast is not None and torch.is_autocast_enabled("cuda"):
            x, weight, bias = (None if t is None else t.to(cast) for t in (x, weight, bias))

    # An ONNX exporter (the TorchScript one traces, the dynamo one exports) translates torch's
    # standard operations, and knows nothing of the layernorm ops: it is given those.
    if (tracing or _is_exporting()) and _onnx_exporting():
        return _standard(centred, x, residual, shape, weight, bias, eps, zero_centered_gamma,
                         h_dtype, rms_decomposed=tracing)

    # Nothing to normalize: torch's norms give the empty outputs and gradients. Under
    # torch.compile inside a torch.func transform or forward AD (Dynamo refuses the transforms'
    # Function, and the ops' autograd has no jvp or batching rule): torch's standard operations,
    # which Dynamo differentiates.
    transformed = _transforms.active()
    if 0 in shape or (transformed and _is_compiling()):
        return _standard(centred, x, residual, shape, weight, bias, eps, zero_centered_gamma,
                         h_dtype, rms_decomposed=False)

    # The ops normalize the last axis of a tensor of any rank. A normalized_shape of several
    # axes is flattened to one, and a tensor subclass (a DTensor) to (M, D): its sharding
    # strategies know rows as the first axis. view_as keeps a trace free of x's rank.
    flat = len(shape) > 1 or type(x) is not Tensor
    x2, r2 = x, residual
    if flat:
        d = math.prod(shape)
        x2 = x.reshape(-1, d)  # (M, D): a view when the strides allow it
        r2 = residual.reshape(-1, d) if add else None
        if len(shape) > 1:
            weight, bias = (None if p is None else p.reshape(-1) for p in (weight, bias))
    if transformed:  # torch.func or forward AD, eager: the Function with jvp and vmap
        y, h = _transforms.apply(x2, r2, weight, bias, eps, centred, zero_centered_gamma,
                                 h_dtype)
    # a trace records one op for every grad mode: fwd, which autograd differentiates
    elif tracing or (torch.is_grad_enabled() and (
            x.requires_grad or (add and residual.requires_grad)
            or (weight is not None and weight.requires_grad)
            or (bias is not None and bias.requires_grad))):
        # autograd keeps y instead of x or h (on meta tensors, which have no values to keep
        # channels and rows by, the default mode gives the same shapes)
        if me and not tracing and not _is_exporting() and not x.is_meta:
            _refuse_dtensors(x_name, x, residual, weight, bias)
            wide = add and wide_residual_warning(x.dtype, h_dtype)
            if wide:
                warnings.warn(wide, UserWarning, stacklevel=3)
            y, h, *_kept = fwd_y(x2, r2, weight, bias, eps, centred, zero_centered_gamma,
                                 h_dtype)
        else:
            y, h, _s0, _s1 = fwd(x2, r2, weight, bias, eps, centred, zero_centered_gamma,
                                 h_dtype)
    else:  # nothing to differentiate: no statistics are computed or kept
        y, h = norm(x2, r2, weight, bias, eps, centred, zero_centered_gamma, h_dtype)
    if flat:
        y, h = y.view_as(x), h.view_as(x) if add else h
    return y, h if add else None


def layer_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    zero_centered_gamma: bool = False,
    memory_efficient: bool = False,
) -> Tensor:
    """Layer norm over the trailing ``normalized_shape`` axes: ``F.layer_norm``, fused.

    Args:
        input: (..., *normalized_shape) float16, bfloat16, float32 or float64, on the CPU
            (the C++ engine) or a CUDA device (Triton kernels).
        normalized_shape: the trailing shape normalized over, flattened to D = prod(shape).
        weight, bias: normalized_shape-shaped scale and shift, or None, any float dtype; their
            gradients come back in their own dtype.
        eps: a finite number >= 0 added to the variance.
        zero_centered_gamma: the scale is 1 + weight (formed in the compute dtype).
        memory_efficient: in training, autograd keeps y (which the next layer keeps anyway)
            and not input; the backward recovers xhat from y. It cannot be differentiated
            again (create_graph=True raises); without a gradient it changes nothing.

    Returns:
        y with input's shape and dtype (float32 under CUDA autocast, as torch's layer_norm).
    """
    return _norm(True, input, None, normalized_shape, weight, bias, eps, zero_centered_gamma,
                 None, memory_efficient, "input")[0]


def rms_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    zero_centered_gamma: bool = False,
    memory_efficient: bool = False,
) -> Tensor:
    """RMS norm over the trailing ``normalized_shape`` axes: ``F.rms_norm``, fused.

    y = scale·x/sqrt(mean(x²) + eps); eps None means ``torch.finfo(T).eps`` of the compute
    dtype T (float32 for 16- and 32-bit input, float64 for float64), as torch's. Other
    arguments and the result as for :func:`layer_norm`, without bias (and input's dtype under
    autocast, as torch's rms_norm).
    """
    return _norm(False, input, None, normalized_shape, weight, None, eps, zero_centered_gamma,
                 None, memory_efficient, "input")[0]


def add_layer_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    residual_dtype: torch.dtype | None = None,
    zero_centered_gamma: bool = False,
    memory_efficient: bool = False,
) -> tuple[Tensor, Tensor]:
    """The residual add and the layer norm of its result, fused: h = x + residual, y = LN(h).

    Args:
        x: a sublayer's output (..., *normalized_shape), any float dtype.
        residual: the residual stream, x's shape, any float dtype.
        residual_dtype: h's dtype (default x's dtype); float32 keeps the residual stream in
            float32 with bfloat16 activations. h is x + residual formed in the widest compute
            dtype of x, residual and h, rounded once; the norm is of h as rounded.
        normalized_shape, weight, bias, eps, zero_centered_gamma: as for :func:`layer_norm`.
        memory_efficient: as for :func:`layer_norm`: autograd keeps y, not h.

    Returns:
        y (x's shape and dtype) and h (x's shape, residual_dtype): the next block's residual.
        Gradients reach x and residual as dh + the norm's gradient.
    """
    y, h = _norm(True, x, residual, normalized_shape, weight, bias, eps, zero_centered_gamma,
                 residual_dtype, memory_efficient, "x")
    return y, h


def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    residual_dtype: torch.dtype | None = None,
    zero_centered_gamma: bool = False,
    memory_efficient: bool = False,
) -> tuple[Tensor, Tensor]:
    """The residual add and the RMS norm of its result, fused: h = x + residual, y = RMS(h).

    As :func:`add_layer_norm` without bias; eps None means ``torch.finfo(T).eps`` of h's
    compute dtype T, as :func:`rms_norm`.
    """
    y, h = _norm(False, x, residual, normalized_shape, weight, None, eps, zero_centered_gamma,
                 residual_dtype, memory_efficient, "x")
    return y, h
