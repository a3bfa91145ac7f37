"""``layernorm bench``: time layer norm implementations against this machine's copy bandwidth.

Implementations: the NumPy reference (``numpy``), the fused Numba kernels of
:mod:`layernorm.cpu` (``fused``, outputs reused through ``out=``) and PyTorch's CPU
``torch.nn.functional.layer_norm`` with autograd (``torch``), each when installed. Each is
checked against the float64 reference (tolerances from :mod:`layernorm.tolerances`) before it
is timed: the check column shows "ok" or the worst error in multiples of the tolerance (the
command fails only for this package's implementations). Operations: ``fwd`` (the forward as
in training: PyTorch records its graph), ``bwd`` (the backward alone: PyTorch's
``autograd.grad`` on a kept graph) and ``fwd+bwd`` (one training step, timed as a unit).

Method: for each shape and dtype, every (implementation, operation) pair and a copy run in
rounds; in each round every pair runs one batch (calls repeated for about 50 ms, 20 ms with
--quick), in an order rotated from round to round, with a 5 ms pause between batches so that
the idle threads of one OpenMP pool stop spinning before the next runs. Per pair, the per-call
times of the rounds give p50 (p20-p80). Speedups are medians over rounds of the per-round
ratios (the pairs of one round ran under the same machine load).

Bandwidth: GB/s on minimal bytes (:func:`layernorm.cost.minimal_bytes`: 2·M·D·itemsize
forward, 3·M·D·itemsize backward, their sum for fwd+bwd), and that as a fraction of copy.
Copy is :func:`layernorm.cpu.copy` of an array of x's size into a preallocated one, with the
same threads, counting read and write (2·M·D·itemsize); without Numba it is NumPy's
single-threaded ``np.copyto``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _validate
from ._table import render
from .cost import minimal_bytes
from .dtypes import NAMES, resolve
from .tolerances import tolerance

STANDARD_SHAPES: tuple[tuple[int, ...], ...] = ((8, 512, 768), (4, 1024, 4096), (1, 64, 65536))
IMPLS = ("numpy", "fused", "torch")
OPS = ("fwd", "bwd", "fwd+bwd")
EPS = 1e-5
PAUSE_S = 0.005  # between batches: lets the previous OpenMP pool's spinning threads sleep
FWD_GOAL, BWD_GOAL, STEP_GOAL = 0.80, 0.70, 1.2  # fractions of copy; fwd+bwd speedup vs torch


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]
    dtype: str

    @property
    def M(self) -> int:
        return int(np.prod(self.shape[:-1]))

    @property
    def D(self) -> int:
        return self.shape[-1]

    @property
    def label(self) -> str:
        return "x".join(map(str, self.shape)) + " " + self.dtype


def _inputs(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    dt = resolve(case.dtype)
    return {
        "x": (rng.standard_normal(case.shape, dtype=np.float32) * 2 + 0.5).astype(dt),
        "gamma": rng.standard_normal(case.D, dtype=np.float32).astype(dt),
        "beta": rng.standard_normal(case.D, dtype=np.float32).astype(dt),
        "dy": rng.standard_normal(case.shape, dtype=np.float32).astype(dt),
    }


# Each implementation: inputs -> (ops: {op: callable}, results: callable returning
# (y, dx, dgamma, dbeta) as NumPy arrays for the check).
Setup = Callable[[dict[str, np.ndarray]], tuple[dict[str, Callable[[], object]], Callable]]


def _setup_numpy(a: dict[str, np.ndarray]) -> tuple[dict, Callable]:
    from . import reference as ref

    x, g, b, dy = a["x"], a["gamma"], a["beta"], a["dy"]
    cache = ref.layer_norm_forward(x, g, b, EPS)[1]

    def step():
        return ref.layer_norm_backward(dy, ref.layer_norm_forward(x, g, b, EPS)[1])

    def results():
        y, c = ref.layer_norm_forward(x, g, b, EPS)
        return (y, *ref.layer_norm_backward(dy, c))

    ops = {
        "fwd": lambda: ref.layer_norm_forward(x, g, b, EPS),
        "bwd": lambda: ref.layer_norm_backward(dy, cache),
        "fwd+bwd": step,
    }
    return ops, results


def _setup_fused(a: dict[str, np.ndarray]) -> tuple[dict, Callable]:
    from . import cpu

    x, g, b, dy = a["x"], a["gamma"], a["beta"], a["dy"]
    y = np.empty_like(x)  # (..., D) outputs reused across calls
    dx = np.empty_like(x)
    cache = cpu.layer_norm_forward(x, g, b, EPS, out=y)[1]

    def step():
        c = cpu.layer_norm_forward(x, g, b, EPS, out=y)[1]
        return cpu.layer_norm_backward(dy, c, out=dx)

    def results():
        yy, c = cpu.layer_norm_forward(x, g, b, EPS)
        return (yy, *cpu.layer_norm_backward(dy, c))

    ops = {
        "fwd": lambda: cpu.layer_norm_forward(x, g, b, EPS, out=y),
        "bwd": lambda: cpu.layer_norm_backward(dy, cache, out=dx),
        "fwd+bwd": step,
    }
    return ops, results


def _to_torch(a: np.ndarray):
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _from_torch(t) -> np.ndarray:
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.numpy()


def _setup_torch(a: dict[str, np.ndarray]) -> tuple[dict, Callable]:
    import torch
    import torch.nn.functional as F

    x, g, b = (_to_torch(a[k]).requires_grad_(True) for k in ("x", "gamma", "beta"))
    dy = _to_torch(a["dy"])
    d = a["x"].shape[-1]
    y = F.layer_norm(x, (d,), g, b, EPS)

    def step():
        return torch.autograd.grad(F.layer_norm(x, (d,), g, b, EPS), (x, g, b), dy)

    def results():
        yy = F.layer_norm(x, (d,), g, b, EPS)
        grads = torch.autograd.grad(yy, (x, g, b), dy)
        return tuple(_from_torch(t) for t in (yy, *grads))

    ops = {
        "fwd": lambda: F.layer_norm(x, (d,), g, b, EPS),
        "bwd": lambda: torch.autograd.grad(y, (x, g, b), dy, retain_graph=True),
        "fwd+bwd": step,
    }
    return ops, results


_SETUPS: dict[str, tuple[str, Setup]] = {
    "numpy": ("numpy", _setup_numpy),
    "fused": ("numba", _setup_fused),
    "torch": ("torch", _setup_torch),
}


def available_impls() -> list[str]:
    """The implementations whose libraries import here."""
    found = []
    for name, (module, _) in _SETUPS.items():
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        found.append(name)
    return found


def _check(results: Callable, a: dict[str, np.ndarray], dtype: str) -> float:
    """Largest error of (y, dx, dgamma, dbeta) over its tolerance (pass: <= 1)."""
    from . import reference as ref

    a64 = {k: v.astype(np.float64) for k, v in a.items()}
    y, cache = ref.layer_norm_forward(a64["x"], a64["gamma"], a64["beta"], EPS)
    want = (y, *ref.layer_norm_backward(a64["dy"], cache))
    worst = 0.0
    for i, (got, w) in enumerate(zip(results(), want, strict=True)):
        tol = tolerance(dtype, "out" if i < 2 else "param")
        err = np.abs(np.asarray(got, dtype=np.float64) - w)
        worst = max(worst, float(np.max(err / (tol.atol + tol.rtol * np.abs(w)))))
    return worst


def _copy_op(case: Case) -> tuple[Callable[[], object], str]:
    dt = resolve(case.dtype)
    src = np.ones((case.M, case.D), dt)  # (M, D)
    dst = np.empty_like(src)
    try:
        from .cpu import copy
    except ImportError:
        return (lambda: np.copyto(dst, src)), "np.copyto (1 thread)"
    return (lambda: copy(src, dst)), "layernorm.cpu.copy"


class _Progress:
    """A status line on stderr: rewritten in place on a terminal, else one line per case."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.case = ""

    def __call__(self, msg: str) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K" + msg)
        else:
            case = msg.split(":")[0]
            if case == self.case:
                return
            self.case = case
            sys.stderr.write(f"bench: {case} ...\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _batch(fn: Callable[[], object], reps: int) -> float:
    """Seconds per call over ``reps`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _threads() -> int:
    try:
        import numba

        return numba.get_num_threads()
    except ImportError:
        pass
    try:
        import torch

        return torch.get_num_threads()
    except ImportError:
        return 1


def set_threads(n: int) -> None:
    """Use ``n`` threads in Numba and PyTorch (those installed)."""
    try:
        import numba
    except ImportError:
        pass
    else:
        numba.set_num_threads(n)
    try:
        import torch
    except ImportError:
        pass
    else:
        torch.set_num_threads(n)


def bench_case(case: Case, impls: list[str], rounds: int, quick: bool,
               progress: Callable[[str], None]) -> list[dict]:
    """Time one shape and dtype; one row per (impl, op) plus one copy row (see module doc)."""
    a = _inputs(case)
    itemsize = a["x"].itemsize
    pairs: dict[tuple[str, str], Callable[[], object]] = {}
    checks: dict[str, float] = {}
    for name in impls:
        progress(f"{case.label}: checking {name}")
        ops, results = _SETUPS[name][1](a)
        checks[name] = _check(results, a, case.dtype)
        for op, fn in ops.items():
            pairs[(name, op)] = fn
    copy_fn, copy_name = _copy_op(case)
    pairs[("copy", "copy")] = copy_fn

    target = 0.02 if quick else 0.05
    reps = {}
    for key, fn in pairs.items():
        progress(f"{case.label}: warming up {key[0]} {key[1]}")
        fn()  # compiles, faults the pages in
        reps[key] = max(1, min(10_000, round(target / max(_batch(fn, 1), 1e-7))))
    keys = list(pairs)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        for key in order:
            progress(f"{case.label}: round {r + 1}/{rounds} {key[0]} {key[1]}")
            time.sleep(PAUSE_S)
            times[key].append(_batch(pairs[key], reps[key]))

    copy_t = np.array(times[("copy", "copy")])  # (rounds,)
    copy_bytes = 2 * case.M * case.D * itemsize
    copy_gbps = copy_bytes / float(np.median(copy_t)) / 1e9
    base = {
        "shape": list(case.shape), "M": case.M, "D": case.D, "dtype": case.dtype,
        "threads": _threads(), "rounds": rounds, "copy_gbps": copy_gbps, "copy": copy_name,
    }
    rows = []
    for (name, op), ts in times.items():
        t = np.array(ts)  # (rounds,)
        if name == "copy":
            nbytes = copy_bytes
        elif op == "fwd+bwd":
            nbytes = (minimal_bytes("fwd", case.M, case.D, itemsize)
                      + minimal_bytes("bwd", case.M, case.D, itemsize))
        else:
            nbytes = minimal_bytes(op, case.M, case.D, itemsize)
        p20, p50, p80 = np.percentile(t, [20, 50, 80])
        speedup = {
            peer: float(np.median(np.array(times[(peer, op)]) / t))
            for peer in impls if peer != name and (peer, op) in times
        }
        rows.append({
            **base, "impl": name, "op": op, "reps": reps[(name, op)],
            "p20_ms": p20 * 1e3, "p50_ms": p50 * 1e3, "p80_ms": p80 * 1e3,
            "bytes": nbytes, "gbps": nbytes / p50 / 1e9,
            "frac_copy": nbytes / p50 / 1e9 / copy_gbps,
            "frac_copy_p20_p80": [nbytes / p80 / 1e9 / copy_gbps, nbytes / p20 / 1e9 / copy_gbps],
            "speedup": speedup,
            "check": None if name == "copy" else checks[name],
        })
    return rows


def run_bench(cases: list[Case], impls: list[str], rounds: int, quick: bool,
              progress: Callable[[str], None] | None = None) -> dict:
    """Benchmark every case; returns ``{"meta": ..., "rows": [...]}`` (rows as bench_case)."""
    from .report import machine_info

    progress = progress or _Progress()
    meta = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "command": " ".join(["layernorm", *sys.argv[1:]]),
        "threads": _threads(),
        "machine": machine_info(),
    }
    rows = []
    for case in cases:
        for row in bench_case(case, impls, rounds, quick, progress):
            rows.append({**row, "timestamp": meta["timestamp"], "host": meta["host"],
                         "machine": meta["machine"]})
    if isinstance(progress, _Progress):
        progress.done()
    return {"meta": meta, "rows": rows}


def format_table(rows: list[dict], markdown: bool = False) -> str:
    """Every row: p50 (p20-p80) ms, GB/s, fraction of copy, speedups against the peers."""
    head = ["shape", "dtype", "impl", "op", "p50 ms (p20-p80)", "GB/s", "of copy",
            "speedup vs peers", "check"]
    body = []
    for r in rows:
        sp = ", ".join(f"{v:.2f}x vs {k}" for k, v in r["speedup"].items())
        chk = "" if r["check"] is None else ("ok" if r["check"] <= 1 else
                                             f"{r['check']:.1f}x tol")
        body.append([
            "x".join(map(str, r["shape"])), r["dtype"], r["impl"], r["op"],
            f"{r['p50_ms']:.3f} ({r['p20_ms']:.3f}-{r['p80_ms']:.3f})", f"{r['gbps']:.1f}",
            f"{r['frac_copy']:.0%}", sp, chk,
        ])
    return render(head, body, markdown)


def _find(rows: list[dict], shape: list[int], dtype: str, impl: str, op: str) -> dict | None:
    for r in rows:
        if r["shape"] == shape and r["dtype"] == dtype and r["impl"] == impl and r["op"] == op:
            return r
    return None


def summary_table(rows: list[dict], markdown: bool = False) -> str:
    """Per shape: copy GB/s, fused and PyTorch fractions of copy, fused speedup vs PyTorch."""
    head = ["shape", "dtype", "threads", "copy GB/s", "fused fwd", "fused bwd", "torch fwd",
            "torch bwd", "fused/torch fwd+bwd", "goals"]
    body = []
    seen = []
    for r in rows:
        key = (r["shape"], r["dtype"])
        if r["impl"] != "copy" or key in seen:
            continue
        seen.append(key)

        def frac(impl: str, op: str, r=r) -> str:
            f = _find(rows, r["shape"], r["dtype"], impl, op)
            if f is None:
                return "-"
            lo, hi = f["frac_copy_p20_p80"]
            return f"{f['frac_copy']:.0%} ({lo:.0%}-{hi:.0%})"

        fw = _find(rows, r["shape"], r["dtype"], "fused", "fwd")
        bw = _find(rows, r["shape"], r["dtype"], "fused", "bwd")
        st = _find(rows, r["shape"], r["dtype"], "fused", "fwd+bwd")
        speed = st["speedup"].get("torch") if st else None
        goals = []
        if fw:
            goals.append("fwd " + ("met" if fw["frac_copy"] >= FWD_GOAL else "missed"))
        if bw:
            goals.append("bwd " + ("met" if bw["frac_copy"] >= BWD_GOAL else "missed"))
        if speed is not None:
            goals.append("speedup " + ("met" if speed >= STEP_GOAL else "missed"))
        body.append([
            "x".join(map(str, r["shape"])), r["dtype"], str(r["threads"]),
            f"{r['copy_gbps']:.1f}", frac("fused", "fwd"), frac("fused", "bwd"),
            frac("torch", "fwd"), frac("torch", "bwd"),
            "-" if speed is None else f"{speed:.2f}x", ", ".join(goals),
        ])
    return render(head, body, markdown)


def plot_bandwidth(rows: list[dict], path: Path) -> Path:
    """Bar chart of GB/s on minimal bytes per case, implementation and pass, with copy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = []
    for r in rows:
        if (r["shape"], r["dtype"]) not in cases:
            cases.append((r["shape"], r["dtype"]))
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    width = 0.8 / max(1, len(impls))
    for ax, op, goal in zip(axes, ("fwd", "bwd"), (FWD_GOAL, BWD_GOAL), strict=True):
        for k, impl in enumerate(impls):
            vals = [(_find(rows, s, d, impl, op) or {}).get("gbps", 0.0) for s, d in cases]
            ax.bar(np.arange(len(cases)) + (k - (len(impls) - 1) / 2) * width, vals, width,
                   label=impl)
        for c, (s, d) in enumerate(cases):
            cp = _find(rows, s, d, "copy", "copy")
            ax.hlines([cp["gbps"], goal * cp["gbps"]], c - 0.45, c + 0.45,
                      colors=["black", "gray"], linestyles=["solid", "dashed"])
        ax.set_xticks(np.arange(len(cases)))
        ax.set_xticklabels(["x".join(map(str, s)) + "\n" + d for s, d in cases], fontsize=8)
        ax.set_title(f"{op}: GB/s on minimal bytes (black: copy, dashed: {goal:.0%} of it)",
                     fontsize=9)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# Runs in a fresh interpreter: import, then the first float32 forward and backward.
_FIRST_CALL_SCRIPT = """
import json, time
t0 = time.perf_counter()
import numpy as np
import layernorm.cpu as lnc
t1 = time.perf_counter()
x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
y, cache = lnc.layer_norm_forward(x, np.ones(256, np.float32), np.zeros(256, np.float32))
t2 = time.perf_counter()
lnc.layer_norm_backward(y, cache)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "forward_s": t2 - t1, "backward_s": t3 - t2}))
"""


def first_call_latency() -> dict[str, dict[str, float]]:
    """Seconds to import ``layernorm.cpu`` and make the first float32 forward and backward in
    a fresh process: ``cold`` with an empty Numba cache (it compiles), ``warm`` loading what
    the cold run cached (what every later ``layernorm`` command pays)."""
    with tempfile.TemporaryDirectory() as cache_dir:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir}
        result = {}
        for label in ("cold", "warm"):
            done = subprocess.run([sys.executable, "-c", _FIRST_CALL_SCRIPT], env=env,
                                  capture_output=True, text=True, check=True)
            result[label] = json.loads(done.stdout)
    return result


def format_latency(latency: dict[str, dict[str, float]]) -> str:
    return "first call, fresh process (float32): " + "; ".join(
        f"{label}: import {t['import_s']:.2f} s, forward {t['forward_s']:.2f} s, "
        f"backward {t['backward_s']:.2f} s" for label, t in latency.items())


def parse_shape(text: str) -> tuple[int, ...]:
    """``"4096x1024"`` -> (4096, 1024), for argparse: every extent a positive integer."""
    try:
        return _validate.parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def default_out() -> Path:
    """bench/results/cpu-<host>-<YYYYmmdd-HHMMSS>.json under the current folder."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in platform.node()) or "host"
    return Path("bench") / "results" / f"cpu-{host}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", action="append", type=parse_shape,
                        help="shape like 4096x1024 (repeatable; replaces the standard shapes "
                             + ", ".join("x".join(map(str, s)) for s in STANDARD_SHAPES) + ")")
    parser.add_argument("--dtype", action="append", choices=NAMES,
                        help="dtype (repeatable; default float32)")
    parser.add_argument("--impl", action="append", choices=IMPLS,
                        help="implementation (repeatable; default: all installed)")
    parser.add_argument("--threads", type=int, help="threads for Numba and PyTorch "
                        "(default: Numba's default, all cores)")
    parser.add_argument("--rounds", type=int, help="rounds of interleaved batches (default 9, "
                        "5 with --quick)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds, shorter batches")
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/"
                        "cpu-<host>-<time>.json)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (this module) or cuda (layernorm.gpu.bench)")


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda":
        return importlib.import_module("layernorm.gpu.bench").run_cuda(args)
    if args.rounds is not None and args.rounds < 1:
        raise SystemExit(f"layernorm bench: --rounds must be >= 1, got {args.rounds}")
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"layernorm bench: --threads must be >= 1, got {args.threads}")
        try:
            set_threads(args.threads)
        except ValueError as exc:
            raise SystemExit(f"layernorm bench: --threads {args.threads}: {exc}") from None
    found = available_impls()
    impls = [i for i in (args.impl or IMPLS) if i in found]
    missing = [i for i in (args.impl or IMPLS) if i not in found]
    if missing:
        print(f"not installed, skipped: {', '.join(missing)}", file=sys.stderr)
    cases = [Case(s, d) for s in (args.shape or STANDARD_SHAPES)
             for d in (args.dtype or ["float32"])]
    rounds = args.rounds or (5 if args.quick else 9)
    result = run_bench(cases, impls, rounds, args.quick)
    if "fused" in impls:
        result["meta"]["first_call"] = first_call_latency()
    rows = result["rows"]
    print(f"layernorm bench: {result['meta']['threads']} threads, {rounds} rounds, "
          f"copy = {rows[0]['copy']}; p50 (p20-p80) over rounds\n")
    print(format_table(rows))
    print()
    print(summary_table(rows))
    if "first_call" in result["meta"]:
        print("\n" + format_latency(result["meta"]["first_call"]))
    out = args.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nsaved {out}")
    # PyTorch sums dgamma/dbeta in float32, outside the float32 tolerance at large M: shown in
    # the check column, not a failure of this package.
    failed = [r for r in rows if r["impl"] in ("numpy", "fused") and r["check"] > 1]
    return 1 if failed else 0


def report_section(ctx: object) -> str:
    """A short benchmark: the summary and full tables, and a bandwidth plot in ctx.outdir."""
    cases = [Case(s, "float32") for s in STANDARD_SHAPES]
    result = run_bench(cases, available_impls(), 3 if ctx.quick else 5, quick=True)
    rows = result["rows"]
    latency = first_call_latency() if "fused" in available_impls() else None
    result["meta"]["first_call"] = latency
    (ctx.outdir / "bench_cpu.json").write_text(json.dumps(result, indent=1))
    png = plot_bandwidth(rows, ctx.outdir / "bench_cpu_bandwidth.png")
    return (
        f"Fused Numba kernels (`layernorm.cpu`) against the NumPy reference and PyTorch's CPU "
        f"`layer_norm` with autograd, {result['meta']['threads']} threads, float32. Bandwidth is "
        f"GB/s on minimal bytes (2·M·D·4 forward, 3·M·D·4 backward) over the copy bandwidth "
        f"measured in the same run (`{rows[0]['copy']}`); p50 over interleaved rounds, with "
        f"p20-p80 in brackets. Goals: forward >= {FWD_GOAL:.0%} and backward >= "
        f"{BWD_GOAL:.0%} of copy, fwd+bwd >= {STEP_GOAL}x PyTorch. A short run: reproduce "
        f"with `layernorm bench` (results in `bench/results/`). The check column compares each "
        f"result with the float64 reference under `layernorm.tolerances`; PyTorch's float32 "
        f"dgamma/dbeta are summed in float32 and fall outside the float32 'param' tolerance, "
        f"which assumes float64 accumulation (shown, not failed).\n\n"
        + summary_table(rows, markdown=True)
        + ("" if latency is None else "\n\nCompiled kernels are cached on disk; "
           + format_latency(latency) + ".")
        + f"\n\n![bandwidth]({png.name})\n\n<details><summary>All rows</summary>\n\n"
        + format_table(rows, markdown=True)
        + "\n\n</details>\n"
    )
