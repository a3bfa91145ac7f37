"""A W8A8 Llama-shaped model on the CPU, end to end: the fused quantized norm in its place.

The model (:data:`CONFIG`: hidden 1024, GQA attention with rotary embeddings, a SwiGLU MLP,
random weights from a seed) runs in float32 activations and one of five ways:

    float          float32 weights, the library's norms (``rms_norm``, ``add_rms_norm``)
    w8a8 fused     int8 weights per output channel, int8 activations per token, matmuls by
                   ``torch._int_mm``; each norm feeds its Linears pre-quantized by
                   ``rms_norm_quant`` (the residual add fused in after attention)
    w8a8 unfused   the same model with the norm, then a per-token quantization in torch eager
                   (:func:`quantize_tokens`): the fusion's own effect is the difference
    torchao        the float model with torchao's ``Int8DynamicActivationInt8WeightConfig``
                   (every Linear but the output head), eager
    torchao compiled  the same under ``torch.compile``

In both W8A8 models the inputs of o_proj and down_proj (not a norm's output) are quantized by
:func:`quantize_tokens`, and the output head stays float32 in every model. Timed in interleaved
rounds: prefill (one sequence of :data:`PREFILL` tokens) and one decode step (one token after
the prefill, over its KV cache). Accuracy against the float model: the largest difference of
the prefill's logits relative to their largest magnitude, and how many of :data:`GREEDY` greedy
tokens agree, and at how many of the prefill's positions the logits' argmax is the float
model's (random weights leave the top logits close, so a greedy continuation parts from the
float model's at its first different token).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable

import numpy as np

from .._table import render
from .harness import batch, quiet_torchao

__all__ = ["CONFIG", "GOAL", "MODES", "format_w8a8", "quantize_tokens", "w8a8_end_to_end"]

CONFIG = {"hidden": 1024, "intermediate": 2816, "layers": 4, "heads": 16, "kv_heads": 4,
          "vocab": 8000, "max_len": 1024, "eps": 1e-6, "rope_theta": 10000.0}
PREFILL = 512
GREEDY = 16
GOAL = 1.1  # w8a8 unfused's prefill time over w8a8 fused's, at least
MODES = ("float", "w8a8 fused", "w8a8 unfused", "torchao", "torchao compiled")
PAUSE_S = 0.05


def quantize_tokens(x):
    """(q, s): x (M, K) float32 to int8 per token in torch eager, as the spec says for
    dynamic int8 (s = max(amax|x| / 127, FLT_EPSILON), q = round half to even of x / s)."""
    import torch

    s = (x.abs().amax(-1, keepdim=True) / 127.0).clamp_(min=torch.finfo(torch.float32).eps)
    return (x / s).round_().clamp_(-127, 127).to(torch.int8), s


class _Int8Linear:
    """y = (q @ w_q^T) * s * w_s: int8 weights per output channel, int32 accumulation."""

    def __init__(self, weight) -> None:
        import torch

        w = weight.detach().float()
        self.scale = (w.abs().amax(1) / 127.0).clamp(min=torch.finfo(torch.float32).eps)  # (N,)
        self.wt = (w / self.scale[:, None]).round().clamp(-127, 127).to(torch.int8).t()  # (K, N)

    def __call__(self, q, s):
        import torch

        return torch._int_mm(q, self.wt).float() * s * self.scale


def _rope(x, cos, sin):
    """Rotary embedding of x (1, H, T, hd) by position tables (T, hd/2): pairs as halves."""
    import torch

    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)


class Model:
    """The Llama-shaped model: float32 parameters as ``torch.nn.Linear`` modules (what torchao
    quantizes), their int8 copies for the W8A8 modes, and a KV cache."""

    def __init__(self, seed: int = 0) -> None:
        import torch

        c = CONFIG
        g = torch.Generator().manual_seed(seed)
        h, hd = c["hidden"], c["hidden"] // c["heads"]
        kv = c["kv_heads"] * hd

        def linear(n_in: int, n_out: int) -> torch.nn.Linear:
            lin = torch.nn.Linear(n_in, n_out, bias=False)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in))
            return lin

        self.embed = torch.randn(c["vocab"], h, generator=g)
        self.layers = torch.nn.ModuleList()
        for _ in range(c["layers"]):
            layer = torch.nn.ModuleDict({
                "q": linear(h, h), "k": linear(h, kv), "v": linear(h, kv), "o": linear(h, h),
                "gate": linear(h, c["intermediate"]), "up": linear(h, c["intermediate"]),
                "down": linear(c["intermediate"], h)})
            layer.attn_norm = torch.nn.Parameter(1 + 0.1 * torch.randn(h, generator=g))
            layer.mlp_norm = torch.nn.Parameter(1 + 0.1 * torch.randn(h, generator=g))
            self.layers.append(layer)
        self.final_norm = 1 + 0.1 * torch.randn(h, generator=g)
        self.head = linear(h, c["vocab"])
        self.int8 = [{k: _Int8Linear(layer[k].weight) for k in layer} for layer in self.layers]
        inv = 1.0 / c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
        angles = torch.outer(torch.arange(c["max_len"]).float(), inv)  # (max_len, hd/2)
        self.cos, self.sin = angles.cos(), angles.sin()
        self.cache = torch.zeros(c["layers"], 2, 1, c["kv_heads"], c["max_len"], hd)

    def forward(self, tokens, start: int, mode: str, modules=None):
        """Logits (T, vocab) of ``tokens`` (T,) at positions start.. (the cache holds the ones
        before), in ``mode`` (float, w8a8 fused, w8a8 unfused; the torchao modes are float
        with torchao's Linears); ``modules`` replaces the layers (torchao's copy)."""
        import torch.nn.functional as F

        import layernorm.torch as lt

        c = CONFIG
        h, heads, kvh = c["hidden"], c["heads"], c["kv_heads"]
        hd = h // heads
        t = tokens.shape[0]
        cos, sin = self.cos[start:start + t], self.sin[start:start + t]
        x = self.embed[tokens]  # (T, h) the residual stream
        delta = None  # the last block's output, added to x by the next norm
        for i, layer in enumerate(modules or self.layers):
            def linear(name, inp, layer=layer, q8=self.int8[i]):
                return _linear(mode, layer, q8, name, inp)

            # attention: the norm of x (+ the last MLP's output), to q, k and v
            inp, x = _normed(mode, layer.attn_norm, x, delta)
            q, k, v = (linear(n, inp).view(t, -1, hd).transpose(0, 1)[None]
                       for n in ("q", "k", "v"))  # (1, H, T, hd)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            self.cache[i, 0, :, :, start:start + t] = k
            self.cache[i, 1, :, :, start:start + t] = v
            keys = self.cache[i, 0, :, :, :start + t]
            vals = self.cache[i, 1, :, :, :start + t]
            o = F.scaled_dot_product_attention(q, keys, vals, is_causal=start == 0 and t > 1,
                                               enable_gqa=kvh != heads)
            o = o[0].transpose(0, 1).reshape(t, h)
            # the MLP: the norm of x + attention's output, to gate and up
            inp, x = _normed(mode, layer.mlp_norm, x, linear("o", o))
            delta = linear("down", F.silu(linear("gate", inp)) * linear("up", inp))
        y, _ = lt.add_rms_norm(delta, x, h, self.final_norm, c["eps"])
        return self.head(y)


def _normed(mode: str, weight, x, delta) -> tuple:
    """(the Linears' input, the residual stream): the RMSNorm of x, or of x + delta fused with
    the add (which gives the new stream); as (q, s) quantized per token in the W8A8 modes, by
    rms_norm_quant (fused) or quantize_tokens after the norm (unfused), else y."""
    import layernorm.torch as lt

    h, eps = CONFIG["hidden"], CONFIG["eps"]
    if mode == "w8a8 fused":
        if delta is None:
            return lt.rms_norm_quant(x, h, weight, eps), x
        a, s, x = lt.rms_norm_quant(delta, h, weight, eps, residual=x)
        return (a, s), x
    if delta is None:
        y = lt.rms_norm(x, h, weight, eps)
    else:
        y, x = lt.add_rms_norm(delta, x, h, weight, eps)
    return (quantize_tokens(y) if mode == "w8a8 unfused" else y), x


def _linear(mode: str, layer, int8: dict, name: str, inp):
    """Linear ``name`` of a layer on ``inp``: in the W8A8 modes its int8 copy, on (q, s) as a
    norm gave them or on a float tensor quantized per token here (o_proj's, down_proj's
    inputs); else the float (or torchao's) module."""
    if not mode.startswith("w8a8"):
        return layer[name](inp)
    return int8[name](*(inp if isinstance(inp, tuple) else quantize_tokens(inp)))


def _greedy(step: Callable, prompt, n: int) -> list[int]:
    """n tokens by greedy decoding: ``step(tokens, start)`` gives logits."""
    import torch

    logits = step(prompt, 0)
    out = [int(logits[-1].argmax())]
    for i in range(n - 1):
        logits = step(torch.tensor([out[-1]]), prompt.shape[0] + i)
        out.append(int(logits[-1].argmax()))
    return out


def w8a8_end_to_end(rounds: int = 5, threads: int | None = None,
                    progress: Callable[[str], None] | None = None) -> dict:
    """The five models of the module docstring timed in interleaved rounds (prefill and one
    decode step), with their accuracy against the float model; torchao's modes left out, with
    the reason, where torchao is missing or fails."""
    import copy

    import torch

    progress = progress or (lambda msg: None)
    if threads is not None:
        torch.set_num_threads(threads)
    model = Model()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, CONFIG["vocab"], (PREFILL,), generator=g)
    token = torch.randint(0, CONFIG["vocab"], (1,), generator=g)
    steps: dict[str, Callable] = {m: (lambda mode: lambda tok, start: model.forward(
        tok, start, mode))(m) for m in MODES[:3]}
    out: dict = {"config": CONFIG, "prefill_tokens": PREFILL,
                 "threads": torch.get_num_threads(), "absent": {}}
    try:
        quiet_torchao()
        import torchao
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        layers = copy.deepcopy(model.layers)
        quantize_(layers, Int8DynamicActivationInt8WeightConfig())
        out["torchao"] = torchao.__version__

        def ao(tok, start):
            return model.forward(tok, start, "float", layers)

        steps["torchao"] = ao
        torch._dynamo.reset()  # a fresh cache: no recompile limit left over from other runs
        steps["torchao compiled"] = torch.compile(ao, dynamic=False)
    except Exception as exc:  # noqa: BLE001 - any failure: say why, time the rest
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
        out["absent"] = {m: why for m in MODES[3:]}
    with torch.no_grad(), warnings.catch_warnings():
        # torch asks torchao's Int8Tensor for a hash for its compile cache, at every compile
        warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching")
        progress("w8a8: accuracy")
        ref = model.forward(prompt, 0, "float")
        scale = float(ref.abs().max())
        want = _greedy(steps["float"], prompt[:64], GREEDY)
        out["accuracy"] = {}
        for m, step in steps.items():
            progress(f"w8a8: {m} (first calls)")
            logits = step(prompt, 0)
            # greedy decoding calls the model at every position: compiled, each a recompile
            same = None if m == "torchao compiled" else sum(
                a == b for a, b in zip(_greedy(step, prompt[:64], GREEDY), want, strict=True))
            out["accuracy"][m] = {
                "logits_rel_error": float((logits - ref).abs().max()) / scale,
                "argmax_same": float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
                "greedy_same": same, "greedy": GREEDY}
        # the unfused pair and the fused op alone, at a prefill's shape, in the same rounds:
        # what fusing saves per norm, so the most it can take off a prefill
        import layernorm.torch as lt

        h = CONFIG["hidden"]
        xs, rs = torch.randn(PREFILL, h, generator=g), torch.randn(PREFILL, h, generator=g)
        wn = model.final_norm
        calls = {("norm + quantize_tokens", "norm"): lambda: quantize_tokens(
                     lt.add_rms_norm(xs, rs, h, wn, CONFIG["eps"])[0]),
                 ("rms_norm_quant", "norm"): lambda: lt.rms_norm_quant(
                     xs, h, wn, CONFIG["eps"], residual=rs)}
        for m, step in steps.items():
            step(prompt, 0)  # the cache holds the prompt: the decode step reads it
            calls[(m, "prefill")] = (lambda s: lambda: s(prompt, 0))(step)
            calls[(m, "decode")] = (lambda s: lambda: s(token, PREFILL))(step)
            for fn in (calls[(m, "prefill")], calls[(m, "decode")]):
                fn()
        times: dict = {k: [] for k in calls}
        keys = list(calls)
        for r in range(rounds):
            progress(f"w8a8: round {r + 1} of {rounds}")
            for k in keys[r % len(keys):] + keys[:r % len(keys)]:
                time.sleep(PAUSE_S)
                times[k].append(batch(calls[k], 1 if k[1] == "prefill" else 10))
    for k in (("norm + quantize_tokens", "norm"), ("rms_norm_quant", "norm")):
        out.setdefault("norm", {})[k[0]] = {
            "ms": [float(q) * 1e3 for q in np.percentile(times[k], [50, 20, 80])]}
    for task in ("prefill", "decode"):
        out[task] = {}
        for m in steps:
            ts = np.array(times[(m, task)])
            out[task][m] = {"ms": [float(q) * 1e3 for q in np.percentile(ts, [50, 20, 80])]}
            if m != "w8a8 fused":
                ratio = ts / np.array(times[("w8a8 fused", task)])
                out[task][m]["over_fused"] = [float(q) for q in np.percentile(ratio, [50, 20, 80])]
    # two norms a layer feed quantized Linears: the most fusing them can save of a prefill
    saved = 2 * CONFIG["layers"] * np.median(
        np.array(times[("norm + quantize_tokens", "norm")])
        - np.array(times[("rms_norm_quant", "norm")]))
    unfused = np.median(times[("w8a8 unfused", "prefill")])
    out["bound"] = float(unfused / (unfused - saved))
    lo, hi = out["prefill"]["w8a8 unfused"]["over_fused"][1:]
    out["verdict"] = ("met" if lo >= GOAL else "missed" if hi < GOAL else
                      f"within the noise ({lo:.2f}-{hi:.2f})")
    return out


def _norm_ms(e2e: dict, name: str) -> str:
    ms = e2e["norm"][name]["ms"]
    return f"{ms[0]:.3f} ms ({ms[1]:.3f}-{ms[2]:.3f})"


def format_w8a8(e2e: dict) -> str:
    """The end-to-end run as a line and a Markdown table."""
    c = e2e["config"]
    head = (f"Llama-shaped model (hidden {c['hidden']}, {c['layers']} layers, {c['heads']} "
            f"heads / {c['kv_heads']} KV heads, MLP {c['intermediate']}, vocabulary "
            f"{c['vocab']}; random weights), {e2e['threads']} thread(s): prefill of "
            f"{e2e['prefill_tokens']} tokens and one decode step after it, p50 (p20-p80) of "
            f"interleaved rounds; a model's time over w8a8 fused's as p50 (p20-p80) of "
            f"per-round ratios. Goal: w8a8 unfused over fused >= {GOAL}x on prefill: "
            f"{e2e['verdict']}. The norms' share bounds it: at this shape the norm then "
            f"quantize_tokens takes {_norm_ms(e2e, 'norm + quantize_tokens')} a call and "
            f"rms_norm_quant {_norm_ms(e2e, 'rms_norm_quant')}, so fusing the "
            f"{2 * c['layers']} norms that feed quantized Linears can make the unfused "
            f"prefill at most {e2e['bound']:.3f}x as fast.")
    rows = []
    for m, acc in e2e["accuracy"].items():
        cells = [m]
        for task in ("prefill", "decode"):
            t = e2e[task][m]
            ms = t["ms"]
            cells.append(f"{ms[0]:.1f} ({ms[1]:.1f}-{ms[2]:.1f})" if task == "prefill" else
                         f"{ms[0]:.2f} ({ms[1]:.2f}-{ms[2]:.2f})")
            r = t.get("over_fused")
            cells.append("1" if r is None else f"{r[0]:.2f}x ({r[1]:.2f}-{r[2]:.2f})")
        same = acc["greedy_same"]
        cells += [f"{acc['logits_rel_error']:.1e}", f"{acc['argmax_same']:.1%}",
                  "(not run: a recompile a step)" if same is None else
                  f"{same} of {acc['greedy']}"]
        rows.append(cells)
    for m, why in e2e["absent"].items():
        rows.append([m, f"left out: {why}", "", "", "", "", "", ""])
    table = render(["model", "prefill ms", "over fused", "decode ms", "over fused",
                    "logits error vs float", "prefill argmax as float's",
                    "greedy tokens as float's"], rows, True)
    return head + "\n\n" + table
