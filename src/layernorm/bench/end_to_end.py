"""End to end: a Llama-shaped model with torch's norms and with ours (``replace_norms`` on a
copy), timed in interleaved rounds as :mod:`layernorm.bench.peers` times one norm: a training
step and greedy generation, each judged against its goal (:func:`end_to_end_verdict`)."""

from __future__ import annotations

import time

import numpy as np

from .._table import render
from . import results
from .harness import batch, quiet_torchao
from .peers import PAUSE_S, ROUNDS

__all__ = ["LLAMA", "end_to_end_verdict", "format_end_to_end", "llama_end_to_end"]

# A Llama-shaped model small enough for a CPU run: the norms' share of its time is what a
# larger one's would be per token (two RMSNorms a block around attention and an MLP).
LLAMA = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 8000,
         "max_position_embeddings": 512}
TRAIN_BATCH = (4, 128)  # sequences, tokens each: one training step
PROMPT, NEW_TOKENS = 16, 32  # greedy generation


def llama_end_to_end(rounds: int = ROUNDS, threads: int | None = None) -> dict:
    """A Llama-shaped model built from a config (random weights, no download), timed with
    torch's norms and with ours (``replace_norms`` on a copy), interleaved: one training step
    (forward, loss, backward) and greedy generation of NEW_TOKENS tokens. Returns per task and
    model p50/p20/p80 ms, ours' speed over torch's (p50: p20-p80 of per-round ratios), the
    largest difference of the logits and whether the generated tokens are the same."""
    import copy

    import torch
    quiet_torchao()  # transformers imports it where installed
    import transformers

    import layernorm.torch as lt

    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**LLAMA)
    theirs = transformers.LlamaForCausalLM(cfg).eval()
    ours = copy.deepcopy(theirs)
    swapped = lt.replace_norms(ours)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, TRAIN_BATCH, generator=g)
    prompt = torch.randint(0, cfg.vocab_size, (1, PROMPT), generator=g)

    def train(model):
        def step():
            model.zero_grad(set_to_none=True)
            model(input_ids=tokens, labels=tokens).loss.backward()
        return step

    def generate(model):
        def run():
            with torch.no_grad():
                return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                      min_new_tokens=NEW_TOKENS)
        return run

    with torch.no_grad():
        logit_diff = float((ours(tokens).logits - theirs(tokens).logits).abs().max())
    same_tokens = bool(torch.equal(generate(ours)(), generate(theirs)()))
    out: dict = {"config": LLAMA, "train_batch": list(TRAIN_BATCH), "prompt": PROMPT,
                 "new_tokens": NEW_TOKENS, "norms_swapped": swapped,
                 "threads": torch.get_num_threads(), "max_logit_diff": logit_diff,
                 "same_tokens": same_tokens}
    for task, make in (("train step", train), ("generate", generate)):
        calls = {"torch": make(theirs), "layernorm": make(ours)}
        for fn in calls.values():
            fn()
        times: dict[str, list[float]] = {k: [] for k in calls}
        for r in range(rounds):
            for k in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                time.sleep(PAUSE_S)
                times[k].append(batch(calls[k], 1))
        ratio = np.array(times["torch"]) / np.array(times["layernorm"])
        out[task] = {k: [float(q) * 1e3 for q in np.percentile(v, [50, 20, 80])]
                     for k, v in times.items()}
        out[task]["speedup"] = [float(q) for q in np.percentile(ratio, [50, 20, 80])]
    return out


def end_to_end_verdict(task: str, timed: dict) -> str:
    """Goals: the training step faster with our norms (p20 of ours' speed above 1),
    generation never slower (p80 not below 1); no verdict where either model's times were
    unsteady (``timed``: a task of :func:`llama_end_to_end`)."""
    wide = results.noisy(*({"p20_ms": timed[k][1], "p80_ms": timed[k][2]}
                           for k in ("torch", "layernorm")))
    if wide:
        return wide
    _p50, lo, hi = timed["speedup"]
    if task == "train step":
        return "faster: met" if lo > 1 else "slower: missed" if hi < 1 else "within the noise"
    return "slower: missed" if hi < 1 else "not slower: met"


def format_end_to_end(e2e: dict) -> str:
    """The end-to-end result as a Markdown table and a line on the outputs."""
    rows = []
    for task in ("train step", "generate"):
        t = e2e[task]
        s = t["speedup"]
        rows.append([task, f"{t['torch'][0]:.1f} ms ({t['torch'][1]:.1f}-{t['torch'][2]:.1f})",
                     f"{t['layernorm'][0]:.1f} ms ({t['layernorm'][1]:.1f}-"
                     f"{t['layernorm'][2]:.1f})", f"{s[0]:.2f}x ({s[1]:.2f}-{s[2]:.2f})",
                     end_to_end_verdict(task, t)])
    c = e2e["config"]
    head = (f"Llama-shaped model from a config (hidden {c['hidden_size']}, "
            f"{c['num_hidden_layers']} layers, vocabulary {c['vocab_size']}; random weights), "
            f"{e2e['threads']} thread(s), {e2e['norms_swapped']} norms swapped: a training step "
            f"on {e2e['train_batch'][0]}x{e2e['train_batch'][1]} tokens and greedy generation "
            f"of {e2e['new_tokens']} tokens after {e2e['prompt']}, interleaved rounds. Logits "
            f"differ by at most {e2e['max_logit_diff']:.1e}; generated tokens "
            + ("identical" if e2e["same_tokens"] else "DIFFER") + ".\n\n")
    return head + render(["task", "torch's norms", "ours", "ours' speed (p20-p80)", "goal"],
                         rows, True)
