"""replace_norms on transformers: every class of its table that the installed transformers
defines is swapped and computes what the original computes (one class of each group that
shares its code, checked to cover them all; forward and gradients; float32,
bfloat16 and the two mixtures of them; Cohere's per-head norms: test_per_head.py), instances
it cannot take are left with their reason,
and tiny config-built models of 24 families give the unswapped model's logits and gradients."""

from __future__ import annotations

import copy
import importlib
import inspect
import math
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import layernorm.torch as lt  # noqa: E402 - after the skips
from layernorm.tolerances import assert_close  # noqa: E402
from layernorm.torch._swap import RECIPES, TABLE, TRANSFORMERS, transformers_key  # noqa: E402

D = 24  # the normalized size of the table's instances
ENTRIES = [(recipe, entry) for recipe, entries in TRANSFORMERS.items() for entry in entries]

# (input dtype, parameter dtype). Tolerances: the coarser of the two dtypes' entries of the
# table. Each original rounds in its own way (docs/models.md lists them by recipe:
# up to three roundings to the coarser dtype where ours has one, and the half-dtype steps of
# the classes that compute in the input's dtype); measured, the worst of them stays under half
# of the bfloat16 "out" and "param" entries. y and dx are "out" (scale: the larger of 1 and
# max|want|, dx being rstd·dy with rstd up to 1/sqrt(eps)); dweight and dbias, sums over 15
# rows, are "param" with the same scale.
DTYPES = [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32"),
          ("float32", "bfloat16")]

# Recipes whose classes call torch's native layer_norm: on the CPU it takes parameters of the
# input's dtype or float32 only, and a mixture it rejects is not compared.
NATIVE_LAYER_NORM = {"torch", "channels_last", "videoprism", "esmfold", "pocket_tts"}


def _class(entry: str) -> type | None:
    """The installed transformers' class of a table entry, or None where it has none."""
    module, name = transformers_key(entry)
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _build(cls: type, eps: float) -> torch.nn.Module:
    """An instance of ``cls`` normalizing D with ``eps``, whatever its constructor's form:
    (size, eps), (eps) alone, (size) alone (Olmo: eps is in its forward), or (config)."""
    params = inspect.signature(cls.__init__).parameters
    names = [n for n in params if n != "self"]
    if names[0] == "config":  # CpmAntLayerNorm, the one norm built from a config
        return cls(transformers.CpmAntConfig(hidden_size=D, eps=eps))
    if names[0] == "eps":
        return cls(eps=eps)
    if "eps" in names or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return cls(D, eps=eps)
    return cls(D)


def _grads(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor | None = None):
    """(y, dy, [dx, dweight, dbias...]) of ``module`` at ``x``, dy drawn where not given."""
    y = module(x)
    if dy is None:
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(y.dtype)
    return y, dy, torch.autograd.grad(y, [x, *module.parameters()], dy)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: str, quantity: str, name: str,
           scale: float | None = None) -> None:
    want64 = want.detach().double().numpy()
    scale = max(float(np.max(np.abs(want64))), 1.0) if scale is None else scale
    assert_close(got.detach().double().numpy(), want64, dtype, quantity, scale=scale, name=name)


def _swap_one(old: torch.nn.Module) -> torch.nn.Module:
    """``old`` swapped (it must be, without a warning): ours in its place."""
    model = torch.nn.Sequential(old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = lt.replace_norms(model)
    assert summary == 1 and summary.swapped == {type(old).__name__: 1} and summary.left == {}
    return model[0]


def _sources(cls: type) -> str:
    """What decides how an instance of ``cls`` computes and is swapped: the source of every
    function its classes define (up to torch.nn.Module; the constructor, forward and their
    helpers) and of the module-level functions those call, with the class's own name made
    neutral (so transformers' copies of one norm agree)."""
    parts = []
    for c in cls.__mro__[:cls.__mro__.index(torch.nn.Module)]:
        for name, fn in sorted(vars(c).items()):
            if not inspect.isfunction(fn):
                continue
            called = [fn.__globals__[g] for g in fn.__code__.co_names
                      if inspect.isfunction(fn.__globals__.get(g))]
            for f in (fn, *called):
                src = inspect.cleandoc(inspect.getsource(f))
                parts.append(f"{name}:" + src.replace(c.__name__, "<class>"))
    return "\n".join(parts)


def _groups() -> dict[tuple[str, str], list[str]]:
    """The table's installed classes grouped by recipe and :func:`_sources`: one group per
    distinct way of computing, its classes in table order."""
    groups: dict[tuple[str, str], list[str]] = {}
    for recipe, entry in ENTRIES:
        cls = _class(entry)
        if cls is not None:
            groups.setdefault((recipe, _sources(cls)), []).append(entry)
    return groups


GROUPS = _groups()
# one test per group, on its first class: (recipe, entry, how many classes share its code)
REPRESENTATIVES = [(recipe, entries[0], len(entries)) for (recipe, _), entries in GROUPS.items()]


def test_every_table_class_is_in_a_tested_group():
    """Protects the reach of the per-group test below: every installed class of the table is
    in exactly one group, whose first class is tested, so a class whose code differs from
    every other's is tested itself; a changed forward makes a new group, a class that only
    renames another's code does not."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm

    members = [e for entries in GROUPS.values() for e in entries]
    assert sorted(members) == sorted(e for _, e in ENTRIES if _class(e) is not None)
    assert len(GROUPS) < len(members) / 2  # the grouping saves most of the classes' tests

    class _Changed(LlamaRMSNorm):
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    keys = {k for _, k in GROUPS}
    assert _sources(_Changed) not in keys
    assert _sources(LlamaRMSNorm) == _sources(MistralRMSNorm) in keys  # copies, renamed


def test_table_is_checked_against_the_installed_transformers():
    """Protects the table's reach: it names the installed transformers' classes (all of them
    for the pinned 5.24; with another version, the groups hold those it has)."""
    missing = [entry for _, entry in ENTRIES if _class(entry) is None]
    if transformers.__version__.startswith("5.24."):
        assert missing == []
    assert len(ENTRIES) - len(missing) >= 200, missing


@pytest.mark.parametrize(("recipe", "entry", "shared"), REPRESENTATIVES,
                         ids=[e for _, e, _ in REPRESENTATIVES])
def test_table_class_computes_what_the_original_computes(recipe, entry, shared):
    """Protects each distinct class of the table (one per group of classes with the same
    code, ``shared`` of them): an instance is swapped (its Parameter objects, eps read from the
    right attribute or the literal, scale, result dtype) and ours give the original's y, dx,
    dweight and dbias within the tolerances above, in every dtype mixture the original
    accepts. Inputs have mean square eps/4, so a wrong eps shows; weights are random (weight
    and 1 + weight differ)."""
    cls = _class(entry)
    assert TABLE[transformers_key(entry)] is RECIPES[recipe]
    for x_dtype, p_dtype in DTYPES:
        torch.manual_seed(0)
        old = _build(cls, eps=0.05)
        eps = getattr(old, RECIPES[recipe].eps) if isinstance(RECIPES[recipe].eps, str) \
            else RECIPES[recipe].eps
        with torch.no_grad():
            for p in old.parameters():
                p.copy_(torch.randn_like(p))
        old.to(getattr(torch, p_dtype))
        params = list(old.parameters())
        x = (0.5 * math.sqrt(eps) * torch.randn(3, 5, D)).to(getattr(torch, x_dtype))
        x.requires_grad_()
        try:
            want, dy, want_grads = _grads(old, x)
        except RuntimeError as exc:  # torch's CPU layer_norm: parameters of another dtype
            assert "mixed dtype" in str(exc) and recipe in NATIVE_LAYER_NORM, exc
            continue
        ours = _swap_one(old)
        assert type(ours) is RECIPES[recipe].ours and ours.eps == eps
        assert all(a is b for a, b in zip(ours.parameters(), params, strict=True))
        got, _, got_grads = _grads(ours, x, dy)
        assert got.dtype == want.dtype, (x_dtype, p_dtype)
        coarse = "bfloat16" if "bfloat16" in (x_dtype, p_dtype) else "float32"
        where = f"{entry} x {x_dtype}, params {p_dtype}"
        _close(got, want, coarse, "out", f"{where}: y")
        _close(got_grads[0], want_grads[0], coarse, "out", f"{where}: dx")
        for g, w, name in zip(got_grads[1:], want_grads[1:], ["dweight", "dbias"], strict=False):
            _close(g, w, coarse, "param", f"{where}: {name}")


def test_docs_list_the_table():
    """Protects docs/models.md's list of the table's classes: each recipe's line names exactly
    its classes, with their number."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    for recipe, entries in TRANSFORMERS.items():
        head = f"- **{recipe}** ({len(entries)}): "
        line = next((x for x in text.splitlines() if x.startswith(head)), None)
        assert line is not None, f"docs/models.md lacks the line starting {head!r}"
        assert sorted(line[len(head):].split(", ")) == sorted(
            transformers_key(e)[1] for e in entries), recipe


def test_olmo_eps_is_the_literal_in_its_forward():
    """Protects the one eps the table reads from source rather than an attribute: OlmoLayerNorm
    has no weight and writes eps=1e-5 in its forward."""
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    assert "eps=1e-5" in inspect.getsource(OlmoLayerNorm.forward).replace(" ", "")
    assert RECIPES["olmo"].eps == 1e-5
    ours = _swap_one(OlmoLayerNorm(D))
    assert (ours.eps, ours.normalized_shape, ours.weight, ours.bias) == (1e-5, (D,), None, None)


def _left(old: torch.nn.Module, reason: str) -> None:
    """``old`` is left in place, named in one warning with ``reason``."""
    model = torch.nn.Sequential(old)
    with pytest.warns(UserWarning, match=reason) as record:
        summary = lt.replace_norms(model)
    assert len(record) == 1 and summary == 0 and model[0] is old
    assert list(summary.left) == [type(old).__name__] and list(summary.left[type(old).__name__]) \
        == ["0"]


def test_instances_ours_cannot_take_are_left_with_their_reason():
    """Protects the per-instance limits of the table: a LlamaRMSNorm built with a tuple (a
    (heads, D) weight over the last axis alone: only Cohere's recipe takes one), ConvNext in
    channels_first, Qwen4's grouped norm and an xLSTM RMSNorm with a bias stay, each with its
    reason; Chameleon's query/key norm (eps fixed in its forward, a (heads, D) weight) is not in
    the table."""
    from transformers.models.chameleon.modeling_chameleon import ChameleonLayerNorm
    from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm
    from transformers.models.xlstm.modeling_xlstm import xLSTMRMSNorm

    _left(LlamaRMSNorm((2, 16)), r"LlamaRMSNorm at 0: its weight has shape \(2, 16\) "
          r"but it normalizes the last axis alone")
    _left(ConvNextLayerNorm(D, data_format="channels_first"), "data_format='channels_first'")
    _left(Qwen4ExpTextRMSNorm(D, group_size=8), "group_size=8: it normalizes groups")
    _left(xLSTMRMSNorm(D, use_bias=True), "it holds bias beyond what its recipe takes")
    _left(ChameleonLayerNorm((2, 16)), "its class is not in replace_norms' table")


def test_weightless_instances_take_the_last_axis():
    """Protects instances without a weight (Gemma3n's v-norm with with_scale=False, xLSTM's
    with use_weight=False): ours have no weight and, as the originals, normalize the last axis
    whatever its size (float32 "out", on sizes D and 7)."""
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm
    from transformers.models.xlstm.modeling_xlstm import xLSTMRMSNorm

    torch.manual_seed(0)
    for old in (Gemma3nRMSNorm(D, eps=0.05, with_scale=False),
                xLSTMRMSNorm(D, eps=0.05, use_weight=False)):
        ours = _swap_one(old)
        assert ours.weight is None and ours.normalized_shape == () and ours.eps == 0.05
        for x in (0.1 * torch.randn(3, D), 0.1 * torch.randn(2, 7)):
            _close(ours(x), old(x), "float32", "out", f"{type(old).__name__}, {tuple(x.shape)}")


# ------------------------------------------------------------------ tiny models of 24 families

HIDDEN, LAYERS, VOCAB, SEQ = 32, 2, 64, 8
_DECODER = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
            "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 32}
_ENCODER = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 40}

# family -> (config arguments, {class: modules swapped}, {class: modules left}); counts per
# layer in the comments (L = 2 layers)
FAMILIES = {
    "gpt2": ({"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": 2, "n_positions": 32},
             {"LayerNorm": 5}, {}),  # 2L + final
    "llama": (_DECODER, {"LlamaRMSNorm": 5}, {}),  # 2L + final, as the next seven
    "mistral": (_DECODER, {"MistralRMSNorm": 5}, {}),
    "mixtral": ({**_DECODER, "num_local_experts": 2, "num_experts_per_tok": 1},
                {"MixtralRMSNorm": 5}, {}),
    "qwen2": (_DECODER, {"Qwen2RMSNorm": 5}, {}),
    "granite": (_DECODER, {"GraniteRMSNorm": 5}, {}),
    "phi3": ({**_DECODER, "pad_token_id": 0}, {"Phi3RMSNorm": 5}, {}),
    "olmo": (_DECODER, {"OlmoLayerNorm": 5}, {}),
    "gpt_neox": (_DECODER, {"LayerNorm": 5}, {}),
    "qwen3": ({**_DECODER, "head_dim": 16}, {"Qwen3RMSNorm": 9}, {}),  # + q, k norms
    "olmo2": (_DECODER, {"Olmo2RMSNorm": 9}, {}),  # 2 post-norms, q, k norms per layer
    "gemma": ({**_DECODER, "head_dim": 16}, {"GemmaRMSNorm": 5}, {}),
    "gemma2": ({**_DECODER, "head_dim": 16}, {"Gemma2RMSNorm": 9}, {}),  # 4L + final
    "gemma3_text": ({**_DECODER, "head_dim": 16}, {"Gemma3RMSNorm": 13}, {}),  # + q, k norms
    "stablelm": ({**_DECODER, "qk_layernorm": True}, {"LayerNorm": 13}, {}),  # + 2 heads × q, k
    "phi": (_ENCODER, {"LayerNorm": 3}, {}),  # one per parallel block + final
    "falcon": ({"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 2},
               {"LayerNorm": 3}, {}),
    "bloom": ({"hidden_size": HIDDEN, "n_layer": LAYERS, "n_head": 2},
              {"LayerNorm": 6}, {}),  # + the embeddings' norm
    "opt": ({"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
             "ffn_dim": 64, "max_position_embeddings": 32, "word_embed_proj_dim": HIDDEN},
            {"LayerNorm": 5}, {}),
    "cohere": ({**_DECODER, "use_qk_norm": True}, {"CohereLayerNorm": 7},
               {}),  # one per parallel block + final, + q, k norms (per head) per layer
    "deepseek_v3": ({**_DECODER, "moe_intermediate_size": 16, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                     "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                     "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8},
                    {"DeepseekV3RMSNorm": 9}, {}),  # + q_a and kv_a norms per layer
    "t5": ({"d_model": HIDDEN, "d_kv": 16, "d_ff": 64, "num_layers": LAYERS, "num_heads": 2,
            "decoder_start_token_id": 0, "pad_token_id": 0},
           {"T5LayerNorm": 12}, {}),  # encoder 2L + final, decoder 3L + final
    "bert": (_ENCODER, {"LayerNorm": 6}, {}),  # embeddings, 2L, the head's transform
    "roberta": ({**_ENCODER, "pad_token_id": 1}, {"LayerNorm": 6}, {}),
}


def _family(name: str) -> torch.nn.Module:
    """The tiny float32 model of family ``name`` from seed 0, its norms' parameters moved away
    from their initial ones and zeros (so weight, 1 + weight and bias all matter)."""
    config = transformers.AutoConfig.for_model(name, vocab_size=VOCAB,
                                               attn_implementation="eager", **FAMILIES[name][0])
    torch.manual_seed(0)
    if name == "t5":
        model = transformers.T5ForConditionalGeneration(config)
    elif name in ("bert", "roberta"):
        model = transformers.AutoModelForMaskedLM.from_config(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for m in model.modules():
            if "norm" in type(m).__name__.lower():
                for p in m.parameters(recurse=False):
                    p.add_(0.5 * torch.randn_like(p))
    return model.train()


def _run(model: torch.nn.Module, ids: torch.Tensor):
    """(logits, {parameter name: gradient of the loss}) in training mode, dropout drawn from
    the same seed for both models (our norms draw no random numbers)."""
    torch.manual_seed(3)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {k: p.grad for k, p in model.named_parameters()
                                 if p.grad is not None}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_swapped_as_counted_and_computes_as_before(name):
    """Protects the swap of 24 families' real models: exactly the norms counted above are
    swapped (by class), nothing norm-like is left (Cohere's per-head query/key norms
    included), and the logits and every parameter's gradient of the loss equal the unswapped
    model's (float32 "out" for logits, scale max(1, max|logits|); float32 "param" for
    gradients with the model's largest gradient as the scale: gradients that cancel to zero,
    such as a key bias's under softmax, keep rounding noise of the size of the others)."""
    if name not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    _, swapped, left = FAMILIES[name]
    model = _family(name)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        summary = lt.replace_norms(model)
    assert summary.swapped == swapped and summary == sum(swapped.values())
    assert {k: len(v) for k, v in summary.left.items()} == left
    assert [str(w.message).startswith("replace_norms left") for w in record] == (
        [True] if left else [])
    assert all(m.training for m in model.modules())

    ids = torch.randint(2, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    logits, grads = _run(model, ids)
    want_logits, want_grads = _run(reference, ids)
    _close(logits, want_logits, "float32", "out", f"{name} logits")
    assert grads.keys() == want_grads.keys()
    scale = max(float(g.abs().max()) for g in want_grads.values())
    for k, g in want_grads.items():
        _close(grads[k], g, "float32", "param", f"{name} d{k}", scale=scale)


def test_cohere_query_key_norms_swapped_per_head():
    """Protects Cohere with use_qk_norm under strict=True: it is accepted, without a warning;
    the (heads, head_dim) query/key norms become PerHeadLayerNorm holding their own weights,
    the other norms LayerNorm. (Their logits and gradients: the family test above.)"""
    from layernorm.torch._modules import PerHeadLayerNorm

    model = _family("cohere")
    old = dict(model.named_modules())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = lt.replace_norms(model, strict=True)
    assert summary == 7 and summary.left == {}
    kinds = {path: type(m) for path, m in model.named_modules()
             if type(old[path]).__name__ == "CohereLayerNorm"}
    per_head = sorted(p for p, k in kinds.items() if k is PerHeadLayerNorm)
    assert per_head == [f"model.layers.{i}.self_attn.{n}_norm" for i in range(LAYERS)
                        for n in "kq"]
    assert sum(k is lt.LayerNorm for k in kinds.values()) == 3
    for path in per_head:
        ours = model.get_submodule(path)
        assert ours.weight is old[path].weight and ours.weight_shape == (2, 16)


def test_t5_half_weights_over_a_float32_residual():
    """Protects T5's result dtype (the weight's where that is half): a bfloat16 T5 whose wo
    layers stay float32 (as transformers loads it) carries a float32 residual stream into
    bfloat16 norms, which must return bfloat16 for the next bfloat16 Linear. Swapped, it runs
    and gives the original's logits within the bfloat16 "out" tolerance (scale max|logits|)."""
    model = _family("t5").eval().to(torch.bfloat16)
    for m in model.modules():
        if hasattr(m, "wo"):  # the feed-forward blocks' output layers
            m.wo.float()
    reference = copy.deepcopy(model)
    assert lt.replace_norms(model) == 12
    ids = torch.randint(2, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = (m(input_ids=ids, labels=ids).logits for m in (model, reference))
    assert got.dtype == want.dtype
    _close(got, want, "bfloat16", "out", "t5 logits",
           scale=max(float(want.abs().max()), 1.0))
