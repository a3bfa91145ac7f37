"""The CPU kernels alone against torch's own, one thread: the figures docs/cpu-kernels.md quotes.

    python tools/kernel_times.py [--rounds 7] [--out bench/results/kernel-times.json]

Times LayerNorm's compiled forward (keeping statistics, as in training) and backward, called
directly through ctypes (no checks, no allocation, no dispatcher), beside
``torch.ops.aten.native_layer_norm`` and ``native_layer_norm_backward`` on the same data, one
thread, float32 and bfloat16, in interleaved rounds. Each round puts every array at a random
64-byte offset: where arrays fall relative to each other moves these timings by 10-15% on this
machine, so a fixed placement would favour one side. Prints the p50 over rounds of each batch's
time per call, in ms; ``--out`` saves the figures as JSON, from which
``python tools/doc_tables.py`` makes docs/cpu-kernels.md's table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from layernorm.bench import doc_tables, results
from layernorm.bench.harness import batch
from layernorm.bench.machine import run_meta
from layernorm.cpu import entry, kernels

SHAPES = ((4096, 768), (1024, 768), (1024, 4096))
CODES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _placed(t: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """A copy of ``t`` at a random 64-byte offset from a fresh allocation."""
    step = 64 // t.element_size()
    off = int(rng.integers(0, 64)) * step
    buf = torch.empty(t.numel() + 64 * step, dtype=t.dtype)
    out = buf[off:off + t.numel()].view(t.shape)
    out.copy_(t)
    return out


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _calls(fwd, bwd, x, dy, y, dx, w, b, stats, partial, dt) -> dict:
    """The four timed calls on one round's arrays (x, dy, y, dx: (M, D) in the dtype timed; w,
    b: (D,) float32, the kernels' scale and shift; the forward first: the backward reads its
    statistics)."""
    m, d = x.shape
    c = partial.shape[0]
    wt, bt = w.to(dt), b.to(dt)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [d], wt, bt, 1e-5)
    return {
        "ours fwd": lambda: fwd(_ptr(x), 0, 0, _ptr(y), 0, 0, _ptr(w), _ptr(b), 1e-5,
                                kernels.CENTRED, _ptr(stats), 0, m, d, 0, d, d, m, 0, 0, m),
        "torch fwd": lambda: torch.ops.aten.native_layer_norm(x, [d], wt, bt, 1e-5),
        "ours bwd": lambda: bwd(_ptr(x), _ptr(dy), 0, _ptr(dx), 0, 0, _ptr(w), _ptr(stats), 0,
                                kernels.CENTRED, _ptr(partial), 0, m, d, 0, 0, 0, c, 0, c),
        "torch bwd": lambda: torch.ops.aten.native_layer_norm_backward(
            dy, x, [d], mean, rstd, wt, bt, [True, True, True]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, help="save the table's figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    names = ("ours fwd", "torch fwd", "ours bwd", "torch bwd")
    result: dict = {"meta": {**run_meta(), "rounds": args.rounds}, "rows": []}
    for m, d in SHAPES:
        for dt, name in CODES.items():
            fwd = entry.ctypes_fn(entry.forward_key(name, None, None, "float32", "float32"))
            bwd = entry.ctypes_fn(entry.backward_key(name, name, None, name, None, "float32",
                                                     "float32"))
            x0, dy0 = torch.randn(m, d).to(dt), torch.randn(m, d).to(dt)
            w, b = torch.randn(d), torch.randn(d)
            stats = torch.empty(m, kernels.NSTATS, dtype=torch.float64)
            partial = torch.empty(kernels.n_chunks(m), 2, d, dtype=torch.float64)
            times: dict[str, list[float]] = {k: [] for k in names}
            for _ in range(args.rounds):
                arrays = [_placed(t, rng) for t in (x0, dy0, x0, dy0)]
                for k, fn in _calls(fwd, bwd, *arrays, w, b, stats, partial, dt).items():
                    batch(fn, 2)
                    times[k].append(batch(fn, 10) * 1e3)
            result["rows"].append({"M": m, "D": d, "dtype": name, "ms": {
                k: float(np.median(times[k])) for k in names}})
            print(f"({m}, {d}) {name}: " + ", ".join(
                f"{k} {result['rows'][-1]['ms'][k]:.3f}" for k in names), flush=True)
    print("\n" + doc_tables.kernel_times_table(result))
    if args.out is not None:
        print(f"\nsaved {results.save(result, args.out)}")


if __name__ == "__main__":
    main()
