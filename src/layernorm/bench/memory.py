"""What autograd keeps for the backward, measured: torch's norms against this package's, in
the default and the memory-efficient mode.

Every tensor autograd saves during a forward passes through
``torch.autograd.graph.saved_tensors_hooks``; :func:`saved_bytes` records each one's storage
and counts every storage once (y saved by the norm and again by the Linear after it is one
storage), leaving out the model's parameters (kept whether or not anything trains). Two
workloads:

* one norm and the Linear that reads its output, on x (M, D): the norm's own cost beside
  what its consumer keeps;
* a Llama-shaped decoder block built from a ``transformers`` config with random weights
  (pre-norm attention and MLP, two RMSNorms), as the model has it (``torch``: transformers'
  own RMSNorm), with its norms swapped by ``replace_norms``, and swapped with
  ``memory_efficient=True``.

Sizes are counted, not timed: the figures are exact and the same on every machine.
:func:`block_backward_times` times the block's backward in the two modes of this package,
interleaved round by round, for what the memory-efficient mode costs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["MODES", "Saved", "block", "block_backward_times", "one_norm", "ratio_spread",
           "saved_bytes"]

MODES = ("torch", "layernorm", "layernorm, memory-efficient")


@dataclass(frozen=True)
class Saved:
    """The bytes autograd keeps: ``total`` over distinct storages, ``tensors`` how many
    tensors were saved, ``storages`` how many distinct storages they live in."""

    total: int
    tensors: int
    storages: int


def saved_bytes(forward: Callable[[], torch.Tensor], exclude: tuple[torch.Tensor, ...] = ()
                ) -> Saved:
    """Run ``forward`` (which returns the loss's input, kept alive until the count is made)
    and count the storages autograd saves for its backward, each once, leaving out those of
    ``exclude`` (the parameters)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return Saved(sum(seen.values()), count, len(seen))


def _norm_module(kind: str, mode: str, d: int, dtype: torch.dtype) -> torch.nn.Module:
    """A LayerNorm (``kind="layer"``) or RMSNorm of ``mode``: torch's own or this package's."""
    import layernorm.torch as lt

    if mode == "torch":
        cls = torch.nn.LayerNorm if kind == "layer" else torch.nn.RMSNorm
        return cls(d, dtype=dtype)
    cls = lt.LayerNorm if kind == "layer" else lt.RMSNorm
    return cls(d, dtype=dtype, memory_efficient=mode.endswith("memory-efficient"))


def one_norm(kind: str, mode: str, m: int, d: int, dtype: torch.dtype) -> Saved:
    """Bytes saved by ``norm(x)`` followed by a Linear (D -> D) on x (M, D) of ``dtype``."""
    torch.manual_seed(0)
    norm = _norm_module(kind, mode, d, dtype)
    linear = torch.nn.Linear(d, d, bias=False, dtype=dtype)
    x = torch.randn(m, d, dtype=dtype, requires_grad=True)
    params = (*norm.parameters(), *linear.parameters())
    return saved_bytes(lambda: linear(norm(x)), params)


def _llama_config(d: int, intermediate: int, heads: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=d, intermediate_size=intermediate, num_attention_heads=heads,
                       num_key_value_heads=heads, num_hidden_layers=1, vocab_size=32,
                       attn_implementation="sdpa")


def _block(mode: str, tokens: int, d: int, intermediate: int, heads: int, dtype: torch.dtype
           ) -> tuple[Callable[[], torch.Tensor], torch.nn.Module, torch.Tensor]:
    """The forward of one Llama decoder block of ``mode`` on ``tokens`` random tokens, the
    block and its input."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    import layernorm.torch as lt

    torch.manual_seed(0)
    config = _llama_config(d, intermediate, heads)
    layer = LlamaDecoderLayer(config, layer_idx=0).to(dtype)
    if mode != "torch":
        lt.replace_norms(layer, memory_efficient=mode.endswith("memory-efficient"))
    rope = LlamaRotaryEmbedding(config)
    x = torch.randn(1, tokens, d, dtype=dtype, requires_grad=True)
    positions = torch.arange(tokens)[None]
    with torch.no_grad():
        cos, sin = rope(x, positions)

    def forward() -> torch.Tensor:
        return layer(x, position_ids=positions, position_embeddings=(cos, sin))

    return forward, layer, x


def block(mode: str, tokens: int, d: int, intermediate: int, heads: int,
          dtype: torch.dtype) -> Saved:
    """Bytes saved by one Llama decoder block on ``tokens`` tokens of width ``d``."""
    forward, layer, _ = _block(mode, tokens, d, intermediate, heads, dtype)
    return saved_bytes(forward, tuple(layer.parameters()))


def block_backward_times(tokens: int, d: int, intermediate: int, heads: int,
                         dtype: torch.dtype, rounds: int = 7) -> dict[str, list[float]]:
    """Seconds of the block's whole backward (one kept graph, ``retain_graph``) in this
    package's two modes, one call of each per round, the modes alternating: mode -> times."""
    graphs = {}
    for mode in MODES[1:]:
        forward, layer, x = _block(mode, tokens, d, intermediate, heads, dtype)
        out = forward()
        graphs[mode] = (out, [x, *layer.parameters()], torch.randn_like(out))
    times: dict[str, list[float]] = {mode: [] for mode in graphs}
    for _ in range(rounds + 1):  # the first round warms up and is dropped
        for mode, (out, leaves, grad) in graphs.items():
            t0 = time.perf_counter()
            torch.autograd.grad(out, leaves, grad, retain_graph=True)
            times[mode].append(time.perf_counter() - t0)
    return {mode: ts[1:] for mode, ts in times.items()}


def ratio_spread(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """(p50, p20, p80) of the per-round ratios num/den."""
    import numpy as np

    r = np.array(num) / np.array(den)
    return float(statistics.median(r)), *(float(q) for q in np.percentile(r, [20, 80]))
