"""The quantized norm against norm-then-quantize on the CPU: ``layernorm bench --quant``.

Providers, on the same inputs (an RMSNorm with a weight, per-token dynamic scales):

    fused          ``layernorm.torch.rms_norm_quant``
    eager          the library's ``rms_norm``, then amax, divide, round, clamp and cast in
                   torch eager (:func:`norm_then_quantize`)
    torch.compile  the same pair under ``torch.compile`` (inductor fuses the quantization; the
                   norm is the library's op, one node)
    norm           the library's ``rms_norm`` alone (the decode goal's yardstick)
    copy           a copy of x (:mod:`layernorm.bench.yardstick`), for the fraction of copy
                   (beside it the norm's own fraction: x read, y written)

Goals (:data:`GOALS`), each judged on p20-p80 of per-round ratios (:func:`results.verdict`):
eager's time over fused's >= 1.5 and torch.compile's >= 1.2 at the :data:`SHAPES`; at one row
(decode) fused's time over the norm's <= 1.2; out of cache (:data:`DRAM_SHAPE`) the fused GB/s on
its minimal bytes (x read; q, the scales written) >= 0.9 of the copy's. Method as
:mod:`layernorm.bench.peers`: interleaved rounds of batches of about 20 ms. Before timing, fused
is checked against the NumPy reference (:func:`layernorm.tolerances.assert_quantized`), and
the pair's q is compared with fused's (the pair rounds y to x's dtype first: a step apart in
some elements, reported as ``pair_equal``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from .._table import render
from . import results
from .harness import interleaved, reps_for, set_threads
from .machine import run_meta

__all__ = ["DECODE_SHAPE", "DRAM_SHAPE", "GOALS", "SHAPES", "format_quant", "minimal_bytes",
           "norm_then_quantize", "run", "summary_line", "verdict_counts"]

SHAPES: tuple[tuple[int, ...], ...] = ((1, 1024, 4096), (4, 1024, 4096))
DECODE_SHAPE = (1, 4096)
DRAM_SHAPE = (16, 1024, 4096)  # 128 MiB of bfloat16 x: out of a 32 MiB last-level cache
DTYPES = ("bfloat16", "float32")
QDTYPES = ("int8", "float8_e4m3fn")
THREADS = (1, 2)
GOALS = {"eager": 1.5, "torch.compile": 1.2, "decode": 1.2, "copy": 0.9}
TARGET_S = 0.02
PAUSE_S = 0.02


def norm_then_quantize(x, weight, eps: float, dtype, qmax: float, min_scale: float):
    """The unfused pair: y = the library's rms_norm (rounded to x's dtype), then per token
    s = max(amax|y| / qmax, min_scale) in float32 and q = y / s rounded (int8: half to even)
    and saturated; returns (q, s)."""
    import torch

    import layernorm.torch as lt

    y = lt.rms_norm(x, (x.shape[-1],), weight, eps)
    s = (y.abs().amax(-1, keepdim=True).float() / qmax).clamp(min=min_scale)
    v = y.float() / s
    if dtype == torch.int8:
        v = v.round()
    return v.clamp(-qmax, qmax).to(dtype), s


def minimal_bytes(x, n_scales: int) -> int:
    """The bytes a quantized norm of ``x`` must move: x read; q (a byte an element) and the
    n_scales float32 scales written."""
    return x.numel() * (x.element_size() + 1) + 4 * n_scales


def _check(q, scales, x, w, eps: float, qdtype: str) -> None:
    """fused's outputs against the NumPy reference (raises AssertionError)."""
    import ml_dtypes
    import torch

    import layernorm as ln
    from layernorm.tolerances import assert_close, assert_quantized

    xn = x.float().numpy().astype(ml_dtypes.bfloat16) if x.dtype == torch.bfloat16 else x.numpy()
    wn = w.float().numpy().astype(xn.dtype)
    qr, sr = ln.rms_norm_quant(xn[:64], wn, eps, dtype=qdtype)
    assert_quantized(q[:64].to(torch.float64).numpy(), qr.astype(np.float64), qdtype)
    assert_close(scales[:64].numpy(), sr, "float32", "quant-scale", name="scales")


def _spread(times: list[float]) -> dict:
    p20, p50, p80 = np.percentile(times, [20, 50, 80])
    return {"p50_ms": p50 * 1e3, "p20_ms": p20 * 1e3, "p80_ms": p80 * 1e3}


def _ratios(num: list[float], den: list[float]) -> list[float]:
    r = np.array(num) / np.array(den)
    return [float(q) for q in np.percentile(r, [50, 20, 80])]


def measure(shape: tuple[int, ...], dtype: str, qdtype: str, threads: int,
            rounds: int) -> dict:
    """One case's row: per provider p50/p20/p80 ms, the ratios (p50, p20, p80 over rounds)
    and the verdicts; torch.compile's pair compiled for the case (static shapes, fullgraph)."""
    import torch

    import layernorm.torch as lt
    from layernorm.reference.quant import QUANT_DTYPES

    set_threads(threads)
    g = torch.Generator().manual_seed(0)
    tdt, qdt = getattr(torch, dtype), getattr(torch, qdtype)
    row_q = QUANT_DTYPES[qdtype]
    x = torch.randn(shape, generator=g).to(tdt)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(tdt)
    d = shape[-1]
    eps = 1e-6
    decode = len(shape) == 2 and shape[0] == 1
    dram = tuple(shape) == DRAM_SHAPE
    row: dict = {"shape": list(shape), "dtype": dtype, "qdtype": qdtype, "threads": threads,
                 "kind": "decode" if decode else "copy" if dram else "batch", "providers": {}}
    calls: dict[str, Callable[[], object]] = {
        "fused": lambda: lt.rms_norm_quant(x, d, w, eps, dtype=qdt)}
    with torch.no_grad():
        q, s = calls["fused"]()
        _check(q.reshape(-1, d), s.reshape(-1, 1), x.reshape(-1, d), w, eps, qdtype)
        args = (x, w, eps, qdt, row_q.qmax, row_q.min_scale)
        if decode or dram:
            calls["norm"] = lambda: lt.rms_norm(x, d, w, eps)
        if dram:
            from .yardstick import copier

            src = np.ones(x.numel(), np.dtype(f"u{x.element_size()}"))
            calls["copy"] = copier(src, np.empty_like(src))
        if not decode and not dram:
            torch._dynamo.reset()  # each case compiles afresh: no recompile limit across cases
            pair = torch.compile(norm_then_quantize, dynamic=False, fullgraph=True)
            calls["eager"] = lambda: norm_then_quantize(*args)
            calls["torch.compile"] = lambda: pair(*args)
            qp, _ = pair(*args)
            row["pair_equal"] = float((qp.to(torch.float32) == q.to(torch.float32)).float()
                                      .mean())
        reps = {}
        for k, fn in calls.items():
            fn()
            reps[k] = reps_for(fn, TARGET_S, cap=20_000)
        times = interleaved(calls, reps, rounds, pause=PAUSE_S)
    for k, ts in times.items():
        row["providers"][k] = _spread(ts)
    fused = times["fused"]
    row["verdicts"] = {}
    for k in ("eager", "torch.compile"):
        if k in times:
            ratio = _ratios(times[k], fused)
            row["providers"][k]["speedup"] = ratio
            row["verdicts"][k] = (results.noisy(row["providers"]["fused"], row["providers"][k])
                                  or results.verdict(ratio[1], ratio[2], GOALS[k]))
    if decode:
        ratio = _ratios(fused, times["norm"])  # fused's time over the norm's: at most the goal
        row["providers"]["norm"]["over"] = ratio
        row["verdicts"]["decode"] = (results.noisy(row["providers"]["fused"],
                                                   row["providers"]["norm"])
                                     or _at_most(ratio, GOALS["decode"]))
    if dram:
        moved = minimal_bytes(x, x.numel() // d)
        copy_bytes = 2 * x.numel() * x.element_size()
        per_copy = [copy_bytes / c for c in times["copy"]]
        frac = _ratios([moved / f for f in fused], per_copy)
        row["gbps"] = moved / (row["providers"]["fused"]["p50_ms"] * 1e-3) / 1e9
        row["fraction_of_copy"] = frac
        # the norm alone (x read, y written) on the same yardstick: the ceiling the fused op's
        # norm sweeps set
        row["norm_fraction_of_copy"] = _ratios([copy_bytes / t for t in times["norm"]],
                                               per_copy)
        row["verdicts"]["copy"] = results.verdict(frac[1], frac[2], GOALS["copy"],
                                                  fmt="{:.2f}")
    return row


def _at_most(ratio: list[float], goal: float) -> str:
    """The goal "at most ``goal``" on (p50, p20, p80) (:func:`results.at_most_verdict`)."""
    return results.at_most_verdict(ratio[1], ratio[2], goal)


def run(rounds: int = 9, shapes: tuple[tuple[int, ...], ...] = SHAPES,
        threads: tuple[int, ...] = THREADS,
        progress: Callable[[str], None] | None = None) -> dict:
    """Every case: ``shapes`` x dtypes x output dtypes x ``threads`` against the pair, decode
    against the norm at the same threads, and the DRAM shape against a copy (the most threads
    of ``threads``); ``{"meta": ..., "rows": [...]}``."""
    progress = progress or (lambda msg: None)
    meta = {**run_meta(), "rounds": rounds, "goals": GOALS}
    rows = []
    cases = [(s, dt, q, t) for t in threads for s in (*shapes, DECODE_SHAPE) for dt in DTYPES
             for q in QDTYPES]
    cases += [(DRAM_SHAPE, dt, q, max(threads)) for dt in DTYPES for q in QDTYPES]
    for shape, dt, q, t in cases:
        progress(f"{'x'.join(map(str, shape))} {dt} -> {q}, {results.n_threads(t)}")
        rows.append(measure(shape, dt, q, t, rounds))
    meta["loadavg"].append(os.getloadavg()[0])
    return {"meta": meta, "rows": rows}


def verdict_counts(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Per goal, how many rows met it, missed it, or could not tell."""
    counts: dict[str, dict[str, int]] = {}
    for r in rows:
        for goal, v in r["verdicts"].items():
            kind = v if v in ("met", "missed") else "undecided"
            counts.setdefault(goal, {"met": 0, "missed": 0, "undecided": 0})[kind] += 1
    return counts


def summary_line(rows: list[dict]) -> str:
    """One line: each goal's met / missed / undecided counts."""
    names = {"eager": "1.5x eager", "torch.compile": "1.2x torch.compile",
             "decode": "decode <= 1.2x the norm", "copy": "0.9 of copy out of cache"}
    return "; ".join(f"{names[g]}: {c['met']} met, {c['missed']} missed"
                     + (f", {c['undecided']} undecided" if c["undecided"] else "")
                     for g, c in verdict_counts(rows).items())


def _ms(p: dict) -> str:
    return f"{p['p50_ms']:.3f} ({p['p20_ms']:.3f}-{p['p80_ms']:.3f})"


def _x(r: list[float]) -> str:
    return f"{r[0]:.2f}x ({r[1]:.2f}-{r[2]:.2f})"


def format_quant(result: dict) -> str:
    """The run as three Markdown tables: against the pair, decode, and out of cache."""
    rows = result["rows"]
    out = []
    batch = [r for r in rows if r["kind"] == "batch"]
    if batch:
        out.append(render(
            ["shape", "in -> out", "threads", "fused ms (p20-p80)", "eager / fused",
             "goal 1.5x", "compile / fused", "goal 1.2x"],
            [["x".join(map(str, r["shape"])), f"{r['dtype']} -> {r['qdtype']}", str(r["threads"]),
              _ms(r["providers"]["fused"]), _x(r["providers"]["eager"]["speedup"]),
              r["verdicts"]["eager"], _x(r["providers"]["torch.compile"]["speedup"]),
              r["verdicts"]["torch.compile"]] for r in batch], True))
    dec = [r for r in rows if r["kind"] == "decode"]
    if dec:
        out.append(render(
            ["decode", "in -> out", "threads", "fused us", "norm us", "fused / norm",
             "goal <= 1.2"],
            [["x".join(map(str, r["shape"])), f"{r['dtype']} -> {r['qdtype']}", str(r["threads"]),
              f"{r['providers']['fused']['p50_ms'] * 1e3:.1f}",
              f"{r['providers']['norm']['p50_ms'] * 1e3:.1f}",
              _x(r["providers"]["norm"]["over"]), r["verdicts"]["decode"]] for r in dec], True))
    big = [r for r in rows if r["kind"] == "copy"]
    if big:
        out.append(render(
            ["out of cache", "in -> out", "threads", "fused ms", "GB/s", "fraction of copy",
             "goal 0.9", "the norm alone"],
            [["x".join(map(str, r["shape"])), f"{r['dtype']} -> {r['qdtype']}", str(r["threads"]),
              _ms(r["providers"]["fused"]), f"{r['gbps']:.1f}",
              f"{r['fraction_of_copy'][0]:.2f} ({r['fraction_of_copy'][1]:.2f}-"
              f"{r['fraction_of_copy'][2]:.2f})", r["verdicts"]["copy"],
              f"{r['norm_fraction_of_copy'][0]:.2f} ({r['norm_fraction_of_copy'][1]:.2f}-"
              f"{r['norm_fraction_of_copy'][2]:.2f})"] for r in big], True))
    return "\n\n".join(out)
