"""Where the time of one small call goes: the parts of a decode-sized norm call, measured.

    python tools/call_cost.py [--d 4096] [--threads 2] [--out bench/results/call-cost.json]

Times, on one row of D float32 elements (1x1xD), each part of a call of ``layernorm.torch``
and of ``layernorm.cpu`` in isolation, beside ``torch.nn.functional.layer_norm``: the
median of 9 batches of 2000 calls each. A part's time is the difference of two calls that
differ by it (for example the op with D elements against the op with 64: the kernel's
arithmetic). Prints the table; ``--out`` saves it as JSON, from which
``python tools/doc_tables.py`` makes docs/cpu-kernels.md's table.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import layernorm.cpu as lnc
import layernorm.torch as lt
from layernorm.bench import doc_tables, results
from layernorm.bench.harness import batch
from layernorm.bench.machine import run_meta
from layernorm.torch import _functional, _ops

BATCHES = 9


def per_call_us(fn: Callable[[], object], n: int = 2000, batches: int = BATCHES) -> float:
    """Median over batches of the mean time of one call, in microseconds."""
    batch(fn, 200)  # warm
    return float(np.median([batch(fn, n) for _ in range(batches)])) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="save the table's figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    d = args.d
    x = torch.randn(1, 1, d)
    w, b = torch.randn(d), torch.randn(d)
    x64, w64, b64 = torch.randn(1, 64), torch.randn(64), torch.randn(64)
    xn = x.numpy().reshape(1, d)
    wn, bn = w.numpy(), b.numpy()
    xg = x.clone().requires_grad_()
    rows: list[tuple[str, float]] = []
    with torch.inference_mode():
        full = per_call_us(lambda: lt.layer_norm(x, d, w, b))
        op = per_call_us(lambda: _ops.norm(x, None, w, b, 1e-5, True, False, None))
        op64 = per_call_us(lambda: _ops.norm(x64, None, w64, b64, 1e-5, True, False, None))
        empty = per_call_us(lambda: torch.empty(1, 1, d))
        checks = per_call_us(lambda: (_functional._check_tensor(x, "input"),
                                      _functional._normalized_shape(d, x, "input"),
                                      _functional._check_param(w, "weight", (d,), x),
                                      _functional._check_param(b, "bias", (d,), x),
                                      _functional._check_eps(1e-5, x.dtype)))
        rows += [
            ("torch.nn.functional.layer_norm, whole call", per_call_us(
                lambda: F.layer_norm(x, (d,), w, b))),
            ("layernorm.torch.layer_norm, whole call (inference)", full),
            ("  Python: argument checks", checks),
            ("  Python: the rest of the wrapper (grad mode, flags, call)", full - op - checks),
            ("  the op through torch's dispatcher, whole", op),
            ("    dispatch, checks in C++, y allocated (the op on 64 elements)", op64),
            ("      of which torch.empty of y", empty),
            (f"    the kernel's arithmetic on {d} elements (op minus op on 64)", op - op64),
        ]
        theirs, ours = torch.nn.LayerNorm(d), lt.LayerNorm(d)
        rows += [
            ("torch.nn.LayerNorm, the module's whole call", per_call_us(lambda: theirs(x))),
            ("layernorm.torch.LayerNorm, the module's whole call (inference)",
             per_call_us(lambda: ours(x))),
        ]
    train = per_call_us(lambda: lt.layer_norm(xg, d, w, b), n=500)
    rows.append(("layernorm.torch.layer_norm, forward with autograd (x requires grad)", train))
    xt, wt, bt = (torch.from_numpy(a) for a in (xn.reshape(1, d), wn, bn))
    yt = torch.empty_like(xt)
    stats = torch.empty((1, 4), dtype=torch.float64)
    check = torch.empty(1, dtype=torch.uint64)
    into = torch.ops.layernorm_cpu.forward_into
    rows += [
        ("layernorm.cpu.layer_norm_forward, whole call", per_call_us(
            lambda: lnc.layer_norm_forward(xn, wn, bn), n=500)),
        ("  the engine's forward_into through torch's dispatcher (outputs given)", per_call_us(
            lambda: into(xt, None, wt, bt, 1e-5, True, yt, None, stats, check, 1 << 14))),
    ]
    result = {"meta": {**run_meta(), "d": d, "threads": args.threads, "batches": BATCHES},
              "rows": [{"part": name.lstrip(), "depth": (len(name) - len(name.lstrip())) // 2,
                        "us": us} for name, us in rows]}
    print(doc_tables.call_cost_table(result))
    if args.out is not None:
        print(f"\nsaved {results.save(result, args.out)}")


if __name__ == "__main__":
    main()
