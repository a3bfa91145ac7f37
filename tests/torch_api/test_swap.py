"""replace_norms: tiny transformers models and plain torch models with their norms swapped
compute, train and serialise as before, and only the known classes are swapped."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import layernorm.torch as lt  # noqa: E402 - after the skips
from layernorm.tolerances import assert_close  # noqa: E402

VOCAB, HIDDEN, LAYERS, SEQ = 100, 32, 2, 8

# Tolerances: everything here runs in float32, so the float32 "out" entry of the table. The
# swapped and unswapped models differ only in the norms' float32 roundings (a few ulps of
# their O(1) outputs), carried through float32 matmuls whose gains are O(1) at this size;
# results compared with scale = the larger of 1 and their largest value (logits, losses).
DTYPE = "float32"


def _close(got, want, name: str, dtype: str = DTYPE) -> None:
    """``got`` against ``want`` (tensors or arrays) under the "out" tolerance of ``dtype``,
    scaled by the size of ``want``."""
    got, want = (np.asarray(t.detach().double() if isinstance(t, torch.Tensor) else t)
                 for t in (got, want))
    assert_close(got, want, dtype, "out", scale=max(float(np.max(np.abs(want))), 1.0),
                 name=name)


def _scramble_norms(model: torch.nn.Module, names: set[str]) -> None:
    """Move every parameter of the norms (classes named in ``names``) away from its initial
    value (ones or zeros), so that weight and bias, and weight and 1 + weight, differ."""
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ in names:
                for p in m.parameters(recurse=False):
                    p.add_(0.5 * torch.randn_like(p))


def _gpt2():
    tf = pytest.importorskip("transformers")
    cfg = tf.GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=2, vocab_size=VOCAB,
                        n_positions=SEQ, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return tf.GPT2LMHeadModel(cfg), {"LayerNorm"}


def _llama():
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=SEQ, rms_norm_eps=1e-3,
                         attn_implementation="eager")
    return tf.LlamaForCausalLM(cfg), {"LlamaRMSNorm"}


def _gemma():
    tf = pytest.importorskip("transformers")
    cfg = tf.GemmaConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                         vocab_size=VOCAB, max_position_embeddings=SEQ, rms_norm_eps=1e-3,
                         attn_implementation="eager")
    return tf.GemmaForCausalLM(cfg), {"GemmaRMSNorm"}


# (builder, number of norm modules): two per layer and the final norm
MODELS = {"gpt2": _gpt2, "llama": _llama, "gemma": _gemma}
NORMS_PER_MODEL = 2 * LAYERS + 1


def _model(name: str) -> torch.nn.Module:
    """The tiny float32 model ``name``, randomly initialised from seed 0, its norms'
    parameters scrambled."""
    torch.manual_seed(0)
    model, norm_names = MODELS[name]()
    _scramble_norms(model, norm_names)
    return model


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(n)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_swap_keeps_logits_parameters_and_state_dict(name):
    """Protects the swap of a real client's norms: the count, each new module's class and
    eps, the same Parameter objects, unchanged state dict keys and training mode, and logits
    equal to the unswapped model's (Gemma: the 1 + weight scale, with weights away from 0)."""
    model = _model(name)
    want_eps = {"gpt2": 1e-5, "llama": 1e-3, "gemma": 1e-3}[name]
    model.train()
    reference = copy.deepcopy(model)
    old = {path: m for path, m in model.named_modules() if "Norm" in type(m).__name__}
    keys = list(model.state_dict())
    params = dict(model.named_parameters())

    assert lt.replace_norms(model) == NORMS_PER_MODEL == len(old)

    new = dict(model.named_modules())
    for path, m in old.items():
        ours = new[path]
        assert type(ours) is (lt.LayerNorm if name == "gpt2" else lt.RMSNorm), path
        assert isinstance(ours, torch.nn.LayerNorm if name == "gpt2" else torch.nn.RMSNorm)
        assert ours.eps == want_eps and ours.training, path
        assert ours.zero_centered_gamma == (name == "gemma"), path
        assert ours.weight is m.weight, path
        assert getattr(ours, "bias", None) is getattr(m, "bias", None), path
    assert list(model.state_dict()) == keys
    assert all(p is params[k] for k, p in model.named_parameters())
    assert len(dict(model.named_parameters())) == len(params)

    ids = _batches(1)[0]
    with torch.no_grad():
        _close(model(ids).logits, reference(ids).logits, f"{name} logits")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_trains_as_before(name):
    """Protects training through the swapped norms (their backward, and the optimizer built
    before the swap still holding the live parameters): 10 SGD steps on the same batches give
    the unswapped model's losses. Two batches in turn, so that the loss can fall (random
    tokens are learnt only by memorising them)."""
    model = _model(name)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # built before the swap
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    assert lt.replace_norms(model) == NORMS_PER_MODEL

    losses = {"ours": [], "reference": []}
    for m, o, key in [(model, opt, "ours"), (reference, opt_ref, "reference")]:
        m.train()
        for ids in _batches(2) * 5:
            o.zero_grad()
            loss = m(ids, labels=ids).loss
            loss.backward()
            o.step()
            losses[key].append(loss.item())
    assert losses["ours"][-1] < losses["ours"][0]  # it did train
    _close(np.array(losses["ours"]), np.array(losses["reference"]), f"{name} losses")


# (model family, class, eps attribute, scale is 1 + weight): every transformers class swapped
HF_RMS_NORMS = [
    ("llama", "LlamaRMSNorm", "variance_epsilon", False),
    ("qwen2", "Qwen2RMSNorm", "variance_epsilon", False),
    ("qwen3", "Qwen3RMSNorm", "variance_epsilon", False),
    ("mistral", "MistralRMSNorm", "variance_epsilon", False),
    ("gemma", "GemmaRMSNorm", "eps", True),
    ("gemma2", "Gemma2RMSNorm", "eps", True),
    ("gemma3", "Gemma3RMSNorm", "eps", True),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(("family", "cls_name", "eps_attr", "centred"), HF_RMS_NORMS,
                         ids=[c for _, c, _, _ in HF_RMS_NORMS])
def test_each_transformers_rms_norm(family, cls_name, eps_attr, centred, dtype):
    """Protects the class table: each transformers RMSNorm becomes our RMSNorm with its eps
    (read from the right attribute; inputs small enough that eps moves the result) and its
    scale (1 + weight for the Gemma family), and computes what the original computes. In
    half dtypes the Llama family rounds twice (x·rstd, then its product with the weight)
    where ours rounds once: the difference stays inside the dtype's "out" tolerance."""
    tf_module = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(tf_module, cls_name, None)
    if cls is None:
        pytest.skip(f"the installed transformers has no {cls_name}")
    torch.manual_seed(0)
    old = cls(24, eps=0.05)
    assert getattr(old, eps_attr) == 0.05
    with torch.no_grad():
        old.weight.copy_(torch.randn(24))
    old.to(getattr(torch, dtype))
    x = (0.1 * torch.randn(3, 5, 24)).to(old.weight.dtype)  # mean(x^2) ~ 0.01 < eps = 0.05
    with torch.no_grad():
        want = old(x)
    model = torch.nn.Sequential(old)

    assert lt.replace_norms(model) == 1

    ours = model[0]
    assert type(ours) is lt.RMSNorm
    assert ours.eps == 0.05 and ours.zero_centered_gamma is centred
    assert ours.weight is old.weight and ours.normalized_shape == (24,)
    with torch.no_grad():
        got = ours(x)
    assert got.dtype == want.dtype == x.dtype
    _close(got, want, cls_name, dtype)


def test_plain_torch_norms():
    """Protects the torch classes in every form: with and without affine parameters or bias,
    a 2-D normalized_shape, eps None, each module's own training mode; outputs unchanged."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        torch.nn.LayerNorm(8, eps=1e-3),
        torch.nn.LayerNorm(8, elementwise_affine=False),
        torch.nn.LayerNorm(8, bias=False),
        torch.nn.RMSNorm(8),
        torch.nn.RMSNorm(8, eps=1e-2, elementwise_affine=False),
        torch.nn.Unflatten(-1, (2, 4)),
        torch.nn.LayerNorm((2, 4)),
        torch.nn.RMSNorm((2, 4), eps=0.5),
        torch.nn.Flatten(-2),
    )
    model[3].eval()
    _scramble_norms(model, {"LayerNorm", "RMSNorm"})
    reference = copy.deepcopy(model)
    norms = {i: m for i, m in enumerate(model) if isinstance(m, (torch.nn.LayerNorm,
                                                                   torch.nn.RMSNorm))}
    x = torch.randn(4, 3, 8)

    assert lt.replace_norms(model) == len(norms) == 7

    for i, old in norms.items():
        ours = model[i]
        assert type(ours) is (lt.LayerNorm if type(old) is torch.nn.LayerNorm else lt.RMSNorm)
        assert (ours.normalized_shape, ours.eps, ours.elementwise_affine, ours.training) == (
            old.normalized_shape, old.eps, old.elementwise_affine, old.training), i
        assert ours.weight is old.weight and getattr(ours, "bias", None) is getattr(
            old, "bias", None), i
    with torch.no_grad():
        _close(model(x), reference(x), "output")


def test_second_call_swaps_nothing():
    """Protects idempotence: our own modules are not swapped again, nor anything else."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.RMSNorm(8))
    assert lt.replace_norms(model) == 2
    after = list(model)
    assert lt.replace_norms(model) == 0
    assert all(a is b for a, b in zip(after, model, strict=True))


def test_shared_module_swapped_once():
    """Protects a norm reached from two places: one new module takes both places, counted
    once, so the two places still share their parameters."""
    norm = torch.nn.LayerNorm(8)
    model = torch.nn.Sequential(norm, torch.nn.Linear(8, 8), norm)
    assert lt.replace_norms(model) == 1
    assert type(model[0]) is lt.LayerNorm and model[0] is model[2]


def test_unknown_and_hooked_norms_left_in_place():
    """Protects against silent changes of behaviour: a subclass with its own forward is not
    a class of the table and stays; a table class with a hook, a forward set on the instance
    or an extra parameter stays; one warning names each with its reason."""

    class Shifted(torch.nn.LayerNorm):
        def forward(self, input):
            return super().forward(input) + 1.0

    hooked = torch.nn.LayerNorm(8)
    hooked.register_forward_hook(lambda module, args, out: out * 2)
    patched = torch.nn.RMSNorm(8)
    patched.forward = lambda x: x
    extra = torch.nn.LayerNorm(8)
    extra.gain = torch.nn.Parameter(torch.ones(1))
    model = torch.nn.Sequential(Shifted(8), hooked, patched, extra, torch.nn.LayerNorm(8))
    with pytest.warns(UserWarning) as record:
        summary = lt.replace_norms(model)
    assert summary == 1 and summary.swapped == {"LayerNorm": 1}
    assert len(record) == 1
    assert str(record[0].message) == (
        "replace_norms left 4 norm-like module(s) in place: Shifted at 0: its class is not in "
        "replace_norms' table, so it may compute something else; LayerNorm at 1: it has hooks; "
        "RMSNorm at 2: its forward is replaced on the instance; LayerNorm at 3: it holds gain "
        "beyond what its recipe takes")
    assert summary.left == {"Shifted": {"0": "its class is not in replace_norms' table, so it "
                                              "may compute something else"},
                            "LayerNorm": {"1": "it has hooks",
                                          "3": "it holds gain beyond what its recipe takes"},
                            "RMSNorm": {"2": "its forward is replaced on the instance"}}
    assert [type(m) for m in model] == [Shifted, torch.nn.LayerNorm, torch.nn.RMSNorm,
                                        torch.nn.LayerNorm, lt.LayerNorm]


class MyRMSNorm(torch.nn.Module):
    """A user's own RMSNorm: norm-like by its name, in no table."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class BlockLayerNorm(torch.nn.Module):
    """A block named after its norm (as transformers' Wav2Vec2EncoderLayerStableLayerNorm):
    not a norm itself."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(self.linear(x))


def test_what_is_norm_like():
    """Protects the scope of the warning: a user's RMSNorm and a lower-case-named LayerNorm are
    named; a block holding norms is not (its norm is swapped, also on a second call); BatchNorm,
    GroupNorm and InstanceNorm are out of scope; our own modules are never named."""

    class Mylayernorm(MyRMSNorm):
        pass

    model = torch.nn.Sequential(MyRMSNorm(8), Mylayernorm(8), BlockLayerNorm(8),
                                torch.nn.BatchNorm1d(8), torch.nn.GroupNorm(2, 8),
                                torch.nn.InstanceNorm1d(8), lt.RMSNorm(8))
    with pytest.warns(UserWarning, match=r"left 2 norm-like module\(s\) in place: MyRMSNorm at "
                      r"0: its class is not in replace_norms' table.*; Mylayernorm at 1: "):
        summary = lt.replace_norms(model)
    assert summary.swapped == {"LayerNorm": 1}
    assert list(summary.left) == ["MyRMSNorm", "Mylayernorm"]
    assert type(model[2].norm) is lt.LayerNorm and type(model[2]) is BlockLayerNorm
    with pytest.warns(UserWarning, match=r"left 2 norm-like"):  # the block is still not named
        assert lt.replace_norms(model) == 0


def test_summary_reads_as_the_count():
    """Protects the return value where callers used the count: it is an int (==, truthiness,
    print, f-strings, arithmetic, copy and pickle keep it), with the classes swapped and left
    and a repr that lists both."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.RMSNorm(8),
                                torch.nn.LayerNorm(8), MyRMSNorm(8))
    with pytest.warns(UserWarning):
        n = lt.replace_norms(model)
    assert isinstance(n, int) and isinstance(n, lt.SwapSummary)
    assert n == 3 and n and n + 1 == 4 and int(n) == 3
    assert (str(n), f"{n} norms", f"{n:>3}", f"{n:d}") == ("3", "3 norms", "  3", "3")
    assert n.swapped == {"LayerNorm": 2, "RMSNorm": 1}
    assert n.left == {"MyRMSNorm": {"3": "its class is not in replace_norms' table, so it may "
                                         "compute something else"}}
    assert repr(n) == ("<replace_norms: 3 swapped (LayerNorm 2, RMSNorm 1), "
                       "1 left (MyRMSNorm 1)>")
    for again in (pickle.loads(pickle.dumps(n)), copy.copy(n)):
        assert again == 3 and again.swapped == n.swapped and again.left == n.left
    none = lt.replace_norms(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert none == 0 and not none and repr(none) == "<replace_norms: 0 swapped, 0 left>"


def test_only_one_kind():
    """Protects ``only``: "rms" swaps the RMSNorms (by what a class computes: T5LayerNorm is
    one) and "layer" the LayerNorms; the other kind is left without a word, and a norm-like
    module outside the table counts by its name."""
    def model():
        return torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.RMSNorm(8), MyRMSNorm(8))

    m = model()
    with pytest.warns(UserWarning, match="MyRMSNorm at 2"):
        n = lt.replace_norms(m, only="rms")
    assert n.swapped == {"RMSNorm": 1} and list(n.left) == ["MyRMSNorm"]
    assert [type(x) for x in m] == [torch.nn.LayerNorm, lt.RMSNorm, MyRMSNorm]
    m = model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        n = lt.replace_norms(m, only="layer")
    assert n.swapped == {"LayerNorm": 1} and n.left == {}
    assert [type(x) for x in m] == [lt.LayerNorm, torch.nn.RMSNorm, MyRMSNorm]

    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    m = torch.nn.Sequential(t5.T5LayerNorm(8), torch.nn.LayerNorm(8))
    assert lt.replace_norms(m, only="rms").swapped == {"T5LayerNorm": 1}
    assert type(m[0]) is lt.RMSNorm and type(m[1]) is torch.nn.LayerNorm


def test_strict_refuses_before_changing_anything():
    """Protects strict=True: where anything norm-like would be left, a ValueError names it and
    why, and the model is untouched (no half-swapped model); where nothing would be, it swaps
    as without strict."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), MyRMSNorm(8), torch.nn.RMSNorm(8))
    before = list(model)
    with pytest.raises(ValueError, match=r"replace_norms\(strict=True\) would leave 1 norm-like "
                       r"module\(s\) in place, so it changed nothing: MyRMSNorm at 1: its class "
                       r"is not in replace_norms' table"):
        lt.replace_norms(model, strict=True)
    assert all(a is b for a, b in zip(model, before, strict=True))
    assert lt.replace_norms(model, strict=True, only="layer") == 1  # MyRMSNorm not asked for


def test_bad_arguments():
    """Protects the errors: a non-module is a TypeError naming model; a norm given as the
    model itself cannot be swapped in place, a ValueError; only and strict are checked by
    kind (TypeError) and value (ValueError), each naming its argument."""
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        lt.replace_norms("model")
    with pytest.raises(ValueError, match="model is itself a LayerNorm"):
        lt.replace_norms(torch.nn.LayerNorm(8))
    with pytest.raises(ValueError, match="model is itself a MyRMSNorm"):
        lt.replace_norms(MyRMSNorm(8))
    model = torch.nn.Sequential(torch.nn.LayerNorm(8))
    with pytest.raises(TypeError, match="only must be None or a str, got tuple"):
        lt.replace_norms(model, only=("rms",))
    with pytest.raises(ValueError, match="only must be None, 'rms' or 'layer', got 'batch'"):
        lt.replace_norms(model, only="batch")
    with pytest.raises(TypeError, match="strict must be a bool, got int"):
        lt.replace_norms(model, strict=1)
    assert type(model[0]) is torch.nn.LayerNorm


def test_module_options_the_swap_uses():
    """Protects the two options of our modules that other libraries' norms need: result_dtype
    (the promoted dtype, or T5's: the weight's where half) computed in the wider dtype and
    rounded once, and normalized_shape=None (the last axis, any size, without weight; a 0-d
    input, which has none, a ValueError); both checked, and shown in the repr."""
    torch.manual_seed(0)
    x16 = torch.randn(3, 8).to(torch.bfloat16)
    promote = lt.RMSNorm(8, 1e-3, result_dtype="promote")  # float32 weight
    with torch.no_grad():
        got = promote(x16)
        want = torch.nn.functional.rms_norm(x16.float(), (8,), promote.weight, 1e-3)
    assert got.dtype == torch.float32
    _close(got, want, "promote")
    half = lt.LayerNorm(8, result_dtype="half_weight").to(torch.bfloat16)
    assert half(torch.randn(3, 8)).dtype == torch.bfloat16  # float32 input, bfloat16 weight
    assert lt.LayerNorm(8, result_dtype="half_weight")(x16).dtype == torch.float32
    assert lt.LayerNorm(8)(x16).dtype == torch.bfloat16  # torch's rule
    assert "result_dtype='promote'" in repr(promote)

    any_d = lt.RMSNorm(None, 1e-3, elementwise_affine=False)
    for d in (5, 12):
        x = torch.randn(2, d)
        _close(any_d(x), torch.nn.functional.rms_norm(x, (d,), eps=1e-3), f"last axis of {d}")
    assert "None (the last axis)" in repr(any_d)
    with pytest.raises(ValueError, match="input must have a last axis to normalize, got a 0-d"):
        any_d(torch.tensor(1.0))

    with pytest.raises(TypeError, match="result_dtype must be a str, got dtype"):
        lt.RMSNorm(8, result_dtype=torch.float32)
    with pytest.raises(ValueError, match="result_dtype must be one of input, promote, "
                                         "half_weight, got 'weight'"):
        lt.LayerNorm(8, result_dtype="weight")
    with pytest.raises(ValueError, match="normalized_shape None .* needs elementwise_affine"):
        lt.LayerNorm(None)


@pytest.mark.parametrize("result_dtype", ["input", "promote", "half_weight"])
def test_rms_norm_eps_none_is_torchs_whatever_the_result_dtype(result_dtype):
    """Protects RMSNorm's eps=None against torch.nn.RMSNorm's: torch takes finfo(float32).eps
    for bfloat16, float16 and float32 inputs (finfo(float64).eps for float64), whatever the
    dtype the module computes in. A bfloat16 input of 0.01s (mean square 1e-4) gives ~0.9994
    with float32's eps and ~0.11 with bfloat16's; a float32 input of 1e-5s beside a float64
    weight (computed in float64 under "promote") gives ~0.029 with float32's eps and ~1.0 with
    float64's. Values within the table's "out" tolerance of each result's dtype."""
    def torchs(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        with warnings.catch_warnings():  # torch: "Mismatch dtype between input and weight"
            warnings.simplefilter("ignore", UserWarning)
            return torch.nn.RMSNorm(4, dtype=dtype)(x).detach()

    x = torch.full((2, 4), 0.01, dtype=torch.bfloat16)
    eps32 = torch.finfo(torch.float32).eps
    exact = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + eps32)
    want = torchs(x, torch.float32)
    _close(want, exact, "torch's rule", dtype="bfloat16")  # the rule, as torch 2.13 has it
    got = lt.RMSNorm(4, result_dtype=result_dtype)(x).detach()
    _close(got, exact, f"{result_dtype}, bfloat16 input",
           dtype="bfloat16" if got.dtype == torch.bfloat16 else "float32")
    _close(got.to(want.dtype), want, f"{result_dtype} against torch", dtype="bfloat16")

    x = torch.full((2, 4), 1e-5)
    want = torchs(x, torch.float64)
    assert abs(float(want[0, 0]) - 0.02895) < 1e-4  # float32's eps, as stated above
    got = lt.RMSNorm(4, result_dtype=result_dtype, dtype=torch.float64)(x).detach()
    _close(got, want, f"{result_dtype}, float64 weight")


@pytest.mark.parametrize(("ours", "theirs"), [(lt.LayerNorm, torch.nn.LayerNorm),
                                              (lt.RMSNorm, torch.nn.RMSNorm)])
def test_modules_take_meta_tensors_and_empty_sizes_as_torchs(ours, theirs):
    """Protects the modules against refusing what torch's modules take: on the meta device
    (shape inference, deferred initialisation) they give a meta result of torch's shape and
    dtype; a normalized size of 0 and a batch of 0 rows give torch's empty result. The
    modules add no check of their own: the functions decide."""
    for shape, x_shape in (((4,), (2, 3, 4)), ((0,), (2, 0)), ((4,), (0, 4)), ((2, 4), (3, 2, 4))):
        for device in ("meta", "cpu"):
            x = torch.randn(x_shape, device=device)
            want = theirs(shape, device=device)(x)
            got = ours(shape, device=device)(x)
            assert (got.device, got.shape, got.dtype) == (want.device, want.shape, want.dtype), (
                shape, x_shape, device)
    weightless = ours(None, elementwise_affine=False, device="meta")
    assert weightless(torch.randn(2, 5, device="meta")).shape == (2, 5)


def test_an_empty_normalized_shape_is_refused_and_old_pickles_load():
    """Protects two edges of the module options: normalized_shape=() is refused as torch's
    functions refuse it (only None means "the last axis"), and a module pickled without the
    option attributes reads them as off (the class defaults) and computes as before."""
    for m in (lt.LayerNorm((), elementwise_affine=False), lt.RMSNorm((), 1e-3, False)):
        with pytest.raises(ValueError, match=r"normalized_shape must be non-empty .* got \(\)"):
            m(torch.randn(2, 3))
    norm = lt.RMSNorm(8, 1e-3)
    old = lt.RMSNorm.__new__(lt.RMSNorm)
    old.__dict__.update({k: v for k, v in norm.__dict__.items()
                         if k not in ("result_dtype", "zero_centered_gamma", "_last_axis")})
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(old(x), norm(x))


def test_transformers_not_imported():
    """Protects transformers being optional: importing layernorm.torch does not import it."""
    code = "import sys, layernorm.torch; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
