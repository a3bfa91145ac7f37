"""Time this package's kernels under several settings of their tuning constants in one run, on
CUDA, against the copy bandwidth measured in the same run: the loop of predict, change, measure
in one call of a GPU machine, without the peers (and torch.compile's compile times).

    python tools/gpu_variants.py [--dtype D] [--norm NORM]... [--n N]... [--rounds R]
                                 [--variant NAME:KNOB=VALUE[,KNOB=VALUE]...]... [--out FILE]

Every run measures the variant "default" (the constants as they are) and each ``--variant``,
back to back for each (norm, N, pass), so drift between them is small; each pass is checked
against the NumPy reference first, as the benchmark does (``layernorm.bench.gpu`` and its
measuring side ``layernorm.bench.gpu_measure``: the same timing, L2 flush and bytes). KNOB is
one of :data:`KNOBS`, the tuning constants at the top of ``layernorm.gpu.launch``; for example
``--variant bwd8k:MAX_SHORT_D_BWD=8192`` holds backward rows of up to 8192 elements whole.
Prints one line per (norm, pass, N) with each variant's fraction of copy, and writes the rows
(the benchmark's keys, the provider named ``layernorm[VARIANT]``) as JSON to ``--out`` (default
.gpu-run/variants.json).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from layernorm import family
from layernorm.bench import gpu, gpu_measure
from layernorm.commands import count

KNOBS = ("MAX_SHORT_D_FWD", "MAX_SHORT_D_BWD", "SHORT_TILE", "LONG_BLOCK", "PROGRAMS_PER_SM",
         "REDUCE_BLOCK_P", "REDUCE_BLOCK_N", "REDUCE_NUM_WARPS")
DEFAULT_NS = (1024, 4096, 8192, 16384, 65536, 262144)


def parse_variant(spec: str) -> tuple[str, dict[str, int]]:
    """``"NAME:KNOB=VALUE,KNOB=VALUE"`` -> (NAME, {KNOB: VALUE}); ValueError naming what is
    wrong (no name, an unknown knob, a value that is not a positive integer)."""
    name, sep, body = spec.partition(":")
    if not sep or not name or not body:
        raise ValueError(f"variant {spec!r}: expected NAME:KNOB=VALUE[,KNOB=VALUE]...")
    settings = {}
    for item in body.split(","):
        knob, eq, value = item.partition("=")
        if knob not in KNOBS:
            raise ValueError(f"variant {name!r}: unknown knob {knob!r}; one of {', '.join(KNOBS)}")
        if not eq or not value.isdigit() or int(value) < 1:
            raise ValueError(f"variant {name!r}: {knob} needs a positive integer, got {value!r}")
        settings[knob] = int(value)
    return name, settings


@contextlib.contextmanager
def settings_of(module: object, settings: dict[str, int]) -> Iterator[None]:
    """``module``'s constants set to ``settings`` inside the block, restored after."""
    saved = {k: getattr(module, k) for k in settings}
    try:
        for k, v in settings.items():
            setattr(module, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def format_lines(rows: list[dict], variants: list[str]) -> list[str]:
    """One line per (norm, dtype, pass, N): copy GB/s and each variant's fraction of it."""
    by: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["norm"], r["dtype"], r["pass"], r["N"])
        by.setdefault(key, {})[r["provider"]] = r
    head = f"{'norm':>14} {'dtype':>8} pass {'N':>7} {'copy':>6}  " + "  ".join(
        f"{v:>10}" for v in variants)
    lines = [head]
    for key in sorted(by):
        got = by[key]
        copy = next(iter(got.values()))["copy_gbps"]
        cells = []
        for v in variants:
            r = got.get(f"layernorm[{v}]")
            text = "-" if r is None else "err" if r["ms"] is None else f"{r['gbps'] / copy:.3f}"
            cells.append(f"{text:>10}")
        lines.append(f"{key[0]:>14} {key[1]:>8} {key[2]:>4} {key[3]:>7} {copy:>6.0f}  "
                     + "  ".join(cells))
    return lines


def measure(session: object, launch: object, device: str, dtype: str, ns: list[int],
            norms: list[str], variants: dict[str, dict[str, int]], out: Path) -> list[dict]:
    """The rows of every (N, norm, pass, variant), measured by ``session`` (as
    ``layernorm.bench.gpu.sweep``'s, one pass as the sweep measures it) with ``launch``'s
    constants set to each variant's; a variant that raises is a row with null ms and the
    error, and the run goes on. ``out`` is rewritten after each (N, norm, pass)."""
    rows: list[dict] = []
    uncaptured: set[tuple[str, str, str]] = set()
    for N in ns:
        M = gpu.rows_for(N, dtype)
        copy = session.copy_gbps(dtype, M, N)
        for norm in norms:
            eps = family.norm(norm).eps
            for pass_ in gpu.PASSES:
                for name, settings in variants.items():
                    prov = gpu.Provider(f"layernorm[{name}]", gpu_measure._ours(norm, N, eps))
                    with settings_of(launch, settings):
                        row, detail = gpu._measure_one(session, device, prov, norm, dtype, M, N,
                                                       pass_, copy, print, uncaptured)
                    rows.append(row)
                    print(f"{norm} {pass_} N={N} {name}: {detail}", flush=True)
                gpu.write_results(rows, out, device)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpu_variants.py", description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=gpu.GPU_DTYPES)
    parser.add_argument("--norm", action="append", choices=gpu.NORMS)
    parser.add_argument("--n", type=count, action="append")
    parser.add_argument("--rounds", type=count, default=50)
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--out", type=Path, default=Path(".gpu-run") / "variants.json")
    args = parser.parse_args(argv)
    try:
        variants = dict([("default", {})] + [parse_variant(v) for v in args.variant])
    except ValueError as exc:
        parser.error(str(exc))
    if (reason := gpu.unavailable()) is not None:
        parser.error(reason)
    import torch

    from layernorm.gpu import launch

    rows = measure(gpu_measure.CudaSession(args.rounds), launch, torch.cuda.get_device_name(),
                   args.dtype, args.n or DEFAULT_NS, args.norm or list(gpu.NORMS), variants,
                   args.out)
    print("\n".join(["", *format_lines(rows, list(variants))]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
