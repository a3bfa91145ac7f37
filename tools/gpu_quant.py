"""Time the quantized norm on CUDA: ``layernorm.torch.rms_norm_quant`` against the same
norm-then-quantize pair ``layernorm bench --quant`` times on the CPU (the library's norm, then
amax, divide, round, clamp and cast in torch eager; and that pair under torch.compile), and
against a copy of x measured in the same run.

    python tools/gpu_quant.py [--rounds R] [--out FILE]

Shapes (M, N): (4096, 4096), (32768, 4096) and (16384, 8192), bfloat16 input; outputs int8
and float8_e4m3fn; per-token scales, and groups of 128. Each case is checked against the NumPy
reference first (64 rows). Timing as the GPU benchmark's (:mod:`layernorm.bench.gpu_measure`):
CUDA-graph replay where capture works, an L2 flush before each run, CUDA events, the median.
Prints one line per case (each provider's ms, fused's fraction of copy on its minimal bytes:
x read, q and the scales written, and the pair's time over fused's) and writes the rows as
JSON to ``--out`` (default .gpu-run/out/gpu-quant.json). Without CUDA it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SHAPES = ((4096, 4096), (32768, 4096), (16384, 8192))
CASES = (("int8", None), ("float8_e4m3fn", None), ("float8_e4m3fn", 128), ("int8", 128))


def measure(rounds: int) -> list[dict]:
    """One row per (M, N, output dtype, group size): ms of each provider, fused's fraction of
    copy and the pair's time over fused's."""
    import torch

    from layernorm.bench import gpu_measure as gm

    flush = torch.empty(gm.FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    rows = []
    for M, N in SHAPES:
        with torch.cuda.stream(stream), torch.no_grad():
            rows += _shape(M, N, rounds, flush)
        torch.cuda.empty_cache()  # the shape's tensors are gone with _shape's frame
    return rows


def _shape(M: int, N: int, rounds: int, flush) -> list[dict]:
    """The rows of one (M, N): a copy, then each case's providers."""
    import torch

    import layernorm.torch as lt
    from layernorm.bench import gpu_measure as gm
    from layernorm.bench.quant import _check, minimal_bytes, norm_then_quantize
    from layernorm.reference.quant import QUANT_DTYPES

    def p50(fn) -> float:
        return gm._quantiles(gm._time(fn, rounds, flush)[0])[0]

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, N, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.rand(N, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    dst = torch.empty_like(x)
    copy_ms = p50(lambda: dst.copy_(x))
    rows = []
    for qname, group in CASES:
        qdt, row_q = getattr(torch, qname), QUANT_DTYPES[qname]
        q, s = lt.rms_norm_quant(x, N, w, 1e-6, dtype=qdt, group_size=group)
        if group is None:
            _check(q.cpu(), s.cpu(), x.cpu(), w.cpu(), 1e-6, qname)
        calls = {"fused": lambda qdt=qdt, group=group: lt.rms_norm_quant(
            x, N, w, 1e-6, dtype=qdt, group_size=group)}
        if group is None:  # the pair quantizes per token
            args = (x, w, 1e-6, qdt, row_q.qmax, row_q.min_scale)
            torch._dynamo.reset()
            pair = torch.compile(norm_then_quantize, dynamic=False, fullgraph=True)
            calls["eager"] = lambda args=args: norm_then_quantize(*args)
            calls["torch.compile"] = lambda args=args, pair=pair: pair(*args)
        ms = {k: p50(fn) for k, fn in calls.items()}
        moved = minimal_bytes(x, s.numel())
        fraction = (moved / ms["fused"]) / (2 * x.numel() * x.element_size() / copy_ms)
        row = {"M": M, "N": N, "dtype": "bfloat16", "qdtype": qname, "group_size": group,
               "ms": ms, "copy_ms": copy_ms, "fraction_of_copy": fraction,
               "over_fused": {k: v / ms["fused"] for k, v in ms.items() if k != "fused"}}
        rows.append(row)
        print(f"{M}x{N} -> {qname} {'per token' if group is None else f'groups of {group}'}: "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
              + f"; fused {fraction:.2f} of copy; "
              + ", ".join(f"{k} / fused {v:.2f}x" for k, v in row["over_fused"].items()),
              flush=True)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tools/gpu_quant.py", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50, help="timed runs per case")
    parser.add_argument("--out", type=Path, default=Path(".gpu-run/out/gpu-quant.json"))
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("tools/gpu_quant.py: needs torch", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("tools/gpu_quant.py: no CUDA device here", file=sys.stderr)
        return 2
    from layernorm.bench.machine import run_meta

    meta = run_meta()
    rows = measure(args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
