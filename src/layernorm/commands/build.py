"""``layernorm build``: build the C++ CPU engine for this torch, where the wheel's does not fit.

The wheel holds the engine built for one torch minor version (its ``torch`` extra pins it), for
any x86-64 CPU with AVX2 and FMA. With another torch, or from a source checkout, ``import
layernorm.torch`` runs the NumPy fallback and says so once; this command compiles the engine
for the torch it runs with (g++ needed; about 60 s on 2 cores, each step printed as it ends)
into ``LAYERNORM_ENGINE_DIR`` where set, else ``~/.cache/layernorm``, where the next import
finds it. Nothing is built where an engine for these sources and this torch is found already.

A build holds an fcntl lock, which the system releases when the process ends however it ends:
a build killed part way leaves no lock held, and the next build resumes it (the steps that
ended are kept). A failed build prints its cause (no compiler, an unwritable folder, a
compiler's error) and what to do in one line, exit status 1; imports repeat that cause until
a build succeeds: after installing a compiler, run this command again. The variables:
``LAYERNORM_ENGINE_DIR`` (where builds live), ``LAYERNORM_NO_CPP=1`` (the NumPy fallback,
silently), ``LAYERNORM_ISA=x86-64-v3`` or ``x86-64-v4`` (force a kernel set), ``CXX`` (the
compiler; g++ by default).
"""

from __future__ import annotations

import argparse
import os
import sys

from . import count

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", type=count, default=None,
                        help="compiler processes at once (default: one a core)")


def run(args: argparse.Namespace) -> int:
    import torch

    from ..engine import build, loader

    found = build.find(build.engine_name(torch.__version__))
    if found is not None:
        print(f"the engine for these sources and torch {torch.__version__} is built: {found}")
        return 0
    try:
        folder = build.build(jobs=args.jobs)
    except build.BuildError as exc:
        print(f"layernorm build: the engine could not be built: {exc}. To fix: "
              f"{build.REMEDIES}", file=sys.stderr)
        return 1
    if os.environ.get("LAYERNORM_NO_CPP") == "1":
        print(f"built: {folder}; LAYERNORM_NO_CPP=1 is set, so imports run the NumPy fallback "
              "until it is unset")
        return 0
    from ..torch import _ops

    if not _ops.NATIVE:
        return 1  # the loader has said why, in one warning
    print(f"built: {folder}; import layernorm.torch loads it, with the kernels of "
          f"{loader.KERNELS} on this CPU")
    return 0
