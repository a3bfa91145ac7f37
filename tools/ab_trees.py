"""Two trees of this project timed against each other in one run: the check that a change
made nothing slower.

    python tools/ab_trees.py --base REV [--new REV] [--rounds 9] [--threads 2] [--peer-shapes]
                             [--only TEXT ...] [--out FILE]

Checks REV out into a temporary worktree (and ``--new`` too, else the new tree is this one),
then times the same calls of ``layernorm.torch`` on CPU tensors in the base tree and the new,
one subprocess per tree and round, the trees alternating round by round (so both see the same
machine over the same minutes): every norm's training forward and backward (default and
memory-efficient) at the shapes of SHAPES in float32 and bfloat16, and the per-call cost of a
decode step (8 rows of 4096); with ``--peer-shapes``, the eight named shapes of ``layernorm bench
--peers`` instead (rows flattened), each in training and inference. A tree whose engine is
built by ``layernorm build`` (no compile at import) gets it built first, into a folder of its
own (``LAYERNORM_ENGINE_DIR``; a tree that builds at import builds into its own too);
``LAYERNORM_ISA`` in the environment picks its kernel set. A process that would time the NumPy
fallback stops the run. Each process warms every call first (a tree that compiles at first
use does so there, untimed). Prints, per call, the median over rounds of each tree's time per
call and their ratio with its spread (new / base: below 1 is faster); ``--out``
saves the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((4096, 768), (1024, 4096), (8192, 4096), (64, 65536))
DECODE = (8, 4096)

# Run in each tree: times every call for about `budget` seconds each, prints JSON.
_SCRIPT = textwrap.dedent("""
    import json, sys, time, torch
    import layernorm.torch as lt
    from layernorm.torch import _ops
    if not _ops.NATIVE:
        raise SystemExit("the C++ engine is not loaded: the NumPy fallback would be timed")
    shapes, decode, threads, budget, only = json.loads(sys.argv[1])
    torch.set_num_threads(threads)
    out = {}
    def timed(name, fn):
        if only and not any(o in name for o in only):
            return
        fn(); fn()
        n, t0 = 0, time.perf_counter()
        while True:
            fn(); n += 1
            t = time.perf_counter() - t0
            if t > budget:
                break
        out[name] = t / n
    for (m, d) in shapes + ([decode] if decode else []):
        for dt in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(m, d, generator=g).to(dt).requires_grad_()
            r = torch.randn(m, d, generator=g).to(dt)
            w = (1 + 0.1 * torch.randn(d, generator=g)).to(dt).requires_grad_()
            b = (0.1 * torch.randn(d, generator=g)).to(dt).requires_grad_()
            dy = torch.randn(m, d, generator=g).to(dt)
            tag = f"({m}, {d}) {str(dt)[6:]}"
            if decode and (m, d) == tuple(decode):
                with torch.inference_mode():
                    timed(f"decode rms_norm {tag}", lambda: lt.rms_norm(x, d, w))
                    timed(f"decode add_rms_norm {tag}", lambda: lt.add_rms_norm(x, r, d, w))
                continue
            for me in (False, True):
                mode = " memory_efficient" if me else ""
                calls = (("layer_norm", lambda: lt.layer_norm(x, d, w, b, memory_efficient=me)),
                         ("rms_norm", lambda: lt.rms_norm(x, d, w, memory_efficient=me)))
                for norm, call in calls:
                    y = call()
                    with torch.no_grad():
                        timed(f"{norm}{mode} fwd {tag}", call)
                    timed(f"{norm}{mode} fwd+bwd {tag}",
                          lambda: torch.autograd.grad(call(), (x, w), dy))
    print(json.dumps(out))
""")


def _env(tree: Path, engines: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree / "src"), "LAYERNORM_ENGINE_DIR": str(engines)}


def _build(tree: Path, engines: Path) -> None:
    """Build the tree's engine into `engines` where the tree builds it by command."""
    if (tree / "src" / "layernorm" / "commands" / "build.py").exists():
        subprocess.run([sys.executable, "-m", "layernorm", "build"], env=_env(tree, engines),
                       check=True, cwd=tree)


def _run(tree: Path, engines: Path, args: list) -> dict[str, float]:
    env = _env(tree, engines)
    done = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=3600, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the revision to compare with")
    p.add_argument("--new", help="the revision compared (default: this working tree)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=float, default=0.05, help="seconds per call and round")
    p.add_argument("--peer-shapes", action="store_true",
                   help="the eight named shapes of layernorm bench --peers")
    p.add_argument("--only", action="append",
                   help="time only the calls whose name contains this (repeatable)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.peer_shapes:
        from layernorm.bench.peers import SHAPES as PEERS

        shapes = [[math.prod(s[:-1]), s[-1]] for s in PEERS.values()]
        decode = None
    else:
        shapes, decode = [list(s) for s in SHAPES], list(DECODE)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        new = Path(tmp) / "new" if args.new else ROOT
        trees = [(base, args.base)] + ([(new, args.new)] if args.new else [])
        for tree, rev in trees:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree),
                            rev], check=True, capture_output=True)
        try:
            # each tree's engine in a folder of its own: a tree may clear others' builds
            engines = {"base": Path(tmp) / "engines-base", "new": Path(tmp) / "engines-new"}
            _build(base, engines["base"])
            _build(new, engines["new"])
            call = [shapes, decode, args.threads, args.budget, args.only]
            _run(base, engines["base"], call)  # a first run builds what each tree needs
            _run(new, engines["new"], call)
            times: dict[str, dict[str, list[float]]] = {}
            for k in range(args.rounds):
                for name, tree in (("base", base), ("new", new)):
                    for key, t in _run(tree, engines[name], call).items():
                        times.setdefault(key, {"base": [], "new": []})[name].append(t)
                print(f"round {k + 1} of {args.rounds} done", file=sys.stderr, flush=True)
        finally:
            for tree, _ in trees:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(tree)], check=False, capture_output=True)
    rows = []
    for key, t in times.items():
        ratios = [n / b for n, b in zip(t["new"], t["base"], strict=True)]
        row = {"call": key, "base_us": statistics.median(t["base"]) * 1e6,
               "new_us": statistics.median(t["new"]) * 1e6, "ratio_p50": statistics.median(ratios),
               "ratio_min": min(ratios), "ratio_max": max(ratios)}
        rows.append(row)
        print(f"{key:<58} base {row['base_us']:10.1f} us  new {row['new_us']:10.1f} us  "
              f"new/base {row['ratio_p50']:.3f} [{row['ratio_min']:.2f}-{row['ratio_max']:.2f}]")
    if args.out:
        from layernorm.bench import results
        from layernorm.bench.machine import run_meta

        meta = {**run_meta(), "base": args.base, "new": args.new or "working tree",
                "threads": args.threads, "rounds": args.rounds, "only": args.only,
                "isa": os.environ.get("LAYERNORM_ISA", "") or "the widest this CPU runs"}
        results.save({"meta": meta, "rows": rows}, args.out)
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
