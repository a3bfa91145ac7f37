"""``layernorm memory``: the bytes autograd keeps for the backward, torch's norms against
this package's default and memory-efficient modes.

Counted with ``torch.autograd.graph.saved_tensors_hooks`` (:mod:`layernorm.bench.memory`):
every storage once (a norm's y saved again by the Linear after it counts once), parameters
left out. Two workloads: one norm and the Linear reading its output, on x (M, D); and a
Llama-shaped decoder block (pre-norm attention and MLP, random weights from a transformers
config) as transformers builds it, with its norms swapped by ``replace_norms``, and swapped
with ``memory_efficient=True``. Exact counts, the same on every machine. ``--out`` saves them
as JSON.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from .._table import render
from ..bench.results import dumps
from . import count, shape, usage_error, writable
from .report import Section

__all__ = ["add_arguments", "measure", "report_section", "run"]

_DTYPES = ("float32", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", type=shape, default=(4096, 1024),
                        help="MxD of the one-norm workload (default 4096x1024)")
    parser.add_argument("--tokens", type=count, default=512,
                        help="tokens of the Llama-shaped block (default 512)")
    parser.add_argument("--hidden", type=count, default=1024,
                        help="the block's width D (default 1024; intermediate 2.75 D, "
                             "heads of 128)")
    parser.add_argument("--dtype", choices=_DTYPES, action="append",
                        help="dtype (repeatable; default float32 and bfloat16)")
    parser.add_argument("--out", type=Path, default=None, help="also save the counts as JSON")


def measure(m: int, d: int, tokens: int, hidden: int, dtypes: tuple[str, ...]) -> list[dict]:
    """One record per (workload, dtype, mode): bytes saved, in MB and in (M, D) activations."""
    import torch

    from ..bench import memory

    heads = max(1, hidden // 128)
    intermediate = 11 * hidden // 4
    rows = []
    for name in dtypes:
        dtype = getattr(torch, name)
        item = torch.empty(0, dtype=dtype).element_size()
        for workload, unit, run in (
            (f"LayerNorm + Linear, {m}x{d}", m * d * item,
             lambda mode, dt=dtype: memory.one_norm("layer", mode, m, d, dt)),
            (f"RMSNorm + Linear, {m}x{d}", m * d * item,
             lambda mode, dt=dtype: memory.one_norm("rms", mode, m, d, dt)),
            (f"Llama block, {tokens} tokens x {hidden}", tokens * hidden * item,
             lambda mode, dt=dtype: memory.block(mode, tokens, hidden, intermediate, heads,
                                                 dt)),
        ):
            for mode in memory.MODES:
                saved = run(mode)
                rows.append({"workload": workload, "dtype": name, "mode": mode,
                             "bytes": saved.total, "activation_bytes": unit,
                             "tensors": saved.tensors, "storages": saved.storages})
    return rows


def _table(rows: list[dict]) -> str:
    """The records as a Markdown table, each against torch's and the default mode's."""
    base = {(r["workload"], r["dtype"], r["mode"]): r["bytes"] for r in rows}
    out = []
    for r in rows:
        key = (r["workload"], r["dtype"])
        torch_b, default_b = base[(*key, "torch")], base[(*key, "layernorm")]
        out.append([r["workload"], r["dtype"], r["mode"], f"{r['bytes'] / 1e6:.2f}",
                    f"{r['bytes'] / r['activation_bytes']:.2f}",
                    f"{(torch_b - r['bytes']) / r['activation_bytes']:+.2f}",
                    f"{(default_b - r['bytes']) / r['activation_bytes']:+.2f}"])
    head = ["workload", "dtype", "norms", "saved MB", "in activations", "saved vs torch",
            "saved vs default"]
    return render(head, out, True)


def _args(args: argparse.Namespace) -> tuple:
    m, d = math.prod(args.shape[:-1]), args.shape[-1]
    return m, d, args.tokens, args.hidden, tuple(args.dtype or _DTYPES)


def run(args: argparse.Namespace) -> int:
    if args.out is not None and (problem := writable(args.out)) is not None:
        return usage_error("layernorm memory", f"argument --out: {problem}")
    if args.hidden < 128 or args.hidden % 128:
        return usage_error("layernorm memory",
                           f"argument --hidden: must be a multiple of 128, got {args.hidden}")
    rows = measure(*_args(args))
    print(_table(rows))
    print("\nin activations: bytes over one (M, D) activation of the workload's dtype; saved: "
          "against torch's norms and against this package's default mode.")
    if args.out is not None:
        args.out.write_text(dumps({"command": "layernorm memory", "rows": rows}))
        print(f"saved to {args.out}")
    return 0


def report_section(ctx: object) -> Section:
    rows = measure(1024 if ctx.quick else 4096, 1024, 256 if ctx.quick else 512, 1024,
                   _DTYPES)
    block = [r for r in rows if r["workload"].startswith("Llama") and r["dtype"] == "float32"]
    by = {r["mode"]: r for r in block}
    unit = by["torch"]["activation_bytes"]
    saved_default = (by["layernorm"]["bytes"] - by["layernorm, memory-efficient"]["bytes"]) / unit
    saved_torch = (by["torch"]["bytes"] - by["layernorm, memory-efficient"]["bytes"]) / unit
    headline = (f"memory-efficient mode keeps {saved_default:.2f} activations less per Llama "
                f"block than the default mode and {saved_torch:.2f} less than transformers' own "
                f"norms (float32; two norms a block, one (tokens, D) activation each)")
    import torch

    from ..bench import memory

    tokens = 256 if ctx.quick else 512
    times = memory.block_backward_times(tokens, 1024, 11 * 1024 // 4, 8, torch.float32)
    p50, p20, p80 = memory.ratio_spread(times["layernorm, memory-efficient"],
                                        times["layernorm"])
    cost = (f"its cost: the block's whole backward takes {p50:.2f}x the default mode's time "
            f"(p20-p80 {p20:.2f}-{p80:.2f} over {len(times['layernorm'])} interleaved rounds; "
            f"{tokens} tokens, float32, {torch.get_num_threads()} threads)")
    body = ("Bytes autograd keeps for the backward (`saved_tensors_hooks`, each storage once, "
            "parameters left out). Reproduce with `layernorm memory`; the backward's time per "
            "norm in both modes is in the CPU kernels' section (`fused-me`, "
            "`layernorm.torch-me`).\n\n" + _table(rows) + "\n\n" + cost[0].upper() + cost[1:]
            + ".\n")
    return Section([headline, cost[0].upper() + cost[1:] + "."], body, {})
