"""The C++ CPU engine's build: its name, its compiler commands, where builds are found, and a
build that cannot hang.

The engine is two kinds of shared object, compiled from ``csrc/`` with g++:

* ``layernorm_cpu.so``, the operator (``operator.cpp``, ``cpu_ops.cpp``, ``autograd.cpp``,
  ``arrays.cpp``): torch's headers, linked against torch's libraries, compiled for any x86-64;
* ``kernels-<set>.so``, the kernels (``forward.cpp``, ``backward.cpp``, ``kernels.cpp``), no
  torch headers, once per instruction set of :data:`SETS`, each in a namespace of its own
  (``-DLAYERNORM_ISA``) with every symbol hidden but its table's entry (a linker version
  script), and no code run at load (checked here: no object may hold ``.init_array``). The
  operator loads the widest set the CPU runs (``LAYERNORM_ISA`` forces one).

They live in one folder with ``engine.json``, the manifest :func:`build` writes last; a folder
without it is not an engine. The folder's name (:func:`engine_name`) hashes the sources, the
flags and torch's minor version, so another source, flag or torch never loads a stale build.

:func:`build` compiles into a folder of its own beside the final one and renames it into
place when every step is done, under an ``fcntl`` lock that the kernel releases when the
process holding it ends, however it ends: a build killed part way leaves a folder that is not
an engine, which the next build resumes (each step's output is renamed into place only when
its command succeeds), and no import ever waits for a lock. A failed build leaves
``<name>.failed`` with its cause beside the folder, which the loader's warning repeats; the
next build removes it.

A build is looked for (:func:`find`) in ``LAYERNORM_ENGINE_DIR`` where set, in the package
(:data:`PACKAGED`, the wheel's) and in the user's cache (:func:`cache_root`).

Used by the wheel's build (``setup.py``, which loads this file by its path: it imports nothing
of the package, and torch only to build), by ``layernorm build``, and by the loader
(:mod:`.loader`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

CSRC = Path(__file__).with_name("csrc")
PACKAGED = Path(__file__).with_name("_built")
"""The wheel's engine: built into the package when the wheel was."""
MANIFEST = "engine.json"
OPERATOR = "layernorm_cpu.so"
OPERATOR_SOURCES = ("operator.cpp", "cpu_ops.cpp", "autograd.cpp", "arrays.cpp")
KERNEL_SOURCES = ("forward.cpp", "backward.cpp", "kernels.cpp")
# The kernels' instruction sets, as -march names them: AVX2 with FMA, and AVX-512. A CPU
# without FMA would round the kernels' mul_add twice and give other bits: it runs none.
SETS = ("x86-64-v3", "x86-64-v4")
# -O3; -ffp-contract=off: no multiply and add is fused unless the source says so (mul_add); no
# -ffast-math, which would break the kernels' isfinite tests and flush subnormals in the whole
# process.
FLAGS = ("-O3", "-std=c++20", "-fPIC", "-ffp-contract=off")
# The operator runs anywhere x86-64 does. -fopenmp: at::parallel_for is inlined from torch's
# headers as an OpenMP region, which without it compiles to a serial loop; not linked with
# -lgomp: the region runs on the OpenMP runtime torch loaded.
OPERATOR_FLAGS = ("-march=x86-64", "-mtune=generic", "-fopenmp")
KERNEL_FLAGS = ("-fvisibility=hidden", "-fvisibility-inlines-hidden")
# The sources by the time they take to compile, the longest first (the order a build starts
# them in).
LONGEST = ("backward.cpp", "autograd.cpp", "cpu_ops.cpp", "arrays.cpp", "operator.cpp",
           "forward.cpp", "kernels.cpp")
BUILD_SECONDS = 60  # about how long a build takes on 2 cores
# Every way out of a failed build, for its message and the loader's.
REMEDIES = ("install g++ and run `layernorm build` again, set LAYERNORM_ENGINE_DIR to a "
            "folder you can write, install the wheel built for this torch, or set "
            "LAYERNORM_NO_CPP=1 to run the NumPy fallback without this message")


class BuildError(RuntimeError):
    """A build that could not finish; its message is the cause, in one line."""


def torch_series(version: str) -> str:
    """torch's minor version of a version string: '2.13' of '2.13.0+cpu'. One engine serves
    every release of a minor version (its C++ ABI)."""
    return ".".join(version.split("+")[0].split(".")[:2])


def engine_name(torch_version: str) -> str:
    """The engine's folder name: changes with its sources and flags and torch's minor version,
    so that an edited source, other flags or another torch never load a stale build."""
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + path.read_bytes())
    h.update(" ".join([*FLAGS, *OPERATOR_FLAGS, *KERNEL_FLAGS, *SETS,
                       torch_series(torch_version)]).encode())
    return f"layernorm_cpu_{h.hexdigest()[:12]}"


def cache_root() -> Path:
    """Where ``layernorm build`` builds: ``LAYERNORM_ENGINE_DIR`` where set, else the user's
    cache (``$XDG_CACHE_HOME/layernorm``, or ``~/.cache/layernorm``)."""
    if os.environ.get("LAYERNORM_ENGINE_DIR"):
        return Path(os.environ["LAYERNORM_ENGINE_DIR"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "layernorm"


def candidates(name: str) -> list[Path]:
    """Where the engine ``name`` may be, in the order looked at."""
    places = [cache_root() / name] if os.environ.get("LAYERNORM_ENGINE_DIR") else []
    return [*places, PACKAGED, cache_root() / name]


def find(name: str) -> Path | None:
    """The first folder of :func:`candidates` that holds the whole engine ``name``."""
    return next((f for f in candidates(name) if (manifest(f) or {}).get("name") == name), None)


def manifest(folder: Path) -> dict | None:
    """A built engine's manifest, or None where ``folder`` holds no whole engine."""
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def failure(root: Path, name: str) -> str | None:
    """The cause of the last failed build of engine ``name`` in ``root``, if it failed."""
    with contextlib.suppress(OSError):
        return (root / f"{name}.failed").read_text().strip() or None
    return None


class Step(NamedTuple):
    """One compiler command: what it makes (a file of the build folder) from what."""

    label: str
    output: str
    argv: tuple[str, ...]
    inputs: tuple[str, ...] = ()  # outputs of earlier steps it needs


def _torch_flags() -> tuple[list[str], list[str]]:
    """The operator's compile flags for torch's headers and its link flags for torch's
    libraries, of the torch installed here."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        raise BuildError(f"torch cannot be imported ({exc}): the engine is built against the "
                         "torch it runs with") from exc
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    cflags = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    for path in cpp_extension.include_paths():
        cflags += ["-isystem", path]
    ldflags = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu"]
    return cflags, ldflags


def plan(cxx: str) -> list[Step]:
    """The steps of a build, compiles first: every object, then the operator and each set's
    kernels linked."""
    cflags, ldflags = _torch_flags()
    # __FILE__ (in the registrations' records) names the package's file, not this folder
    cflags.append(f"-fmacro-prefix-map={CSRC}/=layernorm/engine/csrc/")
    steps, links = [], []
    operator_objects = []
    for source in OPERATOR_SOURCES:
        obj = source.replace(".cpp", ".o")
        operator_objects.append(obj)
        steps.append(Step(source, obj, (cxx, *FLAGS, *OPERATOR_FLAGS, *cflags, "-c",
                                        str(CSRC / source), "-o", obj)))
    links.append(Step(f"link {OPERATOR}", OPERATOR,
                      (cxx, "-shared", *operator_objects, *ldflags, "-o", OPERATOR),
                      tuple(operator_objects)))
    for isa in SETS:
        short = isa.rsplit("-", 1)[1]
        objects = []
        for source in KERNEL_SOURCES:
            obj = source.replace(".cpp", f"-{short}.o")
            objects.append(obj)
            steps.append(Step(f"{source} for {isa}", obj,
                              (cxx, *FLAGS, f"-march={isa}", *KERNEL_FLAGS, cflags[-1],
                               f"-DLAYERNORM_ISA={short}", "-c", str(CSRC / source), "-o", obj)))
        library = f"kernels-{isa}.so"
        links.append(Step(f"link {library}", library,
                          (cxx, "-shared", *objects, "-Wl,--version-script=kernels.map",
                           "-Wl,-z,defs", "-o", library), tuple(objects)))
    return steps + links


def _sections(path: Path) -> set[str]:
    """The section names of a 64-bit little-endian ELF object."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise BuildError(f"{path.name} is not a 64-bit little-endian ELF object")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    def header(i: int) -> tuple[int, int]:
        name, = struct.unpack_from("<I", data, shoff + i * shentsize)
        offset, = struct.unpack_from("<Q", data, shoff + i * shentsize + 0x18)
        return name, offset
    strtab = header(shstrndx)[1]
    names = set()
    for i in range(shnum):
        start = strtab + header(i)[0]
        names.add(data[start:data.index(b"\0", start)].decode())
    return names


def check_no_initialisers(objects: list[Path]) -> None:
    """Raise BuildError for an object that would run code when its library is loaded (a
    dynamic initialiser: .init_array or .ctors), which a kernel set may not: a CPU without
    the set's instructions loads it too, to learn that it cannot run it."""
    for obj in objects:
        found = _sections(obj) & {".init_array", ".ctors"}
        if found:
            raise BuildError(f"{obj.name} runs code when loaded ({', '.join(sorted(found))}): "
                             "a kernel file may hold no dynamic initialiser")


def _run(step: Step, work: Path) -> float:
    """Run one step in `work`; its seconds. Its output is renamed into place only when its
    command succeeds, so that a killed build leaves no half-written file under that name."""
    t0 = time.perf_counter()
    partial = f"{step.output}.part-{os.getpid()}"  # a killed build's orphans write their own
    argv = [partial if a == step.output else a for a in step.argv]
    try:
        done = subprocess.run(argv, cwd=work, capture_output=True, text=True)
    except OSError as exc:
        raise BuildError(f"{step.argv[0]} could not run ({exc.strerror})") from exc
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if "error" in ln] or \
            done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise BuildError(f"{step.argv[0]} failed on {step.label}: {lines[0].strip()}")
    os.replace(work / partial, work / step.output)
    return time.perf_counter() - t0


@contextlib.contextmanager
def _locked(path: Path, say: Callable[[str], None]):
    """Hold an exclusive fcntl lock on `path`: released by the kernel when this process ends,
    however it ends, so a killed build never leaves it held."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process's build of the same engine ({path})")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _say(line: str) -> None:
    print(f"layernorm: {line}", file=sys.stderr, flush=True)


def build(root: Path | None = None, *, jobs: int | None = None,
          say: Callable[[str], None] = _say) -> Path:
    """Build the engine for the torch installed here into ``root/<engine_name>`` (root:
    :func:`cache_root` by default) unless it is built; that folder. Says each step as it
    ends. Raises :class:`BuildError` with the cause (no compiler, no torch, a folder it cannot
    write, a compiler's error), which it also leaves in ``<name>.failed`` for the loader."""
    import torch

    root = Path(root) if root is not None else cache_root()
    name = engine_name(torch.__version__)
    final = root / name
    if manifest(final) is not None:
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".{name}.{os.getpid()}.probe"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise BuildError(f"cannot write {root} ({exc.strerror}): set LAYERNORM_ENGINE_DIR to "
                         "a folder you can write") from exc
    marker = root / f"{name}.failed"
    try:
        with _locked(root / f"{name}.lock", say):
            if manifest(final) is None:
                _build_into(final, torch.__version__, jobs, say)
    except BuildError as exc:
        with contextlib.suppress(OSError):
            marker.write_text(f"{exc}\n")
        raise
    marker.unlink(missing_ok=True)
    return final


def _build_into(final: Path, torch_version: str, jobs: int | None,
                say: Callable[[str], None]) -> None:
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise BuildError(f"no C++ compiler: {cxx} is not on PATH (install g++, or set CXX "
                         "to one)")
    steps = plan(cxx)
    work = final.with_name(final.name + ".partial")  # a killed build's steps are kept here
    work.mkdir(exist_ok=True)
    (work / "kernels.map").write_text("{ global: layernorm_kernels; local: *; };\n")
    todo = [s for s in steps if not (work / s.output).exists()]
    done_before = len(steps) - len(todo)
    jobs = jobs or len(os.sched_getaffinity(0))
    say(f"building the CPU engine for torch {torch_series(torch_version)} into {final} "
        f"({len(todo)} steps on {jobs} cores, about {BUILD_SECONDS} s on 2)"
        + (f"; {done_before} steps kept from an earlier build" if done_before else ""))
    t0, count = time.perf_counter(), done_before
    # the longest first, so that the last to end is short
    compiles = sorted((s for s in todo if not s.inputs), key=lambda s: LONGEST.index(
        Path(s.argv[s.argv.index("-c") + 1]).name))
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(_run, s, work): s for s in compiles}
        try:
            for future in concurrent.futures.as_completed(futures):
                seconds = future.result()
                count += 1
                say(f"  [{count}/{len(steps)}] {futures[future].label} ({seconds:.1f} s)")
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    for step in steps:
        if step.inputs and step.output.startswith("kernels-"):
            check_no_initialisers([work / obj for obj in step.inputs])
    for step in (s for s in todo if s.inputs):
        seconds = _run(step, work)
        count += 1
        say(f"  [{count}/{len(steps)}] {step.label} ({seconds:.1f} s)")
    for path in work.iterdir():  # the engine is its libraries and manifest
        if path.suffix != ".so":
            path.unlink()
    compiler = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    (work / MANIFEST).write_text(json.dumps({
        "name": final.name, "torch": torch_series(torch_version),
        "built_with_torch": torch_version, "sets": list(SETS),
        "compiler": compiler.splitlines()[0] if compiler else cxx,
        "flags": {"all": FLAGS, "operator": OPERATOR_FLAGS, "kernels": KERNEL_FLAGS},
    }, indent=1) + "\n")
    if final.exists():  # a folder without a manifest: not an engine
        shutil.rmtree(final)
    os.replace(work, final)
    for old in final.parent.glob("layernorm_cpu_*"):  # earlier sources' builds for this torch
        if old.is_dir() and old != final and (manifest(old) or {}).get("torch") == \
                torch_series(torch_version):
            shutil.rmtree(old, ignore_errors=True)
    say(f"built in {time.perf_counter() - t0:.0f} s: {final}")
