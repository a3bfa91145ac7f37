"""What a per-head weight costs: PerHeadLayerNorm against a plain weighted LayerNorm, CPU.

    python tools/per_head_cost.py [--tokens 1024] [--heads 32] [--head-dim 128]
                                  [--dtype float32] [--threads 2] [--rounds 9]

Cohere's query/key norms (``CohereLayerNorm`` with a (heads, head_dim) weight) become
``PerHeadLayerNorm`` under ``replace_norms``: the fused op normalizes each head's row without
weight, then a torch multiply applies the weight, one more elementwise pass (and its backward).
This times it on x of shape (tokens, heads, head_dim) against ``layernorm.torch.LayerNorm``
(head_dim,) without bias on the same x, the plain weighted norm of the same shape, and against
the original CohereLayerNorm where transformers is installed: forward under inference_mode, and
forward + backward (dx and dweight). Rounds are interleaved, each in a rotated order; prints
p50 ms of each and the per-round ratio per-head / plain (p50, p20-p80). docs/models.md quotes it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch

import layernorm.torch as lt
from layernorm.bench.harness import interleaved, reps_for, set_threads
from layernorm.torch._modules import PerHeadLayerNorm


def _modules(heads: int, d: int, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """The norms timed, each with a random weight: ours per head, ours plain, the original."""
    torch.manual_seed(0)
    mods: dict[str, torch.nn.Module] = {"per-head": PerHeadLayerNorm((heads, d)),
                                        "plain": lt.LayerNorm(d, bias=False)}
    try:
        from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    except ImportError:
        pass
    else:
        mods["CohereLayerNorm"] = CohereLayerNorm((heads, d))
    with torch.no_grad():
        for m in mods.values():
            m.weight.copy_(torch.randn_like(m.weight))
    return {k: m.to(dtype) for k, m in mods.items()}


def _timed(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, np.ndarray]:
    """Seconds per call of each function, one figure per round: (rounds,) each. Each round
    runs every function in turn (a rotated order), enough calls for about 50 ms."""
    reps = {}
    for k, fn in fns.items():
        fn()  # warm: first-call work, pages faulted in
        reps[k] = reps_for(fn, 0.05)
    return {k: np.array(v) for k, v in interleaved(fns, reps, rounds, pause=0.0).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    set_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    mods = _modules(args.heads, args.head_dim, dtype)
    x = torch.randn(args.tokens, args.heads, args.head_dim).to(dtype)  # (T, H, D)
    dy = torch.randn_like(x)  # (T, H, D)
    xg = x.clone().requires_grad_()

    def forward(m: torch.nn.Module) -> Callable[[], object]:
        def fn() -> object:
            with torch.inference_mode():
                return m(x)
        return fn

    def training(m: torch.nn.Module) -> Callable[[], object]:
        return lambda: torch.autograd.grad(m(xg), [xg, m.weight], dy)

    print(f"x {tuple(x.shape)} {args.dtype}, {args.threads} threads, {args.rounds} rounds; "
          f"p50 ms per call\n")
    print(f"| pass | {' | '.join(mods)} | per-head / plain (p20-p80) |")
    print(f"|---|{'---|' * len(mods)}---|")
    for name, make in (("forward", forward), ("forward + backward", training)):
        t = _timed({k: make(m) for k, m in mods.items()}, args.rounds)
        lo, mid, hi = np.percentile(t["per-head"] / t["plain"], [20, 50, 80])
        cells = " | ".join(f"{np.median(v) * 1e3:.3g}" for v in t.values())
        print(f"| {name} | {cells} | {mid:.2f}x ({lo:.2f}-{hi:.2f}) |")


if __name__ == "__main__":
    main()
