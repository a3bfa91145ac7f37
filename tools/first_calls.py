"""What a user's first calls cost: the import, then the first and second call of every norm.

    python tools/first_calls.py [--out FILE]

Each measurement runs in a fresh process as a user's first would, with the installed package
(``make test`` installs the wheel): empty per-user caches (a temporary HOME, and
TORCH_EXTENSIONS_DIR and XDG_CACHE_HOME in it), PATH reduced to the interpreter's folder and CXX
unset (no compiler, no ninja), no LAYERNORM_ variable. It measures the seconds ``import torch``
takes, then ``import layernorm.torch`` on top of it, and whether the engine was loaded; and, in
a new process per (norm, dtype, mode), the first forward and backward of the norm on a
(64, 1024) input with weights, then the second. A process that prints anything on stderr
fails the run. Prints a table and the goal's verdict per row: the import at most ``import
torch`` + 1 s, a first call at most twice the second + 50 ms. ``--out`` saves the rows as
JSON.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

NORMS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
DTYPES = ("float32", "bfloat16", "float16", "float64")

_IMPORT = textwrap.dedent("""
    import time
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    import layernorm.torch
    t2 = time.perf_counter()
    from layernorm.torch import _ops
    print(t1 - t0, t2 - t1, int(_ops.NATIVE))
""")

_CALLS = textwrap.dedent("""
    import sys, time, torch
    import layernorm.torch as lt
    norm, dtype, me = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3] == "1"
    g = torch.Generator().manual_seed(0)
    def step():
        x = torch.randn(64, 1024, generator=g).to(dtype).requires_grad_()
        r = torch.randn(64, 1024, generator=g).to(dtype)
        w = torch.randn(1024, generator=g).to(dtype).requires_grad_()
        b = torch.randn(1024, generator=g).to(dtype).requires_grad_()
        t0 = time.perf_counter()
        fn = getattr(lt, norm)
        if norm == "layer_norm":
            out = fn(x, 1024, w, b, memory_efficient=me)
        elif norm == "rms_norm":
            out = fn(x, 1024, w, memory_efficient=me)
        elif norm == "add_layer_norm":
            out = fn(x, r, 1024, w, b, memory_efficient=me)[0]
        else:
            out = fn(x, r, 1024, w, memory_efficient=me)[0]
        out.float().sum().backward()
        return time.perf_counter() - t0
    print(step(), step())
""")


def _fresh(script: str, *args: str, home: Path) -> list[float]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LAYERNORM_") and k not in ("CXX", "PATH")}
    env.update(HOME=str(home), TORCH_EXTENSIONS_DIR=str(home / "torch_extensions"),
               XDG_CACHE_HOME=str(home / "cache"), PATH=str(Path(sys.executable).parent))
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0 or done.stderr:
        raise SystemExit(f"first_calls: the process printed: {done.stderr.strip()}")
    return [float(v) for v in done.stdout.split()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch_s, ours_s, native = _fresh(_IMPORT, home=Path(tmp) / "import")
        ok = ours_s <= 1.0
        print(f"import torch {torch_s:.2f} s; import layernorm.torch after it {ours_s:.2f} s "
              f"(goal <= 1 s: {'met' if ok else 'missed'}); the C++ engine "
              f"{'loaded' if native else 'NOT loaded: the NumPy fallback runs'}")
        rows.append({"what": "import", "torch_s": torch_s, "layernorm_torch_s": ours_s,
                     "engine": bool(native), "met": ok})
        print(f"{'norm':<16} {'dtype':<9} {'mode':<17} {'first ms':>9} {'second ms':>10}  goal")
        for norm in NORMS:
            for dtype in DTYPES:
                for me in (False, True):
                    home = Path(tmp) / f"{norm}-{dtype}-{int(me)}"
                    first, second = _fresh(_CALLS, norm, dtype, "1" if me else "0", home=home)
                    ok = first <= 2 * second + 0.05
                    mode = "memory_efficient" if me else "default"
                    print(f"{norm:<16} {dtype:<9} {mode:<17} {first * 1e3:9.1f} "
                          f"{second * 1e3:10.2f}  {'met' if ok else 'missed'}", flush=True)
                    rows.append({"what": "call", "norm": norm, "dtype": dtype, "mode": mode,
                                 "first_s": first, "second_s": second, "met": ok})
    if args.out:
        from layernorm.bench import results
        from layernorm.bench.machine import run_meta

        results.save({"meta": run_meta(), "rows": rows}, args.out)
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
