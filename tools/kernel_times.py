"""The CPU kernels alone against torch's own, one thread: the figures docs/cpu-kernels.md quotes.

    python tools/kernel_times.py [--rounds 7] [--out bench/results/kernel-times.json]

Times the C++ engine's LayerNorm forward (keeping statistics, as in training) and backward,
called through their array entry points (``forward_into``, ``backward_into``: outputs given,
no allocation, no Python checks, torch's dispatcher only), beside
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
from layernorm.cpu.statistics import NSTATS
from layernorm.torch import _ops

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


def _calls(x, dy, y, dx, w, b, stats, sums, dt) -> dict:
    """The four timed calls on one round's arrays (x, dy, y, dx: (M, D) in the dtype timed; w,
    b: (D,) float32, the kernels' scale and shift; the forward first: the backward reads its
    statistics)."""
    d = x.shape[1]
    wt, bt = w.to(dt), b.to(dt)
    ops = torch.ops.layernorm_cpu
    serial = x.numel() + 1  # one thread: on the calling thread
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [d], wt, bt, 1e-5)
    return {
        "ours fwd": lambda: ops.forward_into(x, None, w, b, 1e-5, True, y, None, stats, None,
                                             serial),
        "torch fwd": lambda: torch.ops.aten.native_layer_norm(x, [d], wt, bt, 1e-5),
        "ours bwd": lambda: ops.backward_into(x, dy, None, w, stats, None, None, None, None,
                                              None, None, True, dx, None, sums, None, serial),
        "torch bwd": lambda: torch.ops.aten.native_layer_norm_backward(
            dy, x, [d], mean, rstd, wt, bt, [True, True, True]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, help="save the table's figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not _ops.NATIVE:
        raise SystemExit("kernel_times: the C++ engine is not loaded here (make test installs "
                         "it; layernorm build builds it)")
    rng = np.random.default_rng(0)
    names = ("ours fwd", "torch fwd", "ours bwd", "torch bwd")
    result: dict = {"meta": {**run_meta(), "rounds": args.rounds}, "rows": []}
    for m, d in SHAPES:
        for dt, name in CODES.items():
            x0, dy0 = torch.randn(m, d).to(dt), torch.randn(m, d).to(dt)
            w, b = torch.randn(d), torch.randn(d)
            stats = torch.empty(m, NSTATS, dtype=torch.float64)
            sums = torch.empty(2, d, dtype=torch.float64)
            times: dict[str, list[float]] = {k: [] for k in names}
            for _ in range(args.rounds):
                arrays = [_placed(t, rng) for t in (x0, dy0, x0, dy0)]
                for k, fn in _calls(*arrays, w, b, stats, sums, dt).items():
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
