"""What `layernorm check` computes (layernorm.selfcheck): every norm of the family, every kind
of check, zero-centred gamma, and the fused CPU kernels judged against the reference."""

from __future__ import annotations

import numpy as np
import pytest

from layernorm import reference, selfcheck
from layernorm.dtypes import available
from layernorm.family import NORMS
from layernorm.tolerances import TOLERANCES

NORM_NAMES = list(NORMS)
HAS_ENGINE = selfcheck._fused_cpu() is not None


@pytest.fixture
def rows(check_rows):
    return list(check_rows)


def test_every_norm_has_every_kind_of_check(rows):
    """Protects the coverage of `layernorm check`: for every norm, fast mode on every shape
    and the large one, full mode on the small shapes, each lower precision against float64,
    the fused CPU kernels in every dtype (where the C++ engine runs), and zero-centred gamma among
    the gradient and backend rows; all pass."""
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    low = [d for d in available() if d != "float64"]
    for name in NORM_NAMES:
        mine = [r for r in rows if r.norm == name]
        kinds = {(r.shape, r.method, r.dtype) for r in mine}
        for shape in selfcheck.SHAPES:
            assert (shape, "finite differences (fast)", "float64") in kinds
            if np.prod(shape) <= selfcheck.FULL_SIZE:
                assert (shape, "finite differences (full)", "float64") in kinds
            assert all((shape, "vs float64 reference", d) in kinds for d in low)
            if HAS_ENGINE:
                assert all((shape, "fused CPU vs reference", d) in kinds for d in available())
        assert (selfcheck.LARGE_SHAPE, "finite differences (fast)", "float64") in kinds
        zero_centred = {r.method for r in mine if r.scale == "1+gamma"}
        assert {"finite differences (fast)", "finite differences (full)"} <= zero_centred
        assert not HAS_ENGINE or "fused CPU vs reference" in zero_centred


@pytest.mark.skipif(not HAS_ENGINE, reason="needs the C++ engine")
@pytest.mark.parametrize("name", NORM_NAMES)
def test_a_fused_cpu_bug_fails_the_backend_rows(name, monkeypatch):
    """Protects the backend rows: dgamma of the fused kernel off by ten times the loosest
    relative tolerance of the table fails every fused-CPU row of that norm (but LayerNorm's
    D = 1, where dgamma is 0), naming dgamma, and no row of the reference."""
    from layernorm import cpu

    real = getattr(cpu, f"{name}_backward")
    k = len(NORMS[name].backward_outputs)  # dgamma's place among the backward's results

    def broken(*args):
        grads = list(real(*args))
        grads[k] = grads[k] * (1 + 10 * max(t.rtol for t in TOLERANCES.values()))
        return tuple(grads)

    monkeypatch.setattr(cpu, f"{name}_backward", broken)
    rows = selfcheck.run_checks(norms=[name])
    backend = [r for r in rows if r.method == "fused CPU vs reference" and r.shape[-1] > 1]
    assert backend and not any(r.passed for r in backend)
    assert all(r.detail.startswith("dgamma at") for r in backend)
    assert all(r.passed for r in rows if r.method != "fused CPU vs reference")


@pytest.mark.skipif(not HAS_ENGINE, reason="needs the C++ engine")
@pytest.mark.parametrize("name", NORM_NAMES)
def test_the_zero_centred_rows_use_one_plus_gamma(name, monkeypatch):
    """Protects the 1+gamma rows: a reference forward that ignores zero_centered_gamma fails
    them, and only them (its gradient checks still pass: it is a consistent function). The
    fused kernels disagree with it; an add-norm's also disagrees with its float64 twin, which
    normalizes h with the norm's own forward."""
    real = getattr(reference, f"{name}_forward")

    def ignoring(*args, zero_centered_gamma=False, **kwargs):
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, f"{name}_forward", ignoring)
    rows = selfcheck.run_checks(norms=[name])
    failed = [r for r in rows if not r.passed]
    assert failed and all(r.scale == "1+gamma" and "finite differences" not in r.method
                          for r in failed)
    assert any(r.method == "fused CPU vs reference" for r in failed)


def test_without_the_engine_there_are_no_backend_rows(monkeypatch):
    """Protects `layernorm check` where the C++ engine is missing: the reference's rows only,
    passing."""
    monkeypatch.setattr(selfcheck, "_fused_cpu", lambda: None)
    rows = selfcheck.run_checks(norms=["rms_norm"])
    assert rows and all(r.passed and r.method != "fused CPU vs reference" for r in rows)

