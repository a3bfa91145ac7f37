"""Table 5: ours (the fused CPU kernels) and the peers (torch eager, torch.compile,
onnxruntime) on the same adversarial inputs, y and dx against the exact oracle, held to the
targets of ours; a peer that does not import here is shown absent, with the reason."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..dtypes import available, resolve
from ..family import NORMS, Norm
from ..numerics import exact_norm, relative_error
from .common import _TARGETS, FUSED, Table, _family_modules, _fmt, _run_norm, _ulps

PEERS = ("torch", "torch.compile", "onnxruntime")
OURS = "ours"
PEER_TITLE = "The peers on the same inputs: error of y and dx against the exact oracle"
_PEER_BACKWARD = ("torch", "torch.compile")  # onnxruntime has no backward
_PEER_COLS = (*(f"{w} y" for w in (OURS, *PEERS)), *(f"{w} dx" for w in (OURS, *_PEER_BACKWARD)))
# The peers' cases have sizes of their own, the same under --quick, so that torch.compile
# compiles the same graphs for the report and the command (Inductor caches them on disk).
PEER_ROWS, PEER_D, PEER_LONG_D = 4, 1024, 100_000


@dataclass(frozen=True)
class PeerCase:
    """Rows x (M, D) of one norm (LayerNorm or RMSNorm) in one dtype, for ours and the peers."""

    norm: str  # a key of NORMS without a residual
    name: str
    dtype: str
    x: np.ndarray  # (M, D) float64, rounded to the dtype by the runner


def _peer_cases(rng: np.random.Generator) -> list[PeerCase]:
    """Large mean with small variance, the rows of onnxruntime's tracker, constant rows, values
    near the top of float32's and float64's range, half-precision extremes and long rows."""
    m, d = PEER_ROWS, PEER_D

    def huge(lo: float, hi: float) -> np.ndarray:  # (m, d) ±10^U(lo, hi)
        return rng.choice([-1.0, 1.0], (m, d)) * 10.0 ** rng.uniform(lo, hi, (m, d))

    def long_rows() -> np.ndarray:  # (2, PEER_LONG_D)
        return 1e4 + rng.standard_normal((2, PEER_LONG_D))

    ln, rms = "layer_norm", "rms_norm"
    long_name = f"long rows: 1e4 + N(0, 1), D = {PEER_LONG_D:.0e}"
    cases = [
        PeerCase(ln, "N(0, 1)", "float32", rng.standard_normal((m, d))),
        PeerCase(ln, "1e4 + N(0, 1)", "float32", 1e4 + rng.standard_normal((m, d))),
        PeerCase(ln, "[4e4, 4e4 + 1, 4e4 + 2, 4e4 + 3] (onnxruntime #28463)", "float32",
                 4e4 + np.arange(4.0)[None, :]),
        PeerCase(ln, "[1e7, 1e7 + 1, 1e7 + 2, 1e7 + 3]", "float32", 1e7 + np.arange(4.0)[None, :]),
        PeerCase(ln, "constant rows, U(1e5, 1e6)", "float32",
                 np.repeat(rng.uniform(1e5, 1e6, (m, 1)), d, axis=1)),
        PeerCase(ln, "±10^U(20, 30)", "float32", huge(20, 30)),
        PeerCase(ln, "1e8 + N(0, 1)", "float64", 1e8 + rng.standard_normal((m, d))),
        PeerCase(ln, "±10^U(160, 300)", "float64", huge(160, 300)),
        PeerCase(ln, "float16 extremes: U(-6e4, 6e4)", "float16", rng.uniform(-6e4, 6e4, (m, d))),
        PeerCase(ln, "±10^U(20, 30)", "bfloat16", huge(20, 30)),
        PeerCase(ln, long_name, "float32", long_rows()),
        PeerCase(rms, "N(0, 1)", "float32", rng.standard_normal((m, d))),
        PeerCase(rms, "4e4 + N(0, 1e-3)", "float32", 4e4 + 1e-3 * rng.standard_normal((m, d))),
        PeerCase(rms, "constant rows, ±U(1, 1e4)", "float32",
                 np.repeat(rng.choice([-1.0, 1.0], (m, 1)) * rng.uniform(1, 1e4, (m, 1)), d, 1)),
        PeerCase(rms, "±10^U(20, 30)", "float32", huge(20, 30)),
        PeerCase(rms, "±10^U(160, 300)", "float64", huge(160, 300)),
        PeerCase(rms, "float16 extremes: U(-6e4, 6e4)", "float16", rng.uniform(-6e4, 6e4, (m, d))),
        PeerCase(rms, "±10^U(20, 30)", "bfloat16", huge(20, 30)),
        PeerCase(rms, long_name, "float32", long_rows()),
    ]
    return [c for c in cases if c.dtype in available()]


def _torch_peer(backend: str) -> Callable[[Norm, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """y and dx of ``backend`` ("torch" or "torch.compile") through its provider of
    :mod:`layernorm.bench.providers` (autograd; torch.compile compiles for each case)."""
    def run(norm: Norm, a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ..bench import providers

        y, dx, *_ = providers.PROVIDERS[(norm.name, backend)].setup(a)[1]()
        return {"y": y, "dx": dx}
    return run


def _onnxruntime(norm: Norm, a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """y of onnxruntime's fused CPU operator for ``norm``, a graph of one node:
    LayerNormalization (opset 17) or SimplifiedLayerNormalization (its RMSNorm), on float16,
    float32 or float64 inputs (its epsilon attribute is a float32)."""
    import onnxruntime as ort

    from ..bench.peers import onnx_model

    names = ["x", "gamma", "beta"] if norm.centred else ["x", "gamma"]
    model = onnx_model(norm.name, a["x"].shape, a["x"].dtype.name, norm.eps)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    return {"y": sess.run(None, {k: a[k] for k in names})[0]}


_PEER_RUN = {"torch": _torch_peer("torch"), "torch.compile": _torch_peer("torch.compile"),
             "onnxruntime": _onnxruntime}


def absent_peers() -> dict[str, str]:
    """Each peer that cannot run here, and why (the providers' and the peers benchmark's own
    checks: the library does not import, or torch.compile fails on a small norm)."""
    from ..bench import peers, providers

    why = {p: providers.why_not("layer_norm", p) for p in ("torch", "torch.compile")}
    why["onnxruntime"] = peers.available_peers()["onnxruntime"]
    return {p: reason for p, reason in why.items() if reason is not None}


def _no_kernel(peer: str, dtype: str) -> bool:
    """The peer has no CPU kernel for the dtype (onnxruntime: none for bfloat16)."""
    return peer == "onnxruntime" and dtype == "bfloat16"


def _peer_cell(got: np.ndarray, exact: np.ndarray, dt: np.dtype) -> tuple[str, dict[str, float]]:
    """(cell, errors) of one result: the cell is the normwise relative error, or "NaN", "inf"
    or "all 0" for a result with a NaN, an infinity, or only zeros where the exact one is
    not; the errors (relative and in ulps) are what the targets are checked on."""
    g = np.asarray(got, dtype=np.float64)
    if np.isnan(g).any() or np.isinf(g).any():
        text = "NaN" if np.isnan(g).any() else "inf"
        return text, {"": math.inf, " ulps": math.inf}
    errs = {"": relative_error(g, exact), " ulps": _ulps(g, exact, dt)}
    return ("all 0" if np.any(exact) and not np.any(g) else _fmt(errs[""])), errs


def _misses(errs: dict[str, float], dtype: str) -> list[tuple[str, float, float]]:
    """(target, error, bound) for each of table 4's targets of the dtype that ``errs`` (keys
    "y", "y ulps", "dx", "dx ulps", those measured) misses."""
    return [(k, errs[k], bound) for k, bound in _TARGETS[dtype].items()
            if k in errs and not errs[k] <= bound]


def _peer_row(case: PeerCase, rng: np.random.Generator, ours: tuple[str, object],
              absent: dict[str, str]
              ) -> tuple[list[str], dict[str, list[tuple[str, float, float]]], list[str]]:
    """(cells, the targets ours and each peer miss, peers that raised) of one case, every
    implementation on the same drawn inputs."""
    norm = NORMS[case.norm]
    dt = resolve(case.dtype)
    m, d = case.x.shape
    a = {"x": case.x.astype(dt), "gamma": (1 + 0.5 * rng.standard_normal(d)).astype(dt)}
    if norm.centred:
        a["beta"] = rng.standard_normal(d).astype(dt)
    a["dy"] = rng.standard_normal((m, d)).astype(dt)
    ex = exact_norm(a["x"], a["gamma"], a.get("beta"), norm.eps, a["dy"], centred=norm.centred)
    out = _run_norm(ours[1], norm, a["x"], None, a["gamma"], a.get("beta"), False, a["dy"],
                    None)
    results: dict[str, dict[str, np.ndarray] | str] = {OURS: {"y": out["y"], "dx": out["dx"]}}
    raised = []
    for peer in PEERS:
        if peer in absent:
            results[peer] = "absent"
        elif _no_kernel(peer, case.dtype):
            results[peer] = "—"
        else:
            try:
                results[peer] = _PEER_RUN[peer](norm, a)
            except Exception as exc:  # noqa: BLE001 - a peer's failure is a finding, not ours
                results[peer] = "—"
                raised.append(f"{peer} raised {type(exc).__name__} on {norm.title} "
                              f"{case.name} [{case.dtype}]")
    cells: dict[str, str] = {}
    misses: dict[str, list[tuple[str, float, float]]] = {}
    for who, res in results.items():
        errs: dict[str, float] = {}
        for key in ("y", "dx"):
            if isinstance(res, str) or key not in res:
                cells[f"{who} {key}"] = res if isinstance(res, str) else "—"
                continue
            cells[f"{who} {key}"], e = _peer_cell(res[key], getattr(ex, key), dt)
            errs.update({key + unit: v for unit, v in e.items()})
        if found := _misses(errs, case.dtype):
            misses[who] = found
    fails = "; ".join(f"{who} {', '.join(k.split()[0] for k, _, _ in found)}"
                      for who, found in misses.items())
    row = [norm.title, case.name, case.dtype, *(cells[c] for c in _PEER_COLS), fails or "—"]
    return row, misses, raised


def _versions() -> str:
    """The peers' library versions, as the table's note gives them, with the vector instruction
    set torch's CPU kernels and Inductor's code use here (their sums' order, and so their
    figures, follow it)."""
    import importlib

    found = []
    for lib in ("torch", "onnxruntime", "onnx"):
        try:
            module = importlib.import_module(lib)
        except ImportError:
            found.append(f"{lib} not installed")
            continue
        found.append(f"{lib} {module.__version__}")
        if lib == "torch":
            found[-1] += f" ({module.backends.cpu.get_cpu_capability()})"
    return ", ".join(found)


def _where(cases: list[tuple[str, str, str]]) -> str:
    """": LayerNorm float32 `a`, `b`; RMSNorm float64 `c`" for (norm, case, dtype) triples,
    grouped by norm and dtype in their order of appearance; "" for none."""
    groups: dict[tuple[str, str], list[str]] = {}
    for norm, case, dtype in cases:
        groups.setdefault((norm, dtype), []).append(f"`{case}`")
    if not groups:
        return ""
    return ": " + "; ".join(f"{norm} {dtype} {', '.join(names)}"
                            for (norm, dtype), names in groups.items())


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch, and the code Inductor compiles, on one thread while the peers run (where torch is
    installed), restored after: torch's and Inductor's reductions split a row by the thread
    count, which moves the last digits of their errors."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    # Inductor reads the thread count when it compiles, and its cache of compiled graphs keys
    # on its config, not on the count: so the count goes into the config as well
    try:
        from torch._inductor import config
        compiled = config.patch({"cpp.threads": 1})
    except (ImportError, AttributeError, RuntimeError):
        compiled = contextlib.nullcontext()
    try:
        with compiled:
            yield
    finally:
        torch.set_num_threads(before)


def peer_table(rng: np.random.Generator, cases: list[PeerCase] | None = None
               ) -> tuple[Table, list[str], dict[str, list[tuple[str, str, str]]]]:
    """Table 5: ours and each peer against the exact oracle on the same inputs.

    Returns the table, the targets ours missed (as table 4 words them) and, per peer, the
    cases (norm title, case, dtype) where it misses a target. ``cases`` defaults to
    :func:`_peer_cases` drawn from ``rng``.
    """
    ours = _family_modules()[-1]
    absent = absent_peers()
    table = Table(PEER_TITLE, ["norm", "case", "dtype", *_PEER_COLS, "fails"])
    failed: list[str] = []
    missed: dict[str, list[tuple[str, str, str]]] = {p: [] for p in PEERS}
    problems: list[str] = []
    with _one_torch_thread():
        rows = [(case, *_peer_row(case, rng, ours, absent))
                for case in (_peer_cases(rng) if cases is None else cases)]
    for case, row, misses, raised in rows:
        table.rows.append(row)
        problems += raised
        for who, found in misses.items():
            if who == OURS:  # worded as table 4's failures
                failed += [f"{row[0]}: {case.name} [{case.dtype}, {ours[0]}] {k}: {err:.2e} > "
                           f"{bound:.0e}" for k, err, bound in found]
            else:
                missed[who].append((row[0], case.name, case.dtype))
    mine = ("the fused CPU kernels (layernorm.cpu, what layernorm.torch calls)"
            if ours[0] == FUSED else "the NumPy reference (the C++ engine is not available here)")
    notes = [
        f"Normwise relative errors (max|got - exact|/max|exact|) of each implementation on the "
        f"same inputs: gamma = 1 + N(0, 0.25), beta and dy ~ N(0, 1), each norm's default eps "
        f"(1e-5 LayerNorm, 1e-6 RMSNorm). {OURS}: {mine}. torch: F.layer_norm and F.rms_norm, "
        f"eager, with autograd; torch.compile: the same function under Inductor, static shapes, "
        f"compiled for each case; both on one thread (how their reductions split a row "
        f"depends on the thread count); onnxruntime: LayerNormalization (opset 17) and "
        f"SimplifiedLayerNormalization on its CPU provider, with no backward (no dx column) "
        f"and no bfloat16 CPU kernel (—); its epsilon attribute is a float32. NaN, inf: the "
        f"result holds one; all 0: zeros where the exact result is not. fails: the results "
        f"that miss the target ours is held to (float64 1e-13; float32 y 2e-6, dx 2e-5; "
        f"float16 and bfloat16 2 ulps). Versions: {_versions()}.",
        "Where each peer misses a target: " + "; ".join(
            f"{p} is absent ({absent[p]})" if p in absent else
            f"{p}, {len(missed[p])} of {len(table.rows)} cases" + _where(missed[p])
            for p in PEERS) + ".",
    ]
    if problems:
        notes.append("Not run: " + "; ".join(problems) + ".")
    table.note = "\n\n".join(notes)
    return table, failed, missed
