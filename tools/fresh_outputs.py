"""Calls without ``out=`` against calls with it: what fresh outputs cost the NumPy API.

    python tools/fresh_outputs.py [--threads 2] [--rounds 9]

For each norm of the family and two large float32 shapes, times the NumPy API's forward with
fresh outputs (each call's outputs dropped before the next, as a caller that does not keep them
does) and with ``out=`` (and ``out_h=``) buffers, in interleaved rounds; prints p50 ms of each
and the ratio fresh / out= (p50, p20-p80 of per-round ratios). docs/cpu-kernels.md quotes it.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import layernorm.cpu as lnc
from layernorm.bench.harness import batch
from layernorm.family import NORMS

SHAPES = ((4, 1024, 4096), (8192, 4096))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"{args.threads} threads, {args.rounds} rounds; p50 ms per call\n")
    print("| norm | shape | fresh outputs | out= | fresh / out= (p20-p80) |\n|---|---|---|---|---|")
    for name, norm in NORMS.items():
        fwd = getattr(lnc, f"{name}_forward")
        for shape in SHAPES:
            x = rng.standard_normal(shape).astype(np.float32)
            data = (x, rng.standard_normal(shape).astype(np.float32)) if norm.residual else (x,)
            bufs = {"out": np.empty_like(x)}
            if norm.residual:
                bufs["out_h"] = np.empty_like(x)
            calls = {"fresh": lambda f=fwd, d=data: f(*d),
                     "out": lambda f=fwd, d=data, b=bufs: f(*d, **b)}
            for fn in calls.values():
                fn()
                fn()
            times: dict[str, list[float]] = {k: [] for k in calls}
            for r in range(args.rounds):
                for k in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                    times[k].append(batch(calls[k], 5))
            ratio = np.array(times["fresh"]) / np.array(times["out"])
            lo, mid, hi = np.percentile(ratio, [20, 50, 80])
            print(f"| {name} | {'x'.join(map(str, shape))} | "
                  f"{np.median(times['fresh']) * 1e3:.2f} | {np.median(times['out']) * 1e3:.2f} "
                  f"| {mid:.2f}x ({lo:.2f}-{hi:.2f}) |")


if __name__ == "__main__":
    main()
