"""`layernorm memory` and layernorm.bench.memory: the bytes autograd keeps, counted exactly,
for torch's norms and this package's two modes; and the report's section on it."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from layernorm.bench import memory  # noqa: E402
from layernorm.commands import cli  # noqa: E402
from layernorm.commands import memory as command  # noqa: E402
from layernorm.commands.report import ReportContext  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_one_norm_saves_one_activation_less_in_memory_efficient_mode(kind, dtype):
    """Protects the mode's purpose, measured: a norm followed by a Linear keeps exactly one
    (M, D) activation less in memory-efficient mode than in the default mode (the Linear keeps
    y, which the norm now shares instead of keeping x), and the default mode's x + y with
    O(M) statistics."""
    m, d = 96, 64
    item = torch.empty(0, dtype=dtype).element_size()
    default = memory.one_norm(kind, "layernorm", m, d, dtype)
    efficient = memory.one_norm(kind, "layernorm, memory-efficient", m, d, dtype)
    assert default.total - efficient.total == m * d * item
    assert efficient.total - m * d * item == default.total - 2 * m * d * item  # the stats
    assert efficient.total - m * d * item < 40 * m  # O(M): float64 statistics per row


def test_llama_block_saves_two_activations_less():
    """Protects the block's figure: a Llama decoder block (two RMSNorms) keeps two (tokens, D)
    activations less in memory-efficient mode than in the default mode, and the default mode
    keeps less than transformers' own RMSNorm (which keeps a float32 copy and the product)."""
    tokens, d = 16, 128
    saved = {mode: memory.block(mode, tokens, d, 352, 1, torch.float32)
             for mode in memory.MODES}
    unit = tokens * d * 4
    assert saved["layernorm"].total - saved["layernorm, memory-efficient"].total == 2 * unit
    assert saved["torch"].total > saved["layernorm"].total


def test_command_prints_the_table_and_saves_json(tmp_path, capsys):
    """Protects `layernorm memory`: one row per workload, dtype and mode, the savings against
    the default mode (+1.00 a norm, +2.00 a block in memory-efficient mode) and the JSON."""
    out = tmp_path / "memory.json"
    assert cli.main(["memory", "--shape", "32x64", "--tokens", "8", "--hidden", "128",
                     "--dtype", "float32", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "float32" in ln]
    assert len(rows) == 9
    efficient = [ln for ln in rows if "memory-efficient" in ln]
    assert [ln.rstrip(" |").rsplit("| ", 1)[1] for ln in efficient] == ["+1.00", "+1.00",
                                                                        "+2.00"]
    saved = json.loads(out.read_text())
    assert saved["command"] == "layernorm memory" and len(saved["rows"]) == 9


def test_report_section_names_bytes_and_time(monkeypatch):
    """Protects the report's section: its headline gives the block's saving against both, and
    its second line the backward's time in both modes (interleaved rounds)."""
    monkeypatch.setattr(memory, "block_backward_times",
                        lambda *a, **k: {"layernorm": [1.0, 1.0, 1.0],
                                         "layernorm, memory-efficient": [1.1, 1.0, 1.2]})
    monkeypatch.setattr(command, "measure", lambda *a: _fake_rows())
    section = command.report_section(ReportContext(outdir=None, quick=True))
    assert "2.00 activations less per Llama block than the default mode" in section.summary[0]
    assert "4.00 less than transformers' own norms" in section.summary[0]
    assert "1.10x the default mode's time" in section.summary[1]


def _fake_rows():
    unit = 100
    return [{"workload": "Llama block, 1 tokens x 128", "dtype": "float32", "mode": m,
             "bytes": b, "activation_bytes": unit, "tensors": 1, "storages": 1}
            for m, b in zip(memory.MODES, (2000, 1800, 1600), strict=True)]
