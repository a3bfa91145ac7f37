"""Compile every kernel launch of the family ahead of time for an NVIDIA target, without a GPU,
and report the registers, stack (spills) and shared memory per thread block.

    python tools/compile_kernels.py [sm] [--json]   # sm defaults to 90 (H100)

Each kernel is compiled the way a launch compiles it: the launchers (launch.forward and
launch.backward) are called on meta tensors of typical shapes (M = 4096 rows; D from 1 to
past the long-row limits) with the kernels' launches captured, and each captured launch goes
through Triton's own launch-time specialization (the JIT's binder: 16-byte-aligned pointers
and integers divisible by 16 get ``tt.divisibility`` = 16, integers equal to 1 become
constants) before it is compiled for sm_<sm>; :func:`cases` lists the shapes, and
:func:`cases_from_y` those of the memory-efficient backward (``launch.backward_from_y``).
Identical specializations are compiled once.

Triton ships ptxas and cuobjdump, so this needs only the triton wheel. It must run without
TRITON_INTERPRET (the interpreter's kernels cannot be compiled); tests/gpu/test_gpu_compile.py
runs it in a subprocess.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from layernorm.family import NORMS
from layernorm.gpu import kernels as K
from layernorm.gpu import launch
from layernorm.reference.quant import QUANT_DTYPES

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")
M = 4096  # rows of every launch: a typical batch, a multiple of 16
SMS = 132  # streaming multiprocessors of an H100 SXM (the backward's program count uses it)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
KERNELS = {  # the label of each kernel in the table
    K._fwd_short_kernel: "fwd short",
    K._fwd_long_kernel: "fwd long",
    K._bwd_short_kernel: "bwd short",
    K._bwd_long_rowstats_kernel: "bwd long row stats",
    K._bwd_long_dx_kernel: "bwd long dx",
    K._sum_partials_kernel: "sum partials",
    K._quant_short_kernel: "quant short",
    K._quant_rows_kernel: "quant rows",
}


def cases() -> list[tuple[str, str, int]]:
    """(norm, dtype, D) of the launches compiled: every norm in bfloat16 and float32 at the
    largest short tiles of both passes (D = MAX_SHORT_D_BWD and MAX_SHORT_D_FWD, where the
    backward is long) and on a long row; packed small rows (D = 1 and 256, LayerNorm only:
    the tiles hold as many elements); float64 (half-size plans) for LayerNorm and its
    add-norm, the heaviest variants, at the same three points."""
    wide = [launch.MAX_SHORT_D_BWD // 2, launch.MAX_SHORT_D_FWD // 2, launch.MAX_SHORT_D_FWD]
    out = [(norm, dtype, D) for dtype in ("bf16", "fp32") for norm in NORMS
           for D in (launch.MAX_SHORT_D_BWD, launch.MAX_SHORT_D_FWD, 2 * launch.MAX_SHORT_D_FWD)]
    out += [("layer_norm", "bf16", 1), ("layer_norm", "bf16", 256)]
    out += [(norm, "fp64", D) for norm in ("layer_norm", "add_layer_norm") for D in wide]
    return out


def cases_from_y() -> list[tuple[str, str, int]]:
    """(norm, dtype, D) of the memory-efficient backward's launches compiled (with kept
    channels and rows kept whole, its heaviest variant): LayerNorm and its add-norm, whose
    recovery subtracts the shift, in bfloat16 and float32 at the backward's largest short tile
    and on a long row."""
    return [(norm, dtype, D) for dtype in ("bf16", "fp32") for norm in ("layer_norm",
                                                                        "add_layer_norm")
            for D in (launch.MAX_SHORT_D_BWD, 2 * launch.MAX_SHORT_D_FWD)]


def cases_quant() -> list[tuple[str, str, int, bool, int | None]]:
    """(norm, dtype, D, float8, group_size) of the quantized norm's launches compiled: the
    largest short tile (per token, and per group of 128 with the residual add) and a long row
    (its second kernel, per token and per group), in bfloat16 to float8 and float32 to int8."""
    short, long = launch.MAX_SHORT_D_FWD, 2 * launch.MAX_SHORT_D_FWD
    return [("rms_norm", "bf16", short, True, None), ("add_rms_norm", "bf16", short, True, 128),
            ("layer_norm", "fp32", short, False, 128), ("rms_norm", "fp32", long, False, None),
            ("rms_norm", "bf16", long, True, 128)]


def _tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@contextlib.contextmanager
def capturing() -> Iterator[list[tuple]]:
    """A list that receives (kernel, args, kwargs) of every launch of the KERNELS made inside
    the block, instead of running them (``kernel[grid](...)`` calls ``kernel.run``)."""
    launches: list[tuple] = []

    def capture(kernel):
        def run(*args, grid, warmup, **kwargs):
            launches.append((kernel, args, kwargs))
        return run

    saved = {k: k.__dict__.get("run") for k in KERNELS}
    for k in KERNELS:
        k.run = capture(k)
    try:
        yield launches
    finally:
        for k, run in saved.items():
            if run is None:
                del k.run
            else:
                k.run = run


def captured_launches(norm: str, dtype: str, D: int, from_y: bool = False) -> list[tuple]:
    """(kernel, args, kwargs) of each launch the launchers make for ``norm`` on (M, D) ``dtype``
    meta tensors: forward, then backward with the forward's outputs; with ``from_y``, only the
    memory-efficient backward's, with one kept channel and one row kept whole."""
    n = NORMS[norm]
    dt = DTYPES[dtype]
    x = _tensor((M, D), dt)
    residual = _tensor((M, D), dt) if n.residual else None
    weight = _tensor((D,), dt)
    bias = _tensor((D,), dt) if n.centred else None
    with capturing() as launches:
        y, h, mean, rstd = launch.forward(x, residual, weight, bias, 1e-5, centred=n.centred)
        xn = h if n.residual else x
        dh = _tensor((M, D), dt) if n.residual else None
        residual_dtype = dt if n.residual else None
        if from_y:
            del launches[:]  # the forward's, compiled with the default mode's cases
            one = _tensor((1,), torch.int64)
            launch.backward_from_y(_tensor((M, D), dt), dh, y, weight, bias, rstd, one,
                                   _tensor((M, 1), rstd.dtype), centred=n.centred,
                                   x_dtype=dt if n.residual else None,
                                   residual_dtype=residual_dtype, rows=one,
                                   xhat_rows=_tensor((1, D), rstd.dtype))
        else:
            launch.backward(_tensor((M, D), dt), dh, xn, weight, bias, mean, rstd,
                            centred=n.centred, x_dtype=dt if n.residual else None,
                            residual_dtype=residual_dtype)
    return launches


def captured_quant(norm: str, dtype: str, D: int, float8: bool,
                   group_size: int | None) -> list[tuple]:
    """(kernel, args, kwargs) of each launch of ``launch.forward_quant`` for ``norm`` on (M, D)
    ``dtype`` meta tensors, with dynamic scales bounded by a scale_ub."""
    n = NORMS[norm]
    dt = DTYPES[dtype]
    with capturing() as launches:
        limits = QUANT_DTYPES["float8_e4m3fn" if float8 else "int8"]
        launch.forward_quant(
            _tensor((M, D), dt), _tensor((M, D), dt) if n.residual else None,
            _tensor((D,), dt), _tensor((D,), dt) if n.centred else None, 1e-5,
            centred=n.centred, float8=float8, group_size=group_size,
            scale_ub=_tensor((1,), torch.float32), qmax=limits.qmax,
            min_scale=limits.min_scale)
    return [launch_ for launch_ in launches if launch_[0] in (K._quant_short_kernel,
                                                              K._quant_rows_kernel)]


def launches() -> list[tuple[str, tuple, dict]]:
    """(label, (kernel, args, kwargs), dtype) of every launch to compile, in table order."""
    launch._sm_count = lambda device: SMS
    out = []
    for norm, dtype, D in cases():
        for kernel, args, kwargs in captured_launches(norm, dtype, D):
            out.append((f"{KERNELS[kernel]} {norm} D={D}", (kernel, args, kwargs), dtype))
    for norm, dtype, D in cases_from_y():
        for kernel, args, kwargs in captured_launches(norm, dtype, D, from_y=True):
            out.append((f"{KERNELS[kernel]} {norm} D={D} from y", (kernel, args, kwargs),
                        dtype))
    for norm, dtype, D, float8, group in cases_quant():
        for kernel, args, kwargs in captured_quant(norm, dtype, D, float8, group):
            to = "float8" if float8 else "int8"
            per = f"groups of {group}" if group else "per token"
            out.append((f"{KERNELS[kernel]} {norm} D={D} to {to}, {per}", (kernel, args, kwargs),
                        dtype))
    return out


def compile_launch(kernel, args: tuple, kwargs: dict, sm: int):
    """Compile one captured launch for sm_<sm> with the launch-time specialization."""
    target = GPUTarget("cuda", sm, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    key = (kernel.fn.__name__, str(sorted(signature.items())), str(sorted(constexprs.items())),
           str(sorted(attrs.items())), options.num_warps)
    return key, lambda: triton.compile(src, target=target, options=options.__dict__)


# PTX instructions that are not correctly rounded, or flush subnormals to zero: the kernels'
# divisions and square roots must be none of them (kernels.py, module docstring, item 2).
INEXACT = re.compile(r"\b(?:div|sqrt|rsqrt|rcp)\.(?:full|approx)[\w.]*"
                     r"|\b\w+(?:\.\w+)*\.ftz\b[\w.]*")


SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)\s*([^;]*);")
BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")


def loop_spills(sass: str) -> int:
    """Spill instructions (STL, LDL) that may run once per loop iteration: those inside a loop
    (between a backward branch's target and the branch) or past the kernel's last EXIT (the
    subroutines, such as the slow path of a correctly rounded division, are placed there and
    are called from the loops). A spill outside every loop runs once per program."""
    code = [(int(a, 16), op, rest) for a, op, rest in SASS_LINE.findall(sass)]
    loops = []
    for addr, op, rest in code:
        target = BRANCH_TARGET.search(rest)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    exits = [addr for addr, op, _ in code if op == "EXIT"]
    last_exit = max(exits) if exits else -1
    return sum(1 for addr, op, _ in code if op.startswith(("STL", "LDL"))
               and (addr > last_exit or any(lo <= addr <= hi for lo, hi in loops)))


def resource_usage(compiled) -> dict:
    """REG, STACK, SHARED and LOCAL per thread of a compiled kernel, from cuobjdump; the spill
    instructions of its machine code that may run per loop iteration (:func:`loop_spills`);
    and the inexact instructions in its PTX (INEXACT)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
        sass = subprocess.run([CUOBJDUMP, "--dump-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    usage = dict(zip(("reg", "stack", "shared", "local"), map(int, found.groups()), strict=True))
    return {**usage, "loop_spills": loop_spills(sass),
            "inexact": sorted(set(INEXACT.findall(compiled.asm["ptx"])))}


def table(sm: int) -> list[dict]:
    """One row per distinct launch: label, dtype, num_warps and resource usage on sm_<sm>."""
    rows, seen = [], set()
    for label, (kernel, args, kwargs), dtype in launches():
        key, build = compile_launch(kernel, args, kwargs, sm)
        if key not in seen:
            seen.add(key)
            rows.append({"kernel": label, "dtype": dtype, "num_warps": kwargs.get("num_warps"),
                         **resource_usage(build())})
    return rows


def main(argv: list[str]) -> int:
    sm = int(argv[0]) if argv and argv[0].isdigit() else 90
    rows = table(sm)
    if "--json" in argv:
        print(json.dumps(rows))
    else:
        print(f"sm_{sm}: registers, stack (spills), spill instructions in loops and shared "
              f"memory per thread block")
        for r in rows:
            print(f"{r['kernel']:<56} {r['dtype']:<5} warps {r['num_warps']:>2}  reg {r['reg']:>3}"
                  f"  stack {r['stack']:>4}  in loops {r['loop_spills']:>2}  local {r['local']:>3}"
                  f"  shared {r['shared']:>5}"
                  + (f"  inexact {' '.join(r['inexact'])}" if r["inexact"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
