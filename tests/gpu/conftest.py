"""The GPU tests run on CUDA when a device is present, else in Triton's interpreter on CPU tensors.

Triton picks the interpreter when a kernel is decorated, i.e. when layernorm.gpu.kernels is first
imported, so TRITON_INTERPRET is set here, at collection, before the test modules import it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

try:
    import torch
except ImportError:  # the test modules skip themselves
    torch = None

if torch is not None and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


if torch is not None:
    @pytest.fixture
    def poisoned_outputs(monkeypatch):
        """Every buffer the launchers allocate (outputs, statistics, partial sums) starts as
        NaN, so an element no kernel writes is NaN in the results and fails the comparison,
        instead of passing on whatever the allocator's memory held. The modules of the
        launchers' tests use it for every test (``pytest.mark.usefixtures``)."""
        from triton_cases import poisoned_empty

        from layernorm.gpu import launch

        monkeypatch.setattr(launch.torch, "empty", poisoned_empty)

    @pytest.fixture
    def check(float64_oracle):
        """:func:`triton_cases.assert_matches_oracle` with the float64 oracle."""
        from triton_cases import assert_matches_oracle

        def check(case, **kw) -> dict:
            return assert_matches_oracle(case, float64_oracle, **kw)
        return check

    @pytest.fixture
    def partial_rows(monkeypatch) -> list[int]:
        """The number of partial rows of dw and db (of programs writing them) of every
        backward launched from here on, with 16 "SMs"."""
        from layernorm.gpu import launch

        monkeypatch.setattr(launch, "_sm_count", lambda device: 16)
        seen: list[int] = []
        count = launch._partial_rows

        def recording(*args, **kw) -> int:
            seen.append(count(*args, **kw))
            return seen[-1]
        monkeypatch.setattr(launch, "_partial_rows", recording)
        return seen

    @pytest.fixture(params=["short", "long"])
    def path(request, monkeypatch) -> int:
        """The row length of a short-row test (several rows a tile), or of a long-row one:
        every D > 64 takes the long path in blocks of 32 (16 for float64), ragged last block
        included. A test may choose one path by indirect parametrization ("short" or
        "long")."""
        from triton_cases import LONG_D, SHORT_D

        from layernorm.gpu import launch

        if request.param == "short":
            return SHORT_D
        monkeypatch.setattr(launch, "MAX_SHORT_D_FWD", 64)
        monkeypatch.setattr(launch, "MAX_SHORT_D_BWD", 64)
        monkeypatch.setattr(launch, "LONG_BLOCK", 32)
        assert launch.plan("fwd", LONG_D).long and launch.plan("bwd", LONG_D, wide=True).long
        return LONG_D


# ---------------------------------------------------------------------------------------------
# The short GPU call (tools/gpu_session.sh quick): its test steps, selected by marker
# ---------------------------------------------------------------------------------------------

_FAST = ("bfloat16", "float32")  # the dtypes that step (1) runs: what models train in


def _fast(key: str):
    return lambda params: params.get(key) in _FAST


# What only a GPU can show, each norm and mode once per dtype, in three steps that
# ``pytest tests/gpu -m STEP`` runs: (file, test, which of its parameter sets, or all).
QUICK_STEPS: dict[str, list[tuple[str, str, object]]] = {
    # (1) every norm and mode against the float64 oracle
    "gpu_oracle": [
        ("test_gpu.py", "test_family_matches_the_oracle", _fast("dtype")),
        ("test_gpu.py", "test_long_rows_at_their_real_size", None),
        ("test_gpu.py", "test_parameters_each_optional", None),
        ("test_gpu.py", "test_zero_centered_gamma", _fast("dtype")),
        ("test_gpu.py", "test_float32_residual_stream_with_bfloat16_x", None),
        ("test_gpu.py", "test_dh_absent_or_present", None),
        ("test_gpu.py", "test_constant_rows", _fast("dtype")),
        ("test_gpu.py", "test_rows_whose_sums_overflow", _fast("dtype")),
        ("test_gpu_memory_efficient.py", "test_matches_the_reference", _fast("dtype")),
        ("test_gpu_memory_efficient.py", "test_zero_centered_gamma", _fast("dtype")),
        ("test_gpu_memory_efficient.py", "test_rescaled_rows", _fast("dtype")),
        ("test_gpu_quant.py", "test_scales_and_q_match_the_float64_oracle", _fast("dtype")),
        ("test_gpu_quant.py", "test_rounding_is_to_nearest_even_and_saturates", _fast("dtype")),
        ("test_gpu_quant.py", "test_float8_matches_ml_dtypes_everywhere_in_range", _fast("dtype")),
        ("test_gpu_quant.py", "test_non_finite_values_flag_their_token_or_group_alone", None),
        ("test_gpu_torch.py", "test_the_triton_path_matches_the_float64_oracle", _fast("dtype")),
        ("test_gpu_torch.py", "test_the_triton_path_under_jvp_and_vmap", None),
        ("test_gpu_torch.py", "test_the_triton_path_passes_gradcheck", None),
    ],
    # (2) bit-identical reruns and batch invariance, on small grids and on the real one
    "gpu_invariance": [
        ("test_gpu.py", "test_deterministic", None),
        ("test_gpu.py", "test_batch_invariance", None),
        ("test_gpu_memory_efficient.py", "test_deterministic", None),
        ("test_gpu_quant.py", "test_a_rows_result_does_not_depend_on_the_batch", None),
        ("test_gpu_scale.py", "test_bit_identical_at_scale", None),
        ("test_gpu_scale.py", "test_batch_invariant_at_scale", None),
    ],
    # (3) one bfloat16 problem past 2**31 elements: 64-bit offsets, about 40 GB
    "gpu_scale": [
        ("test_gpu_scale.py", "test_offsets_past_two_to_the_31",
         lambda params: (params.get("name"), params.get("N")) == ("add_rms_norm", 4096)),
    ],
}


_LOG = {"path": None}  # the file of pytest_runtest_logreport, in the main process only


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # not an xdist worker, whose reports go to main
        _LOG["path"] = os.environ.get("LAYERNORM_TEST_LOG") or None
    for step in QUICK_STEPS:
        config.addinivalue_line("markers", f"{step}: a test step of tools/gpu_session.sh quick")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Marks each test of :data:`QUICK_STEPS` with its step; a rule that matches no test of a
    file collected whole (not named by a node id, ``file.py::test``) is an error, so a renamed
    test or parameter cannot drop out of the short call unseen."""
    named = {Path(arg.split("::")[0]).name for arg in config.args if "::" in arg}
    files = {item.path.name for item in items} - named
    for step, rules in QUICK_STEPS.items():
        for file, name, which in rules:
            chosen = [item for item in items if item.path.name == file
                      and item.originalname == name
                      and (which is None or which(getattr(item, "callspec", None)
                                                  and item.callspec.params or {}))]
            if file in files and not chosen:
                raise pytest.UsageError(f"{step}: no test {file}::{name} matches its rule")
            for item in chosen:
                item.add_marker(step)


def pytest_runtest_logreport(report):
    """With ``LAYERNORM_TEST_LOG`` set, each test's outcome is appended to that file as one
    JSON line as soon as it is known (in the main process only, under xdist too), so a run
    stopped at a time limit keeps every result it reached."""
    path = _LOG["path"]
    # every test's call; a setup that fails or skips (the call never runs); a failed teardown
    if not path or not (report.when == "call" or report.failed
                        or (report.when == "setup" and report.skipped)):
        return
    message = ""
    if report.failed or report.skipped:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = (crash.message if crash is not None
                   else report.longrepr[2] if isinstance(report.longrepr, tuple)
                   else (str(report.longrepr).strip().splitlines() or [""])[-1])
    outcome = report.outcome if report.when == "call" else f"{report.outcome} in {report.when}"
    with open(path, "a") as f:
        f.write(json.dumps({"test": report.nodeid, "outcome": outcome,
                            "seconds": round(report.duration, 3), "message": message[:500]})
                + "\n")
