"""CPU versus peers: ``layernorm.torch`` against what a PyTorch user already has, in one run.

    providers    ours (``layernorm.torch``, through its public functions and their checks),
                 ``torch`` (eager: ``F.layer_norm``/``F.rms_norm``, after ``x + residual``
                 for an add-norm), ``torch.compile`` (Inductor, static shapes, of the same
                 eager function; compiled once per case, the compile time recorded apart)
                 and ``onnxruntime`` (its fused CPU operators LayerNormalization,
                 SimplifiedLayerNormalization, SkipLayerNormalization and
                 SkipSimplifiedLayerNormalization, outputs preallocated through IOBinding)
    modes        ``inference``: the forward under ``torch.inference_mode`` (every provider);
                 ``training``: forward and backward with every gradient (x, residual, weight,
                 bias) through autograd (the torch providers; onnxruntime has no backward)
    measure      one case (norm, shape, dtype, mode, threads): each provider's outputs
                 compared with ours (largest absolute difference), then interleaved rounds
    run          the grid, saved as one JSON file per kind of run (``cpu-peers.json``)
    judging      each row's verdict against the goal (:func:`judged_against`)

Every provider runs in the same grad mode on the same inputs. A peer without a kernel for a
dtype here (onnxruntime's CPU operators take no bfloat16) is shown absent with the reason, not
converted. Threads: ``torch.set_num_threads`` for the torch providers (ours follows it) and
onnxruntime's ``intra_op_num_threads``.

Timing: in each round every provider runs one batch of calls (about 20 ms, the count set from
the fastest of three calls), in an order rotated from round to round, with a pause of
:data:`PAUSE_S` between batches so that one library's spinning threads go to sleep before the
next runs. Per provider
p50 (p20-p80) per call; the speed of ours against a peer is the peer's time over ours per
round, p50 (p20-p80). A row is steady when ours and the best peer each have p80/p20 below
:data:`layernorm.bench.results.STEADY`; only steady rows get a verdict against the goal
(:data:`GOAL` times the best peer, judged with :func:`layernorm.bench.results.verdict`), the
others "too noisy to tell".

The run in words and a figure (the table, headlines, advice, the report's answers and
docs/torch.md's section): :mod:`layernorm.bench.peer_report`; a Llama-shaped model end to
end: :mod:`layernorm.bench.end_to_end`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..family import norm as family_norm
from . import providers, results
from .harness import interleaved, reps_for
from .machine import run_meta

__all__ = ["DEFAULT_DTYPES", "FULL_DTYPES", "GOAL", "IMPLS", "MODES", "PEERS", "ROUNDS", "SHAPES",
           "Absent", "Case", "available_peers", "judged_against", "load", "measure",
           "onnx_model", "run"]

SHAPES: dict[str, tuple[int, ...]] = {
    "decode": (1, 1, 4096),
    "decode x8": (8, 1, 4096),
    "short": (1, 32, 4096),
    "BERT": (8, 128, 768),
    "prefill": (1, 1024, 4096),
    "training": (8, 512, 768),
    "training large": (4, 1024, 4096),
    "long rows": (1, 64, 65536),
}
MODES = ("inference", "training")
PEERS = ("torch", "torch.compile", "onnxruntime")
IMPLS = ("layernorm", *PEERS)
DEFAULT_DTYPES = ("float32",)
FULL_DTYPES = ("float32", "bfloat16")
GOAL = 1.2  # ours at least this many times as fast as the best peer
# goals near one call's fixed cost: the decode shapes, inference, against torch eager
DECODE_GOALS = {"decode": 1 / 2.0, "decode x8": 1 / 1.5}
# Between batches: onnxruntime's threads spin for new work after a run, and OpenMP's after a
# parallel region; a batch started while they spin shares its cores with them (ours measured
# 1.7 ms instead of 0.76 ms right after onnxruntime with a 5 ms pause, 0.86 ms with 50 ms).
PAUSE_S = 0.05
ROUNDS = 5
TARGET_S = 0.02  # a batch's length


class Absent(Exception):
    """A provider that cannot run a case here; the message says why, in a few words."""


@dataclass(frozen=True)
class Case:
    norm: str
    shape: str  # a key of SHAPES
    dtype: str
    mode: str
    threads: int

    @property
    def dims(self) -> tuple[int, ...]:
        return SHAPES[self.shape]


def _inputs(case: Case):
    """The case's tensors, float32 drawn then rounded to the dtype: x, residual, gamma, beta
    (those the norm takes, named as in :mod:`layernorm.family`), dy and dh (the cotangents of
    training)."""
    import torch

    n = family_norm(case.norm)
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, case.dtype)
    d = case.dims[-1]

    def draw(*shape):
        return torch.randn(*shape, generator=g).to(dt)

    t = {"x": draw(*case.dims), "gamma": 1 + 0.1 * draw(d)}
    if n.residual:
        t["residual"] = draw(*case.dims)
    if n.centred:
        t["beta"] = 0.1 * draw(d)
    t["dy"] = draw(*case.dims)
    if n.residual:
        t["dh"] = draw(*case.dims)
    return t


def _torch_call(forward: Callable, case: Case, t: dict) -> tuple[Callable, Callable]:
    """(call, results) of a torch-side ``forward`` (as :func:`layernorm.bench.providers.eager`:
    the norm's inputs, then its parameters) in the case's mode: results are the outputs (y, h)
    and in training the gradients of the inputs and parameters."""
    import torch

    n = family_norm(case.norm)
    names = (*n.forward_inputs, *n.params)
    if case.mode == "inference":
        args = [t[k] for k in names]

        def call():
            return forward(*args)

        return call, call
    leaves = [t[k].detach().clone().requires_grad_(True) for k in names]
    cot = [t["dy"], t["dh"]] if n.residual else [t["dy"]]

    def call():
        outs = forward(*leaves)
        return (*outs, *torch.autograd.grad(outs, leaves, cot))

    return call, call


def onnx_model(norm: str, dims: tuple[int, ...], dtype: str, eps: float) -> bytes:
    """A serialized ONNX graph of one node, onnxruntime's fused CPU operator for ``norm`` (a
    family name) on inputs of shape ``dims`` and ``dtype`` (float16, bfloat16, float32,
    float64): LayerNormalization and SimplifiedLayerNormalization (opset 17), or, for the
    add-norms, com.microsoft's SkipLayerNormalization and SkipSimplifiedLayerNormalization.
    Inputs x, [residual,] gamma[, beta]; outputs y[, h]."""
    import onnx
    from onnx import TensorProto, helper

    n = family_norm(norm)
    dims = list(dims)
    d = dims[-1]
    elem = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
            "float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE}[dtype]
    ins = [helper.make_tensor_value_info("x", elem, dims)]
    if n.residual:
        ins.append(helper.make_tensor_value_info("residual", elem, dims))
    ins.append(helper.make_tensor_value_info("gamma", elem, [d]))
    if n.centred:
        ins.append(helper.make_tensor_value_info("beta", elem, [d]))
    outs = [helper.make_tensor_value_info("y", elem, dims)]
    if n.residual:
        outs.append(helper.make_tensor_value_info("h", elem, dims))
        op = "SkipLayerNormalization" if n.centred else "SkipSimplifiedLayerNormalization"
        node = helper.make_node(op, [i.name for i in ins], ["y", "", "", "h"],
                                domain="com.microsoft", epsilon=eps)
    else:
        op = "LayerNormalization" if n.centred else "SimplifiedLayerNormalization"
        node = helper.make_node(op, [i.name for i in ins], ["y"], axis=-1, epsilon=eps)
    graph = helper.make_graph([node], norm, ins, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return onnx._serialize(model) if hasattr(onnx, "_serialize") else model.SerializeToString()


def _onnxruntime(case: Case, t: dict, eps: float) -> tuple[Callable, Callable]:
    if case.mode == "training":
        raise Absent("no backward")
    if case.dtype != "float32":
        raise Absent(f"no {case.dtype} CPU kernel")
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise Absent("not installed (extra 'peers')") from exc
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = case.threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(onnx_model(case.norm, case.dims, case.dtype, eps), opts,
                                providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    for i in sess.get_inputs():
        binding.bind_cpu_input(i.name, t[i.name].numpy())
    outs = {o.name: np.empty(case.dims, np.float32) for o in sess.get_outputs()}
    for name, a in outs.items():
        binding.bind_output(name, "cpu", 0, np.float32, list(a.shape), a.ctypes.data)

    def call():
        sess.run_with_iobinding(binding)
        return outs

    def results():
        call()
        return tuple(outs[k] for k in ("y", "h") if k in outs)

    return call, results


def available_peers() -> dict[str, str | None]:
    """Each peer, and why it cannot run here (None where it can)."""
    found: dict[str, str | None] = {"torch": None, "torch.compile": None}
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        found["onnxruntime"] = f"{exc.name} is not installed (extra 'peers')"
    else:
        found["onnxruntime"] = None
    return found


def _setup(impl: str, case: Case, t: dict) -> tuple[Callable, Callable, float | None]:
    """(call, results, compile seconds or None) of ``impl`` on the case, or raises Absent."""
    eps = family_norm(case.norm).eps
    d = case.dims[-1]
    if impl == "layernorm":
        return (*_torch_call(providers.ours(case.norm, d, eps), case, t), None)
    if impl == "torch":
        return (*_torch_call(providers.eager(case.norm, d, eps), case, t), None)
    if impl == "torch.compile":
        import torch

        torch._dynamo.reset()  # each case compiles afresh: no recompile limit across cases
        compiled = torch.compile(providers.eager(case.norm, d, eps), dynamic=False,
                                 fullgraph=True)
        call, res = _torch_call(compiled, case, t)
        t0 = time.perf_counter()
        try:
            with _grad_mode(case):
                call()
        except Exception as exc:  # noqa: BLE001 - a compiler failure is a fact of this machine
            raise Absent(f"compile failed: {type(exc).__name__}") from exc
        return call, res, time.perf_counter() - t0
    return (*_onnxruntime(case, t, eps), None)


def _grad_mode(case: Case):
    import contextlib

    import torch

    return torch.inference_mode() if case.mode == "inference" else contextlib.nullcontext()


def _numpy(o) -> np.ndarray:
    import torch

    if isinstance(o, torch.Tensor):
        return o.detach().double().numpy()
    return np.asarray(o, np.float64)


def _max_diff(ours: tuple, theirs: tuple) -> float:
    """The largest absolute difference over the outputs both return, in float64."""
    worst = 0.0
    for a, b in zip(ours, theirs, strict=False):
        diff = np.abs(_numpy(a) - _numpy(b))
        worst = max(worst, float(diff.max()) if diff.size else 0.0)
    return worst


def measure(case: Case, rounds: int, impls: tuple[str, ...] = IMPLS) -> dict:
    """One case: its row (see the module doc) with per provider p50/p20/p80 ms, the compile
    time, the largest difference from ours, or why it is absent; and ours over each peer."""
    import torch

    torch.set_num_threads(case.threads)
    t = _inputs(case)
    calls: dict[str, Callable] = {}
    row: dict = {"norm": case.norm, "shape": case.shape, "dims": list(case.dims),
                 "dtype": case.dtype, "mode": case.mode, "threads": case.threads,
                 "providers": {}}
    with _grad_mode(case):
        ours_out = None
        for impl in impls:
            entry: dict = {}
            try:
                call, res, compile_s = _setup(impl, case, t)
                out = res()
                if impl == "layernorm":
                    ours_out = out
                entry["max_diff"] = None if ours_out is None else _max_diff(ours_out, out)
                entry["compile_s"] = compile_s
                calls[impl] = call
            except Absent as exc:
                entry["absent"] = str(exc)
            row["providers"][impl] = entry
        reps = {}
        for impl, fn in calls.items():
            fn()
            reps[impl] = reps_for(fn, TARGET_S, cap=20_000)
        times = interleaved(calls, reps, rounds, pause=PAUSE_S)
    for impl, ts in times.items():
        p20, p50, p80 = np.percentile(ts, [20, 50, 80])
        row["providers"][impl].update(p20_ms=p20 * 1e3, p50_ms=p50 * 1e3, p80_ms=p80 * 1e3,
                                      reps=reps[impl])
        if impl != "layernorm" and "layernorm" in times:
            ratio = np.array(ts) / np.array(times["layernorm"])  # (rounds,)
            row["providers"][impl]["speedup"] = [float(q) for q in
                                                 np.percentile(ratio, [50, 20, 80])]
    _judge(row)
    return row


def judged_against(row: dict) -> tuple[tuple[str, ...], float]:
    """The peers a row is judged against and the speed over them it must reach: at the decode
    shapes in inference, where one call's fixed cost is the time, torch eager alone, at 1/2
    (one row) and 1/1.5 (eight rows) of its speed; elsewhere every peer, at GOAL."""
    if row["mode"] == "inference" and row["shape"] in DECODE_GOALS:
        return ("torch",), DECODE_GOALS[row["shape"]]
    return PEERS, GOAL


def _judge(row: dict) -> None:
    """Set ``best`` (the fastest of the peers the row is judged against), ``goal`` and
    ``verdict``: against the goal where ours and that peer were steady, else why not."""
    ours = row["providers"].get("layernorm", {})
    names, goal = judged_against(row)
    peers = {k: v for k, v in row["providers"].items() if k in names and "p50_ms" in v}
    row["goal"] = goal
    if "p50_ms" not in ours or not peers:
        row["best"] = None
        row["verdict"] = "no peer timed" if "p50_ms" in ours else "ours not timed"
        return
    best = min(peers, key=lambda k: peers[k]["p50_ms"])
    row["best"] = best
    _p50, lo, hi = peers[best]["speedup"]
    row["verdict"] = results.noisy(ours, peers[best]) or results.verdict(lo, hi, goal)


def run(cases: list[Case], rounds: int, progress: Callable[[str], None] | None = None,
        impls: tuple[str, ...] = IMPLS) -> dict:
    """Every case, in order; ``{"meta": ..., "rows": [...]}``."""
    progress = progress or (lambda msg: None)
    meta = {**run_meta(), "rounds": rounds, "peers": available_peers()}
    try:
        import onnxruntime

        meta["machine"]["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    rows = []
    for c in cases:
        progress(f"{c.norm} {c.shape} {c.dtype} {c.mode} {c.threads}t")
        rows.append(measure(c, rounds, impls))
    meta["loadavg"].append(os.getloadavg()[0])
    return {"meta": meta, "rows": rows}


def load(path: Path) -> dict:
    """A run saved by ``layernorm bench --peers``: ``{"meta", "rows"}`` and, where the
    end-to-end model ran, ``"end_to_end"``."""
    result = json.loads(Path(path).read_text())
    if not isinstance(result, dict) or not {"meta", "rows"} <= set(result) <= {
            "meta", "rows", "end_to_end"}:
        raise ValueError(f"{path}: not a result of layernorm bench --peers")
    return result
