"""The installed package and its C++ CPU engine: served from the wheel with no compiler, the
same bits from every kernel set, a build that a kill cannot hang, a failed build that says
why, in one line, until a build succeeds."""

from __future__ import annotations

import fcntl
import os
import platform
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import layernorm  # noqa: E402
from layernorm.engine import build  # noqa: E402

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason="the engine is built for x86-64")

PACKAGE = Path(layernorm.__file__).parent
NAME = build.engine_name(torch.__version__)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A user's environment: PATH the venv's bin alone (no compiler, no ninja), no CXX, an
    empty home (no cache of builds), none of the package's variables but those given."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LAYERNORM_") and k not in ("CXX", "PATH", "XDG_CACHE_HOME")}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**env, "PATH": str(Path(sys.executable).parent), "HOME": str(home), **extra}


def _python(script: str, env: dict[str, str], *args: str,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


# A first forward and backward of every norm (and the quantized norm's forward) on CPU
# tensors: prints whether the engine served them, its folder and kernel set.
_FIRST_CALLS = textwrap.dedent("""
    import torch
    import layernorm.torch as lt
    from layernorm.engine import loader
    from layernorm.torch import _ops
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 512, generator=g, requires_grad=True)
    r = torch.randn(8, 512, generator=g, requires_grad=True)
    w = torch.randn(512, generator=g, requires_grad=True)
    b = torch.randn(512, generator=g, requires_grad=True)
    outs = [lt.layer_norm(x, 512, w, b), lt.rms_norm(x, 512, w),
            lt.add_layer_norm(x, r, 512, w, b)[0], lt.add_rms_norm(x, r, 512, w)[0]]
    for y in outs:
        y.backward(torch.ones_like(y))
    q, s = lt.rms_norm_quant(x.detach(), 512, w.detach(), dtype=torch.int8)
    want = torch.nn.functional.layer_norm(x, (512,), w, b)
    err = float((outs[0] - want).detach().abs().max())
    # the ops whose CPU kernel the engine's operator registered
    ops = [op for op in ("fwd", "bwd", "norm", "fwd_y", "bwd_y", "norm_quant", "add_norm_quant")
           if "engine/csrc/operator.cpp" in next(
               ln for ln in torch._C._dispatch_dump(f"layernorm::{op}").splitlines()
               if ln.startswith("CPU:"))]
    print(_ops.NATIVE, loader.FOLDER, loader.KERNELS, err < 1e-5, len(ops))
""")


def test_the_wheel_serves_every_norm_with_no_compiler_and_says_nothing(tmp_path):
    """Protects the wheel: the installed package, with PATH reduced to the venv's bin (no g++,
    no ninja) and CXX unset, runs a first forward and backward of every norm and the quantized
    norm on the engine built into the package (not the NumPy fallback, not a build in a cache),
    with the widest kernel set this CPU runs, and prints nothing."""
    done = _python(_FIRST_CALLS, _env(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    native, folder, kernels, close, ops = done.stdout.split()
    assert native == "True"
    assert Path(folder) == build.PACKAGED and (build.PACKAGED / build.OPERATOR).exists()
    widest = "x86-64-v4" if "avx512bw" in Path("/proc/cpuinfo").read_text() else "x86-64-v3"
    assert kernels == widest
    assert close == "True" and int(ops) == 7


# Every norm's forward and backward, inference and quantized output, in float32, bfloat16 and
# float64, at row lengths with and without a ragged tail past the vector width; saved to the
# file its argument names.
_BITS = textwrap.dedent("""
    import sys, torch
    import layernorm.torch as lt
    from layernorm.engine import loader
    out = []
    for dt in (torch.float32, torch.bfloat16, torch.float64):
        for d in (96, 1000, 4133):
            g = torch.Generator().manual_seed(d)
            x = (3 + torch.randn(37, d, generator=g)).to(dt).requires_grad_()
            r = torch.randn(37, d, generator=g).to(dt).requires_grad_()
            w = torch.randn(d, generator=g).requires_grad_()
            b = torch.randn(d, generator=g).requires_grad_()
            ys = [lt.layer_norm(x, d, w, b), lt.rms_norm(x, d, w),
                  *lt.add_layer_norm(x, r, d, w, b, residual_dtype=torch.float32),
                  *lt.add_rms_norm(x, r, d, w),
                  lt.layer_norm(x, d, w, b, memory_efficient=True)]
            loss = sum((y.double() * (i + 1)).sum() for i, y in enumerate(ys))
            out += [y.detach() for y in ys] + list(torch.autograd.grad(loss, (x, r, w, b)))
            with torch.inference_mode():
                out += [lt.rms_norm(x, d, w)]
                out += list(lt.rms_norm_quant(x, d, w, dtype=torch.float8_e4m3fn))
    torch.save(out, sys.argv[1])
    print(loader.KERNELS)
""")


def _sets_here() -> list[str]:
    flags = Path("/proc/cpuinfo").read_text()
    v3 = all(f in flags for f in ("avx2", "fma", "bmi2", "f16c", "movbe"))
    v4 = v3 and all(f in flags for f in ("avx512f", "avx512bw", "avx512cd", "avx512dq",
                                         "avx512vl"))
    return [s for s, ok in (("x86-64-v3", v3), ("x86-64-v4", v4)) if ok]


def test_every_kernel_set_gives_the_same_bits(tmp_path):
    """Protects the portable binary: each kernel set this CPU runs, forced with LAYERNORM_ISA,
    gives the same output bits as the others (and as the set chosen by default) for every
    norm's forward, backward, memory-efficient backward, inference and quantized output, in
    float32, bfloat16 and float64; an unknown set is refused in one warning naming the sets,
    and the fallback runs."""
    sets = _sets_here()
    if not sets:
        pytest.skip("this CPU runs no kernel set of the engine")
    results = {}
    for forced in ["", *sets]:
        path = tmp_path / f"bits{forced}.pt"
        done = _python(_BITS, _env(tmp_path, LAYERNORM_ISA=forced), str(path))
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert done.stdout.strip() == (forced or sets[-1])
        results[forced] = torch.load(path)
    base = results[""]
    assert len(base) == 3 * 3 * (7 + 4 + 3)
    for forced in sets:
        for k, (got, want) in enumerate(zip(results[forced], base, strict=True)):
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8),
                                                           want.view(torch.uint8)), (forced, k)
    done = _python("import layernorm.torch as lt; from layernorm.torch import _ops; "
                   "print(_ops.NATIVE)", _env(tmp_path, LAYERNORM_ISA="x86-64-v9"))
    lines = [ln for ln in done.stderr.splitlines() if "RuntimeWarning" in ln]
    assert done.stdout.strip() == "False" and len(lines) == 1
    assert "LAYERNORM_ISA=x86-64-v9 names no kernel set" in lines[0] and "x86-64-v3" in lines[0]


# A stand-in compiler: compiles an empty file for each object (a real object, with no code run
# at load), copies the installed engine's library of the same name for each link, and with
# FAKE_HANG set hangs on the last link, so that a build can be killed part way.
_FAKE_CXX = textwrap.dedent("""\
    #!{python}
    import os, shutil, subprocess, sys, time
    from pathlib import Path
    args = sys.argv[1:]
    if args == ["--version"]:
        print("stand-in compiler"); sys.exit(0)
    out = args[args.index("-o") + 1]
    if os.environ.get("FAKE_HANG") and out.startswith("kernels-x86-64-v4.so"):
        time.sleep(600)
    if "-c" in args:
        sys.exit(subprocess.call(["{gxx}", "-c", "-x", "c++", "/dev/null", "-o", out],
                                 env={{**os.environ, "PATH": "/usr/bin:/bin"}}))
    name = out.split(".so")[0] + ".so"
    shutil.copy(Path("{engine}") / name, out)
""")


def _fake_compiler(tmp_path: Path) -> Path:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ here to make the stand-in's objects")
    path = tmp_path / "fake-c++"
    path.write_text(_FAKE_CXX.format(python=sys.executable, gxx=gxx, engine=build.PACKAGED))
    path.chmod(0o755)
    return path


_BUILD = "import sys; from layernorm.engine import build; print(build.build(sys.argv[1]))"


def test_a_build_killed_part_way_leaves_every_import_and_the_next_build_working(tmp_path):
    """Protects against a hang: a build killed part way (SIGKILL, as an out-of-memory kill or a
    CI timeout does it) leaves no lock held and no folder taken for an engine; an import meanwhile
    loads at once (it never waits on a build); the next build takes the lock at once, keeps the
    steps that had ended, finishes, and the next import with LAYERNORM_ENGINE_DIR loads it."""
    cxx = _fake_compiler(tmp_path)
    root = tmp_path / "engines"
    env = _env(tmp_path, CXX=str(cxx), LAYERNORM_ENGINE_DIR=str(root))
    first = subprocess.Popen([sys.executable, "-c", _BUILD, str(root)],
                             env={**env, "FAKE_HANG": "1"}, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    watchdog = threading.Timer(240, os.killpg, (first.pid, signal.SIGKILL))
    watchdog.start()
    try:
        ended = 0
        for line in first.stderr:  # every step but the last link ends; then it hangs
            ended += "] " in line
            if ended == 12:
                break
        assert ended == 12
    finally:
        watchdog.cancel()
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert not (root / NAME / build.MANIFEST).exists()
    with open(root / f"{NAME}.lock") as lock:  # not held: taken at once
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(lock, fcntl.LOCK_UN)

    imported = _python(_FIRST_CALLS, env)
    assert imported.returncode == 0 and imported.stderr == "", imported.stderr
    assert imported.stdout.split()[:2] == ["True", str(build.PACKAGED)]

    second = _python(_BUILD, env, str(root))
    assert second.returncode == 0, second.stderr
    assert "12 steps kept from an earlier build" in second.stderr
    assert second.stdout.strip() == str(root / NAME)
    assert build.manifest(root / NAME)["name"] == NAME
    assert sorted(p.name for p in root.iterdir()) == [NAME, f"{NAME}.lock"]

    imported = _python(_FIRST_CALLS, env)
    assert imported.returncode == 0 and imported.stderr == "", imported.stderr
    assert imported.stdout.split()[:2] == ["True", str(root / NAME)]


def test_a_failed_build_says_why_in_one_line_until_a_build_succeeds(tmp_path):
    """Protects the fallback's messages: from a source tree with no engine built (a copy of the
    package without its _built/), `layernorm build` without a compiler ends with one line naming
    the cause and the remedies, exit status 1, no traceback; the next import warns once, at the
    caller's line, with that cause and how to clear it, and the ops give the same results on the
    NumPy fallback; a build that succeeds clears the message."""
    tree = tmp_path / "src"
    shutil.copytree(PACKAGE, tree / "layernorm",
                    ignore=shutil.ignore_patterns("_built", "__pycache__"))
    root = tmp_path / "engines"
    env = _env(tmp_path, PYTHONPATH=str(tree), LAYERNORM_ENGINE_DIR=str(root),
               CXX="/nonexistent/c++")
    done = subprocess.run([sys.executable, "-m", "layernorm", "build"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "no C++ compiler: /nonexistent/c++ is not on PATH" in done.stderr
    assert "LAYERNORM_ENGINE_DIR" in done.stderr and "LAYERNORM_NO_CPP=1" in done.stderr

    script = textwrap.dedent("""
        import warnings, torch
        warnings.simplefilter("always")
        import layernorm.torch as lt
        from layernorm.torch import _ops
        x = torch.randn(4, 32)
        print(_ops.NATIVE, float((lt.layer_norm(x, 32) - torch.nn.functional.layer_norm(
            x, (32,))).abs().max()))
    """)
    done = _python(script, env)
    assert done.returncode == 0, done.stderr
    native, err = done.stdout.split()
    assert native == "False" and float(err) < 1e-5
    warned = [ln for ln in done.stderr.splitlines() if "RuntimeWarning" in ln]
    assert len(warned) == 1 and warned[0].startswith("<string>:4: RuntimeWarning")
    assert "could not be built (no C++ compiler" in warned[0]
    assert "NumPy fallback" in warned[0] and "`layernorm build` tries again" in warned[0]

    cxx = _fake_compiler(tmp_path)
    built = _python(_BUILD, {**env, "CXX": str(cxx)}, str(root))
    assert built.returncode == 0, built.stderr
    assert not (root / f"{NAME}.failed").exists()
    done = _python(script, env)
    assert done.returncode == 0 and "RuntimeWarning" not in done.stderr, done.stderr
    assert done.stdout.split()[0] == "True"


def test_an_engine_built_for_another_torch_is_refused_in_one_line(tmp_path):
    """Protects the torch pin: a package whose engine was built for another torch minor
    version (its manifest says 2.99) does not load it; the import warns once, naming both
    versions and `layernorm build`, and the NumPy fallback runs."""
    tree = tmp_path / "src"
    shutil.copytree(PACKAGE, tree / "layernorm",
                    ignore=shutil.ignore_patterns("_built", "__pycache__"))
    built = tree / "layernorm" / "engine" / "_built"
    built.mkdir()
    (built / build.MANIFEST).write_text('{"name": "layernorm_cpu_0123456789ab", "torch": "2.99"}')
    done = _python("import layernorm.torch; from layernorm.torch import _ops; print(_ops.NATIVE)",
                   _env(tmp_path, PYTHONPATH=str(tree)))
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
    warned = [ln for ln in done.stderr.splitlines() if "RuntimeWarning" in ln]
    assert len(warned) == 1
    assert f"built for torch 2.99, and torch {torch.__version__} is imported" in warned[0]
    assert "`layernorm build`" in warned[0] and "NumPy fallback" in warned[0]


def test_the_build_refuses_a_kernel_object_that_runs_code_at_load(tmp_path):
    """Protects the kernel sets' loading: an object with a dynamic initialiser (code run when
    its library is loaded, here a global initialised by a call) is refused with a BuildError
    naming it; one with only constants and functions passes."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ here")
    sources = {"static.cpp": "int f(); int x = f();\n",
               "plain.cpp": "constexpr int k = 3; int f() { return k; }\n"}
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
        subprocess.run([gxx, "-c", "-O2", "-fPIC", name, "-o", name.replace(".cpp", ".o")],
                       cwd=tmp_path, check=True)
    build.check_no_initialisers([tmp_path / "plain.o"])
    with pytest.raises(build.BuildError, match=r"static\.o runs code when loaded \(\.init_array"):
        build.check_no_initialisers([tmp_path / "plain.o", tmp_path / "static.o"])
