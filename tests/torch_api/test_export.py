"""Models computed by layernorm.torch leave PyTorch: ONNX export with both of torch's exporters
(standard ONNX operators, run by onnxruntime with no custom-operator library), torch.export
(the layernorm ops kept, with dynamic shapes), and torch.jit.trace (one graph for every grad
mode and every rank).

Tolerances: everything runs in float32 (float16 where a test says so), so the "out" entries of
the tolerance table, scaled by the size of the result. onnxruntime's kernels are not ours, but
both compute the norm in float32 and round once, so their results differ by a few float32
rounding steps, carried through the models' matmuls (gains O(1) at these sizes).
"""

from __future__ import annotations

import collections
import copy
import io
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import layernorm.torch as lt  # noqa: E402 - after the skips
from layernorm.tolerances import assert_close  # noqa: E402

D = 16
VOCAB, HIDDEN, LAYERS, SEQ = 100, 32, 2, 8
EXPORT_DOC = Path(__file__).resolve().parents[2] / "docs" / "export.md"
RMS_OPSET = 23  # the first ONNX opset with RMSNormalization

pytestmark = [
    pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export"),
    pytest.mark.filterwarnings("ignore:The feature will be removed"),
    pytest.mark.filterwarnings("ignore:`torch.jit.trace"),
    pytest.mark.filterwarnings("ignore:# The axis name"),  # the shared Dims of x and r
]


def _close(got, want, name: str, quantity: str = "out") -> None:
    """``got`` against ``want`` (tensors or arrays) under the tolerance of want's dtype, scaled
    by the size of ``want``."""
    got, want = (t.detach() if isinstance(t, torch.Tensor) else torch.from_numpy(np.asarray(t))
                 for t in (got, want))
    dtype = str(want.dtype).removeprefix("torch.")
    got, want = got.double().numpy(), want.double().numpy()
    assert_close(got, want, dtype, quantity, scale=max(float(np.max(np.abs(want))), 1.0),
                 name=name)


class _Chain(torch.nn.Module):
    """The four functions in a row, with zero-centred gamma and a residual stream in
    ``residual_dtype``: y1 = LN(x), y2 = RMS(y1), (y3, h3) = add-LN(y2, r), (y4, h4) =
    add-RMS(y3, h3); x and r (..., 16), any float dtype."""

    def __init__(self, dtype: torch.dtype = torch.float32,
                 residual_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(D, generator=g).to(dtype))
        self.b = torch.nn.Parameter(torch.randn(D, generator=g).to(dtype))
        self.residual_dtype = residual_dtype

    def forward(self, x, r):
        y1 = lt.layer_norm(x, x.shape[-1:], self.w, self.b)  # sizes a trace reads as tensors
        y2 = lt.rms_norm(y1, D, self.w, zero_centered_gamma=True)
        y3, h3 = lt.add_layer_norm(y2, r, D, self.w, self.b, zero_centered_gamma=True,
                                   residual_dtype=self.residual_dtype)
        y4, h4 = lt.add_rms_norm(y3, h3, D, self.w, 1e-5, residual_dtype=self.residual_dtype)
        return y1, y2, y3, h3, y4, h4


class _Block(torch.nn.Module):
    """A pre-norm residual block of torch's own norms, for replace_norms to swap."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.lin1 = torch.nn.LayerNorm(D), torch.nn.Linear(D, D)
        self.norm2, self.lin2 = torch.nn.RMSNorm(D, eps=1e-5), torch.nn.Linear(D, D)

    def forward(self, x):
        x = x + self.lin1(self.norm1(x))
        return x + self.lin2(self.norm2(x))


def _inputs(shape, dtype=torch.float32, seed=1):
    """(x, r) of ``shape`` and ``dtype``, N(0, 1) from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(2))


# --- ONNX -----------------------------------------------------------------------------------

def _to_onnx(module, args, exporter: str, opset: int, names=("x", "r"), dynamic=()):
    """The onnx.ModelProto of ``module`` (in eval mode) exported by torch.onnx.export with
    ``exporter`` ("dynamo" or "torchscript") at ``opset``; the inputs ``names`` have their axes
    ``dynamic`` free."""
    onnx = pytest.importorskip("onnx")
    module.eval()
    if exporter == "dynamo":
        pytest.importorskip("onnxscript", reason="torch.onnx's dynamo exporter needs onnxscript")
        dims = {a: torch.export.Dim(f"axis{a}") for a in dynamic}  # shared: equal sizes
        shapes = {n: dims for n in names}
        program = torch.onnx.export(module, args, dynamo=True, opset_version=opset,
                                    dynamic_shapes=shapes if dynamic else None, verbose=False)
        return program.model_proto
    buf = io.BytesIO()
    torch.onnx.export(module, args, buf, dynamo=False, opset_version=opset,
                      input_names=list(names),
                      dynamic_axes={n: {a: f"axis{a}" for a in dynamic} for n in names}
                      if dynamic else None)
    return onnx.load_from_string(buf.getvalue())


def _run_onnx(model, *inputs: torch.Tensor) -> list[np.ndarray]:
    """``model``'s outputs from onnxruntime's CPU provider, inputs in the graph's order."""
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {i.name: t.numpy() for i, t in zip(sess.get_inputs(), inputs, strict=True)}
    return sess.run(None, feed)


def _ops(model) -> collections.Counter:
    """(domain, op type) -> count over ``model``'s graph (top level: no exporter here makes
    functions or subgraphs of these models)."""
    return collections.Counter((n.domain, n.op_type) for n in model.graph.node)


def _standard_only(ops: collections.Counter) -> None:
    assert all(domain in ("", "ai.onnx") for domain, _ in ops), \
        f"operators outside the standard domain: {sorted(k for k in ops if k[0])}"


EXPORTERS = [("dynamo", RMS_OPSET), ("dynamo", 18), ("torchscript", 17)]


@pytest.mark.parametrize("exporter,opset", EXPORTERS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype,residual_dtype", [
    (torch.float32, None), (torch.float16, torch.float32)], ids=["float32", "float16+f32res"])
def test_four_functions_export_to_standard_onnx_ops(exporter, opset, dtype, residual_dtype):
    """Protects ONNX export of the four functions (zero-centred gamma; float16 activations
    and residual with a float32 residual stream h): only standard operators
    (LayerNormalization, and RMSNormalization from opset 23 of the dynamo exporter, else its
    decomposition), batch and sequence axes left free, and onnxruntime's results, dtypes
    included, equal to ours at the traced shape and at another."""
    module = _Chain(dtype, residual_dtype)
    model = _to_onnx(module, _inputs((2, 3, D), dtype), exporter, opset, dynamic=(0, 1))
    ops = _ops(model)
    _standard_only(ops)
    assert ops["", "LayerNormalization"] == 2
    assert ops["", "RMSNormalization"] == (2 if opset >= RMS_OPSET else 0)
    assert ops["", "ReduceMean"] == (0 if opset >= RMS_OPSET else 2)  # the decomposed RMS
    for shape in [(2, 3, D), (4, 5, D)]:
        x, r = _inputs(shape, dtype, seed=len(shape) + shape[0])
        with torch.no_grad():
            want = module(x, r)
        got = _run_onnx(model, x, r)
        for name, g, w in zip(("y1", "y2", "y3", "h3", "y4", "h4"), got, want, strict=True):
            assert g.dtype == w.numpy().dtype, name
            _close(g, w, f"{exporter} opset {opset} {name} {shape}")


def _llama():
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=SEQ, rms_norm_eps=1e-3, use_cache=False,
                         attn_implementation="eager")
    return tf.LlamaForCausalLM(cfg), "RMSNormalization"


def _bert():
    tf = pytest.importorskip("transformers")
    cfg = tf.BertConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64,
                        num_attention_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                        attn_implementation="eager")
    return tf.BertForMaskedLM(cfg), "LayerNormalization"


class _Logits(torch.nn.Module):
    """A transformers model as token ids -> logits, the one output an exporter needs."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def _model_pair(build):
    """(unswapped, swapped, how many norms were swapped, the norms' ONNX operator): a tiny
    float32 transformers model from seed 0, its norms' parameters moved away from ones and
    zeros, and a copy with replace_norms applied."""
    torch.manual_seed(0)
    model, norm_op = build()
    with torch.no_grad():
        for m in model.modules():
            if "Norm" in type(m).__name__:
                for p in m.parameters(recurse=False):
                    p.add_(0.5 * torch.randn_like(p))
    swapped = copy.deepcopy(model)
    count = int(lt.replace_norms(swapped))
    return _Logits(model).eval(), _Logits(swapped).eval(), count, norm_op


def _check_model_export(build, exporter: str, opset: int) -> None:
    """The unswapped model, then the swapped one, exported and run by onnxruntime: the same
    operators (each norm one ``norm_op``), and logits equal to each model's own."""
    unswapped, swapped, count, norm_op = _model_pair(build)
    assert count > 0
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ops = {}
    for which, module in (("unswapped", unswapped), ("swapped", swapped)):
        model = _to_onnx(module, (ids,), exporter, opset, names=("ids",))
        ops[which] = _ops(model)
        with torch.no_grad():
            want = module(ids)
        (got,) = _run_onnx(model, ids)
        _close(got, want, f"{which} logits")
    _standard_only(ops["swapped"])
    assert ops["swapped"]["", norm_op] == count
    assert ops["swapped"] == ops["unswapped"]


@pytest.mark.parametrize("build", [_llama, _bert], ids=["llama", "bert"])
def test_transformers_model_exports_with_the_dynamo_exporter(build):
    """Protects the dynamo exporter's ONNX of a model swapped by replace_norms (Llama's
    RMSNorms at opset 23, BERT's LayerNorms): the graph the unswapped model gives, operator
    for operator, one standard norm operator per swapped module, and onnxruntime's logits
    equal to eager's."""
    _check_model_export(build, "dynamo", RMS_OPSET)


def _doc_example() -> str:
    """The ONNX example of docs/export.md as written: its one Python block that exports."""
    blocks = [code for code in re.findall(r"```python\n(.*?)```", EXPORT_DOC.read_text(), re.S)
              if "torch.onnx.export" in code]
    assert len(blocks) == 1, "docs/export.md: one Python block should call torch.onnx.export"
    return blocks[0]


def test_the_onnx_example_of_the_docs_runs_as_written(tmp_path, monkeypatch):
    """Protects docs/export.md's ONNX example, its code taken from the document: run as
    written it writes model.onnx, of standard operators with one RMSNormalization per norm of
    the two-layer Llama (5), which onnxruntime runs to the swapped model's own logits; and what
    the text says of use_cache: without use_cache=False the export fails on the DynamicCache
    the model returns, and model.config.use_cache = False set after the model is built leaves
    no cache in its output."""
    tf = pytest.importorskip("transformers")
    pytest.importorskip("onnxscript", reason="torch.onnx's dynamo exporter needs onnxscript")
    onnx = pytest.importorskip("onnx")
    code = _doc_example()
    monkeypatch.chdir(tmp_path)  # the example saves model.onnx where it runs
    example: dict = {}
    exec(compile(code, str(EXPORT_DOC), "exec"), example)
    model = onnx.load(str(tmp_path / "model.onnx"))
    ops = _ops(model)
    _standard_only(ops)
    assert ops["", "RMSNormalization"] == 2 * LAYERS + 1
    with torch.no_grad():
        want = example["model"](example["ids"]).logits
    (got,) = _run_onnx(model, example["ids"])
    _close(got, want, "the example's logits")

    assert ", use_cache=False" in code
    default = code.replace(", use_cache=False", "").replace("model.onnx", "default.onnx")
    with pytest.raises(torch.onnx.OnnxExporterError, match="DynamicCache"):
        exec(compile(default, str(EXPORT_DOC), "exec"), {})
    assert not (tmp_path / "default.onnx").exists()
    config = copy.deepcopy(example["config"])
    config.use_cache = tf.LlamaConfig().use_cache  # transformers' default
    assert config.use_cache is True
    built = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        assert built(example["ids"]).past_key_values is not None
        built.config.use_cache = False
        assert built(example["ids"]).past_key_values is None


def test_bert_exports_with_the_torchscript_exporter():
    """Protects the TorchScript-based exporter's ONNX (opset 17) of BERT swapped by
    replace_norms, as for the dynamo exporter. (Llama does not export this way, swapped or
    not: transformers' masks use aten::diff, which that exporter cannot translate.)"""
    _check_model_export(_bert, "torchscript", 17)


def test_onnxruntime_fuses_bert_add_norms_unless_told_not_to(tmp_path):
    """Protects what docs/export.md says onnxruntime runs: at its default optimization level
    it replaces the Add + LayerNormalization pairs of the exported swapped BERT (4 of its 6
    norms) with its own SkipLayerNormalization, and at ORT_ENABLE_BASIC keeps all 6 standard
    LayerNormalization operators."""
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    _, swapped, _, _ = _model_pair(_bert)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model = _to_onnx(swapped, (ids,), "dynamo", RMS_OPSET, names=("ids",))
    counts = {}
    for level in ("ORT_ENABLE_ALL", "ORT_ENABLE_BASIC"):
        opts = ort.SessionOptions()
        opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        opts.optimized_model_filepath = str(tmp_path / f"{level}.onnx")
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        ops = collections.Counter(n.op_type for n in onnx.load(opts.optimized_model_filepath)
                                  .graph.node)
        counts[level] = (ops["SkipLayerNormalization"], ops["LayerNormalization"])
    assert counts == {"ORT_ENABLE_ALL": (4, 2), "ORT_ENABLE_BASIC": (0, 6)}


def test_only_onnx_export_takes_torch_standard_ops():
    """Protects the other ways out from the ONNX route: torch.export before and after an ONNX
    export, and torch.jit.trace, record the layernorm ops; the ONNX graph has none."""
    pytest.importorskip("onnxscript", reason="torch.onnx's dynamo exporter needs onnxscript")
    module = _Chain().eval()
    args = _inputs((2, 3, D))

    def exported_ops():
        graph = torch.export.export(module, args).graph
        return {str(n.target) for n in graph.nodes if n.op == "call_function"}

    before = exported_ops()
    model = _to_onnx(module, args, "dynamo", RMS_OPSET)
    assert not torch.onnx.is_in_onnx_export()
    assert exported_ops() == before
    assert "layernorm.fwd.default" in before and not any("aten.layer_norm" in t or "rms_norm" in t
                                                         for t in before)
    traced = torch.jit.trace(module, args, check_trace=False)
    assert "layernorm::fwd" in str(traced.graph)
    _standard_only(_ops(model))


def test_strict_capture_inside_an_onnx_export_takes_torch_standard_ops(monkeypatch):
    """Protects the dynamo exporter's strict capture (its fallback when the non-strict one
    fails): dynamo folds torch.onnx.is_in_onnx_export() to False there, so the exporter's own
    flag must tell the functions that an ONNX export runs; with it set, a strict capture
    records torch's layer_norm, not the layernorm op the exporter cannot translate."""
    flags = pytest.importorskip("torch.onnx._internal.exporter._flags")
    monkeypatch.setattr(flags, "_is_onnx_exporting", True)
    graph = torch.export.export(lt.LayerNorm(D).eval(), (torch.randn(2, D),), strict=True).graph
    ops = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert any("aten.layer_norm" in t for t in ops), ops
    assert not any("layernorm" in t for t in ops), ops


# --- torch.export -----------------------------------------------------------------------------

@pytest.mark.parametrize("strict,grad", [(False, True), (False, False), (True, True)],
                         ids=["non-strict", "non-strict-no_grad", "strict"])
def test_torch_export_keeps_the_layernorm_ops(strict, grad):
    """Protects torch.export of a block swapped by replace_norms and of the four functions:
    the graph calls layernorm.fwd (layernorm.norm under no_grad), with batch and sequence
    dynamic; the exported program, and the same after run_decompositions, give eager's
    results at another shape."""
    block = _Block()
    assert int(lt.replace_norms(block)) == 2
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}
    op = "layernorm.fwd.default" if grad else "layernorm.norm.default"
    for module, shapes in [(block, {"x": dims}), (_Chain(), {"x": dims, "r": dims})]:
        n = len(shapes)
        example, other = _inputs((2, 3, D))[:n], _inputs((5, 7, D), seed=2)[:n]
        with torch.set_grad_enabled(grad):
            program = torch.export.export(module, example, dynamic_shapes=shapes,
                                          strict=strict)
            want = module(*other)
        targets = [str(node.target) for node in program.graph.nodes
                   if node.op == "call_function"]
        assert targets.count(op) == (2 if module is block else 4), targets
        assert not any("layer_norm" in t or "rms_norm" in t for t in targets), targets
        for prog in (program, program.run_decompositions()):
            got = prog.module()(*other)
            for g, w in zip(got if n == 2 else [got], want if n == 2 else [want], strict=True):
                assert torch.equal(g, w)


# --- torch.jit.trace --------------------------------------------------------------------------

class _One(torch.nn.Module):
    """One of the four functions on (x, r) over the trailing ``shape`` (r unused by the plain
    norms); returns y, or (y, h)."""

    def __init__(self, name: str, shape: tuple[int, ...] | str) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.name, self.shape = name, shape
        shape = (D,) if shape == "x.shape[-1]" else shape
        self.w = torch.nn.Parameter(torch.randn(shape, generator=g))
        self.b = torch.nn.Parameter(torch.randn(shape, generator=g))

    def forward(self, x, r):
        fn = getattr(lt, self.name)
        centred = "layer" in self.name
        params = (self.w, self.b) if centred else (self.w,)
        shape = x.shape[-1] if self.shape == "x.shape[-1]" else self.shape
        return fn(*((x, r) if "add" in self.name else (x,)), shape, *params)


TRACED = [("layer_norm", (D,)), ("rms_norm", (D,)), ("add_layer_norm", (D,)),
          ("add_rms_norm", (D,)), ("layer_norm", (4, 4)), ("add_rms_norm", (4, 4)),
          ("rms_norm", "x.shape[-1]")]


@pytest.mark.parametrize("name,shape", TRACED,
                         ids=[f"{n}-{s if isinstance(s, str) else f'{len(s)}axes'}"
                              for n, s in TRACED])
def test_jit_trace_holds_for_other_ranks_and_grad_modes(name, shape):
    """Protects torch.jit.trace of the four functions (and of a normalized_shape of two axes,
    and of one read from x, which a trace hands out as a tensor): the trace check passes (one
    graph under grad and no_grad, and for an input of another rank), no TracerWarning, and the
    module traced on (3, *shape) gives eager's results and gradients on (5, 7, *shape) and
    (2, *shape), with grad and under no_grad."""
    eager = _One(name, shape)
    shape = (D,) if isinstance(shape, str) else shape
    traced_from = copy.deepcopy(eager)
    example = _inputs((3, *shape))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(traced_from, example,
                                 check_inputs=[_inputs((5, 7, *shape), seed=4), example])
    assert not [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)], \
        [str(w.message) for w in caught]
    params = {"eager": [eager.w, eager.b], "traced": [traced_from.w, traced_from.b]}
    for shape_in in [(5, 7, *shape), (2, *shape)]:
        x, r = _inputs(shape_in, seed=len(shape_in))
        with torch.no_grad():
            want, got = eager(x, r), traced(x, r)
        for g, w in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want)),
                        strict=True):
            _close(g, w, f"{name} {shape_in} no_grad")
        grads = {}
        for which, module in (("eager", eager), ("traced", traced)):
            xg, rg = x.clone().requires_grad_(), r.clone().requires_grad_()
            out = module(xg, rg)
            out = out if isinstance(out, tuple) else (out,)
            cot = [torch.ones_like(o) * (i + 1) for i, o in enumerate(out)]
            leaves = [xg, rg, *params[which]]
            grads[which] = torch.autograd.grad(out, leaves, cot, allow_unused=True)
            if which == "traced":
                for g, w in zip(out, want if isinstance(want, tuple) else (want,), strict=True):
                    _close(g, w, f"{name} {shape_in} grad")
        for leaf, g, w in zip(("x", "r", "w", "b"), grads["traced"], grads["eager"],
                              strict=True):
            assert (g is None) == (w is None), leaf
            if g is not None:
                _close(g, w, f"{name} {shape_in} d{leaf}",
                       "param" if leaf in ("w", "b") else "out")
