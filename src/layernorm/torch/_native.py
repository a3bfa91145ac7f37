"""The CPU engine and the operator that runs the ops on CPU tensors: built once per machine.

``csrc/`` holds the engine (``engine.h``: the kernels of every norm, ``forward.cpp`` and
``backward.cpp``) and the operator (``operator.h``: checks, outputs, threads; ``cpu_ops.cpp``,
``autograd.cpp`` and ``arrays.cpp``), which registers the CPU kernels of ``layernorm::fwd``,
``layernorm::bwd``, ``layernorm::norm``, ``layernorm::fwd_y`` and ``layernorm::bwd_y``, the
NumPy API's entry points and the bandwidth yardstick's copy. They are
compiled with torch's ``cpp_extension`` (g++ and ninja, :data:`FLAGS`) into a folder beside the
package (:func:`build_directory`), named by a hash of the sources, the flags, torch's version and
the CPU's instruction set: ``make`` builds it right after installing (:func:`build`); any other
install builds it at the first import of ``layernorm.torch``, with one line on stderr saying so,
and later imports load it in well under a second.

Large outputs (1 MiB and more) come from a pool of blocks whose tensors were freed, so that a
call does not pay the first touch of fresh pages (:func:`layernorm.cpu.memory.pool_cap` caps
it).

Where it cannot be built (no compiler, no ninja), :func:`load` says so in one warning and
returns False; so does ``LAYERNORM_NO_CPP=1``, without a warning. Then the ops' CPU kernels and
the NumPy API run the NumPy fallback (:mod:`layernorm.cpu.fallback`, the reference's
arithmetic on one thread): the same results within the tolerance table, many times slower.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path

import torch

from .. import recovery
from ..cpu import memory
from ..reference.quant import QUANT_DTYPES

__all__ = ["load"]

CSRC = Path(__file__).with_name("csrc")
# compiled; the headers beside them are hashed too
SOURCES = ("forward.cpp", "backward.cpp", "operator.cpp", "cpu_ops.cpp", "autograd.cpp",
           "arrays.cpp")
# -O3 -march=native: the fixed-order sums (csrc/element.h) become this CPU's vector registers;
# -ffp-contract=off: no multiply and add is fused unless the source says so (mul_add); no
# -ffast-math, which would break the kernels' isfinite tests and flush subnormals in the whole
# process. -fopenmp: at::parallel_for is inlined from torch's headers as an OpenMP region,
# which without it compiles to a serial loop; no -lgomp: the region runs on the OpenMP
# runtime torch loaded.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
# Where the build lives: beside the package, so that it is built once per install and CPU.
BUILD_ROOT = Path(__file__).with_name("_build")
BUILD_SECONDS = 60  # about how long a build takes on 2 cores


def _instruction_set() -> str:
    """What this CPU can run: its flags line in /proc/cpuinfo (the machine's name elsewhere)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def _name() -> str:
    """The engine's name: changes with its sources and flags, torch's version and the CPU's
    instruction set, so that an edited source, another torch or another CPU never loads a
    stale build."""
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + path.read_bytes())
    h.update(" ".join([*FLAGS, torch.__version__, _instruction_set()]).encode())
    return f"layernorm_cpu_{h.hexdigest()[:12]}"


def build_directory() -> Path:
    """The folder of this machine's build: in ``LAYERNORM_ENGINE_DIR`` where set, else beside
    the package, or where that cannot be written, in the user's cache."""
    name = _name()
    root = Path(os.environ.get("LAYERNORM_ENGINE_DIR") or BUILD_ROOT)
    with contextlib.suppress(OSError):
        root.mkdir(exist_ok=True)
    if not os.access(root, os.W_OK):
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "layernorm"
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def build() -> Path:
    """Build the engine for this machine unless it is built; the path of its library."""
    folder = build_directory()
    library = folder / f"{folder.name}.so"
    if library.exists():
        return library
    if shutil.which("ninja") is None:  # the ninja wheel's binary, where the venv is not on PATH
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    from torch.utils import cpp_extension

    print(f"layernorm: building the CPU engine for this machine, once (about {BUILD_SECONDS} s)"
          f" into {folder}", file=sys.stderr, flush=True)
    cpp_extension.load(name=folder.name, sources=[str(CSRC / s) for s in SOURCES],
                       extra_cflags=list(FLAGS), build_directory=str(folder),
                       is_python_module=False, verbose=False)
    for old in folder.parent.glob("layernorm_cpu_*"):  # builds of earlier sources
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return library


def load() -> bool:
    """Build (or load the cached build of) the C++ operator and register its CPU kernels;
    True on success. On failure, one warning says why and False is returned."""
    if os.environ.get("LAYERNORM_NO_CPP") == "1":
        return False
    try:
        library = build()
        if not hasattr(torch.ops.layernorm_cpu, "copy_into"):
            torch.ops.load_library(str(library))
    except Exception as exc:  # noqa: BLE001 - any failure to build means: fall back
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(f"layernorm: the C++ CPU engine could not be built ({why}): CPU tensors "
                      f"and layernorm.cpu run the NumPy fallback instead, many times slower",
                      RuntimeWarning, stacklevel=2)
        return False
    quant = [QUANT_DTYPES[name] for name in ("int8", "float8_e4m3fn")]
    torch.ops.layernorm_cpu._setup(memory.CAP_BYTES, recovery.MARGIN, [q.qmax for q in quant],
                                   [q.min_scale for q in quant])
    return True

