"""`layernorm report`'s first screen: the user's three questions answered in plain sentences
before any table, and the peers' answers built only from steady measurements."""

from __future__ import annotations

from layernorm.bench import peer_report
from layernorm.commands import check, report
from layernorm.commands.report import ReportContext, Section


def _sections(monkeypatch, made: dict[str, Section]) -> None:
    """The report's sections replaced by ``made`` (title -> the Section it returns)."""
    import types

    module = types.ModuleType("fake_sections")
    for i, sec in enumerate(made.values()):
        setattr(module, f"s{i}", lambda ctx, sec=sec: sec)
    monkeypatch.setitem(__import__("sys").modules, "fake_sections", module)
    monkeypatch.setattr(report, "SECTIONS",
                        [(title, f"fake_sections:s{i}") for i, title in enumerate(made)])


def test_first_screen_answers_the_questions_before_the_details(tmp_path, monkeypatch, check_rows):
    """Protects the report's opening: the three questions come first, in order, each with the
    answer of every section that gave one (linking to it), before the summary, the machine and
    the sections; a question no section answers says so rather than staying silent."""
    monkeypatch.setattr(check, "run_checks", lambda seed=0, norms=None: list(check_rows))
    right = check.report_section(ReportContext(tmp_path, True))
    speed = Section(["12 of 64 cases met"], "the table", {"faster": "**1.10x** the best peer."})
    _sections(monkeypatch, {"Gradient checks": right, "CPU versus peers": speed})
    text = report.write_report(tmp_path, quick=True).read_text()
    order = [text.index(h) for h in ("## Is it right?", "## Is it faster than what I have?",
                                     "## What to use on this machine", "## Summary",
                                     "## Machine", "## Gradient checks")]
    assert order == sorted(order)
    first = text[:text.index("## Summary")]
    assert f"**Yes, in every check run here.** All {len(check_rows)} checks" in first
    assert "the fused CPU kernels agree with the reference in every dtype" in first
    assert "([gradient checks](#gradient-checks))" in first
    assert "**1.10x** the best peer. ([cpu versus peers](#cpu-versus-peers))" in first
    use = first[first.index("## What to use on this machine"):]
    assert "No section of this report answers it." in use


def test_a_failed_check_answers_no(tmp_path, monkeypatch, check_rows):
    """Protects the first answer from hiding a failure: one failed check makes the answer to
    "is it right" a bold No with the count, never a Yes."""
    from dataclasses import replace

    rows = list(check_rows)
    rows[0] = replace(rows[0], passed=False)
    monkeypatch.setattr(check, "run_checks", lambda seed=0, norms=None: rows)
    answer = check.report_section(ReportContext(tmp_path, True)).answers["right"]
    assert answer.startswith(f"**No: 1 of {len(rows)} gradient checks failed**")
    assert "Yes" not in answer


def _row(norm: str, shape: str, mode: str, ours: tuple, **peer_times: tuple) -> dict:
    """A peers row: ours' and each peer's (p50, p20, p80) ms, the speedup from their p50s
    with a +-5% spread."""
    def timed(t):
        return {"p50_ms": t[0], "p20_ms": t[1], "p80_ms": t[2]}

    providers = {"layernorm": timed(ours)}
    for name, t in peer_times.items():
        q = t[0] / ours[0]
        providers[name.replace("_", ".")] = {**timed(t), "speedup": [q, q * 0.95, q * 1.05]}
    return {"norm": norm, "shape": shape, "dtype": "float32", "threads": 2, "mode": mode,
            "providers": providers}


def test_peer_answers_count_only_steady_shapes():
    """Protects the speed answer: per norm and mode, ours against the fastest peer of each
    shape, median over steady shapes only; a shape whose time spread wide is counted as too
    noisy to tell, never as faster or slower; the recommendation names what was faster beyond
    the noise at most shapes and where something else was, and credits a level shape to
    neither."""
    steady = (1.0, 0.98, 1.02)
    rows = [
        _row("layer_norm", "BERT", "inference", steady, torch=(2.0, 1.9, 2.1),
             onnxruntime=(1.5, 1.45, 1.55)),                          # 1.5x onnxruntime
        _row("layer_norm", "prefill", "inference", steady, torch=(1.3, 1.25, 1.35)),  # 1.3x
        _row("layer_norm", "decode", "inference", steady, torch=(0.5, 0.49, 0.51)),   # 0.5x
        _row("layer_norm", "training", "inference", (1.0, 0.6, 1.6),  # wide: no verdict
             torch=(0.2, 0.19, 0.21)),
    ]
    got = peer_report.answers(rows)
    line = next(ln for ln in got["faster"].splitlines() if ln.startswith("| LayerNorm |"))
    assert ("**1.30x** (faster at 2, level at 0, slower at 1 of 4 shapes; too noisy to tell "
            "at 1; slowest 0.50x torch at decode)") in line
    assert "| not timed |" in line  # no training rows
    assert ("- LayerNorm, inference: `layernorm.torch` (faster at 2 of 4 shapes; `torch` at "
            "decode)") in got["use"]
    level = [_row("rms_norm", "BERT", "training", steady, torch=(1.0, 0.98, 1.02))]
    assert "- RMSNorm, training: any (no shape faster or slower beyond the noise; level at " \
           "BERT)" in peer_report.answers(level)["use"]
    assert peer_report.answers([]) == {}
