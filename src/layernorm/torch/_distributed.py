"""How the ops shard: DTensor runs ``layernorm::fwd``, ``norm`` and ``bwd`` on each rank's rows.

Every output row of the family depends on its own input row alone, and the parameters'
gradients are sums over rows. So with x (and residual, dy, dh, the statistics) split by rows,
each rank runs the fused kernels on its own rows with the whole weight and bias, and

* y, h, the statistics, dx and dresidual come out split by rows as their inputs were;
* dweight and dbias come out as each rank's sums over its own rows, ``Partial("sum")``, which
  DTensor reduces (all-reduce or reduce-scatter) where something needs the total.

That is sequence parallelism without a gather of x. The strategies, per mesh dimension, with R
a split of the rows (``Shard(0)``, or the ``_StridedShard`` of dim 0 that flattening a
(B, S, D) tensor split along S gives):

    fwd  rows:       x, residual R; weight, bias Replicate   -> y, h, stats0, stats1 R
    norm rows:       as fwd                                   -> y, h R
         replicated: everything Replicate
    bwd  rows:       dy, dh, xn, stats0, stats1 R; weight, bias Replicate
                     -> dx, dresidual R; dweight, dbias Partial()
         replicated: everything Replicate

An absent tensor argument (None) takes no placement; an absent output (the empty (0,) h of a
plain norm, dresidual, dweight or dbias) is Replicate. DTensor picks the strategy that moves
the fewest bytes and redistributes the inputs to it: x split by rows stays where it is, a
replicated x stays replicated, a Partial x is reduce-scattered to rows, and an x split along
D is gathered (the norm needs whole rows).

DTensor is imported by those who use it and takes a second or two to import, so importing this
module (which :mod:`layernorm.torch` does) registers the strategies at once only where
``torch.distributed.tensor`` is already imported, and otherwise the moment it is; where torch
has no ``torch.distributed`` it does nothing. A registration that fails warns instead of
failing the import it happens in.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

import torch

from . import _ops  # noqa: F401 - the ops exist before their strategies are registered

__all__ = ["register"]

_DTENSOR = "torch.distributed.tensor"


def register() -> bool:
    """Register the ops' sharding strategies with DTensor (again: replaces them). False, with
    nothing registered, where this torch lacks the pieces (``register_sharding`` of
    ``torch.distributed.tensor.experimental``, or ``_StridedShard``): DTensor inputs then raise
    DTensor's own error naming the op."""
    try:
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor.experimental import register_sharding
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return False

    rep = Replicate()

    def given(arg: object, placement: object) -> object:
        return None if arg is None else placement  # an absent tensor takes no placement

    def row_placements(spec: object) -> list[object]:
        # A split of the rows, or Replicate; those the input has first. DTensor takes the first
        # strategy of least cost, and its costs tie: it prices a move from Replicate (a local
        # slice) at 0, and one from _StridedShard too (though that one gathers). In a tie the
        # input's own placement must win, or e.g. a strided xn with a replicated dy would go
        # to Shard(0) through a gather of xn and both statistics.
        own = [p for p in spec.placements
               if p == rep or (isinstance(p, (Shard, _StridedShard)) and p.dim == 0)]
        return list(dict.fromkeys([*own, Shard(0), rep]))

    @register_sharding(torch.ops.layernorm.fwd.default)
    def fwd_strategies(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype):
        """[(outputs y, h, stats0, stats1), (inputs x, residual, weight, bias)] per strategy."""
        return [([r, rep if residual is None else r, r, r],
                 [r, given(residual, r), given(weight, rep), given(bias, rep)])
                for r in row_placements(x)]

    @register_sharding(torch.ops.layernorm.norm.default)
    def norm_strategies(x, residual, weight, bias, eps, centred, zero_centered_gamma, h_dtype):
        """[(outputs y, h), (inputs x, residual, weight, bias)] per strategy."""
        return [([r, rep if residual is None else r],
                 [r, given(residual, r), given(weight, rep), given(bias, rep)])
                for r in row_placements(x)]

    @register_sharding(torch.ops.layernorm.bwd.default)
    def bwd_strategies(dy, dh, xn, weight, bias, stats0, stats1, centred, zero_centered_gamma,
                       x_dtype, residual_dtype):
        """[(outputs dx, dresidual, dweight, dbias), (inputs dy, dh, xn, weight, bias, stats0,
        stats1)] per strategy; the rows follow xn's (the forward's) placement."""
        strategies = []
        for r in row_placements(xn):
            total = rep if r == rep else Partial()  # each rank's sum over its own rows
            strategies.append((
                [r, rep if residual_dtype is None else r, rep if weight is None else total,
                 rep if bias is None else total],
                [r, given(dh, r), r, given(weight, rep), given(bias, rep), r, r],
            ))
        return strategies

    return True


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands the import of ``torch.distributed.tensor`` to the finders
    after it, and has the module's loader call :func:`register` once the module has run."""

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None):
        if fullname != _DTENSOR:
            return None
        sys.meta_path.remove(self)  # once, and not for the lookup below
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_and_register(module: ModuleType) -> None:
                exec_module(module)
                _register_or_warn()

            spec.loader.exec_module = exec_and_register
        return spec


def _register_or_warn() -> None:
    """:func:`register`, from inside an import: a failure (a DTensor API this module does not
    know) must not fail importing torch.distributed.tensor or layernorm.torch."""
    try:
        register()
    except Exception as exc:  # reported here; DTensor raises on use
        warnings.warn(f"layernorm.torch could not register how DTensor shards its ops "
                      f"({exc!r}); its functions will raise on DTensor inputs",
                      RuntimeWarning, stacklevel=2)


if torch.distributed.is_available():
    if _DTENSOR in sys.modules:
        _register_or_warn()
    else:
        sys.meta_path.insert(0, _RegisterOnImport())
