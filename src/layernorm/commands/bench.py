"""``layernorm bench``: time the family's implementations against this machine's copy bandwidth.

Norms: every member of the family (``--norm`` picks). Implementations (``--impl`` picks; by
default every one that runs here): the NumPy reference (``numpy``), the C++ engine's fused
kernels of :mod:`layernorm.cpu` (``fused``, outputs reused through ``out=``), this package's
PyTorch API with autograd (``layernorm.torch``), PyTorch's CPU functions with autograd (``torch``:
``F.layer_norm`` or ``F.rms_norm``, after ``x + residual`` for an add-norm) and the same
function under ``torch.compile`` (``torch.compile``: inductor, compiled once per case before
the timing; left out, with the reason, where compiling fails here). Each is checked against
the float64 reference (tolerances from :mod:`layernorm.tolerances`) before it is timed: the
check column shows "ok" or the worst error in multiples of the tolerance (the command fails
only for this package's implementations). Operations: ``fwd`` (the forward as in training:
PyTorch records its graph), ``bwd`` (the backward alone: PyTorch's ``autograd.grad`` on a
kept graph) and ``fwd+bwd`` (one training step, timed as a unit).

Method (:mod:`layernorm.bench.harness`): every (implementation, operation) pair and a copy
run in interleaved rounds of batches of about 50 ms (20 ms with --quick); p50 (p20-p80) over
the rounds, speedups as medians of per-round ratios. Bandwidth: GB/s on minimal bytes
(each (M, D) input read once and each output written once: :func:`layernorm.cost.minimal_bytes`;
their sum for fwd+bwd; an add-norm's dresidual not counted where the implementation returns dx
as dresidual too, as autograd's x + residual does), and that as a
fraction of a copy of x's size with the same threads (:mod:`layernorm.bench.yardstick`),
interleaved in the same rounds. Each case is labelled by where its data lives against the
last-level cache: "in cache", "DRAM", or "straddles LLC", where no fraction of copy is judged.
Goals (:mod:`layernorm.bench.results`) are judged at both ends of the p20-p80 spread with a
guard band of 10% around the goal: met, missed, "noisy: rerun" or "too close to call".
Figures that cannot be results carry a flag instead of a verdict: "busy machine" (other
processes took our cores), "overhead-bound" (a copy too short to measure bandwidth),
"implausible" (faster than the copy by a margin, or fwd+bwd faster than its part). The run is
saved as JSON. ``--device cuda`` runs the GPU
benchmark instead (:mod:`layernorm.bench.gpu`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from ..bench import end_to_end, gpu, peer_report, peers, providers, quant, results, w8a8
from ..bench.harness import STANDARD_SHAPES, Case, first_call_latency, run_bench, set_threads
from ..dtypes import NAMES
from . import count, shape, usage_error, writable
from .report import Section, anchor, folded

__all__ = ["OURS", "REPORT_SHAPES", "add_arguments", "gpu_report_section", "parse_shape",
           "peers_report_section", "quant_report_section", "report_section", "run", "run_cuda",
           "run_peers", "run_quant"]

# this package's: a failed check fails the command
OURS = ("numpy", "fused", "fused-me", "layernorm.torch", "layernorm.torch-me")
# The report's short set, one shape per judged regime of a 32 MiB last-level cache in float32:
# 4x256x768 in cache for every norm (an add-norm's backward moves 15.7 MB), 4x1024x4096 in
# DRAM (its copy moves 134 MB); each case also compiles torch.compile's function.
REPORT_SHAPES: tuple[tuple[int, ...], ...] = ((4, 256, 768), (4, 1024, 4096))


class Progress:
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


def _run_bench(cases: list[Case], backends: list[str], rounds: int, quick: bool) -> dict:
    progress = Progress()
    result = run_bench(cases, backends, rounds, quick, progress)
    progress.done()
    return result


parse_shape = shape  # the one shape rule of every command (layernorm.commands.shape)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", action="append", type=shape,
                        help="MxD or AxBxD (repeatable; replaces the standard shapes "
                             + ", ".join("x".join(map(str, s)) for s in STANDARD_SHAPES) + ")")
    parser.add_argument("--dtype", action="append", choices=NAMES,
                        help="dtype (repeatable; default float32)")
    parser.add_argument("--norm", action="append", choices=providers.norms(),
                        help="norm (repeatable; default: every norm of the family)")
    parser.add_argument("--impl", action="append", choices=providers.BACKENDS,
                        help="implementation (repeatable; default: every one that runs here)")
    parser.add_argument("--threads", type=count, help="threads for PyTorch, on which the "
                        "engine runs (default: PyTorch's default, all cores)")
    parser.add_argument("--rounds", type=count, help="rounds of interleaved batches "
                        "(default 9, 5 with --quick)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds, shorter batches")
    parser.add_argument("--out", type=Path, help="JSON file (default, in bench/runs/, not "
                        "tracked: cpu-<host>-<time>.json; with --peers cpu-peers.json; with "
                        "--device cuda gpu-<time>-<device>.json, or in the folder --out names)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (layernorm.bench.harness) or cuda (layernorm.bench.gpu)")
    parser.add_argument("--peers", action="store_true",
                        help="CPU versus peers: layernorm.torch against torch eager, "
                             "torch.compile and onnxruntime, inference and training, the "
                             "named shapes (layernorm.bench.peers); 2 threads, float32 unless "
                             "--full, --threads or --dtype say otherwise")
    parser.add_argument("--quant", action="store_true",
                        help="CPU: the quantized norm (rms_norm_quant) against norm-then-"
                             "quantize in torch eager and torch.compile, at one row against "
                             "the norm, out of cache against a copy (layernorm.bench.quant), "
                             "and a W8A8 Llama-shaped model end to end (layernorm.bench.w8a8); "
                             "1 and 2 threads")
    parser.add_argument("--full", action="store_true",
                        help="with --peers: float32 and bfloat16, 1 thread and every core")
    parser.add_argument("--resume", action="store_true",
                        help="with --device cuda and an --out .json file: keep the rows it "
                             "has measured and measure only the rest (a run cut short goes "
                             "on where it stopped)")
    parser.add_argument("--compile-n", action="append", type=count, metavar="N",
                        help="with --device cuda: the torch.compile peer only at these row "
                             "lengths among those measured (repeatable; default every N), since "
                             "each N compiles anew")


def _not_runnable(norm: str, wanted: list[str]) -> dict[str, str]:
    """Those of ``wanted`` that cannot run here, each with the reason."""
    return {impl: reason for impl in dict.fromkeys(wanted)
            if (reason := providers.why_not(norm, impl)) is not None}


PROG = "layernorm bench"


def run(args: argparse.Namespace) -> int:
    out_file = args.out is not None and gpu.names_a_file(args.out)
    if args.resume and (args.device != "cuda" or not out_file):
        return usage_error(PROG, "argument --resume: needs --device cuda and --out FILE.json "
                                 "(the file whose rows to keep)")
    if args.out is not None:  # on CUDA, --out may name a folder
        folder = args.device == "cuda" and not out_file
        if (problem := writable(args.out, folder=folder)) is not None:
            return usage_error(PROG, f"argument --out: {problem}")
    if args.compile_n and args.device != "cuda":
        return usage_error(PROG, "argument --compile-n: only with --device cuda")
    if args.device == "cuda":
        return run_cuda(args)
    if args.full and not args.peers:
        return usage_error(PROG, "argument --full: only with --peers")
    if args.peers and args.quant:
        return usage_error(PROG, "argument --quant: not with --peers")
    if args.peers:
        return run_peers(args)
    if args.quant:
        return run_quant(args)
    if args.threads is not None:
        try:
            set_threads(args.threads)
        except (ValueError, RuntimeError) as exc:  # a count torch refuses
            return usage_error(PROG, f"argument --threads: {exc}")
    norms = args.norm or providers.norms()
    missing = _not_runnable(norms[0], args.impl or list(providers.BACKENDS))
    if args.impl and missing:  # asked for by name: a mistake, before any timing
        return usage_error(PROG, "argument --impl: " + "; ".join(
            f"{impl} cannot run here: {reason}" for impl, reason in missing.items()))
    for impl, reason in missing.items():  # the default set: say what it leaves out
        print(f"{PROG}: {impl} left out: {reason}", file=sys.stderr)
    impls = [b for b in providers.BACKENDS
             if b in (args.impl or providers.BACKENDS) and b not in missing]
    cases = [Case(s, d, n) for n in norms for s in (args.shape or STANDARD_SHAPES)
             for d in (args.dtype or ["float32"])]
    rounds = args.rounds or (5 if args.quick else 9)
    result = _run_bench(cases, impls, rounds, args.quick)
    if "fused" in impls:
        result["meta"]["first_call"] = first_call_latency()
    rows = result["rows"]
    meta = result["meta"]
    load = " to ".join(f"{v:.1f}" for v in meta["loadavg"])
    print(f"layernorm bench: {results.n_threads(meta['threads'])}, {rounds} rounds, "
          f"copy = {rows[0]['copy']}, load average {load}; p50 (p20-p80) over rounds\n")
    print(results.regime_note(meta["llc_bytes"]) + "\n")
    print(results.format_table(rows, markdown=True))
    print()
    print(results.summary_table(rows, markdown=True))
    api = results.torch_table(rows, markdown=True)
    if api:
        print(f"\nPyTorch API: fwd+bwd time of torch (eager) and torch.compile over "
              f"layernorm.torch's, p50 (p20-p80) of per-round ratios; goal >= "
              f"{results.TORCH_API_GOAL}x torch\n")
        print(api)
    me = results.me_table(rows, markdown=True)
    if me:
        print(f"\nMemory-efficient backward: its time over the default mode's, p50 (p20-p80) "
              f"of per-round ratios; goal <= {results.ME_GOAL:.2f}x\n")
        print(me)
    print("\n" + "\n".join(f"- {line}" for line in results.headlines(rows)))
    if "first_call" in meta:
        print("\n" + results.format_latency(meta["first_call"]))
    out = results.save(result, args.out or results.default_path())
    print(f"\nsaved {out}")
    # PyTorch sums dgamma/dbeta in float32, outside the float32 tolerance at large M: shown in
    # the check column, not a failure of this package.
    failed = [r for r in rows if r["impl"] in OURS and r["check"] > 1]
    return 1 if failed else 0


def _plot(make, rows: list[dict], path: Path, alt: str) -> str:
    """A Markdown image of ``make(rows, path)``, or a line saying why there is none."""
    try:
        return f"![{alt}]({make(rows, path).name})"
    except ImportError:
        return "(matplotlib is not installed: no plot.)"


def _end_to_end(result: dict, rounds: int, threads: int) -> dict | None:
    """The Llama-shaped model's run, also stored in ``result``; None without transformers."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    result["end_to_end"] = end_to_end.llama_end_to_end(rounds, threads)
    return result["end_to_end"]


def peer_cases(norms: list[str], dtypes: list[str], threads: list[int]) -> list[peers.Case]:
    """The grid, threads outermost (torch.compile recompiles when the thread count changes)."""
    return [peers.Case(n, s, d, m, t) for t in threads for n in norms for s in peers.SHAPES
            for d in dtypes for m in peers.MODES]


def _peer_grid(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    cores = os.cpu_count() or 1
    dtypes = args.dtype or list(peers.FULL_DTYPES if args.full else peers.DEFAULT_DTYPES)
    threads = ([args.threads] if args.threads else
               sorted({1, cores}) if args.full else [min(2, cores)])
    return dtypes, threads


def run_quant(args: argparse.Namespace) -> int:
    """``layernorm bench --quant``: the quantized norm's grid and the W8A8 model, their tables,
    and the JSON (bench/runs/cpu-quant.json unless --out)."""
    given = [f"--{k}" for k in ("shape", "impl", "norm", "dtype", "threads")
             if getattr(args, k)]
    if given:
        return usage_error(PROG, f"argument --quant: takes its own grid; leave out "
                                 f"{', '.join(given)}")
    try:
        import torch  # noqa: F401
    except ImportError:
        return usage_error(PROG, "argument --quant: needs torch (the package's torch extra)")
    rounds = args.rounds or (5 if args.quick else 9)
    progress = Progress()
    result = quant.run(rounds, quant.SHAPES[:1] if args.quick else quant.SHAPES,
                       progress=progress)
    result["w8a8"] = w8a8.w8a8_end_to_end(min(rounds, 5), min(2, os.cpu_count() or 1),
                                          progress)
    progress.done()
    out = results.save(result, args.out or results.RUNS_DIR / "cpu-quant.json")
    print(f"layernorm bench --quant: {rounds} rounds; RMSNorm with a weight, per-token "
          f"scales; ratios are p50 (p20-p80) of per-round ratios\n")
    print(quant.format_quant(result))
    print("\n- " + quant.summary_line(result["rows"]))
    print("\n" + w8a8.format_w8a8(result["w8a8"]))
    print(f"\nsaved {out}")
    return 0


def quant_report_section(ctx: object) -> Section:
    """The report's "Quantized output": the quantized norm at 1x1024x4096 on 2 threads (and
    one row, and out of cache) against norm-then-quantize, and the W8A8 model end to end."""
    threads = min(2, os.cpu_count() or 1)
    rounds = 3 if ctx.quick else 5
    progress = Progress()
    result = quant.run(rounds, quant.SHAPES[:1], (threads,), progress)
    result["w8a8"] = w8a8.w8a8_end_to_end(rounds, threads, progress)
    progress.done()
    results.save(result, ctx.outdir / "bench_quant.json")
    rows = result["rows"]
    e2e = result["w8a8"]
    fused = e2e["prefill"]
    heads = [
        f"the norm with its output quantized (`rms_norm_quant`), {quant.summary_line(rows)}",
        f"a W8A8 Llama-shaped model end to end: prefill "
        f"{fused['float']['over_fused'][0]:.2f}x as fast as the float model and "
        f"{fused['w8a8 unfused']['over_fused'][0]:.2f}x the same model with norm-then-quantize "
        f"(goal {w8a8.GOAL}x: {e2e['verdict']}; the norms' share bounds it at "
        f"{e2e['bound']:.3f}x)"]
    body = (
        "`layernorm.torch.rms_norm_quant` writes the norm's output as int8 or float8_e4m3fn "
        "with its scales (docs/derivation.md, \"Quantized output\"), against the pair a "
        "user would write: the library's `rms_norm`, then amax, divide, round, clamp and cast "
        "in torch eager, and the same pair under `torch.compile`. Interleaved rounds; the "
        "full grid (4x1024x4096, 1 thread): `layernorm bench --quant`.\n\n"
        + quant.format_quant(result) + "\n\n" + w8a8.format_w8a8(e2e) + "\n")
    answers = {"use": (
        "For a W8A8 (int8) or FP8 Linear after a norm, `rms_norm_quant` / `layer_norm_quant` "
        "(residual add included) in place of the norm and a separate quantization: "
        f"{quant.summary_line(rows)}.")}
    return Section(heads, body, answers)


def run_peers(args: argparse.Namespace) -> int:
    """``layernorm bench --peers``: the grid, its table and headlines, and the JSON
    (bench/runs/cpu-peers.json, or cpu-peers-full.json with --full, unless --out)."""
    if args.shape or args.impl:
        return usage_error(PROG, "argument --peers: takes its named shapes and every "
                                 "provider; leave out --shape and --impl")
    bad = [d for d in (args.dtype or []) if d not in peers.FULL_DTYPES]
    if bad:
        return usage_error(PROG, f"argument --dtype: with --peers, one of "
                                 f"{', '.join(peers.FULL_DTYPES)}; got {', '.join(bad)}")
    dtypes, threads = _peer_grid(args)
    for name, why in peers.available_peers().items():
        print(f"{PROG}: peer {name}: " + ("found" if why is None else f"left out: {why}"),
              file=sys.stderr)
    rounds = args.rounds or (3 if args.quick else peers.ROUNDS)
    cases = peer_cases(args.norm or providers.norms(), dtypes, threads)
    progress = Progress()
    result = peers.run(cases, rounds, progress)
    progress.done()
    print(f"layernorm bench --peers: {len(cases)} cases, {rounds} rounds each; ours' speed "
          f"over a peer is its time over ours (p50: p20-p80 of per-round ratios)\n")
    print(peer_report.table(result["rows"]))
    print("\n" + "\n".join(f"- {line}" for line in peer_report.summary(result["rows"])))
    e2e = _end_to_end(result, rounds, max(threads))
    if e2e is None:
        print(f"{PROG}: end to end left out: transformers is not installed", file=sys.stderr)
    else:
        print("\n" + end_to_end.format_end_to_end(e2e))
    name = "cpu-peers-full.json" if args.full else "cpu-peers.json"
    out = results.save(result, args.out or results.RUNS_DIR / name)
    print(f"\nsaved {out}")
    return 0


def peers_report_section(ctx: object) -> Section:
    """The report's "CPU versus peers": the default grid (every norm and named shape, both
    modes, float32, 2 threads), its headlines, the table and a plot of ours against the best
    peer per case."""
    cases = peer_cases(providers.norms(), list(peers.DEFAULT_DTYPES),
                       [min(2, os.cpu_count() or 1)])
    progress = Progress()
    result = peers.run(cases, 3 if ctx.quick else peers.ROUNDS, progress)
    progress.done()
    rows = result["rows"]
    plot = _plot(peer_report.plot, rows, ctx.outdir / "bench_peers.png",
                 "ours against the best peer")
    left = [f"`{k}` ({v})" for k, v in result["meta"]["peers"].items() if v is not None]
    grid = f"{peer_report.scope(rows)}, inference and training"
    first, *rest = peer_report.summary(rows)
    heads = [f"{grid}: {first}", *rest]
    e2e = _end_to_end(result, 3 if ctx.quick else peers.ROUNDS, min(2, os.cpu_count() or 1))
    results.save(result, ctx.outdir / "bench_peers.json")
    e2e_text = "End to end: transformers is not installed.\n\n"
    if e2e is not None:
        heads.append("end to end, a Llama-shaped model with its norms swapped (the same "
                     "command): " + "; ".join(
            f"{task} {end_to_end.end_to_end_verdict(task, e2e[task])} "
            f"({e2e[task]['speedup'][0]:.2f}x)" for task in ("train step", "generate")))
        e2e_text = end_to_end.format_end_to_end(e2e) + "\n\n"
    body = (
        "`layernorm.torch` (through its public functions, with their checks) against what a "
        "PyTorch user already has: torch eager (`F.layer_norm`, `F.rms_norm`, after "
        "`x + residual`), `torch.compile` of the same (Inductor, static shapes, compiled "
        "once per case; compile time in the JSON) and onnxruntime's fused CPU operators "
        "(LayerNormalization, SimplifiedLayerNormalization, SkipLayerNormalization, "
        "SkipSimplifiedLayerNormalization; outputs preallocated through IOBinding). Inference: "
        "the forward under `torch.inference_mode`; training: forward and backward with every "
        "gradient (onnxruntime has none). Interleaved rounds; each cell is a provider's p50 "
        "per call and ours' speed over it (its time over ours, p50: p20-p80 of per-round "
        f"ratios). Goal: at least {peers.GOAL}x the fastest peer; at the decode shapes in "
        "inference, within 2x (one row) and 1.5x (eight rows) of torch eager's time. A verdict "
        f"only where ours and that peer were steady (p80/p20 < {results.STEADY}): otherwise "
        "\"too noisy to tell\". "
        + (f"Left out here: {', '.join(left)}. " if left else "")
        + f"The grid: {grid}. The full grid (bfloat16, 1 thread): "
        "`layernorm bench --peers --full`.\n\n"
        + e2e_text + plot + "\n\n"
        + folded(f"All {len(rows)} cases of {grid}", peer_report.table(rows)) + "\n")
    answers = peer_report.answers(rows, e2e)
    if "use" in answers:
        answers["use"] += (
            f"\n\nThis advice covers the shapes above only. The [CPU kernels and bandwidth]"
            f"({anchor('CPU kernels and bandwidth')}) section times one training step "
            f"(fwd+bwd) at {_shapes(REPORT_SHAPES)} against torch eager alone, so its "
            "verdicts can differ from these lines without contradicting them.")
    return Section(heads, body, answers)


def run_cuda(args: argparse.Namespace) -> int:
    """``layernorm bench --device cuda``: measure, print the table, write the JSON.

    Reads ``args.dtype`` (names or None: bfloat16 and float32), ``args.shape`` (see
    :func:`layernorm.bench.gpu.parse_shapes`), ``args.quick``, ``args.out`` (.json file or
    folder; default bench/runs), ``args.resume`` (keep the measured rows of the ``--out``
    file and measure the rest), ``args.rounds`` (runs per measurement) and
    ``args.compile_n`` (the row lengths of the torch.compile peer; None: all). Returns 0 when
    done, 1 when our kernels disagree with the reference or fail, 2 when nothing can be
    measured.
    """
    reason = gpu.unavailable()
    if reason is not None:
        return usage_error(PROG, f"argument --device: {reason}")
    dtypes = list(args.dtype or gpu.DEFAULT_DTYPES)
    unknown = [d for d in dtypes if d not in gpu.GPU_DTYPES]
    if unknown:
        return usage_error(PROG, f"argument --dtype: with --device cuda, one of "
                                 f"{', '.join(gpu.GPU_DTYPES)}; got {', '.join(unknown)}")
    rounds = args.rounds or (gpu.QUICK_ROUNDS if args.quick else gpu.ROUNDS)
    try:
        kept = gpu.kept_rows(args.out) if args.resume else []
    except (ValueError, OSError) as exc:  # not a results file, or another device's
        return usage_error(PROG, f"argument --resume: {exc}")
    rows, problems, _device, path = gpu.measure(dtypes, args.shape, args.quick, rounds,
                                                norms=args.norm, out=args.out, kept=kept,
                                                compile_ns=args.compile_n)
    print()
    print(gpu.format_table(rows, markdown=True))
    print(f"\nresults written to {path}")
    for p in problems:
        print(f"note: {p}")
    # our kernels wrong, or failing: a check that ran and failed
    ours_failed = any(p.startswith("layernorm ") and ("differs" in p or ": failed:" in p)
                      for p in problems)
    return 1 if ours_failed else 0


def report_section(ctx: object) -> Section:
    """A short benchmark on :data:`REPORT_SHAPES`: the headlines (the summary's lines), the
    per-case, PyTorch API and full tables, and a bandwidth plot in ctx.outdir."""
    cases = [Case(s, "float32", n) for n in providers.norms() for s in REPORT_SHAPES]
    backends = providers.available()
    result = _run_bench(cases, backends, 3 if ctx.quick else 5, quick=True)
    rows = result["rows"]
    latency = first_call_latency() if "fused" in backends else None
    result["meta"]["first_call"] = latency
    results.save(result, ctx.outdir / "bench_cpu.json")
    plot = _plot(results.plot_bandwidth, rows, ctx.outdir / "bench_cpu_bandwidth.png",
                 "bandwidth")
    left_out = [f"`{b}` ({providers.why_not('layer_norm', b)})"
                for b in providers.BACKENDS if b not in backends]
    api = results.torch_table(rows, markdown=True)
    shapes = _shapes(REPORT_SHAPES)
    # each headline names its shapes: a line quoted alone must not read as the peers' grid
    heads = [re.sub(r"^(`[^`]+`): ", lambda m: f"{m.group(1)} at {shapes}: ", line)
             for line in results.headlines(rows)]
    summary = [f"`layernorm bench` at {shapes} only "
               f"({results.n_threads(result['meta']['threads'])}, float32; fwd+bwd is one "
               f"training step, against torch eager): {len(rows)} timings of {len(backends)} "
               "implementations; each verdict below only where the spread of the rounds "
               "allows one, and only for these shapes (the first screen's answers come from "
               f"the peers' grid: [CPU versus peers]({anchor('CPU versus peers')}))",
               *heads]
    body = (
        f"The fused kernels of the C++ engine (`layernorm.cpu`) and this package's PyTorch API "
        f"on them "
        f"(`layernorm.torch`, with autograd) for every norm of the family, against the NumPy "
        f"reference, PyTorch's CPU functions with autograd (`torch`: `F.layer_norm`, "
        f"`F.rms_norm`, after `x + residual` for the add-norms) and the same functions under "
        f"`torch.compile` (inductor, compiled before the timing), "
        f"{results.n_threads(result['meta']['threads'])}, float32, shapes "
        + ", ".join("x".join(map(str, s)) for s in REPORT_SHAPES)
        + (f"; left out here: {', '.join(left_out)}" if left_out else "")
        + f". Bandwidth is GB/s on minimal bytes (each (M, D) input read once, each output "
        f"written once: `layernorm.cost.minimal_bytes`; an add-norm's dresidual not counted "
        f"where the gradient of x serves as it, as in PyTorch) over the bandwidth of a copy of the "
        f"same size measured in the same rounds (`{rows[0]['copy']}`), p50 of per-round "
        f"ratios with p20-p80 in brackets. Goals: forward >= {results.FWD_GOAL:.0%} and "
        f"backward >= {results.BWD_GOAL:.0%} of copy, fused fwd+bwd >= {results.STEP_GOAL}x "
        f"PyTorch, and fwd+bwd through `layernorm.torch` >= {results.TORCH_API_GOAL}x "
        f"PyTorch's own; each met only when p20 clears it by {results.CLOSE:.0%}, missed only "
        f"when p80 falls short by {results.CLOSE:.0%}, else \"noisy: rerun\" or \"too close "
        f"to call\". Figures that cannot be results show a flag instead of a verdict: "
        f"\"busy machine\" (other processes took the cores), \"overhead-bound\" (a copy under "
        f"{results.OVERHEAD_S * 1e6:.0f} µs per call), \"implausible\" (faster than "
        f"{results.FRACTION_MARGIN}x the copy, or fwd+bwd faster than one of its passes). A "
        f"short run: reproduce with `layernorm bench` (results in `bench/runs/`). The check "
        f"column compares each result with the float64 reference under "
        f"`layernorm.tolerances`; PyTorch's float32 dgamma/dbeta are summed in float32 and fall "
        f"outside the float32 'param' tolerance, which assumes float64 accumulation (shown, "
        f"not failed).\n\n"
        + results.regime_note(result["meta"]["llc_bytes"]) + "\n\n"
        + results.summary_table(rows, markdown=True)
        + (f"\n\nThe PyTorch API at {shapes}: fwd+bwd time of `torch` and `torch.compile` "
           f"over `layernorm.torch`'s (p50 and p20-p80 of per-round ratios).\n\n{api}"
           if api else "")
        + (f"\n\nThe memory-efficient backward at {shapes} (`fused-me`, `layernorm.torch-me`: "
           f"`memory_efficient=True`, xhat recovered from y): its time over the default "
           f"mode's (p50 and p20-p80 of per-round ratios); goal <= {results.ME_GOAL:.2f}x."
           f"\n\n{me}" if (me := results.me_table(rows, markdown=True)) else "")
        + ("" if latency is None else "\n\nNothing is compiled at a call (the C++ engine is "
           "built once per machine); " + results.format_latency(latency) + ".")
        + f"\n\n{plot}\n\n"
        + folded(f"All rows ({shapes})", results.format_table(rows, markdown=True)) + "\n"
    )
    return Section(summary, body)


def _shapes(shapes: tuple[tuple[int, ...], ...]) -> str:
    """``shapes`` as the report names them: "4x256x768 and 4x1024x4096"."""
    names = ["x".join(map(str, s)) for s in shapes]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def _gpu_headline(rows: list[dict]) -> str:
    """Our kernels' fraction of copy on the goals' ground (bfloat16, N >= 2K), per pass, and
    how many of the measured rows met their goal."""
    parts = []
    for pass_, goal in gpu.GOALS.items():
        fr = [r["gbps"] / r["copy_gbps"] for r in rows
              if r["provider"] == "layernorm" and r["pass"] == pass_
              and r["dtype"] == "bfloat16" and r["N"] >= 2048 and r["ms"] is not None]
        if fr:
            met = sum(f >= goal for f in fr)
            parts.append(f"{pass_} {min(fr):.2f}-{max(fr):.2f} of copy (goal {goal}: met in "
                         f"{met} of {len(fr)})")
    failed = sum(r["ms"] is None for r in rows)
    return ("; ".join(parts) or "no layernorm rows in bfloat16 at N >= 2K") + (
        f"; {failed} row{'s' if failed > 1 else ''} failed" if failed else "")


def gpu_report_section(ctx: object) -> Section:
    """The report's GPU section: the newest results as a table and a plot, or a note that there
    are none yet and how to make them."""
    path = gpu.latest_results()
    if path is None:
        return Section(
            ["not measured: no GPU results exist. Run `" + gpu.COMMAND + "` on a machine with "
             "an NVIDIA GPU; the next report shows them."],
            "No GPU measurements exist yet. On a machine with a CUDA GPU, run "
            f"`{gpu.COMMAND}`: it writes `bench/runs/gpu-<time>-<device>.json`, which the "
            "next `layernorm report` shows here as a table and a bandwidth plot.\n",
            {"faster": "On a GPU: not measured; no GPU results exist (the GPU kernels are "
                       "tested under Triton's interpreter only)."})
    rows = gpu.load_results(path)
    summary = [f"measured on {rows[0]['device']} (`{path.as_posix()}`, not on this machine "
               f"unless it has that GPU): {_gpu_headline(rows)}."]
    parts = [
        f"Measured on {rows[0]['device']} by `{gpu.COMMAND}` (`{path.as_posix()}`). Fraction of "
        "the copy bandwidth measured in the same run, on minimal bytes (each pass's "
        "streams of M·N elements and the parameters: layernorm.bench.gpu.pass_bytes); "
        "`vs X` is X's time over ours (> 1: ours is faster). "
        f"Goals on an H100: forward >= {gpu.GOALS['fwd']} and backward >= {gpu.GOALS['bwd']} of "
        "copy for N >= 2K in bfloat16, >= 0.75 at 128K and 256K, never slower than the fastest "
        "peer.",
        "",
    ]
    try:
        png = gpu.plot_bandwidth(rows, Path(ctx.outdir) / "gpu-bandwidth.png")
        parts += [f"![Fraction of copy bandwidth per provider and N, on the GPU]({png.name})", ""]
    except ImportError:
        parts += ["(matplotlib is not installed, so there is no plot: pip install matplotlib.)",
                  ""]
    parts.append(folded("All rows", gpu.format_table(rows, markdown=True)))
    return Section(summary, "\n".join(parts) + "\n",
                   {"faster": f"On a GPU ({rows[0]['device']}, not this machine unless it has "
                              f"that GPU): {_gpu_headline(rows)}."})
