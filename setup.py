"""The wheel's build: the package with the C++ CPU engine compiled into it.

Everything but the engine is declared in pyproject.toml. Building the wheel compiles the engine
(src/layernorm/engine/build.py: the operator for any x86-64, the kernels for x86-64-v3 and
x86-64-v4) against the torch installed in the build's environment into
``layernorm/engine/_built/``, and tags the wheel for the platform (``py3-none-linux_x86_64``:
the binaries use no Python API, only torch's C++ one). That torch must be the one the
``torch`` extra pins; build without pip's isolation, in an environment that has it:

    pip install torch==2.13.* --index-url https://download.pytorch.org/whl/cpu
    pip wheel --no-build-isolation --no-deps -w dist .

``LAYERNORM_ENGINE_DIR`` keeps the engine's builds between wheel builds (an unchanged engine is
not compiled again); ``LAYERNORM_NO_CPP=1`` builds a wheel without the engine (pure Python, any
platform; CPU tensors then run the NumPy fallback). An editable install (``pip install -e``)
builds the engine into the source tree's ``_built/``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
WITH_ENGINE = os.environ.get("LAYERNORM_NO_CPP") != "1"


def _engine_build():
    """src/layernorm/engine/build.py, loaded by its path: importing the package would need
    its dependencies here."""
    spec = importlib.util.spec_from_file_location(
        "layernorm_engine_build", ROOT / "src" / "layernorm" / "engine" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithEngine(build_py):
    """build_py, then the engine compiled (or taken from LAYERNORM_ENGINE_DIR's builds) into
    the package's engine/_built/."""

    def run(self) -> None:
        super().run()
        if not WITH_ENGINE:
            return
        import torch
        from packaging.requirements import Requirement

        pins = [Requirement(r) for r in self.distribution.extras_require.get("torch", [])]
        version = torch.__version__.split("+")[0]
        if not all(p.specifier.contains(version, prereleases=True) for p in pins):
            raise SystemExit(f"layernorm: the wheel's engine would be built against torch "
                             f"{torch.__version__}, which the torch extra "
                             f"({', '.join(map(str, pins))}) does not admit: install that torch "
                             "in the build's environment and build with --no-build-isolation")
        build = _engine_build()
        package = ROOT / "src" if self.editable_mode else Path(self.build_lib)
        target = package / "layernorm" / "engine" / "_built"
        cache = os.environ.get("LAYERNORM_ENGINE_DIR")
        with tempfile.TemporaryDirectory() as tmp:
            try:
                folder = build.build(Path(cache) if cache else Path(tmp))
            except build.BuildError as exc:
                raise SystemExit(f"layernorm: the engine could not be built: {exc}") from exc
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(folder, target)


class WithBinaries(Distribution):
    """A distribution with binaries (the engine's) when it holds the engine: installed to
    platlib, in a platform wheel."""

    def has_ext_modules(self) -> bool:
        return WITH_ENGINE


class PlatformWheel(bdist_wheel):
    """A wheel for this platform and any Python 3 when it holds the engine."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, platform = super().get_tag()
        return ("py3", "none", platform) if WITH_ENGINE else (python, abi, platform)


setup(distclass=WithBinaries,
      cmdclass={"build_py": BuildWithEngine, "bdist_wheel": PlatformWheel})
