"""``replace_norms``: a model's norm modules swapped for ours, in place, in one call.

The classes swapped, and how (exact classes only: a subclass may compute something else):

| class (exact)                                     | becomes   | eps from         | scale      |
|---------------------------------------------------|-----------|------------------|------------|
| torch.nn.LayerNorm                                | LayerNorm | eps              | weight     |
| torch.nn.RMSNorm                                  | RMSNorm   | eps (None stays) | weight     |
| transformers' LlamaRMSNorm, Qwen2RMSNorm,         | RMSNorm   | variance_epsilon | weight     |
|   Qwen3RMSNorm, MistralRMSNorm                    |           |                  |            |
| transformers' GemmaRMSNorm, Gemma2RMSNorm,        | RMSNorm   | eps              | 1 + weight |
|   Gemma3RMSNorm                                   |           |                  |            |

transformers' classes are recognised by their defining module and name
(``transformers.models.llama.modeling_llama.LlamaRMSNorm``), so transformers is never
imported here and a class absent from the installed version is simply never met.

Rounding against each original (ours: statistics in float32 for half inputs, the scale formed
in the compute dtype, y rounded once to the input's dtype):
- torch's modules: the same maths and roundings; results agree to the "out" tolerances.
- Llama, Qwen2, Qwen3, Mistral: compute in float32, round x·rstd to the input's dtype, then
  multiply by the weight in the promoted dtype of weight and input: two roundings where ours
  has one, so half results may differ by about one ulp (inside the float16 and bfloat16 "out"
  tolerances of :mod:`layernorm.tolerances`). With a float32 weight and a half input they
  return float32; ours returns the input's dtype.
- Gemma, Gemma2, Gemma3: compute in float32 and round (x·rstd·(1 + weight)) once, as ours.
- float64 inputs: transformers' classes compute in float32, ours in float64 (more exact).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ._modules import LayerNorm, RMSNorm

__all__ = ["replace_norms"]


@dataclass(frozen=True)
class _Known:
    """How instances of one known class become ours."""

    ours: type[LayerNorm] | type[RMSNorm]
    eps: str  # the attribute holding eps
    zero_centered_gamma: bool  # the class's scale is 1 + weight
    params: frozenset[str]  # the parameters (some may be None) an instance holds


def _key(cls: type) -> tuple[str, str]:
    return cls.__module__, cls.__qualname__


def _hf(model: str, prefix: str) -> tuple[str, str]:
    return f"transformers.models.{model}.modeling_{model}", f"{prefix}RMSNorm"


_LN, _W = frozenset({"weight", "bias"}), frozenset({"weight"})
_KNOWN: dict[tuple[str, str], _Known] = {
    _key(torch.nn.LayerNorm): _Known(LayerNorm, "eps", False, _LN),
    _key(torch.nn.RMSNorm): _Known(RMSNorm, "eps", False, _W),
    **{_hf(m, p): _Known(RMSNorm, "variance_epsilon", False, _W)
       for m, p in [("llama", "Llama"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"),
                    ("mistral", "Mistral")]},
    **{_hf(m, p): _Known(RMSNorm, "eps", True, _W)
       for m, p in [("gemma", "Gemma"), ("gemma2", "Gemma2"), ("gemma3", "Gemma3")]},
}

# Per-instance behaviour a swap would drop: the hooks torch keeps on each module.
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
          "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
          "_load_state_dict_post_hooks")


def _why_kept(old: torch.nn.Module, known: _Known) -> str | None:
    """Why ``old``, of a known class, is not swapped (None: it is): what it carries beyond its
    class (hooks, its own forward, extra tensors or submodules) would be lost or changed."""
    if any(getattr(old, h, None) for h in _HOOKS):
        return "it has hooks"
    if "forward" in vars(old):
        return "its forward is replaced on the instance"
    if set(old._parameters) != known.params or old._buffers or old._modules:
        return "it holds parameters, buffers or submodules beyond its class's"
    return None


def _ours(old: torch.nn.Module, known: _Known) -> LayerNorm | RMSNorm:
    """Our module in ``old``'s place: its eps and training mode, its very Parameter objects
    (so their device, dtype, values, gradients and optimizer state go with them)."""
    eps = getattr(old, known.eps)
    if known.ours is LayerNorm:
        # built on the meta device: its own parameters are replaced at once, never allocated
        new = LayerNorm(old.normalized_shape, eps, old.elementwise_affine,
                        bias=old.bias is not None, device="meta")
    else:
        shape = getattr(old, "normalized_shape", None) or tuple(old.weight.shape)
        new = RMSNorm(shape, eps, old.weight is not None, device="meta",
                      zero_centered_gamma=known.zero_centered_gamma)
    for name in known.params:
        setattr(new, name, old._parameters[name])
    return new.train(old.training)


def replace_norms(model: torch.nn.Module) -> int:
    """Swap every norm of ``model`` of a known class for :class:`LayerNorm` or
    :class:`RMSNorm`, in place, and return how many modules were swapped.

    Known classes (exact classes, subclasses are left alone): ``torch.nn.LayerNorm``,
    ``torch.nn.RMSNorm``, and transformers' ``LlamaRMSNorm``, ``Qwen2RMSNorm``,
    ``Qwen3RMSNorm``, ``MistralRMSNorm`` (eps from ``variance_epsilon``) and ``GemmaRMSNorm``,
    ``Gemma2RMSNorm``, ``Gemma3RMSNorm`` (eps from ``eps``; their scale is 1 + weight, so
    ours get ``zero_centered_gamma=True``). The module docstring compares their roundings.

    Each new module keeps the old one's Parameter objects (``new.weight is old.weight``), eps
    and training mode, so the state dict keys, an optimizer built before the swap and
    ``isinstance(m, torch.nn.LayerNorm)`` all hold as before. A module reached from several
    parents is swapped once, by one module, everywhere. Our own modules are not swapped again,
    so a second call returns 0. A known module carrying hooks, a forward set on the instance,
    or extra parameters, buffers or submodules is left in place, with one warning naming each.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: ``model`` is itself a norm of a known class (it cannot be swapped in place:
            build ours directly, or swap inside a container).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if _key(type(model)) in _KNOWN:
        raise ValueError(f"model is itself a {type(model).__qualname__}, which cannot be "
                         "swapped in place: build layernorm.torch's module directly, or call "
                         "replace_norms on a model that contains it")
    # collect first: the tree is changed only after it has been walked
    sites = [(path, parent, name, child) for path, parent in model.named_modules()
             for name, child in parent._modules.items()
             if child is not None and _key(type(child)) in _KNOWN]
    swapped: dict[int, torch.nn.Module] = {}
    kept: dict[int, str] = {}
    for path, parent, name, old in sites:
        if id(old) not in swapped:
            known = _KNOWN[_key(type(old))]
            why = _why_kept(old, known)
            if why is not None:
                kept.setdefault(id(old), f"{path + '.' if path else ''}{name} "
                                         f"({type(old).__qualname__}: {why})")
                continue
            swapped[id(old)] = _ours(old, known)
        setattr(parent, name, swapped[id(old)])
    if kept:
        warnings.warn(f"replace_norms left {len(kept)} norm module(s) in place: "
                      + "; ".join(kept.values()), stacklevel=2)
    return len(swapped)
