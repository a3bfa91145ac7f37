"""Per-call cost of the norms at decode sizes: M = 1 and 8 rows of N = 4096, bfloat16, the
forward alone (inference), for this package and each peer that imports (torch eager, Liger,
QuACK: ``layernorm.bench.gpu_measure.providers_for``, without torch.compile), timed two ways:

    eager   called from Python back to back: host time per call over --calls calls, the
            device synchronized at both ends (what a step pays without graphs: Python,
            dispatch and launch, or the kernel where it is longer)
    graph   --calls calls captured in one CUDA graph and replayed: CUDA-event time per call
            (the kernels and the gaps between them; no L2 flush: a decode step's rows come
            from the layer before)

    python tools/gpu_decode.py [--device cuda|cpu] [--calls K] [--rounds R] [--out FILE]

Each provider's output is checked against the NumPy reference before it is timed. Prints one
line per (norm, M, provider) and a table of ours against torch eager (goal: within 1.2x per
call under graph replay) with each provider's launch cost (eager minus graph), and writes the
rows as JSON to ``--out`` (default .gpu-run/out/decode.json), rewritten after every row.
``--device cpu`` runs the same on CPU tensors without graphs, to check the tool end to end on
a machine without a GPU. Without CUDA, ``--device cuda`` says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

NORMS = ("rms_norm", "add_rms_norm", "layer_norm")
ROWS = (1, 8)
N = 4096
DTYPE = "bfloat16"
GOAL = 1.2  # ours / torch eager per call under graph replay, at most


def _inputs(norm: str, M: int, device: str) -> tuple[list, list]:
    """(inputs, params) of one case: x (and residual) N(0, 1), weight near 1, bias near 0."""
    import torch

    from layernorm import family

    nm = family.norm(norm)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(torch.bfloat16)

    inputs = [randn(M, N) for _ in nm.forward_inputs]
    params = [1 + 0.1 * randn(N), 0.1 * randn(N)][:len(nm.params)]
    return inputs, params


def _per_call_eager(fn, calls: int, rounds: int, sync) -> list[float]:
    """Microseconds per call of ``calls`` back-to-back calls, one figure per round."""
    out = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        out.append((time.perf_counter() - start) / calls * 1e6)
    return out


def _per_call_graph(fn, calls: int, rounds: int) -> list[float]:
    """Microseconds per call of ``calls`` calls captured in one CUDA graph, one figure per
    replay (CUDA events)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / calls * 1e3)
    return out


def measure(device: str, calls: int, rounds: int, out: Path, meta: dict) -> list[dict]:
    """One row per (norm, M, provider, mode): microseconds per call (p50, p20, p80), or the
    error that stopped it; ``out`` is rewritten (with ``meta``) after every row, so a run
    stopped at a time limit keeps what it measured."""
    import torch

    from layernorm.bench import gpu_measure as gm

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    modes = ("eager", "graph") if cuda else ("eager",)
    rows = []
    for norm in NORMS:
        providers, notes = gm.providers_for(norm, N, compiled=False)
        for text in notes:
            print(f"note: {text}", flush=True)
        for M in ROWS:
            inputs, params = _inputs(norm, M, device)
            for prov in providers:
                base = {"norm": norm, "dtype": DTYPE, "M": M, "N": N, "provider": prov.name}
                try:
                    with torch.no_grad():
                        fn, mismatch = gm.prepare(prov, norm, DTYPE, inputs, params, [], "fwd")
                        if mismatch:
                            raise AssertionError(f"differs from the reference: {mismatch}")
                        for _ in range(10):  # compile, autotune, first launches
                            fn()
                        sync()
                except Exception as exc:  # a provider may fail in any way: a row says so
                    rows += [{**base, "mode": m, "error": gm._one_line(exc)} for m in modes]
                    _write(out, meta, rows)
                    print(f"{norm} M={M} {prov.name}: {rows[-1]['error']}", flush=True)
                    continue
                for mode in modes:
                    try:
                        with torch.no_grad():
                            times = (_per_call_eager(fn, calls, rounds, sync) if mode == "eager"
                                     else _per_call_graph(fn, calls, rounds))
                        p50, p20, p80 = gm._quantiles(times)
                        row = {**base, "mode": mode, "us": p50, "p20": p20, "p80": p80}
                        detail = f"{row['us']:.2f} us a call ({row['p20']:.2f}-{row['p80']:.2f})"
                    except Exception as exc:  # capture may fail: the row says why
                        row = {**base, "mode": mode, "error": gm._one_line(exc)}
                        detail = row["error"]
                    rows.append(row)
                    _write(out, meta, rows)
                    print(f"{norm} M={M} {prov.name} {mode}: {detail}", flush=True)
    return rows


def _write(out: Path, meta: dict, rows: list[dict]) -> None:
    """``out`` replaced whole by the run so far (a stop while writing leaves the last one)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    tmp.replace(out)


def table(rows: list[dict]) -> str:
    """Per (norm, M, mode): each provider's microseconds a call, ours over torch's with the
    verdict of the graph-replay goal; then each provider's launch cost (eager - graph)."""
    from layernorm._table import render

    providers = list(dict.fromkeys(r["provider"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["norm"], r["M"], r["provider"], r["mode"]): r.get("us") for r in rows}
    head = ["norm", "M", "mode", *(f"{p} us" for p in providers), "ours / torch",
            f"goal <= {GOAL}x"]
    body = []
    for norm in NORMS:
        for M in ROWS:
            for mode in modes:
                us = [by.get((norm, M, p, mode)) for p in providers]
                ours, torch_ = by.get((norm, M, "layernorm", mode)), by.get((norm, M, "torch",
                                                                            mode))
                ratio = ours / torch_ if ours and torch_ else None
                verdict = ("-" if mode != "graph" or ratio is None
                           else "met" if ratio <= GOAL else "missed")
                body.append([norm, str(M), mode,
                             *("err" if u is None else f"{u:.2f}" for u in us),
                             "-" if ratio is None else f"{ratio:.2f}x", verdict])
            if "graph" in modes:
                launch = [(by.get((norm, M, p, "eager")), by.get((norm, M, p, "graph")))
                          for p in providers]
                body.append([norm, str(M), "launch (eager - graph)",
                             *("-" if None in pair else f"{pair[0] - pair[1]:.2f}"
                               for pair in launch), "", ""])
    return render(head, body, align=">")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tools/gpu_decode.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--calls", type=int, default=100, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per mode")
    parser.add_argument("--out", type=Path, default=Path(".gpu-run/out/decode.json"))
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("tools/gpu_decode.py: needs torch", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("tools/gpu_decode.py: no CUDA device here", file=sys.stderr)
        return 2
    from layernorm.bench.machine import run_meta

    meta = {**run_meta(), "device": (torch.cuda.get_device_name() if args.device == "cuda"
                                     else "cpu"), "calls": args.calls, "rounds": args.rounds}
    rows = measure(args.device, args.calls, args.rounds, args.out, meta)
    _write(args.out, meta, rows)
    print(table(rows))
    print(f"saved {args.out}")
    return 1 if any("error" in r and r["provider"] == "layernorm" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
