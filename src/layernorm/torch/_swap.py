"""``replace_norms``: a model's norm modules swapped for ours, in place, in one call.

Which modules are swapped, and into what, is one table (``TABLE``): each class it names (exact
classes: a subclass may compute something else) has a recipe (one of ``RECIPES``) saying which
of ours takes its place, where its eps lives, whether its scale is weight or 1 + weight, and the
dtype of its result (``result_dtype`` of our modules). The classes are torch's ``LayerNorm`` and
``RMSNorm`` and 238 of transformers' (``TRANSFORMERS``), each checked against its original by
tests/torch_api/test_hf_models.py. They are recognised by their defining module and name
(``transformers.models.llama.modeling_llama``, ``LlamaRMSNorm``), so transformers is never
imported here and a class absent from the installed version is never met.

The normalized shape is the attribute a recipe names (``shape``) where the class has one;
otherwise the weight's size, these classes normalizing the last axis; a class without weight
fixes no size, and ours (``normalized_shape=None``) take the last axis whatever its size. An
instance of a ``per_head`` recipe whose weight spans more axes than the last becomes
``PerHeadLayerNorm``: the fused op normalizes the last axis without weight, and a torch
multiply by the weight follows.

The recipes by model family, what each original computes and how it rounds against ours, every
class of the table, and the norm-like classes of transformers left in place: docs/models.md.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._modules import LayerNorm, PerHeadLayerNorm, RMSNorm, _Ours

__all__ = ["SwapSummary", "replace_norms"]

ONLY = {"rms": RMSNorm, "layer": LayerNorm}  # replace_norms' ``only``: the kind it swaps


@dataclass(frozen=True)
class _Recipe:
    """How an instance of a class in the table becomes ours (module docstring)."""

    ours: type[LayerNorm] | type[RMSNorm]
    eps: str | float  # the attribute holding eps, or the literal the class's forward uses
    zero_centred: bool = False  # the class's scale is 1 + weight
    result: str = "input"  # ours' result_dtype
    shape: str | None = None  # the attribute holding the normalized shape (None: see above)
    params: frozenset[str] | None = None  # the parameters it may hold (None: all ours take)
    check: Callable[[torch.nn.Module], str | None] | None = None  # why an instance is left
    per_head: bool = False  # a weight over more axes than the last: PerHeadLayerNorm takes it

    def allowed(self) -> frozenset[str]:
        if self.params is not None:
            return self.params
        return frozenset({"weight", "bias"} if self.ours is LayerNorm else {"weight"})


def _channels_last(old: torch.nn.Module) -> str | None:
    fmt = getattr(old, "data_format", None)
    return None if fmt == "channels_last" else \
        f"data_format={fmt!r}: it normalizes axis 1 of (N, C, H, W), ours the last axis"


def _ungrouped(old: torch.nn.Module) -> str | None:
    size = getattr(old, "group_size", None)
    return None if size is None else \
        f"group_size={size}: it normalizes groups of {size} along the last axis"


_NONE = frozenset()
RECIPES: dict[str, _Recipe] = {
    "torch": _Recipe(LayerNorm, "eps", shape="normalized_shape"),
    "torch-rms": _Recipe(RMSNorm, "eps", shape="normalized_shape"),
    "llama": _Recipe(RMSNorm, "variance_epsilon", result="promote"),
    "llama4": _Recipe(RMSNorm, "eps", result="promote"),
    "olmo2": _Recipe(RMSNorm, "variance_epsilon"),
    "gemma": _Recipe(RMSNorm, "eps", zero_centred=True, check=_ungrouped),
    "gemma3n": _Recipe(RMSNorm, "eps"),
    "weightless": _Recipe(RMSNorm, "eps", params=_NONE),
    "t5": _Recipe(RMSNorm, "variance_epsilon", result="half_weight"),
    "cohere": _Recipe(LayerNorm, "variance_epsilon", params=frozenset({"weight"}),
                      per_head=True),
    "olmo": _Recipe(LayerNorm, 1e-5, shape="normalized_shape", params=_NONE),
    "deberta": _Recipe(LayerNorm, "variance_epsilon", result="promote"),
    "esmfold": _Recipe(LayerNorm, "eps", shape="c_in"),
    "pocket_tts": _Recipe(LayerNorm, "eps", result="promote", shape="normalized_shape"),
    "channels_last": _Recipe(LayerNorm, "eps", shape="normalized_shape", check=_channels_last),
    "videoprism": _Recipe(LayerNorm, "eps", zero_centred=True, shape="normalized_shape"),
}

# transformers' classes by recipe, "model.Class" for transformers.models.model.modeling_model
# (or "model.file.Class" for transformers.models.model.modeling_file)
TRANSFORMERS: dict[str, tuple[str, ...]] = {
    "torch": ("esmc.EsmcLayerNorm", "esmfold2.EsmFold2LayerNorm"),
    "llama": (
        "aimv2.Aimv2RMSNorm", "apertus1p5.Apertus1p5TextRMSNorm", "apertus.ApertusRMSNorm",
        "arcee.ArceeRMSNorm", "aria.AriaTextRMSNorm", "axk1.AXK1RMSNorm", "axk2.AXK2RMSNorm",
        "bailing_hybrid.BailingHybridRMSNorm", "bamba.BambaRMSNorm", "bitnet.BitNetRMSNorm",
        "blt.BltRMSNorm", "chameleon.ChameleonRMSNorm", "clvp.ClvpRMSNorm",
        "cohere2_moe.Cohere2MoeRMSNorm", "cosmos3_edge.Cosmos3EdgeTextRMSNorm", "csm.CsmRMSNorm",
        "cwm.CwmRMSNorm", "deepseek_ocr2.DeepseekOcr2TextRMSNorm",
        "deepseek_ocr2.DeepseekOcr2VisionRMSNorm", "deepseek_v2.DeepseekV2RMSNorm",
        "deepseek_v32.DeepseekV32RMSNorm", "deepseek_v3.DeepseekV3RMSNorm",
        "deimv2.Deimv2RMSNorm", "dia.DiaRMSNorm", "diffllama.DiffLlamaRMSNorm",
        "doge.DogeRMSNorm", "dots1.Dots1RMSNorm", "dots3_note.Dots3NoteRMSNorm",
        "emu3.Emu3RMSNorm", "ernie4_5_moe.Ernie4_5_MoeRMSNorm",
        "ernie4_5_vl_moe.Ernie4_5_VLMoeRMSNorm", "ernie4_5.Ernie4_5RMSNorm",
        "eurobert.EuroBertRMSNorm", "evolla.EvollaRMSNorm", "exaone4_5.Exaone4_5_RMSNorm",
        "exaone4.Exaone4RMSNorm", "exaone_moe.ExaoneMoeRMSNorm", "falcon_h1.FalconH1RMSNorm",
        "falcon_mamba.FalconMambaRMSNorm", "glm4_moe_lite.Glm4MoeLiteRMSNorm",
        "glm4_moe.Glm4MoeRMSNorm", "glm4.Glm4RMSNorm", "glm4v_moe.Glm4vMoeRMSNorm",
        "glm4v_moe.Glm4vMoeTextRMSNorm", "glm4v.Glm4vRMSNorm", "glm5_next.Glm5NextRMSNorm",
        "glm5_next.Glm5NextTextRMSNorm", "glm_image.GlmImageRMSNorm",
        "glm_moe_dsa.GlmMoeDsaRMSNorm", "glm_ocr.GlmOcrRMSNorm", "glm.GlmRMSNorm",
        "gradium_phonon_tts.GradiumPhononTTSTimestepNorm",
        "granite4_vision.Granite4VisionTextRMSNorm", "granite_docling.GraniteDoclingTextRMSNorm",
        "granitemoehybrid.GraniteMoeHybridRMSNorm", "granitemoe.GraniteMoeRMSNorm",
        "granitemoeshared.GraniteMoeSharedRMSNorm", "granitemoe_swa.GraniteMoeSWARMSNorm",
        "granite.GraniteRMSNorm", "granite_swa.GraniteSWARMSNorm",
        "higgs_audio_v2.HiggsAudioV2RMSNorm", "hunyuan_v1_dense.HunYuanDenseV1RMSNorm",
        "hunyuan_v1_moe.HunYuanMoEV1RMSNorm", "hunyuan_vl.HunYuanVLRMSNorm",
        "hyperclovax.HyperCLOVAXRMSNorm", "hy_v3.HYV3RMSNorm", "hy_v4.HYV4RMSNorm",
        "hy_v4_vl.HYV4VLRMSNorm", "idefics2.Idefics2RMSNorm", "idefics3.Idefics3RMSNorm",
        "inkling.InklingRMSNorm", "internvl.InternVLVisionRMSNorm", "jamba.JambaRMSNorm",
        "jetmoe.JetMoeRMSNorm", "kimi_linear.KimiLinearRMSNorm", "kolibri1.Kolibri1RMSNorm",
        "laguna.LagunaRMSNorm", "lfm2_moe.Lfm2MoeRMSNorm", "lfm2.Lfm2RMSNorm", "lfm3.Lfm3RMSNorm",
        "lfm3_vl.Lfm3VlVisionRMSNorm", "lighton_ocr.LightOnOcrRMSNorm", "llama.LlamaRMSNorm",
        "longcat_flash.LongcatFlashRMSNorm", "mamba2.Mamba2RMSNorm", "mamba.MambaRMSNorm",
        "mellum.MellumRMSNorm", "mimo_v2_flash.MiMoV2FlashRMSNorm", "minicpm3.MiniCPM3RMSNorm",
        "minimax_m2.MiniMaxM2RMSNorm", "minimax.MiniMaxRMSNorm", "ministral3.Ministral3RMSNorm",
        "ministral.MinistralRMSNorm", "mistral3.Mistral3RMSNorm", "mistral4.Mistral4RMSNorm",
        "mistral_large4.MistralLarge4RMSNorm", "mistral.MistralRMSNorm", "mixtral.MixtralRMSNorm",
        "mllama.MllamaTextRMSNorm", "molmo2.Molmo2RMSNorm",
        "muse_glimmer_assistant.MuseGlimmerAssistantRMSNorm", "neucodec.NeuCodecRMSNorm",
        "olmoe.OlmoeRMSNorm", "ovis2.Ovis2RMSNorm", "paddleocr_vl.PaddleOCRRMSNorm",
        "pe_audio.PeAudioEncoderRMSNorm", "pe_audio_video.PeAudioVideoEncoderRMSNorm",
        "pe_video.PeVideoEncoderRMSNorm", "phi3.Phi3RMSNorm",
        "phi4_multimodal.Phi4MultimodalRMSNorm", "pixtral.PixtralRMSNorm",
        "qianfan_ocr.QianfanOCRVisionRMSNorm", "qwen2_5_vl.Qwen2_5_VLRMSNorm",
        "qwen2_5_omni.Qwen2_5OmniRMSNorm", "qwen2_moe.Qwen2MoeRMSNorm", "qwen2.Qwen2RMSNorm",
        "qwen2_vl.Qwen2VLRMSNorm", "qwen3_moe.Qwen3MoeRMSNorm",
        "qwen3_omni_moe.Qwen3OmniMoeCode2WavRMSNorm", "qwen3_omni_moe.Qwen3OmniMoeRMSNorm",
        "qwen3_omni_moe.Qwen3OmniMoeTextRMSNorm", "qwen3_omni_moe.Qwen3OmniMoeThinkerTextRMSNorm",
        "qwen3.Qwen3RMSNorm", "qwen3_vl_moe.Qwen3VLMoeTextRMSNorm", "qwen3_vl.Qwen3VLTextRMSNorm",
        "sapiens2.Sapiens2RMSNorm", "seed_oss.SeedOssRMSNorm", "smollm3.SmolLM3RMSNorm",
        "solar_open.SolarOpenRMSNorm", "timesfm2_5.TimesFm2_5RMSNorm", "timesfm.TimesFmRMSNorm",
        "ultrabert.UltrabertRMSNorm", "ultravbert.UltraVBertRMSNorm",
        "unlimited_ocr.UnlimitedOcrTextRMSNorm",
        "vibevoice_acoustic_tokenizer.VibeVoiceAcousticTokenizerRMSNorm",
        "vibevoice_asr.VibeVoiceAsrRMSNorm", "vibevoice.VibeVoiceRMSNorm",
        "voxtral_realtime.VoxtralRealtimeRMSNorm", "xcodec2.Xcodec2RMSNorm", "youtu.YoutuRMSNorm",
        "zamba2.Zamba2RMSNorm", "zamba.ZambaRMSNorm", "zaya.ZayaRMSNorm",
    ),
    "llama4": (
        "cpmant.CpmAntLayerNorm", "imagegpt.ImageGPTLayerNorm", "llama4.Llama4TextRMSNorm",
        "xlstm.xLSTMRMSNorm",
    ),
    "olmo2": (
        "afmoe.AfmoeRMSNorm", "beam.BeamRMSNorm", "deepseek_v4.DeepseekV4RMSNorm",
        "flex_olmo.FlexOlmoRMSNorm", "flint.FlintRMSNorm", "gpt_oss.GptOssRMSNorm",
        "helium.HeliumRMSNorm", "inkling2_loop.Inkling2LoopRMSNorm", "inkling2.Inkling2RMSNorm",
        "lara_mini.LaraMiniRMSNorm", "nemotron_h_omni.NemotronH_Omni_RMSNorm",
        "nemotron_h.NemotronHRMSNorm", "olmo2.Olmo2RMSNorm", "olmo3.Olmo3RMSNorm",
        "olmo_hybrid.OlmoHybridRMSNorm", "openai_privacy_filter.OpenAIPrivacyFilterRMSNorm",
    ),
    "gemma": (
        "gemma2.Gemma2RMSNorm", "gemma3.Gemma3RMSNorm", "gemma.GemmaRMSNorm",
        "minimax_m3_vl.MiniMaxM3VLRMSNorm", "muse_glimmer.MuseGlimmerTextCenteredRMSNorm",
        "muse_spark.MuseSparkTextCenteredRMSNorm", "qwen3_5_moe.Qwen3_5MoeRMSNorm",
        "qwen3_5.Qwen3_5RMSNorm", "qwen3_next.Qwen3NextRMSNorm", "qwen4_exp.Qwen4ExpTextRMSNorm",
        "recurrent_gemma.RecurrentGemmaRMSNorm", "step3p7.Step3p7RMSNorm",
        "t5gemma2.T5Gemma2RMSNorm", "t5gemma.T5GemmaRMSNorm", "vaultgemma.VaultGemmaRMSNorm",
    ),
    "gemma3n": (
        "diffusion_gemma.DiffusionGemmaRMSNorm", "embedding_gemma2.EmbeddingGemma2RMSNorm",
        "gemma3n.Gemma3nRMSNorm", "gemma4.Gemma4RMSNorm", "gemma4_unified.Gemma4UnifiedRMSNorm",
        "kyutai_speech_to_text.KyutaiSpeechToTextRMSNorm", "moshi.MoshiRMSNorm",
        "muse_glimmer.MuseGlimmerRMSNorm", "muse_spark.MuseSparkRMSNorm", "neomme.NeoMMERMSNorm",
    ),
    "weightless": (
        "deepseek_v4.DeepseekV4UnweightedRMSNorm", "esmfold2.EsmFold2RMSNorm",
        "glm5_next.Glm5NextTextUnweightedRMSNorm", "hrm_text.HrmTextRMSNorm",
        "inkling2_loop.Inkling2LoopUnweightedRMSNorm", "inkling2.Inkling2UnweightedRMSNorm",
        "llama4.Llama4TextL2Norm", "nanochat.NanoChatRMSNorm",
    ),
    "t5": (
        "idefics.IdeficsRMSNorm", "kosmos2_5.Kosmos2_5LayerNorm", "longt5.LongT5LayerNorm",
        "mt5.MT5LayerNorm", "pix2struct.Pix2StructLayerNorm", "pop2piano.Pop2PianoLayerNorm",
        "switch_transformers.SwitchTransformersLayerNorm", "t5.T5LayerNorm", "udop.UdopLayerNorm",
        "umt5.UMT5LayerNorm",
    ),
    "cohere": (
        "cohere2.Cohere2LayerNorm", "cohere2_moe.Cohere2MoeLayerNorm",
        "cohere_compass.CohereCompassLayerNorm", "cohere.CohereLayerNorm",
    ),
    "olmo": ("olmo.OlmoLayerNorm",),
    "deberta": ("deberta.DebertaLayerNorm",),
    "esmfold": ("esm.esmfold.EsmFoldLayerNorm",),
    "pocket_tts": (
        "gradium_phonon_tts.GradiumPhononTTSFlowLayerNorm", "pocket_tts.PocketTTSFlowLayerNorm",
    ),
    "channels_last": (
        "convnext.ConvNextLayerNorm", "convnextv2.ConvNextV2LayerNorm",
        "deepseek_ocr2.DeepseekOcr2SamLayerNorm", "deepseek_vl_hybrid.DeepseekVLHybridLayerNorm",
        "dinov3_convnext.DINOv3ConvNextLayerNorm", "edgetam.EdgeTamLayerNorm",
        "edgetam_video.EdgeTamVideoLayerNorm", "got_ocr2.GotOcr2LayerNorm",
        "lw_detr.LwDetrLayerNorm", "pp_formulanet.PPFormulaNetLayerNorm",
        "rf_detr.RfDetrLayerNorm", "sam2.Sam2LayerNorm", "sam2_video.Sam2VideoLayerNorm",
        "sam3_tracker.Sam3TrackerLayerNorm", "sam3_tracker_video.Sam3TrackerVideoLayerNorm",
        "sam_hq.SamHQLayerNorm", "sam.SamLayerNorm", "seggpt.SegGptLayerNorm",
        "slanext.SLANeXtLayerNorm", "unlimited_ocr.UnlimitedOcrSamLayerNorm",
    ),
    "videoprism": ("videoprism.VideoPrismLayerNorm",),
}


def transformers_key(entry: str) -> tuple[str, str]:
    """(defining module, class name) of a table entry "model.Class" or "model.file.Class"."""
    model, *file, name = entry.split(".")
    return f"transformers.models.{model}.modeling_{file[0] if file else model}", name


def _key(cls: type) -> tuple[str, str]:
    return cls.__module__, cls.__qualname__


TABLE: dict[tuple[str, str], _Recipe] = {
    _key(torch.nn.LayerNorm): RECIPES["torch"],
    _key(torch.nn.RMSNorm): RECIPES["torch-rms"],
    **{transformers_key(e): RECIPES[r] for r, entries in TRANSFORMERS.items() for e in entries},
}

# Per-instance behaviour a swap would drop: the hooks torch keeps on each module.
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
          "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
          "_load_state_dict_post_hooks")


class SwapSummary(int):
    """What :func:`replace_norms` did: an ``int``, the number of modules swapped (so
    ``n == 0``, ``if n:``, ``print(n)`` and ``f"{n} norms"`` read it as a number), with

    - ``swapped``: {class name: number of modules of that class swapped};
    - ``left``: {class name: {module path: why it was left in place}}, the norm-like modules
      not swapped (those of the kind excluded by ``only`` are not counted).

    Its repr gives both by class.
    """

    swapped: dict[str, int]
    left: dict[str, dict[str, str]]

    def __new__(cls, swapped: dict[str, int], left: dict[str, dict[str, str]]) -> SwapSummary:
        self = super().__new__(cls, sum(swapped.values()))
        self.swapped, self.left = swapped, left
        return self

    def __getnewargs__(self) -> tuple[dict[str, int], dict[str, dict[str, str]]]:
        return self.swapped, self.left

    __str__ = int.__repr__  # print(n) and f"{n}" show the number

    def __repr__(self) -> str:
        def by_class(counts: dict[str, int]) -> str:
            return f" ({', '.join(f'{k} {v}' for k, v in counts.items())})" if counts else ""
        left = {k: len(v) for k, v in self.left.items()}
        return (f"<replace_norms: {int(self)} swapped{by_class(self.swapped)}, "
                f"{sum(left.values())} left{by_class(left)}>")


def _named_norm(m: torch.nn.Module) -> bool:
    """Whether ``m``'s class is named ...LayerNorm or ...RMSNorm or derives from torch's."""
    name = type(m).__name__.lower()
    return name.endswith(("layernorm", "rmsnorm")) or isinstance(
        m, (torch.nn.LayerNorm, torch.nn.RMSNorm))


def _norm_like(m: torch.nn.Module) -> bool:
    """A norm replace_norms answers for: of a class in the table, or named as a norm, not ours,
    and no block of named norms (Wav2Vec2EncoderLayerStableLayerNorm holds its norms: those
    are swapped instead)."""
    return _key(type(m)) in TABLE or _named_norm(m) and not isinstance(m, _Ours) and not any(
        _named_norm(c) for c in m.modules() if c is not m)


def _kind(m: torch.nn.Module) -> type[LayerNorm] | type[RMSNorm]:
    """Which of ours a norm-like module is, for ``only``: its recipe's, else what its name or
    base class says."""
    recipe = TABLE.get(_key(type(m)))
    if recipe is not None:
        return recipe.ours
    rms = type(m).__name__.lower().endswith("rmsnorm") or isinstance(m, torch.nn.RMSNorm)
    return RMSNorm if rms else LayerNorm


def _why_left(old: torch.nn.Module) -> str | None:
    """Why the norm-like ``old`` is left in place (None: it is swapped): its class is not in the
    table, or what it carries beyond its class (hooks, its own forward, extra tensors or
    submodules) would be lost, or ours cannot compute what this instance computes."""
    recipe = TABLE.get(_key(type(old)))
    if recipe is None:
        return "its class is not in replace_norms' table, so it may compute something else"
    if any(getattr(old, h, None) for h in _HOOKS):
        return "it has hooks"
    if "forward" in vars(old):
        return "its forward is replaced on the instance"
    params = {k for k, p in old._parameters.items() if p is not None}
    if not params <= recipe.allowed() or old._buffers or old._modules:
        extra = sorted(params - recipe.allowed()) + sorted(old._buffers) + sorted(old._modules)
        return f"it holds {', '.join(extra)} beyond what its recipe takes"
    weight = old._parameters.get("weight")
    if recipe.shape is None and weight is not None and weight.dim() != 1 and not _per_head(
            recipe, weight):
        return (f"its weight has shape {tuple(weight.shape)} but it normalizes the last axis "
                "alone; ours take one weight of the normalized shape")
    return recipe.check(old) if recipe.check else None


def _per_head(recipe: _Recipe, weight: torch.Tensor | None) -> bool:
    """Whether an instance of ``recipe`` with ``weight`` becomes PerHeadLayerNorm."""
    return recipe.per_head and weight is not None and weight.dim() > 1


def _ours(old: torch.nn.Module,
          memory_efficient: bool = False) -> LayerNorm | RMSNorm | PerHeadLayerNorm:
    """Our module in ``old``'s place: its eps and training mode, its very Parameter objects
    (so their device, dtype, values, gradients and optimizer state go with them), and
    ``memory_efficient``."""
    recipe = TABLE[_key(type(old))]
    weight, bias = old._parameters.get("weight"), old._parameters.get("bias")
    eps = getattr(old, recipe.eps) if isinstance(recipe.eps, str) else recipe.eps
    if _per_head(recipe, weight):
        new = PerHeadLayerNorm(tuple(weight.shape), eps, device="meta",
                               memory_efficient=memory_efficient)
        new.weight = weight
        return new.train(old.training)
    if recipe.shape is not None:
        shape = getattr(old, recipe.shape)
    else:
        shape = None if weight is None else tuple(weight.shape)
    options = {"device": "meta", "zero_centered_gamma": recipe.zero_centred,
               "result_dtype": recipe.result, "memory_efficient": memory_efficient}
    # built on the meta device: its own parameters are replaced at once, never allocated
    if recipe.ours is LayerNorm:
        new = LayerNorm(shape, eps, weight is not None, bias=bias is not None, **options)
    else:
        new = RMSNorm(shape, eps, weight is not None, **options)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            setattr(new, name, p)
    return new.train(old.training)


def _at(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _listing(left: list[tuple[str, str, str]]) -> str:
    """'Class at path, path: reason' for each class and reason of ``left`` (class, path,
    reason), in the model's order."""
    groups: dict[tuple[str, str], list[str]] = {}
    for cls, path, why in left:
        groups.setdefault((cls, why), []).append(path)
    return "; ".join(f"{cls} at {', '.join(paths)}: {why}" for (cls, why), paths in groups.items())


def replace_norms(model: torch.nn.Module, *, only: str | None = None,
                  strict: bool = False, memory_efficient: bool = False) -> SwapSummary:
    """Swap every norm of ``model`` whose class is in the table for :class:`LayerNorm` or
    :class:`RMSNorm`, in place, and say what was swapped and what was left.

    The table (module docstring; docs/models.md lists its classes) holds torch's ``LayerNorm``
    and ``RMSNorm`` and 238 of transformers' norm classes, each with a recipe: which of ours,
    eps from which attribute (or the literal its forward uses), scale weight or 1 + weight
    (``zero_centered_gamma=True``), and the dtype of the result (``result_dtype``). Exact classes
    only: a subclass may compute something else.

    Each new module keeps the old one's Parameter objects (``new.weight is old.weight``), eps
    and training mode, so the state dict keys, an optimizer built before the swap and
    ``isinstance(m, torch.nn.LayerNorm)`` all hold as before. A module reached from several
    parents is swapped once, by one module, everywhere. Our own modules are not swapped again,
    so a second call swaps nothing.

    Every norm-like module (a class named ...LayerNorm or ...RMSNorm in any case, or a subclass
    of torch's two; not ours, and not a block holding such modules, whose norms are swapped on
    their own) that is not swapped is named, with the reason, in one ``UserWarning``: its class
    is not in the table; it carries hooks, a forward set on the instance, or tensors or
    submodules its recipe does not take; or ours cannot compute what it does (a weight spanning
    more axes than it normalizes outside Cohere's classes, channels_first, groups). Cohere's
    per-head query/key norms become :class:`PerHeadLayerNorm`.

    Args:
        model: the module to change in place.
        only: None (swap both kinds), "rms" (RMSNorms only) or "layer" (LayerNorms only). The
            kind is what the class computes (T5LayerNorm is an RMSNorm); for a class outside
            the table, what its name or base class says. Modules of the other kind are left
            without a word and are not counted as left.
        strict: raise instead of warning where anything norm-like would be left. The check
            comes before any change: a model that fails it is untouched.
        memory_efficient: every module built gets ``memory_efficient=True``: in training,
            autograd keeps each norm's output instead of its input (one activation of the
            norm's size less per norm where the next layer keeps the output anyway). Modules
            that are ours already are not changed.

    Returns:
        A :class:`SwapSummary`: the ``int`` number of modules swapped, with ``swapped`` and
        ``left`` by class name.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``; ``only`` is not a str or None;
            ``strict`` or ``memory_efficient`` is not a bool.
        ValueError: ``only`` is not "rms" or "layer"; ``model`` is itself norm-like (it cannot
            be swapped in place: build ours directly, or swap inside a container); with
            ``strict=True``, a norm-like module would be left (the message names each, and
            why).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if only is not None and not isinstance(only, str):
        raise TypeError(f"only must be None or a str, got {type(only).__name__}")
    if only is not None and only not in ONLY:
        raise ValueError(f"only must be None, 'rms' or 'layer', got {only!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    if not isinstance(memory_efficient, bool):
        raise TypeError(f"memory_efficient must be a bool, got "
                        f"{type(memory_efficient).__name__}")
    if _norm_like(model):
        raise ValueError(f"model is itself a {type(model).__qualname__}, which cannot be "
                         "swapped in place: build layernorm.torch's module directly, or call "
                         "replace_norms on a model that contains it")
    # decide first: the tree is changed only after all of it has been walked and judged
    sites = [(path, parent, name, child) for path, parent in model.named_modules()
             for name, child in parent._modules.items()
             if child is not None and _norm_like(child)
             and (only is None or _kind(child) is ONLY[only])]
    chosen: dict[int, torch.nn.Module] = {}  # id -> a module to swap, each once
    left: list[tuple[str, str, str]] = []  # (class, path, why), in the model's order
    seen: set[int] = set()
    for path, _parent, name, old in sites:
        if id(old) in seen:
            continue
        seen.add(id(old))
        why = _why_left(old)
        if why is None:
            chosen[id(old)] = old
        else:
            left.append((type(old).__name__, _at(path, name), why))
    if strict and left:
        raise ValueError(f"replace_norms(strict=True) would leave {len(left)} norm-like "
                         f"module(s) in place, so it changed nothing: {_listing(left)}")
    new = {key: _ours(old, memory_efficient) for key, old in chosen.items()}
    swapped: dict[str, int] = {}
    for old in chosen.values():
        swapped[type(old).__name__] = swapped.get(type(old).__name__, 0) + 1
    for _path, parent, name, old in sites:
        if id(old) in new:
            setattr(parent, name, new[id(old)])
    if left:
        warnings.warn(f"replace_norms left {len(left)} norm-like module(s) in place: "
                      f"{_listing(left)}", stacklevel=2)
    by_class: dict[str, dict[str, str]] = {}
    for cls, path, why in left:
        by_class.setdefault(cls, {})[path] = why
    return SwapSummary(swapped, by_class)
