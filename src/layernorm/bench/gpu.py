"""The GPU benchmark: the fused Triton kernels against PyTorch and public kernels, on CUDA.

    parse_shapes, rows_for      the (M, N) sweep: N = 256 ... 256K, M = 32,768 rows or fewer
    unavailable                 why nothing can be measured here (no torch/triton, no CUDA, the
                                interpreter), or None
    measure                     every (dtype, M, N): a copy, then each provider's forward and
                                backward, each checked against the NumPy reference first
    make_row, write_results,    result rows (exactly :data:`RESULT_KEYS`) and their JSON files,
    load_results, latest_results  bench/results/gpu-<time>-<device>.json
    format_table, plot_bandwidth  fraction of copy per provider, our speed against each peer

Timing: the median of many runs timed by CUDA events, L2 flushed before every run (a 256 MB
write); the forward is y, the backward dx, dweight and dbias (final reduction included). A
device-to-device copy of the same tensor, timed the same way in the same run, is the
bandwidth a pass is compared with: quality is GB/s on minimal bytes
(:func:`layernorm.cost.minimal_bytes`) over that copy's GB/s.

Providers: ``layernorm`` (ours), ``torch`` (eager ``F.layer_norm``), ``torch.compile`` (of
``F.layer_norm``), and ``liger`` (Liger-Kernel) and ``quack`` (QuACK) when importable. Their
y and dx on the first rows are compared with the NumPy reference through
:func:`layernorm.tolerances.compare` before timing.

torch and triton are imported only inside the functions that run on a GPU, so the results,
the table and the plot (the report's GPU section) work without them.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._table import render
from .._validate import parse_shape
from ..cost import minimal_bytes
from ..dtypes import DTYPES
from ..tolerances import compare

RESULTS_DIR = Path("bench") / "results"
RESULT_KEYS = ("device", "dtype", "M", "N", "provider", "pass", "ms", "gbps", "copy_gbps")
PROVIDERS = ("layernorm", "torch", "torch.compile", "liger", "quack")
# The Triton kernels compute in float32: the dtypes whose compute dtype is float32.
GPU_DTYPES = tuple(name for name, d in DTYPES.items() if d.compute == "float32")
DEFAULT_DTYPES = ("bfloat16", "float32")
NS = tuple(2**k for k in range(8, 19))  # 256 ... 262,144
QUICK_NS = (1024, 4096, 32768, 262144)
MAX_ROWS = 32768
MAX_ELEMENTS = 2**30  # fewer rows for the largest N: 2 GB (bf16) or 4 GB (fp32) per tensor
FLUSH_BYTES = 256 * 2**20  # larger than any GPU's L2
ROUNDS, QUICK_ROUNDS = 100, 25
WARMUP = 3
CHECK_ROWS = 4  # rows checked against the NumPy reference before timing
EPS = 1e-5
COMMAND = "layernorm bench --device cuda"
GOALS = {"fwd": 0.90, "bwd": 0.80}  # fraction of copy bandwidth for N >= 2K on an H100


def rows_for(N: int) -> int:
    """M for row length N: 32,768 rows, fewer when M·N would pass 2**30 elements."""
    return max(1, min(MAX_ROWS, MAX_ELEMENTS // N))


def parse_shapes(specs: Sequence[Any] | None, quick: bool) -> list[tuple[int, int]]:
    """(M, N) pairs from ``--shape`` values: a shape tuple (M is the product of the leading
    extents; a 1-tuple is N alone), ``"MxN"``, ``"N"`` or an int N; N alone gets M from
    :func:`rows_for`. None gives the default sweep (a shorter one with ``quick``)."""
    if not specs:
        return [(rows_for(n), n) for n in (QUICK_NS if quick else NS)]
    shapes = []
    for spec in specs:
        if isinstance(spec, str):
            dims = list(parse_shape(spec))
        elif isinstance(spec, (tuple, list)) and spec and all(
                isinstance(d, int) and not isinstance(d, bool) for d in spec):
            dims = list(spec)
        elif isinstance(spec, int) and not isinstance(spec, bool):
            dims = [spec]
        else:
            raise ValueError(f"shape must be 'MxN', 'N' or a tuple of ints, got {spec!r}")
        if min(dims) < 1:
            raise ValueError(f"shape extents must be >= 1, got {spec!r}")
        n = dims[-1]
        shapes.append((math.prod(dims[:-1]) if len(dims) > 1 else rows_for(n), n))
    return shapes


def make_row(
    device: str, dtype: str, M: int, N: int, provider: str, pass_: str, ms: float,
    copy_gbps: float,
) -> dict[str, Any]:
    """One result row; gbps is on the minimal bytes of the pass."""
    itemsize = DTYPES[dtype].itemsize
    gbps = minimal_bytes(pass_, M, N, itemsize) / (ms * 1e6)
    row = {"device": device, "dtype": dtype, "M": M, "N": N, "provider": provider,
           "pass": pass_, "ms": ms, "gbps": gbps, "copy_gbps": copy_gbps}
    return {k: row[k] for k in RESULT_KEYS}


def results_path(device: str, when: float | None = None) -> str:
    """File name of a results file: sorts by time, then names the device."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "gpu"
    return f"gpu-{stamp}-{slug}.json"


def write_results(rows: list[dict[str, Any]], out: Path | str | None, device: str) -> Path:
    """Write ``rows`` as JSON to ``out`` (a .json file, or a folder; default bench/results)."""
    out = RESULTS_DIR if out is None else Path(out)
    path = out if out.suffix == ".json" else out / results_path(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    return path


def load_results(path: Path) -> list[dict[str, Any]]:
    """The rows of a results file, each checked to have exactly :data:`RESULT_KEYS`."""
    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of rows, got {type(rows).__name__}")
    for row in rows:
        if not isinstance(row, dict) or set(row) != set(RESULT_KEYS):
            raise ValueError(f"{path}: every row must have exactly the keys {RESULT_KEYS}, "
                             f"got {row!r}")
    return rows


def latest_results(folder: Path = RESULTS_DIR) -> Path | None:
    """The newest ``gpu-*.json`` in ``folder`` (names sort by time), or None."""
    paths = sorted(Path(folder).glob("gpu-*.json"))
    return paths[-1] if paths else None


def _peers(rows: Iterable[dict[str, Any]]) -> list[str]:
    present = {r["provider"] for r in rows}
    return [p for p in PROVIDERS if p in present and p != "layernorm"]


def format_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """One line per (dtype, pass, N): copy GB/s, each provider's fraction of it, and how many
    times faster ``layernorm`` is than each peer (peer ms / layernorm ms; > 1 is faster)."""
    providers = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    peers = _peers(rows)
    head = ["dtype", "pass", "N", "M", "copy GB/s", *(f"{p} of copy" for p in providers),
            *(f"vs {p}" for p in peers)]
    groups: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["pass"], r["N"], r["M"]), {})[r["provider"]] = r
    body = []
    order = sorted(groups, key=lambda k: (k[0], k[1] != "fwd", k[2]))
    for dtype, pass_, n, m in order:
        by = groups[(dtype, pass_, n, m)]
        copy = next(iter(by.values()))["copy_gbps"]
        line = [dtype, pass_, str(n), str(m), f"{copy:.0f}"]
        line += [f"{by[p]['gbps'] / by[p]['copy_gbps']:.2f}" if p in by else "-" for p in providers]
        ours = by.get("layernorm")
        line += [f"{by[p]['ms'] / ours['ms']:.2f}x" if ours and p in by else "-" for p in peers]
        body.append(line)
    return render(head, body, markdown, align=">")


def plot_bandwidth(rows: list[dict[str, Any]], path: Path) -> Path:
    """Fraction of copy bandwidth against N, one panel per (pass, dtype), one line per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in rows})
    passes = [p for p in ("fwd", "bwd") if any(r["pass"] == p for r in rows)]
    fig, axes = plt.subplots(len(passes), len(dtypes), squeeze=False, sharex=True, sharey=True,
                             figsize=(5 * len(dtypes), 3.6 * len(passes)))
    for i, pass_ in enumerate(passes):
        for j, dtype in enumerate(dtypes):
            ax = axes[i][j]
            for provider in PROVIDERS:
                pts = sorted((r["N"], r["gbps"] / r["copy_gbps"]) for r in rows
                             if (r["pass"], r["dtype"], r["provider"]) == (pass_, dtype, provider))
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=provider)
            ax.axhline(GOALS[pass_], color="grey", linestyle="--", linewidth=1, label="goal")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{pass_} {dtype}")
            ax.set_xlabel("N (row length)")
            ax.set_ylabel("fraction of copy bandwidth")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(rows[0]["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Measurement (needs torch and a CUDA device)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Provider:
    """fn(x, weight, bias) -> y. ``backward``: y can be differentiated; ``bias``: it takes a
    bias; ``fp32_params``: it takes float32 weight and bias whatever x's dtype."""

    name: str
    fn: Callable[..., Any]
    backward: bool = True
    bias: bool = True
    fp32_params: bool = False


def _providers(N: int) -> tuple[list[Provider], list[str]]:
    """The providers for rows of length N, and notes on the ones missing."""
    import torch
    import torch.nn.functional as F

    from ..gpu.api import layer_norm

    def torch_ln(x, w, b):
        return F.layer_norm(x, (N,), w, b, EPS)

    torch._dynamo.reset()  # a fresh cache per N: no recompile limit, no dynamic shapes
    found = [
        Provider("layernorm", lambda x, w, b: layer_norm(x, (N,), w, b, EPS)),
        Provider("torch", torch_ln),
        Provider("torch.compile", torch.compile(torch_ln, dynamic=False)),
    ]
    notes = []
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        found.append(Provider("liger", lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)))
    except ImportError as exc:
        notes.append(f"liger: not importable ({exc})")
    try:  # QuACK's API moved between versions: with autograd (no bias), or forward only
        from quack.layernorm import layernorm as quack_ln

        found.append(Provider("quack", lambda x, w, b: quack_ln(x, w, EPS), bias=False,
                              fp32_params=True))
        notes.append("quack: weight only (this version takes no bias)")
    except ImportError:
        try:
            from quack.rmsnorm import layernorm_fwd

            found.append(Provider("quack", lambda x, w, b: layernorm_fwd(x, w, b, EPS),
                                  backward=False, fp32_params=True))
            notes.append("quack: forward only (this version has no layer-norm backward)")
        except ImportError as exc:
            notes.append(f"quack: not importable ({exc})")
    return found, notes


def _time_ms(fn: Callable[[], Any], rounds: int, flush: Any,
             before: Callable[[], Any] | None = None) -> list[float]:
    """Sorted times (ms) of ``rounds`` runs of ``fn``, each after an L2 flush, by CUDA events."""
    import torch

    for _ in range(WARMUP):
        if before:
            before()
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rounds)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rounds)]
    for start, end in zip(starts, ends, strict=True):
        if before:
            before()
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def _quantiles(times: list[float]) -> tuple[float, float, float]:
    """p50, p20, p80 of sorted times."""
    q = statistics.quantiles(times, n=10, method="inclusive")
    return statistics.median(times), q[1], q[7]


def _check_rows(dtype: str, x: Any, w: Any, b: Any, y: Any, dy: Any = None,
                dx: Any = None) -> str | None:
    """None if y (and dx) match the NumPy reference on the first rows, else what differs."""
    from ..reference import layer_norm_backward, layer_norm_forward

    def f64(t):
        return None if t is None else t.detach().double().cpu().numpy()

    n = CHECK_ROWS
    yr, cache = layer_norm_forward(f64(x[:n]), f64(w), f64(b), EPS)
    pairs = [("y", f64(y[:n]), yr)]
    if dx is not None:
        pairs.append(("dx", f64(dx[:n]), layer_norm_backward(f64(dy[:n]), cache)[0]))
    for name, got, want in pairs:
        c = compare(got, want, dtype, "out")
        if not c:
            return (f"{name}: max error {c.max_abs_err:.2e}, at {c.index} {c.got:.6g} against "
                    f"{c.want:.6g} (bound {c.bound:.2e})")
    return None


def _copy_gbps(x: Any, rounds: int, flush: Any) -> float:
    """Bandwidth of a device-to-device copy of x (read and write), timed like the passes."""
    import torch

    dst = torch.empty_like(x)
    p50 = _quantiles(_time_ms(lambda: dst.copy_(x), rounds, flush))[0]
    return 2 * x.numel() * x.element_size() / (p50 * 1e6)


def _measure_provider(prov: Provider, dtype_name: str, x: Any, w: Any, b: Any, dy: Any,
                      rounds: int, flush: Any) -> tuple[dict[str, list[float]], str | None]:
    """Sorted times per pass of one provider, and how it differs from the reference (or None)."""
    import torch

    w = w.float() if prov.fp32_params else w
    b = (b.float() if prov.fp32_params else b) if prov.bias else None
    with torch.no_grad():
        err = _check_rows(dtype_name, x, w, b, prov.fn(x, w, b))
    times = {"fwd": _time_ms(lambda: prov.fn(x, w, b), rounds, flush)}
    if prov.backward:
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        bg = None if b is None else b.detach().requires_grad_()
        y = prov.fn(xg, wg, bg)
        y.backward(dy, retain_graph=True)
        err = err or _check_rows(dtype_name, x, w, b, y, dy, xg.grad)

        def clear_grads() -> None:
            xg.grad = wg.grad = None
            if bg is not None:
                bg.grad = None

        times["bwd"] = _time_ms(lambda: y.backward(dy, retain_graph=True), rounds, flush,
                                before=clear_grads)
    return times, err


def _measure_shape(dtype_name: str, M: int, N: int, rounds: int, flush: Any,
                   device: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows for one (dtype, M, N), and the problems found (our own mismatch among them)."""
    import torch

    dtype = getattr(torch, DTYPES[dtype_name].torch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, N, device="cuda", dtype=dtype, generator=gen)
    dy = torch.randn(M, N, device="cuda", dtype=dtype, generator=gen)
    w = (1 + 0.1 * torch.randn(N, device="cuda", generator=gen)).to(dtype)
    b = (0.1 * torch.randn(N, device="cuda", generator=gen)).to(dtype)

    copy_gbps = _copy_gbps(x, rounds, flush)
    print(f"{dtype_name} M={M} N={N}: copy {copy_gbps:.0f} GB/s", flush=True)

    providers, problems = _providers(N)
    rows = []
    for prov in providers:
        try:
            times, err = _measure_provider(prov, dtype_name, x, w, b, dy, rounds, flush)
        except torch.cuda.OutOfMemoryError:
            problems.append(f"{prov.name} N={N} {dtype_name}: out of memory, skipped")
            torch.cuda.empty_cache()
            continue
        if err:
            problems.append(f"{prov.name} N={N} {dtype_name}: differs from the reference: {err}")
        for pass_, t in times.items():
            p50, p20, p80 = _quantiles(t)
            row = make_row(device, dtype_name, M, N, prov.name, pass_, p50, copy_gbps)
            rows.append(row)
            print(f"  {pass_} {prov.name:>13}: {p50:.4f} ms (p20 {p20:.4f}, p80 {p80:.4f})  "
                  f"{row['gbps']:.0f} GB/s  {row['gbps'] / copy_gbps:.2f} of copy", flush=True)
    return rows, problems


def unavailable() -> str | None:
    """Why :func:`measure` cannot run here (a sentence naming the command), or None."""
    try:
        import torch

        from ..gpu import kernels
    except ImportError as exc:
        return f"{COMMAND} needs torch and triton ({exc}): pip install 'layernorm[gpu]'"
    if not torch.cuda.is_available():
        return (f"{COMMAND}: no CUDA device is available here, so there is nothing to measure. "
                "Run it on a machine with an NVIDIA GPU.")
    if kernels.INTERPRET:
        return (f"{COMMAND}: TRITON_INTERPRET=1 is set, which runs kernels in the interpreter; "
                "unset it to measure.")
    return None


def measure(dtypes: Sequence[str], shapes: Sequence[tuple[int, int]], rounds: int
            ) -> tuple[list[dict[str, Any]], list[str], str]:
    """Rows for every dtype (names of :data:`GPU_DTYPES`) and (M, N), the problems found, and
    the device's name; progress is printed as it goes. Needs :func:`unavailable` to be None."""
    import torch

    device = torch.cuda.get_device_name()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for dtype_name in dtypes:
        for M, N in shapes:
            got, found = _measure_shape(dtype_name, M, N, rounds, flush, device)
            rows += got
            problems += found
    return rows, problems, device
