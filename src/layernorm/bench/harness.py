"""The CPU benchmark's timing: every (provider, operation) of a case against a copy, in rounds.

    bench_case          one case (norm, shape, dtype): check each provider against the float64
                        reference, then time every (backend, op) pair and the copy
    run_bench           every case, each row stamped with the machine and the time; the run
                        records the load average before and after
    llc_bytes, regime   the last-level cache's size, and where a case's data lives
    set_threads         the thread count of PyTorch, on which the engine runs
    first_call_latency  import and first calls of layernorm.cpu in two fresh processes

Check: each provider's results against :func:`layernorm.bench.providers.reference` through
:func:`layernorm.tolerances.compare`; a row's ``check`` is the worst error in multiples of its
tolerance (pass: <= 1), so a run shows how far off a provider is rather than stopping.

Rounds: in each round every pair runs one batch (calls repeated for about 50 ms, 20 ms when
quick; the count set from the fastest of three calls), in an order rotated from round to round,
with a pause between batches so that the idle threads of one OpenMP pool stop spinning before
the next runs. Per pair, the per-call times of the rounds give p50 (p20-p80); speedups and
fractions of copy are medians (with p20-p80) over rounds of per-round ratios, since the pairs of
one round ran under the same machine load, so the spread carries the copy's own variance.
A provider's setup (for ``torch.compile``, the compilation) and its check run before the
rounds, untimed.

Bandwidth: GB/s on minimal bytes (:func:`layernorm.cost.minimal_bytes`; their sum for fwd+bwd;
:func:`pass_bytes`: without dresidual's for the add-norms' backward of the implementations that
return dx as dresidual too) and that as a fraction of the copy's GB/s
(:mod:`layernorm.bench.yardstick`: data of the case's size, the same threads, the same rounds,
read and write counted).

Where the data lives (:func:`regime`): "in cache" when the largest pass's minimal bytes fit in
the last-level cache, "DRAM" when even the copy's (2·M·D·itemsize) are at least twice its size,
else "straddles LLC" (part of the data stays in cache from call to call, a varying part, so
the copy and the passes, which move different amounts, are not in the same regime).

Other processes: with as many threads as cores, a process that takes a core stalls every
parallel call until its preempted thread runs again (a copy of 1x64x65536 float32 on 2 threads
of 2 cores fell from 30-34 GB/s to 4.0-4.4 GB/s while another process used one core, below its
single-threaded 10-18 GB/s). Each case records ``other_cores``, the CPU time other processes
(and the hypervisor's steal) used during its rounds over their wall time, from /proc/stat;
:func:`layernorm.bench.results.flag_rows` withholds verdicts where it is too high.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from ..cost import minimal_bytes
from ..dtypes import resolve
from ..family import norm as family_norm
from ..tolerances import compare
from . import providers, results
from .machine import run_meta

__all__ = ["PAUSE_S", "SHARED_GRADIENT", "STANDARD_SHAPES", "Case", "batch", "bench_case",
           "check", "first_call_latency", "interleaved", "llc_bytes", "pass_bytes",
           "quiet_torchao", "regime", "reps_for", "run_bench", "set_threads", "threads"]

# Implementations whose add-norm backward returns one tensor as the gradient of both x and the
# residual (autograd's own x + residual does, compiled or not; layernorm.torch does where the
# residual shares x's dtype, as in every case here): they write dresidual's bytes once, as dx.
SHARED_GRADIENT = ("layernorm.torch", "torch", "torch.compile")

STANDARD_SHAPES: tuple[tuple[int, ...], ...] = ((8, 512, 768), (4, 1024, 4096), (1, 64, 65536))
K = TypeVar("K")

PAUSE_S = 0.005  # between batches: lets the previous OpenMP pool's spinning threads sleep


@dataclass(frozen=True)
class Case:
    """One benchmarked problem: ``shape`` (..., D) in ``dtype``, for ``norm``."""

    shape: tuple[int, ...]
    dtype: str
    norm: str = "layer_norm"

    def __post_init__(self) -> None:
        family_norm(self.norm)  # a ValueError naming the choices

    @property
    def M(self) -> int:
        return int(np.prod(self.shape[:-1]))

    @property
    def D(self) -> int:
        return self.shape[-1]

    @property
    def label(self) -> str:
        return (family_norm(self.norm).title + " " + "x".join(map(str, self.shape)) + " "
                + self.dtype)


def check(norm: str, got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...],
          dtype: str) -> float:
    """The largest error among ``norm``'s results in multiples of its tolerance (pass: <= 1;
    inf where a result is non-finite and the reference is not).

    The parameters' gradients are sums over the M rows of products each rounded once, so
    their error grows like sqrt(M): their tolerance is scaled by sqrt(M) (as QuACK's tests do).
    """
    rows = want[0].size // want[0].shape[-1] if want[0].ndim else 1
    worst = 0.0
    for name, g, w in zip(providers.outputs(norm), got, want, strict=True):
        quantity = providers.quantity(norm, name)
        c = compare(g, w, dtype, quantity, scale=math.sqrt(rows) if quantity == "param" else 1)
        ratio = abs(c.got - c.want) / c.bound
        if not math.isfinite(ratio):  # matching infs or NaNs pass; a non-finite miss fails
            ratio = 0.0 if c.ok else math.inf
        worst = max(worst, ratio)
    return worst


def pass_bytes(case: Case, op: str, itemsize: int, impl: str) -> int:
    """The bytes ``impl``'s ``op`` ("fwd", "bwd" or "fwd+bwd") must move on ``case``: the minimal
    bytes, less dresidual's in the backward of an add-norm where ``impl`` returns dx as
    dresidual too (:data:`SHARED_GRADIENT`)."""
    passes = ("fwd", "bwd") if op == "fwd+bwd" else (op,)
    total = sum(minimal_bytes(p, case.M, case.D, itemsize, norm=case.norm) for p in passes)
    if "bwd" in passes and family_norm(case.norm).residual and impl in SHARED_GRADIENT:
        total -= case.M * case.D * itemsize
    return total


def llc_bytes(cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """Bytes of the last-level cache (the data or unified cache of the highest level that
    cpu0 sees, as Linux lists it under ``cache_dir``), or None where that is unknown."""
    best = None  # (level, bytes)
    for index in sorted(cache_dir.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not size:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1].upper(), 1)
        try:
            nbytes = int(size.rstrip("KMGkmg")) * unit
        except ValueError:
            continue
        if best is None or level > best[0]:
            best = (level, nbytes)
    return None if best is None else best[1]


def regime(case: Case, llc: int | None) -> str:
    """Where ``case``'s data lives with a last-level cache of ``llc`` bytes (module doc):
    :data:`~layernorm.bench.results.IN_CACHE`, :data:`~layernorm.bench.results.DRAM`,
    :data:`~layernorm.bench.results.STRADDLES` or, ``llc`` None,
    :data:`~layernorm.bench.results.UNKNOWN`."""
    if llc is None:
        return results.UNKNOWN
    itemsize = resolve(case.dtype).itemsize
    largest = max(minimal_bytes(p, case.M, case.D, itemsize, norm=case.norm)
                  for p in ("fwd", "bwd"))
    if largest <= llc:
        return results.IN_CACHE
    if 2 * case.M * case.D * itemsize >= 2 * llc:
        return results.DRAM
    return results.STRADDLES


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine has used, steal included; those of this process), or
    None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    own = os.times()
    return (user + nice + system + irq + softirq + steal) / tick, own.user + own.system


def _cpus() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _copy_op(case: Case) -> tuple[Callable[[], object], str]:
    dt = resolve(case.dtype)
    src = np.ones((case.M, case.D), dt)  # (M, D)
    dst = np.empty_like(src)
    try:
        from .yardstick import copier
    except ImportError:
        return (lambda: np.copyto(dst, src)), "np.copyto (1 thread)"
    return copier(src, dst), "layernorm.bench.yardstick.copy"


def batch(fn: Callable[[], object], reps: int) -> float:
    """Seconds per call over ``reps`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def reps_for(fn: Callable[[], object], target_s: float, cap: int | None = None) -> int:
    """Calls in a batch of about ``target_s`` seconds (at most ``cap``), from the fastest of
    three single calls: one call slowed by another process would set too few."""
    once = min(batch(fn, 1) for _ in range(3))
    n = max(1, round(target_s / max(once, 1e-7)))
    return n if cap is None else min(cap, n)


def interleaved(calls: dict[K, Callable[[], object]], reps: dict[K, int], rounds: int,
                pause: float | None = None,
                progress: Callable[[int, K], None] | None = None) -> dict[K, list[float]]:
    """Seconds per call of each of ``calls``, one figure a round, each a batch of ``reps[k]``
    calls: every round times every call in turn, the order rotated by one round by round (so
    that no call always follows the same one), ``pause`` seconds (:data:`PAUSE_S` where None)
    before each batch, after ``progress(round, key)``."""
    pause = PAUSE_S if pause is None else pause
    keys = list(calls)
    times: dict[K, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            if progress is not None:
                progress(r, k)
            if pause:
                time.sleep(pause)
            times[k].append(batch(calls[k], reps[k]))
    return times


def quiet_torchao() -> None:
    """Import torchao quietly, where installed (transformers imports it; the W8A8 benchmark
    measures it): it logs a warning for each of its CUDA libraries it cannot load, which on a
    machine without a GPU is every one, and torch warns of its enums' registration. Their
    errors still show."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    pytree = logging.getLogger("torch.utils._pytree")
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
    except ImportError:
        pass
    finally:
        pytree.setLevel(level)


def threads() -> int:
    """The threads the timed libraries use: PyTorch's (the engine runs on them), else 1."""
    try:
        import torch
    except ImportError:
        return 1
    return torch.get_num_threads()


def set_threads(n: int) -> None:
    """Use ``n`` threads in PyTorch, where installed (the engine runs on its threads)."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(n)


def bench_case(case: Case, backends: list[str], rounds: int, quick: bool,
               progress: Callable[[str], None]) -> list[dict]:
    """Time one case; one row per (backend, op) plus one copy row (see the module doc), each
    with its flags (:func:`layernorm.bench.results.flag_rows`)."""
    a = providers.inputs(case.norm, case.shape, case.dtype)
    itemsize = a["x"].itemsize
    want = providers.reference(case.norm, a)
    pairs: dict[tuple[str, str], Callable[[], object]] = {}
    checks: dict[str, float] = {}
    for name in backends:
        progress(f"{case.label}: checking {name}")
        ops, outputs_of = providers.PROVIDERS[(case.norm, name)].setup(a)
        checks[name] = check(case.norm, outputs_of(), want, case.dtype)
        for op, fn in ops.items():
            pairs[(name, op)] = fn
    copy_fn, copy_name = _copy_op(case)
    pairs[("copy", "copy")] = copy_fn

    target = 0.02 if quick else 0.05
    reps = {}
    for key, fn in pairs.items():
        progress(f"{case.label}: warming up {key[0]} {key[1]}")
        fn()  # compiles, faults the pages in
        reps[key] = reps_for(fn, target, cap=10_000)
    wall0, cpu0 = time.perf_counter(), _cpu_seconds()
    times = interleaved(pairs, reps, rounds, progress=lambda r, key: progress(
        f"{case.label}: round {r + 1}/{rounds} {key[0]} {key[1]}"))
    wall, cpu1 = time.perf_counter() - wall0, _cpu_seconds()
    other = (None if cpu0 is None or cpu1 is None
             else max(0.0, (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / wall)

    copy_t = np.array(times[("copy", "copy")])  # (rounds,)
    copy_bytes = 2 * case.M * case.D * itemsize
    copy_gbps = copy_bytes / float(np.median(copy_t)) / 1e9
    llc = llc_bytes()
    base = {
        "norm": case.norm, "shape": list(case.shape), "M": case.M, "D": case.D,
        "dtype": case.dtype, "threads": threads(), "cpus": _cpus(), "rounds": rounds,
        "copy_gbps": copy_gbps, "copy": copy_name, "llc_bytes": llc,
        "regime": regime(case, llc), "other_cores": other,
    }
    rows = []
    for (name, op), ts in times.items():
        t = np.array(ts)  # (rounds,)
        nbytes = copy_bytes if name == "copy" else pass_bytes(case, op, itemsize, name)
        p20, p50, p80 = np.percentile(t, [20, 50, 80])
        # per-round fractions of copy: this pair's GB/s over the copy's of the same round
        frac = (nbytes / t) / (copy_bytes / copy_t)  # (rounds,)
        # per-round ratios: peer's time over this pair's, both timed in the same round
        ratios = {peer: np.array(times[(peer, op)]) / t  # (rounds,)
                  for peer in backends if peer != name and (peer, op) in times}
        speedup = {peer: float(np.median(v)) for peer, v in ratios.items()}
        speedup_spread = {peer: [float(q) for q in np.percentile(v, [20, 80])]
                          for peer, v in ratios.items()}
        rows.append({
            **base, "impl": name, "op": op, "reps": reps[(name, op)],
            "p20_ms": p20 * 1e3, "p50_ms": p50 * 1e3, "p80_ms": p80 * 1e3,
            "bytes": nbytes, "gbps": nbytes / p50 / 1e9,
            "frac_copy": float(np.median(frac)),
            "frac_copy_p20_p80": [float(q) for q in np.percentile(frac, [20, 80])],
            "speedup": speedup, "speedup_p20_p80": speedup_spread,
            "check": None if name == "copy" else checks[name],
        })
    return results.flag_rows(rows)


def run_bench(cases: list[Case], backends: list[str], rounds: int, quick: bool,
              progress: Callable[[str], None] | None = None) -> dict:
    """Benchmark every case; returns ``{"meta": ..., "rows": [...]}`` (rows as bench_case).
    ``progress`` receives a status message before each step."""
    progress = progress or (lambda msg: None)
    meta = {**run_meta(), "threads": threads(), "llc_bytes": llc_bytes()}
    rows = []
    for case in cases:
        for row in bench_case(case, backends, rounds, quick, progress):
            rows.append({**row, "timestamp": meta["timestamp"], "host": meta["host"],
                         "machine": meta["machine"]})
    meta["loadavg"].append(os.getloadavg()[0])
    return {"meta": meta, "rows": rows}


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
    a fresh process, twice: ``first`` and ``second`` (nothing is compiled at a call: the C++
    engine was built once, by ``make``; the two differ by what the operating system caches)."""
    result = {}
    for label in ("first", "second"):
        done = subprocess.run([sys.executable, "-c", _FIRST_CALL_SCRIPT], capture_output=True,
                              text=True, check=True)
        result[label] = json.loads(done.stdout)
    return result
