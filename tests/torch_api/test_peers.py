"""layernorm bench --peers: the providers run and agree with ours, the rows carry what the table
and the verdicts need, the verdict rules, the end-to-end model, and the command's mistakes.
No test measures time: the timings here only have to exist."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from layernorm.bench import end_to_end, peer_report, peers  # noqa: E402

ORT = peers.available_peers()["onnxruntime"] is None


@pytest.mark.parametrize("norm, mode", [("layer_norm", "inference"), ("add_rms_norm", "inference"),
                                        ("add_layer_norm", "training")])
def test_every_provider_runs_and_agrees_with_ours(norm, mode):
    """Protects the comparison: on one case each provider is timed (or absent with a reason:
    onnxruntime has no backward), every present peer's outputs lie within float32 rounding of
    ours, and the row names the fastest peer and a verdict."""
    row = peers.measure(peers.Case(norm, "decode x8", "float32", mode, 1), rounds=1)
    got = row["providers"]
    assert set(got) == set(peers.IMPLS)
    assert "p50_ms" in got["layernorm"] and "p50_ms" in got["torch"]
    for name, p in got.items():
        if name == "layernorm" or "absent" in p:
            continue
        assert p["max_diff"] < 1e-4, (name, p["max_diff"])
        assert len(p["speedup"]) == 3
    if mode == "training":
        assert got["onnxruntime"] == {"absent": "no backward"}
    elif ORT:
        assert "p50_ms" in got["onnxruntime"]
    assert got["torch.compile"].get("compile_s") or "absent" in got["torch.compile"]
    assert row["best"] in peers.PEERS and row["verdict"]
    assert peer_report.table([row]).count("\n") == 2  # a header, a rule, one row


def test_bfloat16_without_a_kernel_is_absent_not_converted():
    """Protects fairness: onnxruntime's CPU operators take no bfloat16, so the peer is shown
    absent with that reason rather than timed on converted data."""
    row = peers.measure(peers.Case("rms_norm", "decode", "bfloat16", "inference", 1), rounds=1,
                        impls=("layernorm", "onnxruntime"))
    if ORT:
        assert row["providers"]["onnxruntime"] == {"absent": "no bfloat16 CPU kernel"}


def _row(shape: str, mode: str, spreads: dict[str, tuple[float, float, float]],
         ours=(1.0, 1.0, 1.0)) -> dict:
    """A row whose providers have p50/p20/p80 ms and ours' speed over each (p50, p20, p80)."""
    providers = {"layernorm": dict(zip(("p50_ms", "p20_ms", "p80_ms"), ours, strict=True))}
    for name, s in spreads.items():
        providers[name] = {"p50_ms": ours[0] * s[0], "p20_ms": ours[0] * s[0],
                           "p80_ms": ours[0] * s[0], "speedup": list(s)}
    return {"shape": shape, "mode": mode, "providers": providers}


def test_verdict_rules():
    """Protects the judging: the fastest peer is the one judged, at 1.2x; decode inference is
    judged against torch eager alone at 1/2 and 1/1.5; an unsteady row gets no verdict."""
    row = _row("BERT", "inference", {"torch": (3.0, 2.9, 3.1), "onnxruntime": (1.5, 1.4, 1.6)})
    peers._judge(row)
    assert row["best"] == "onnxruntime" and row["verdict"] == "met" and row["goal"] == 1.2
    row = _row("BERT", "training", {"torch": (1.0, 0.95, 1.05)})
    peers._judge(row)
    assert row["verdict"] == "missed"
    row = _row("decode", "inference", {"torch": (0.6, 0.58, 0.62),
                                       "onnxruntime": (0.1, 0.1, 0.1)})
    peers._judge(row)
    assert row["best"] == "torch" and row["goal"] == 0.5 and row["verdict"] == "met"
    row = _row("decode x8", "inference", {"torch": (0.5, 0.48, 0.52)})
    peers._judge(row)
    assert row["verdict"] == "missed"  # 0.52 < (1/1.5) * 0.9
    row = _row("BERT", "inference", {"torch": (3.0, 2.9, 3.1)}, ours=(1.0, 0.5, 1.5))
    peers._judge(row)
    assert row["verdict"] == "too noisy to tell (p20-p80 500.0 us-1.50 ms)"


def test_end_to_end_gives_no_verdict_on_unsteady_times():
    """Protects the end-to-end verdict: where either model's times spread wide (p20-p80
    16.7-74.8 ms) the steps' ratio says nothing, so the verdict says too noisy to tell; steady
    times are judged on the ratio's spread."""
    wide = {"torch": [20.0, 16.7, 74.8], "layernorm": [19.0, 18.0, 19.5],
            "speedup": [1.05, 1.02, 1.08]}
    assert end_to_end.end_to_end_verdict("train step", wide) == (
        "too noisy to tell (p20-p80 16.70 ms-74.80 ms)")
    steady = {**wide, "torch": [20.0, 19.5, 20.5]}
    assert end_to_end.end_to_end_verdict("train step", steady) == "faster: met"
    assert end_to_end.end_to_end_verdict("generate", {**steady, "speedup": [0.9, 0.85, 0.95]}) == (
        "slower: missed")


def test_end_to_end_model_swaps_and_matches(monkeypatch):
    """Protects the end-to-end comparison: the Llama-shaped model with its norms swapped gives
    the original's logits within float32 rounding and the same greedy tokens, and both tasks
    are timed for both models."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(end_to_end, "LLAMA", {**end_to_end.LLAMA, "hidden_size": 64,
                                              "intermediate_size": 128,
                                              "num_hidden_layers": 2,
                                              "num_attention_heads": 4,
                                              "num_key_value_heads": 4, "vocab_size": 256})
    monkeypatch.setattr(end_to_end, "TRAIN_BATCH", (2, 16))
    monkeypatch.setattr(end_to_end, "NEW_TOKENS", 4)
    monkeypatch.setattr(end_to_end, "PAUSE_S", 0.0)
    e = end_to_end.llama_end_to_end(rounds=1, threads=1)
    assert e["norms_swapped"] == 2 * 2 + 1  # two a block and the final one
    assert e["max_logit_diff"] < 1e-4 and e["same_tokens"]
    for task in ("train step", "generate"):
        assert set(e[task]) == {"torch", "layernorm", "speedup"}
    assert "| train step |" in end_to_end.format_end_to_end(e)


@pytest.mark.parametrize("argv, message", [
    (["--full"], "argument --full: only with --peers"),
    (["--peers", "--shape", "4x8"], "argument --peers: takes its named shapes"),
    (["--peers", "--dtype", "float16"], "argument --dtype: with --peers, one of"),
])
def test_command_mistakes_are_one_line(argv, message):
    """Protects the command line: a misuse of --peers or --full is one line and exit 2."""
    done = subprocess.run([sys.executable, "-m", "layernorm", "bench", *argv],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
