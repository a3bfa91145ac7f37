"""The NumPy API against layernorm.torch on the same data and threads: one engine, one speed?

    python tools/one_speed.py [--rounds 9] [--threads 2] [--out bench/results/one-speed.json]

Both APIs run the same C++ engine; what differs is the wrapper around it. For each norm of the
family and float32 inputs of 1 MB to 128 MB, times in interleaved rounds (each pair one batch
of about 50 ms a round, the order rotated round by round):

    numpy fwd            layernorm.cpu's forward, as a user calls it (checksum on, fresh y)
    numpy fwd, no check  the same with checksum=False (the cost of the checksum alone)
    torch fwd            layernorm.torch's function on tensors that require grad (training)
    numpy bwd            layernorm.cpu's backward from that forward's cache (fresh dx)
    torch bwd            torch.autograd.grad through layernorm.torch's forward (its backward)

Prints per case the p50 ms of each and the ratio numpy / torch (p50, and p20-p80 of the
per-round ratios) for the forward and the backward; the goal is at most 1.10. ``--out`` saves
the rows as JSON.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import torch

import layernorm.cpu as lnc
import layernorm.torch as lt
from layernorm.bench import results
from layernorm.bench.harness import interleaved, reps_for, set_threads
from layernorm.bench.machine import run_meta
from layernorm.family import NORMS

SHAPES = ((256, 1024), (1024, 4096), (8192, 4096))  # 1, 16 and 128 MB of float32 x
GOAL = 1.10


def _calls(name: str, m: int, d: int, rng: np.random.Generator) -> dict:
    """The five timed calls of one case, by name."""
    norm = NORMS[name]
    x = rng.standard_normal((m, d)).astype(np.float32)
    r = rng.standard_normal((m, d)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    b = (0.1 * rng.standard_normal(d)).astype(np.float32)
    dy = rng.standard_normal((m, d)).astype(np.float32)
    params = (w, b) if norm.centred else (w,)
    fwd = getattr(lnc, f"{name}_forward")
    bwd = getattr(lnc, f"{name}_backward")
    args = (x, r) if norm.residual else (x,)
    *_, cache = fwd(*args, *params)
    back = (lambda: bwd(dy, None, cache)) if norm.residual else (lambda: bwd(dy, cache))
    xt, rt = torch.from_numpy(x).requires_grad_(), torch.from_numpy(r).requires_grad_()
    pt = [torch.from_numpy(p).requires_grad_() for p in params]
    targs = (xt, rt) if norm.residual else (xt,)
    fn = getattr(lt, name)

    def torch_fwd():
        return fn(*targs, d, *pt)

    out = torch_fwd()
    y = out[0] if norm.residual else out
    dyt = torch.from_numpy(dy)
    return {
        "numpy fwd": lambda: fwd(*args, *params),
        "numpy fwd, no check": lambda: fwd(*args, *params, checksum=False),
        "torch fwd": torch_fwd,
        "numpy bwd": back,
        "torch bwd": lambda: torch.autograd.grad(y, [*targs, *pt], dyt, retain_graph=True),
    }


def _spread(v: list[float]) -> tuple[float, float, float]:
    q = np.percentile(v, [20, 50, 80])
    return float(q[1]), float(q[0]), float(q[2])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    set_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = []
    print(f"{args.threads} threads, {args.rounds} rounds; p50 ms per call; numpy / torch "
          f"(p20-p80 of per-round ratios), goal <= {GOAL:.2f}\n")
    print("| norm | shape | numpy fwd | no check | torch fwd | fwd ratio | numpy bwd | torch bwd "
          "| bwd ratio |\n|---|---|---|---|---|---|---|---|---|")
    for name in NORMS:
        for m, d in SHAPES:
            calls = _calls(name, m, d, rng)
            reps = {k: reps_for(f, 0.05) for k, f in calls.items()}
            ms = {k: [t * 1e3 for t in v]
                  for k, v in interleaved(calls, reps, args.rounds).items()}
            fr = [a / b for a, b in zip(ms["numpy fwd"], ms["torch fwd"], strict=True)]
            br = [a / b for a, b in zip(ms["numpy bwd"], ms["torch bwd"], strict=True)]
            row = {"norm": name, "shape": [m, d], "dtype": "float32", "threads": args.threads,
                   "rounds": args.rounds, "ms_p50": {k: statistics.median(v)
                                                     for k, v in ms.items()},
                   "fwd_ratio": _spread(fr), "bwd_ratio": _spread(br)}
            rows.append(row)
            t = row["ms_p50"]
            f, b_ = row["fwd_ratio"], row["bwd_ratio"]
            print(f"| {name} | {m}x{d} | {t['numpy fwd']:.3f} | {t['numpy fwd, no check']:.3f} "
                  f"| {t['torch fwd']:.3f} | {f[0]:.2f} ({f[1]:.2f}-{f[2]:.2f}) "
                  f"| {t['numpy bwd']:.3f} | {t['torch bwd']:.3f} "
                  f"| {b_[0]:.2f} ({b_[1]:.2f}-{b_[2]:.2f}) |", flush=True)
    met = sum(r["fwd_ratio"][0] <= GOAL for r in rows) + sum(r["bwd_ratio"][0] <= GOAL
                                                            for r in rows)
    print(f"\ngoal (numpy / torch <= {GOAL:.2f}) met in {met} of {2 * len(rows)} passes")
    if args.out is not None:
        meta = {**run_meta(), "goal": GOAL}
        print(f"saved {results.save({'meta': meta, 'rows': rows}, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
