"""The copies a machine has, timed side by side: the check that the bandwidth yardstick is one.

    python tools/copy_yardsticks.py [--rounds 15] [--threads 2] [--out FILE]

Every "% of copy" the project states divides by the GB/s of :func:`layernorm.bench.yardstick.copy`
(the CPU engine's block-parallel copy with ordinary stores). This times it beside the other
copies of the same arrays with the same threads, in interleaved rounds: torch's
``Tensor.copy_`` and NumPy's ``copyto`` (one thread). Prints the median GB/s (read + write) and
the spread over rounds of each, and each one's median over the yardstick's; ``--out`` saves the
rows as JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from layernorm.bench import results
from layernorm.bench.harness import PAUSE_S, set_threads
from layernorm.bench.machine import run_meta
from layernorm.bench.yardstick import copier

CASES = (((8192, 4096), "float32"), ((4096, 768), "float32"), ((64, 65536), "float32"),
         ((1024, 768), "float32"), ((8192, 4096), "bfloat16"))


def _copies(shape: tuple[int, int], dtype: str) -> tuple[dict, int]:
    """The copies of one (shape, dtype) case, by name, and the bytes each moves."""
    dt = getattr(torch, dtype)
    ts = torch.ones(shape, dtype=dt)  # (M, D)
    td = torch.empty_like(ts)
    src = ts.view(torch.int16).numpy() if dtype == "bfloat16" else ts.numpy()
    dst = td.view(torch.int16).numpy() if dtype == "bfloat16" else td.numpy()
    copies = {"yardstick (engine)": copier(src, dst),
              "torch copy_": lambda: td.copy_(ts),
              "np.copyto (1 thread)": lambda: np.copyto(dst, src)}
    return copies, 2 * ts.numel() * ts.element_size()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    set_threads(args.threads)
    rows = []
    for shape, dtype in CASES:
        copies, nbytes = _copies(shape, dtype)
        reps = max(3, int(2e8 // nbytes))
        gbs: dict[str, list[float]] = {name: [] for name in copies}
        for fn in copies.values():  # warm: pages touched
            fn()
        for _ in range(args.rounds):
            for name, fn in copies.items():
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                gbs[name].append(nbytes * reps / (time.perf_counter() - t0) / 1e9)
                time.sleep(PAUSE_S)
        base = statistics.median(gbs["yardstick (engine)"])
        for name, v in gbs.items():
            med = statistics.median(v)
            rows.append({"shape": list(shape), "dtype": dtype, "copy": name, "gbs_p50": med,
                         "gbs_min": min(v), "gbs_max": max(v), "of_yardstick": med / base})
            print(f"{str(shape):>14} {dtype:>8}  {name:<20} {med:6.1f} GB/s "
                  f"[{min(v):.1f}-{max(v):.1f}]  {med / base:5.2f}x")
    if args.out:
        results.save({"meta": {**run_meta(), "threads": args.threads, "rounds": args.rounds},
                      "rows": rows}, args.out)
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
