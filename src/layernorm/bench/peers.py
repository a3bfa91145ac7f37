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
    table, plot  the table (ours over the best peer, and each peer) and a plot
    answers      the report's first screen from a run: ours' speed per norm and mode, and what
                 to use (:func:`advice`: a choice only at a strict majority of the shapes
                 decided), each saying the grid it covers (:func:`scope`)

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
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .._table import render
from ..family import norm as family_norm
from . import providers, results
from .harness import batch
from .machine import run_meta

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["DEFAULT_DTYPES", "FULL_DTYPES", "GOAL", "IMPLS", "LLAMA", "MODES", "PEERS",
           "ONNX_ROUTE", "ROUNDS", "SHAPES", "Absent", "Case", "advice", "answers",
           "available_peers", "doc_section", "end_to_end_verdict", "figure", "format_end_to_end",
           "judged_against", "llama_end_to_end", "load", "measure", "onnx_model", "plot", "run",
           "scope", "summary", "table"]

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
            once = min(batch(fn, 1) for _ in range(3))
            reps[impl] = max(1, min(20_000, round(TARGET_S / max(once, 1e-7))))
        times: dict[str, list[float]] = {k: [] for k in calls}
        keys = list(calls)
        for r in range(rounds):
            for impl in keys[r % len(keys):] + keys[:r % len(keys)]:
                time.sleep(PAUSE_S)
                times[impl].append(batch(calls[impl], reps[impl]))
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


def _cell(p: dict) -> str:
    if "absent" in p:
        return f"absent ({p['absent']})"
    if "p50_ms" not in p:
        return "-"
    s = p.get("speedup")
    text = f"{_ms(p['p50_ms'])}"
    if s is not None:
        text += f" ({s[0]:.2f}x: {s[1]:.2f}-{s[2]:.2f})"
    return text


def _ms(ms: float) -> str:
    return f"{ms * 1e3:.1f} us" if ms < 1 else f"{ms:.2f} ms"


def table(rows: list[dict], markdown: bool = True) -> str:
    """One line per case: ours p50 (p20-p80), each peer's p50 with ours' speed over it
    (p50: p20-p80 of per-round ratios), the largest difference of any peer's output from ours,
    and the verdict against the goal."""
    head = ["norm", "shape", "dtype", "mode", "thr", "ours p50 (p20-p80)",
            *(f"{p} (ours' speed over it)" for p in PEERS), "max |diff|", "verdict"]
    body = []
    for r in rows:
        ours = r["providers"].get("layernorm", {})
        our_cell = (f"{_ms(ours['p50_ms'])} ({_ms(ours['p20_ms'])}-{_ms(ours['p80_ms'])})"
                    if "p50_ms" in ours else _cell(ours))
        diffs = [p["max_diff"] for k, p in r["providers"].items()
                 if k != "layernorm" and p.get("max_diff") is not None]
        body.append([r["norm"], f"{r['shape']} {'x'.join(map(str, r['dims']))}", r["dtype"],
                     r["mode"], str(r["threads"]), our_cell,
                     *(_cell(r["providers"].get(p, {})) for p in PEERS),
                     f"{max(diffs):.1e}" if diffs else "-", r["verdict"]])
    return render(head, body, markdown)


def summary(rows: list[dict]) -> list[str]:
    """Headlines: how many steady rows met the goal, and the weakest ratio over the best peer."""
    judged = [r for r in rows if r.get("best")]
    met = [r for r in judged if r["verdict"] == "met"]
    missed = [r for r in judged if r["verdict"] == "missed"]
    lines = [f"{len(met)} of {len(judged)} cases met their goal against the best peer, "
             f"{len(missed)} missed, {len(judged) - len(met) - len(missed)} undecided "
             f"(too noisy to tell, or within the guard band)"]
    if judged:
        worst = min(judged, key=lambda r: r["providers"][r["best"]]["speedup"][0])
        s = worst["providers"][worst["best"]]["speedup"]
        lines.append(f"weakest: {worst['norm']} {worst['shape']} {worst['dtype']} "
                     f"{worst['mode']} {worst['threads']} thread(s): {s[0]:.2f}x "
                     f"{worst['best']} ({s[1]:.2f}-{s[2]:.2f})")
    return lines


def _grid(rows: list[dict]) -> list[tuple[str, int]]:
    """The (dtype, threads) pairs of ``rows``, sorted."""
    return sorted({(r["dtype"], r["threads"]) for r in rows})


def _standing(rows: list[dict], names: tuple[str, ...] = PEERS) -> dict[tuple[str, str], dict]:
    """Per (norm, mode): each row's fastest at p50 of the peers ``names`` (every one timed,
    whatever the row is judged against) and ours' speed over it, sorted into faster (p20 of
    the per-round ratios above 1), slower (p80 below 1), level, and too noisy to tell (a
    time's p80/p20 at :data:`layernorm.bench.results.STEADY` or more). Each entry is (case,
    peer, ours' speed at p50 or None): the case is the row's shape, followed by its dtype and
    threads where ``rows`` hold several of those."""
    several = len(_grid(rows)) > 1
    out: dict[tuple[str, str], dict] = {}
    for r in rows:
        case = f"{r['shape']} ({r['dtype']}, {r['threads']}t)" if several else r["shape"]
        ours = r["providers"].get("layernorm", {})
        timed = {k: v for k, v in r["providers"].items()
                 if k in names and "p50_ms" in v and "speedup" in v}
        if "p50_ms" not in ours or not timed:
            continue
        peer = min(timed, key=lambda k: timed[k]["p50_ms"])
        s = out.setdefault((r["norm"], r["mode"]), {"faster": [], "slower": [], "level": [],
                                                     "noisy": []})
        if results.noisy(ours, timed[peer]):
            s["noisy"].append((case, peer, None))
            continue
        p50, lo, hi = timed[peer]["speedup"]
        s["faster" if lo > 1 else "slower" if hi < 1 else "level"].append((case, peer, p50))
    return out


def scope(rows: list[dict]) -> str:
    """The grid ``rows`` cover, in words: the command that times it, its dtypes and thread
    counts, and each shape with its extents, so that a figure quoted from it says where it
    holds."""
    grid = _grid(rows)
    dtypes = list(dict.fromkeys(d for d, _ in grid))
    threads = sorted({t for _, t in grid})
    if len(grid) == len(dtypes) * len(threads):  # every dtype at every thread count
        where = (f"{' and '.join(dtypes)}, {' and '.join(map(str, threads))} "
                 f"thread{'s' if threads != [1] else ''}")
    else:
        where = "; ".join(f"{d}, {t} thread{'s' if t > 1 else ''}" for d, t in grid)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    named = ", ".join(f"{s} {'x'.join(map(str, SHAPES[s]))}" if s in SHAPES else s
                      for s in shapes)
    return f"`layernorm bench --peers` ({where}; {len(shapes)} shapes: {named})"


# What onnxruntime's place in the advice means for a PyTorch user.
ONNX_ROUTE = ("`onnxruntime` means a model exported to ONNX and run in onnxruntime "
              "(`docs/export.md`), whose norms are its fused operators; it is not a per-op "
              "swap in a PyTorch model")


def advice(s: dict, unit: str = "shapes") -> str:
    """What to use for one norm and mode, from its standing (:func:`_standing`): a choice only
    where it was faster beyond the noise at a strict majority of the shapes decided (faster,
    slower or level; a shape too noisy to tell is not decided); "any" where no shape was
    decided either way, or where the level shapes are that majority; otherwise "depends on
    the shape", naming the shapes where each was faster. The too-noisy shapes follow, named.
    ``unit`` names what the entries are: "shapes", or "cases" where they span several dtypes
    or thread counts."""
    wins: dict[str, list[str]] = {}
    for shape, _, _ in s["faster"]:
        wins.setdefault("layernorm.torch", []).append(shape)
    for shape, peer, _ in s["slower"]:
        wins.setdefault(peer, []).append(shape)
    level = [shape for shape, _, _ in s["level"]]
    decided = len(level) + sum(len(v) for v in wins.values())
    total = decided + len(s["noisy"])
    noisy = ", ".join(shape for shape, _, _ in s["noisy"])
    tail = f"; too noisy to tell at {noisy}" if noisy else ""
    if not decided:
        return f"none named (too noisy to tell at all {total} {unit}: {noisy})"
    ranked = sorted(wins, key=lambda k: -len(wins[k]))  # ties keep ours first
    at = [f"`{k}` at {', '.join(wins[k])}" for k in ranked]
    if not wins:
        return (f"any (no {unit[:-1]} faster or slower beyond the noise; level at "
                f"{', '.join(level)}){tail}")
    top = ranked[0]
    if 2 * len(wins[top]) > decided:
        return (f"`{top}` (faster at {len(wins[top])} of {total} {unit}"
                + "".join(f"; {a}" for a in at[1:])
                + (f"; level at {', '.join(level)}" if level else "") + f"){tail}")
    if 2 * len(level) > decided:
        return (f"any (level at {len(level)} of {total} {unit}: {', '.join(level)}; "
                + "; ".join(at) + f"){tail}")
    return (f"depends on the shape (none was faster at most of the {decided} {unit} "
            "decided): "
            + "; ".join(at) + (f"; level at {', '.join(level)}" if level else "") + tail)


def answers(rows: list[dict], e2e: dict | None = None) -> dict[str, str]:
    """The report's first screen from one run: "faster" (per norm and mode, ours' speed over
    the fastest peer of each shape, median and counts, noisy shapes named as such; the
    end-to-end model) and "use" (per norm and mode, :func:`advice`; where onnxruntime is
    named, what it applies to and the advice among the PyTorch providers alone)."""
    standing = _standing(rows)
    if not standing:
        return {}
    in_torch = _standing(rows, ("torch", "torch.compile"))
    unit = "cases" if len(_grid(rows)) > 1 else "shapes"
    lines, use = [], []
    for norm in dict.fromkeys(r["norm"] for r in rows):
        cells = []
        for mode in MODES:
            s = standing.get((norm, mode))
            if s is None:
                cells.append("not timed")
                continue
            steady = s["faster"] + s["slower"] + s["level"]
            n = len(steady) + len(s["noisy"])
            title = f"{family_norm(norm).title}, {mode}"
            use.append(f"- {title}: {advice(s, unit)}")
            if any(peer == "onnxruntime" for _, peer, _ in s["slower"]):
                within = in_torch.get((norm, mode))
                use.append(f"  - {ONNX_ROUTE}"
                           + (f"; within PyTorch: {advice(within, unit)}" if within else ""))
            if not steady:
                cells.append(f"too noisy to tell at all {n} {unit}")
                continue
            med = float(np.median([q for _, _, q in steady]))
            weakest = min(steady, key=lambda t: t[2])
            text = (f"**{med:.2f}x** (faster at {len(s['faster'])}, level at "
                    f"{len(s['level'])}, slower at {len(s['slower'])} of {n} {unit}")
            if s["noisy"]:
                text += f"; too noisy to tell at {len(s['noisy'])}"
            if weakest[2] < 1:
                text += f"; slowest {weakest[2]:.2f}x {weakest[1]} at {weakest[0]}"
            cells.append(text + ")")
        lines.append(f"| {family_norm(norm).title} | " + " | ".join(cells) + " |")
    where = scope(rows)
    faster = (
        f"Ours (`layernorm.torch`) against the fastest of torch eager, torch.compile and "
        f"onnxruntime at each shape, all timed in the same run of {where}: the median, over "
        "the shapes timed steadily, of the fastest peer's time over ours, above 1 meaning ours "
        "is faster. A shape counts as faster or slower only where the per-round ratios' "
        "p20-p80 lies wholly on that side of 1, and not at all where a time was too noisy to "
        "tell. onnxruntime's times are its fused operator alone, as a model exported to ONNX "
        "runs it.\n\n"
        "| norm | inference | training |\n|---|---|---|\n" + "\n".join(lines))
    if e2e is not None:
        faster += "\n\nIn a Llama-shaped model (" + "; ".join(
            f"{task}: {e2e[task]['speedup'][0]:.2f}x, {end_to_end_verdict(task, e2e[task])}"
            for task in ("train step", "generate")) + ")."
    use_text = (f"From {where}, per norm and mode: ours against the fastest peer at each "
                "shape. A choice is named only where it was faster beyond the noise at more "
                "than half of the shapes decided (faster, slower or level; a shape too noisy "
                "to tell is not decided); where level shapes are that majority, any will do; "
                "otherwise it depends on the shape, and the line names the shapes where each "
                "was faster."
                + ("" if unit == "cases" else " Other dtypes and thread counts: "
                   "`layernorm bench --peers --full`.")
                + "\n\n" + "\n".join(use))
    return {"faster": faster, "use": use_text}


def figure(rows: list[dict]) -> Figure:
    """Ours' speed over the fastest peer judged per case (p20-p80 bars), one panel per mode,
    dtype and thread count, each case's goal marked. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    short = {"layer_norm": "LN", "rms_norm": "RMS", "add_layer_norm": "add+LN",
             "add_rms_norm": "add+RMS"}
    panels = sorted({(r["mode"], r["dtype"], r["threads"]) for r in rows})
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 4.2 * len(panels)), squeeze=False,
                             layout="constrained")
    for ax, (mode, dtype, thr) in zip(axes[:, 0], panels, strict=True):
        mine = [r for r in rows if (r["mode"], r["dtype"], r["threads"]) == (mode, dtype, thr)
                and r.get("best")]
        labels = [f"{short[r['norm']]} {r['shape']}" for r in mine]
        s = np.array([r["providers"][r["best"]]["speedup"] for r in mine]).reshape(-1, 3)
        xs = np.arange(len(mine))
        ax.bar(xs, s[:, 0], color="tab:blue", alpha=0.7)
        ax.errorbar(xs, s[:, 0], yerr=[s[:, 0] - s[:, 1], s[:, 2] - s[:, 0]], fmt="none",
                    ecolor="black", capsize=2)
        ax.scatter(xs, [r["goal"] for r in mine], marker="_", s=120, color="tab:red",
                   zorder=3, label="goal (decode: against torch eager)")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(xs, labels, fontsize=7, rotation=50, ha="right", rotation_mode="anchor")
        ax.set_ylabel("peer's time / ours")
        ax.set_title(f"{mode}, {dtype}, {thr} thread{'s' if thr > 1 else ''}: ours against "
                     f"the fastest peer judged", fontsize=10)
        ax.legend(fontsize=8)
    return fig


def plot(rows: list[dict], path: Path) -> Path:
    """:func:`figure` saved as a PNG at ``path``; returns ``path``. Raises ImportError without
    matplotlib."""
    fig = figure(rows)
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --- end to end ---------------------------------------------------------------------------

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


def load(path: Path) -> dict:
    """A run saved by ``layernorm bench --peers``: ``{"meta", "rows"}`` and, where the
    end-to-end model ran, ``"end_to_end"``."""
    result = json.loads(Path(path).read_text())
    if not isinstance(result, dict) or not {"meta", "rows"} <= set(result) <= {
            "meta", "rows", "end_to_end"}:
        raise ValueError(f"{path}: not a result of layernorm bench --peers")
    return result


def doc_section(result: dict) -> str:
    """What docs/torch.md shows of a saved run: per dtype and thread count the headlines, then
    the table of every case, one per dtype and thread count (tests/test_docs.py checks the
    document against the file with this function)."""
    rows = result["rows"]
    for r in rows:  # the verdicts by this version's rules, not the file's
        _judge(r)
    groups = sorted({(r["dtype"], r["threads"]) for r in rows}, key=lambda k: (k[0], -k[1]))
    parts = []
    for dtype, thr in groups:
        mine = [r for r in rows if r["dtype"] == dtype and r["threads"] == thr]
        parts.append(f"**{dtype}, {thr} thread{'s' if thr > 1 else ''}**\n\n"
                     + "\n".join(f"- {line}" for line in summary(mine)) + "\n\n"
                     + table(mine))
    if "end_to_end" in result:
        parts.append(format_end_to_end(result["end_to_end"]))
    return "\n\n".join(parts)
