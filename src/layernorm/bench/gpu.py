"""The GPU benchmark: the family's PyTorch API against PyTorch and public kernels, on CUDA.

    parse_shapes, rows_for      the (M, N) sweep: N = 256 ... 256K, M = 32,768 rows, fewer
                                where a tensor would pass 4 GiB (bfloat16: QuACK's 16,384
                                and 8,192 at 128K and 256K)
    unavailable                 why nothing can be measured here (no torch/triton, no CUDA, the
                                interpreter), or None
    measure                     every (dtype, M, N, norm): a copy, then each provider's passes,
                                each checked against the NumPy reference first
    sweep                       the loop itself, apart from CUDA: a provider's exception is a
                                row, the file is rewritten after every row, and the rows of
                                an earlier run can be kept and not measured again (resume)
    pass_bytes, make_row,       result rows and their JSON files,
    write_results, load_results,  bench/runs/gpu-<time>-<device>.json unless --out names a
    latest_results                file or folder; the newest of bench/runs and bench/results
    format_table, plot_bandwidth  fraction of copy per provider, our speed against each peer

Providers, per norm (a library that lacks a norm is absent for it; one that does not import
is absent, with a note). torch is ``torch.nn.functional``, after h = x + residual for an
add-norm, and torch.compile compiles that function, per N:

    norm            layernorm          torch        liger                         quack
    layer_norm      lt.layer_norm      layer_norm   LigerLayerNormFunction        layernorm_fwd/_bwd
    rms_norm        lt.rms_norm        rms_norm     LigerRMSNormFunction          rmsnorm
    add_layer_norm  lt.add_layer_norm  layer_norm   -                             -
    add_rms_norm    lt.add_rms_norm    rms_norm     LigerFusedAddRMSNormFunction  rmsnorm(residual)

``lt`` is :mod:`layernorm.torch`. Liger's RMSNorms run with its defaults (offset 0, casting
mode "llama") and ``in_place=False``, as in place overwrites dy with dx. QuACK
(``quack.rmsnorm``) takes float32 weight and bias, as in its own benchmarks; its layer norm
has no autograd Function, so ``layernorm_fwd`` (keeping mean and rstd) and ``layernorm_bwd``
are joined in one here.

Passes: ``fwd`` is the forward on inputs that need no gradient (nothing recorded for
autograd); ``bwd`` is ``torch.autograd.grad`` of the outputs (y, and h with its gradient dh
for an add-norm) on a kept graph, with respect to the inputs and parameters: dx (and
dresidual) and dweight (and dbias) with their final reduction.

Check: before timing, each pass's outputs on the first rows (y and h; dx and dresidual) are
compared with the NumPy reference (:mod:`layernorm.reference`, float64 on the same rounded
inputs, h rounded to the input dtype) through :func:`layernorm.tolerances.compare`.

Timing: each pass is captured in a CUDA graph and replayed, so the host's work of a Python
path is not timed; where capture fails, the calls themselves are timed (the row's
``timing`` says which, "cuda_graph" or "events"). Each run follows an L2 flush (a 256 MB
write) and is timed by CUDA events; the median of many runs is kept. A device-to-device copy
of an (M, N) tensor, timed the same way in the same run, is the bandwidth a pass is compared
with.

Bytes (:func:`pass_bytes`): the minimal bytes of :func:`layernorm.cost.minimal_bytes` (fwd
reads x, and residual, and writes y, and h; bwd reads x or h, dy, and dh, and writes dx, and
dresidual) plus the parameters (read; their gradients written backward), all at the input's
item size whatever dtype a provider keeps its parameters in, so GB/s compare as times do.

Resuming (``--resume``): :func:`measure` is given the rows of the results file
(:func:`kept_rows`), keeps those measured and measures only what they lack (a failed row is
measured again), so a run cut short (a time limit) goes on where it stopped. The rows of one
(dtype, M, N) share one copy bandwidth: a shape with rows kept reuses their copy figure
rather than measuring another.

Results: a JSON list of rows, rewritten after every row, with the keys of
:data:`RESULT_KEYS` (``ms`` and ``gbps`` null where the provider raised) and, of
:data:`OPTIONAL_KEYS`, ``timing`` for a measured row or ``error`` (the exception in one line)
for a failed one. Files written before the family was measured have no ``norm``: they are
read as layer_norm.

The providers, each pass's check and its timing, and the CUDA session that measures for
:func:`sweep`, are in :mod:`layernorm.bench.gpu_measure`. torch and triton are imported only
there and inside the functions that measure, so the results, the table and the plot (the
report's GPU section) work without them.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import family
from .._table import render
from .._validate import parse_shape, shape_extents
from ..cost import minimal_bytes
from ..dtypes import DTYPES
from .results import RECORD_DIR, RUNS_DIR, dumps

RESULT_KEYS = ("device", "norm", "dtype", "M", "N", "provider", "pass", "ms", "gbps",
               "copy_gbps")
OPTIONAL_KEYS = ("timing", "error")
NORMS = tuple(family.NORMS)
PROVIDERS = ("layernorm", "torch", "torch.compile", "liger", "quack")
PASSES = ("fwd", "bwd")
# The Triton kernels compute in float32: the dtypes whose compute dtype is float32.
GPU_DTYPES = tuple(name for name, d in DTYPES.items() if d.compute == "float32")
DEFAULT_DTYPES = ("bfloat16", "float32")
NS = tuple(2**k for k in range(8, 19))  # 256 ... 262,144
QUICK_NS = (1024, 4096, 32768, 262144)
MAX_ROWS = 32768
# At most 4 GiB per (M, N) tensor: for bfloat16, QuACK's row counts (M·N <= 2**31 elements,
# 16,384 rows at 128K and 8,192 at 256K), so figures compare with its published ones. An
# add-norm's backward holds eight such tensors and the CUDA graphs' outputs besides (about
# 40 GiB), which float32 at 2**31 elements (8 GiB a tensor) would take past an H100's 80 GB.
MAX_TENSOR_BYTES = 4 * 2**30
FLUSH_BYTES = 256 * 2**20  # larger than any GPU's L2
ROUNDS, QUICK_ROUNDS = 100, 25
WARMUP = 3
CHECK_ROWS = 4  # rows checked against the NumPy reference before timing
ERROR_CHARS = 300  # an error row's message is cut to its first line, at most this long
COMMAND = "layernorm bench --device cuda"
GOALS = {"fwd": 0.90, "bwd": 0.80}  # fraction of copy bandwidth for N >= 2K on an H100


def rows_for(N: int, dtype: str = "bfloat16") -> int:
    """M for row length N: 32,768 rows, fewer when an (M, N) tensor of ``dtype`` would pass
    :data:`MAX_TENSOR_BYTES`."""
    return max(1, min(MAX_ROWS, MAX_TENSOR_BYTES // (DTYPES[dtype].itemsize * N)))


def parse_shapes(specs: Sequence[Any] | None, quick: bool, dtype: str = "bfloat16"
                 ) -> list[tuple[int, int]]:
    """(M, N) pairs from ``--shape`` values: tuples of at least two positive extents (as
    :func:`layernorm.commands.shape` parses them; the leading extents multiply into M) or
    their text, ``"MxN"``. None gives the default sweep (a shorter one with ``quick``), where
    :func:`rows_for` picks M for ``dtype``."""
    if not specs:
        return [(rows_for(n, dtype), n) for n in (QUICK_NS if quick else NS)]
    shapes = []
    for spec in specs:
        dims = parse_shape(spec) if isinstance(spec, str) else shape_extents(spec)
        shapes.append((math.prod(dims[:-1]), dims[-1]))
    return shapes


# ---------------------------------------------------------------------------------------------
# Result rows and files (no torch)
# ---------------------------------------------------------------------------------------------


def pass_bytes(norm: str, pass_: str, M: int, N: int, itemsize: int) -> int:
    """Bytes a pass must move: the (M, N) arrays of :func:`layernorm.cost.minimal_bytes` and
    the parameters (read; their gradients written in the backward), at ``itemsize``."""
    # the parameters are what cost's extras add with them less what they add without (the
    # per-row statistics, which an implementation may recompute rather than move)
    params = (minimal_bytes(pass_, M, N, itemsize, norm=norm, extras=True)
              - minimal_bytes(pass_, M, N, itemsize, norm=norm, extras=True, affine=False))
    return minimal_bytes(pass_, M, N, itemsize, norm=norm) + params


def make_row(
    device: str, norm: str, dtype: str, M: int, N: int, provider: str, pass_: str,
    ms: float | None, copy_gbps: float, *, timing: str | None = None, error: str | None = None,
) -> dict[str, Any]:
    """One result row: GB/s on :func:`pass_bytes` over ``ms``. A measured row has ``timing``
    ("cuda_graph" or "events"); a failed one has ``ms`` None and ``error``."""
    gbps = None if ms is None else pass_bytes(norm, pass_, M, N, DTYPES[dtype].itemsize) / (
        ms * 1e6)
    row = {"device": device, "norm": norm, "dtype": dtype, "M": M, "N": N,
           "provider": provider, "pass": pass_, "ms": ms, "gbps": gbps, "copy_gbps": copy_gbps}
    if timing is not None:
        row["timing"] = timing
    if error is not None:
        row["error"] = error
    return row


@functools.cache
def _run_started() -> float:
    return time.time()


def results_path(device: str) -> str:
    """File name of a results file: sorts by time, then names the device. The time is when
    this process first named a file, so the rewrites during a run, and a final write after
    it, go to one file."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(_run_started()))
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "gpu"
    return f"gpu-{stamp}-{slug}.json"


def names_a_file(out: Path | str) -> bool:
    """Whether ``out`` (``--out``) names a results file (a .json name, any case) rather than
    a folder for one."""
    return Path(out).suffix.lower() == ".json"


def results_file(out: Path | str | None, device: str) -> Path:
    """Where rows go: ``out`` if it names a .json file, else a :func:`results_path` file in
    the folder ``out`` (default bench/runs)."""
    out = RUNS_DIR if out is None else Path(out)
    return out if names_a_file(out) else out / results_path(device)


def write_results(rows: list[dict[str, Any]], out: Path | str | None, device: str) -> Path:
    """Write ``rows`` as JSON to :func:`results_file`, replacing it whole (a crash while
    writing leaves the previous version)."""
    path = results_file(out, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(rows))
    os.replace(tmp, path)
    return path


def load_results(path: Path) -> list[dict[str, Any]]:
    """The rows of a results file, each checked to have the keys of :data:`RESULT_KEYS` and
    no others but :data:`OPTIONAL_KEYS`; a row with no ``norm`` (an older file) is
    layer_norm."""
    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of rows, got {type(rows).__name__}")
    out = []
    for row in rows:
        row = {"norm": "layer_norm", **row} if isinstance(row, dict) else row
        if not isinstance(row, dict) or not set(RESULT_KEYS) <= set(row) <= {
                *RESULT_KEYS, *OPTIONAL_KEYS}:
            raise ValueError(f"{path}: every row must have the keys {RESULT_KEYS} and may have "
                             f"{OPTIONAL_KEYS}, got {row!r}")
        out.append(row)
    return out


def latest_results(*folders: Path) -> Path | None:
    """The newest ``gpu-*.json`` in ``folders`` (default bench/runs, where runs go, and
    bench/results, the record; names sort by time), or None."""
    paths = [p for f in (folders or (RUNS_DIR, RECORD_DIR)) for p in Path(f).glob("gpu-*.json")]
    return max(paths, key=lambda p: p.name) if paths else None


def _fraction(row: dict[str, Any]) -> float | None:
    """A row's GB/s over its copy's, or None for a failed row."""
    return None if row["ms"] is None else row["gbps"] / row["copy_gbps"]


def format_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """One line per (norm, dtype, pass, N): copy GB/s, each provider's fraction of it ("err"
    where it raised), and how many times faster ``layernorm`` is than each peer (peer ms /
    layernorm ms; > 1 is faster)."""
    providers = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    peers = [p for p in providers if p != "layernorm"]
    head = ["norm", "dtype", "pass", "N", "M", "copy GB/s", *(f"{p} of copy" for p in providers),
            *(f"vs {p}" for p in peers)]
    groups: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        key = (r["norm"], r["dtype"], r["pass"], r["N"], r["M"])
        groups.setdefault(key, {})[r["provider"]] = r
    body = []
    order = sorted(groups, key=lambda k: (NORMS.index(k[0]), k[1], PASSES.index(k[2]), k[3]))
    for key in order:
        by = groups[key]
        line = [key[0], key[1], key[2], str(key[3]), str(key[4]),
                f"{next(iter(by.values()))['copy_gbps']:.0f}"]
        fractions = {p: _fraction(r) for p, r in by.items()}
        line += ["-" if p not in by else "err" if fractions[p] is None else f"{fractions[p]:.2f}"
                 for p in providers]
        ours = fractions.get("layernorm")
        line += [f"{by[p]['ms'] / by['layernorm']['ms']:.2f}x"
                 if ours is not None and fractions.get(p) is not None else "-" for p in peers]
        body.append(line)
    return render(head, body, markdown, align=">")


def plot_bandwidth(rows: list[dict[str, Any]], path: Path) -> Path:
    """Fraction of copy bandwidth against N: one row of panels per norm, one panel per
    (pass, dtype), one line per provider (failed rows left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["ms"] is not None]
    norms = [n for n in NORMS if any(r["norm"] == n for r in done)]
    columns = [(p, d) for p in PASSES for d in sorted({r["dtype"] for r in done})
               if any((r["pass"], r["dtype"]) == (p, d) for r in done)]
    fig, axes = plt.subplots(len(norms), len(columns), squeeze=False, sharex=True, sharey=True,
                             figsize=(4.5 * len(columns), 3.4 * len(norms)))
    for i, norm in enumerate(norms):
        for j, (pass_, dtype) in enumerate(columns):
            ax = axes[i][j]
            for provider in PROVIDERS:
                pts = sorted((r["N"], _fraction(r)) for r in done
                             if (r["norm"], r["pass"], r["dtype"], r["provider"])
                             == (norm, pass_, dtype, provider))
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=provider)
            ax.axhline(GOALS[pass_], color="grey", linestyle="--", linewidth=1, label="goal")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{family.norm(norm).title} {pass_} {dtype}")
            ax.set_xlabel("N (row length)")
            ax.set_ylabel("fraction of copy bandwidth")
            ax.grid(True, alpha=0.3)
    labels = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            labels.setdefault(label, handle)
    fig.legend(list(labels.values()), list(labels), loc="upper right", fontsize=8)
    fig.suptitle(rows[0]["device"])
    fig.tight_layout(rect=(0, 0, 0.92, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# The sweep (no torch: the measuring is a session's)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Provider:
    """``fn(*inputs, *params)`` -> y, or (y, h) for an add-norm, differentiable by autograd:
    inputs are x (and residual), params weight (and bias), as :mod:`layernorm.family` orders
    them. ``fp32_params``: it takes float32 parameters whatever x's dtype."""

    name: str
    fn: Callable[..., Any]
    fp32_params: bool = False


@dataclass(frozen=True)
class Measured:
    """One pass of one provider: sorted times (ms), how they were taken ("cuda_graph" or
    "events"), how its results differ from the reference (None if they agree), and why it
    was not captured in a graph (None if it was)."""

    times: list[float]
    timing: str
    mismatch: str | None = None
    capture_error: str | None = None


def _one_line(exc: BaseException) -> str:
    """``Type: message``, the message's first line, at most :data:`ERROR_CHARS` long."""
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first.strip()}"[:ERROR_CHARS]


def _quantiles(times: list[float]) -> tuple[float, float, float]:
    """p50, p20, p80 of sorted times."""
    if len(times) < 2:
        return times[0], times[0], times[0]
    q = statistics.quantiles(times, n=10, method="inclusive")
    return statistics.median(times), q[1], q[7]


def _key(row: dict[str, Any]) -> tuple:
    """What a row measured: (dtype, M, N, norm, provider, pass)."""
    return row["dtype"], row["M"], row["N"], row["norm"], row["provider"], row["pass"]


def sweep(session: Any, device: str, dtypes: Sequence[str], shapes: Sequence[tuple[int, int]],
          norms: Sequence[str], path: Path, kept: Sequence[dict[str, Any]] = ()
          ) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows for every (dtype, M, N, norm, provider, pass), and the problems found; ``path`` is
    rewritten after every row and progress printed.

    ``session`` measures: ``copy_gbps(dtype, M, N)``, ``providers(norm, N)`` -> (providers,
    notes on missing ones), ``run(provider, norm, dtype, M, N, pass_)`` -> :class:`Measured`,
    and ``release()`` after a failure (frees what it can). An exception from ``run`` is a row
    with ``ms`` None and the exception in ``error``, and the sweep goes on; a shape whose copy
    cannot be measured is skipped with a note.

    ``kept``: rows of an earlier run, returned first (and written) as they are. Those measured
    are not measured again, and a shape with measured rows reuses their copy bandwidth; a
    failed one is measured again and replaced."""
    rows = list(kept)
    done = {_key(r) for r in rows if r["ms"] is not None}
    copies = {(r["dtype"], r["M"], r["N"]): r["copy_gbps"] for r in rows if r["ms"] is not None}
    problems: list[str] = []
    uncaptured: set[tuple[str, str, str]] = set()  # (provider, norm, pass) noted once

    def note(text: str) -> None:
        if text not in problems:
            problems.append(text)

    def record(row: dict[str, Any], detail: str) -> None:
        rows[:] = [r for r in rows if _key(r) != _key(row)]  # a failed kept row is replaced
        rows.append(row)
        write_results(rows, path, device)
        print(f"  {row['norm']:>14} {row['pass']} {row['provider']:>13}: {detail}", flush=True)

    def copy_of(dtype: str, M: int, N: int) -> float | None:
        """The shape's copy bandwidth: kept, or measured now (None if that fails)."""
        if (dtype, M, N) not in copies:
            try:
                copies[dtype, M, N] = session.copy_gbps(dtype, M, N)
            except Exception as exc:  # any failure: the sweep goes on
                session.release()
                note(f"copy M={M} N={N} {dtype}: {_one_line(exc)}; shape skipped")
                copies[dtype, M, N] = None
                return None
            print(f"{dtype} M={M} N={N}: copy {copies[dtype, M, N]:.0f} GB/s", flush=True)
        return copies[dtype, M, N]

    def shape(dtype: str, M: int, N: int) -> None:
        for norm in norms:
            providers, notes = session.providers(norm, N)
            for text in notes:
                note(text)
            for prov in providers:
                for pass_ in PASSES:
                    if (dtype, M, N, norm, prov.name, pass_) in done:
                        continue
                    copy = copy_of(dtype, M, N)
                    if copy is None:
                        return
                    record(*_measure_one(session, device, prov, norm, dtype, M, N, pass_, copy,
                                         note, uncaptured))

    if rows:
        write_results(rows, path, device)
        print(f"kept {len(done)} measured rows of {path}; measuring the rest", flush=True)
    for dtype in dtypes:
        for M, N in shapes:
            shape(dtype, M, N)
    return rows, problems


def _measure_one(session: Any, device: str, prov: Provider, norm: str, dtype: str, M: int,
                 N: int, pass_: str, copy: float, note: Callable[[str], None],
                 uncaptured: set[tuple[str, str, str]]) -> tuple[dict[str, Any], str]:
    """One pass of one provider: its row and the progress line's detail."""
    where = f"{prov.name} {norm} N={N} {dtype}"
    try:
        m = session.run(prov, norm, dtype, M, N, pass_)
    except Exception as exc:  # any failure is a row
        error = _one_line(exc)
        note(f"{where} {pass_}: failed: {error}")
        session.release()
        return (make_row(device, norm, dtype, M, N, prov.name, pass_, None, copy, error=error),
                f"failed: {error}")
    if m.mismatch:
        note(f"{where}: differs from the reference: {m.mismatch}")
    if m.capture_error and (prov.name, norm, pass_) not in uncaptured:
        uncaptured.add((prov.name, norm, pass_))
        note(f"{prov.name} {norm} {pass_}: timed by events where it does not capture in a CUDA "
             f"graph (first at N={N} {dtype}: {m.capture_error})")
    p50, p20, p80 = _quantiles(m.times)
    row = make_row(device, norm, dtype, M, N, prov.name, pass_, p50, copy, timing=m.timing)
    return row, (f"{p50:.4f} ms (p20 {p20:.4f}, p80 {p80:.4f})  {row['gbps']:.0f} GB/s  "
                 f"{row['gbps'] / copy:.2f} of copy"
                 f"{'' if m.timing == 'cuda_graph' else '  (events)'}")


def unavailable() -> str | None:
    """Why :func:`measure` cannot run here (a clause: "no CUDA device ..."), or None."""
    try:
        import torch

        from ..gpu import kernels
    except ImportError as exc:
        return f"needs torch and triton ({exc}): from a checkout, pip install -e '.[gpu]'"
    if not torch.cuda.is_available():
        return "no CUDA device is available here, so there is nothing to measure"
    if kernels.INTERPRET:
        return ("TRITON_INTERPRET=1 is set, which runs the kernels in Triton's interpreter; "
                "unset it to measure")
    return None


def kept_rows(path: Path | str) -> list[dict[str, Any]]:
    """The rows of the results file ``path`` to resume (none if it does not exist yet);
    ValueError if it is not a results file or holds rows of another device than this one."""
    import torch

    path = Path(path)
    if not path.exists():
        return []
    rows = load_results(path)
    device = torch.cuda.get_device_name()
    others = sorted({r["device"] for r in rows} - {device})
    if others:
        raise ValueError(f"{path} holds rows measured on {', '.join(others)}, not on this "
                         f"{device}")
    return rows


def measure(dtypes: Sequence[str], specs: Sequence[Any] | None, quick: bool, rounds: int,
            norms: Iterable[str] | None = None, out: Path | str | None = None,
            kept: Sequence[dict[str, Any]] = (), compile_ns: Iterable[int] | None = None
            ) -> tuple[list[dict[str, Any]], list[str], str, Path]:
    """Rows for every dtype (names of :data:`GPU_DTYPES`), shape (``specs`` and ``quick`` as
    for :func:`parse_shapes`, M picked per dtype) and norm (default: the family), the problems
    found, the device's name and the results file: rows are written to :func:`results_file` of
    ``out`` as they come and progress is printed. ``kept``: rows of an earlier run (see
    :func:`kept_rows`), kept, and not measured again. ``compile_ns``: the row lengths at
    which the torch.compile peer is measured (None: every one). Needs :func:`unavailable` to
    be None."""
    import torch

    from .gpu_measure import CudaSession

    norms = list(NORMS if norms is None else norms)
    for n in norms:
        family.norm(n)
    device = torch.cuda.get_device_name()
    path = results_file(out, device)
    session, rows, problems = CudaSession(rounds, compile_ns), list(kept), []
    for dtype in dtypes:
        rows, found = sweep(session, device, [dtype], parse_shapes(specs, quick, dtype), norms,
                            path, kept=rows)
        problems += [p for p in found if p not in problems]
    return rows, problems, device, path
