"""The CPU benchmark's results: JSON files, flags, verdicts, the tables, headlines and the plot.

    save, load, default_path  ``{"meta": ..., "rows": [...]}`` as JSON (one row a line), by
                              default bench/runs/cpu-<host>-<time>.json
    RUNS_DIR, RECORD_DIR      bench/runs, where a run goes unless ``--out`` names a file (not
                              tracked), and bench/results, the runs the docs are made from
    dumps                     rows as JSON, one per line
    flag_rows                 each row's ``flags``: figures that cannot be results (below)
    verdict                   met, missed, or undecided: a goal judged at both ends of the
                              spread, with a guard band around the goal (below)
    noisy                     "too noisy to tell" where a time's p80/p20 reaches STEADY
    fraction_verdict          a fraction-of-copy goal: its flags, no verdict across regimes,
                              else verdict
    speedup_verdict           a speedup goal against a peer: flags on either row, else verdict
    format_table              every row: p50 (p20-p80), GB/s, fraction of copy, speedups, flags
    summary_table             per case: where the data lives, copy GB/s, fused and PyTorch
                              fractions of copy, the goals
    torch_table               per case: torch eager's and torch.compile's fwd+bwd time over
                              layernorm.torch's, the goal for the PyTorch API
    headlines                 one Markdown line per implementation: the number behind its verdict
    bandwidth_figure, plot_bandwidth  GB/s (p20-p80 bars) per case, backend and pass, with the
                              copy and the goals
    format_latency            the first-call latency of two fresh processes
    n_threads, regime_note    "1 thread", "2 threads"; what the regimes mean, in words

Regimes. A fraction of copy compares a pass with a copy of the same size, and is a judgement of
the pass only when both move their data through the same level: "in cache" (the largest
pass's minimal bytes fit in the last-level cache; then the copy's do too) and "DRAM" (even the
copy's bytes are at least twice the cache). A case whose data "straddles LLC" gets no
bandwidth verdict, nor one whose cache size is unknown; speedups against torch compare two
implementations on the same data and are judged in every regime.

Flags (:func:`flag_rows`), shown instead of a verdict (the tables of one line per case show
them without the details in brackets):
    busy machine      other processes used more of the cores than our threads left free
                      (more than BUSY_CORES beyond them): every pass of the case stalled on
                      preempted threads; no verdict of the case stands
    overhead-bound    the copy takes under OVERHEAD_S per call: call overhead, not bandwidth,
                      sets both times, so fractions of copy say nothing
    implausible: Nx copy   a fraction of copy above FRACTION_MARGIN at p50
    implausible: fwd+bwd faster than fwd (or bwd) alone, and on that part "implausible: slower
                      than fwd+bwd": a sum faster than its part; one of the two times is wrong
A fraction-of-copy verdict stands only on a row without flags; a speedup verdict falls to a
busy machine or to a sum faster than its part, on its row or on the peer's.

Verdicts. p20 and p80 over the rounds capture the noise within one run, but two runs differ by
more. In five LayerNorm float32 runs of the standard shapes (2 threads of 2 cores), where a
verdict is given (DRAM) the p50 of a fraction of copy or of a speedup over torch moved by up to
12% from run to run (43% where the spread was wide), and the p20 of one run lay at most 9%
above the p80 of another; on the shapes that straddle the cache, up to 41% for fractions of
copy. So a goal is "met" only when p20 clears it by CLOSE (10%), "missed" only when p80 falls
short of it by CLOSE, and otherwise undecided: "noisy: rerun" when the spread itself contains
the goal, "too close to call" when it lies within the band; and no verdict at all where a
time's own p80 is STEADY (1.25) times its p20 or more: "too noisy to tell". Two runs then give
opposite verdicts only if one's p20 lies 22% (1.1/0.9) above the other's p80, more than twice
what was seen. More rounds narrow p20-p80 but not the shift from run to run, so the default
stays 9 rounds (5 with --quick).
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np

from .._table import render
from ..family import norm as family_norm
from .providers import BACKENDS, MEMORY_EFFICIENT

__all__ = ["BUSY_CORES", "BWD_GOAL", "CLOSE", "DRAM", "FRACTION_MARGIN", "FWD_GOAL",
           "IN_CACHE", "OVERHEAD_S", "STEADY", "STEP_GOAL", "STRADDLES", "TORCH_API_GOAL",
           "ME_GOAL", "RECORD_DIR", "RUNS_DIR", "UNKNOWN",
           "bandwidth_figure", "default_path", "dumps", "flag_rows", "format_latency",
           "format_table", "fraction_verdict", "headlines", "load", "me_table", "me_verdict",
           "n_threads", "noisy", "plot_bandwidth",
           "regime_note", "save", "speedup_verdict", "summary_table", "torch_table", "verdict"]

# A run goes to RUNS_DIR (ignored by git) unless --out names a file; RECORD_DIR holds the runs
# the docs' tables and figures are made from, each named for what it holds.
RUNS_DIR = Path("bench") / "runs"
RECORD_DIR = Path("bench") / "results"

FWD_GOAL, BWD_GOAL, STEP_GOAL = 0.80, 0.70, 1.5  # fractions of copy; fwd+bwd speedup vs torch
TORCH_API_GOAL = 1.5  # torch eager's fwd+bwd time over layernorm.torch's
ME_GOAL = 1.10  # the memory-efficient backward's time over the default mode's, at most

IN_CACHE, DRAM, STRADDLES, UNKNOWN = "in cache", "DRAM", "straddles LLC", "LLC size unknown"
JUDGED_REGIMES = (IN_CACHE, DRAM)  # where pass and copy move their data through one level

# Both the copy and the kernels use ordinary stores, so each written line is read first
# (write-allocate): a pass reading r and writing w streams moves r + 2w, the copy 3 for its 2
# counted. At the copy's own hardware rate the LayerNorm/RMSNorm backward (r=2, w=1) shows
# (3/4)/(2/3) = 1.125 of copy, the most in the family; a fraction of copy moves by up to 12%
# from run to run (module doc). Above 1.125 * 1.12 ~ 1.25 no pass is as fast as measured.
FRACTION_MARGIN = 1.25
# A parallel call of the copy costs several microseconds here with nothing to copy (the op's
# dispatch and OpenMP's fork and join); under 50 us a seventh of the copy's time or more is
# overhead, and more of the passes' (several calls each for torch's autograd): no time
# measures bandwidth.
OVERHEAD_S = 50e-6
# Cores other processes may use beyond those our threads leave free. A quiet machine shows
# 0.00-0.01 over a case's rounds here; a tenth of a core is 5 ms of every 50 ms batch, about
# one time slice, so about one preemption of one of our threads per batch.
BUSY_CORES = 0.1
CLOSE = 0.10  # the guard band around a goal, relative (module doc)
# A measurement whose p80 is this many times its p20 or more is too noisy for any verdict: the
# rounds disagree by more than a verdict's guard band on either side (1.1/0.9 ~ 1.22).
STEADY = 1.25

_OPS = {"fwd": "forward", "bwd": "backward", "fwd+bwd": "fwd+bwd"}
# flags that make a time, not only a fraction of copy, unfit for a verdict
_TIME_FLAGS = ("busy machine", "implausible: fwd+bwd", "implausible: slower than fwd+bwd")


def n_threads(n: int) -> str:
    """``"1 thread"``, ``"2 threads"``."""
    return f"{n} thread" if n == 1 else f"{n} threads"


def regime_note(llc: int | None) -> str:
    """What the regimes of the tables mean, in a sentence, for a last-level cache of ``llc``
    bytes (None: unknown)."""
    size = "of unknown size" if llc is None else f"of {llc / 2**20:g} MiB"
    return (f'Where the data lives, against the last-level cache (LLC, {size}): "{IN_CACHE}" '
            f"when the largest pass's minimal bytes fit in it, \"{DRAM}\" when even the copy's "
            f'(2·M·D·itemsize) are at least twice its size, "{STRADDLES}" in between. A '
            f"fraction of copy is judged only in cache (against an in-cache copy) or in DRAM "
            f"(against a DRAM copy): in between, part of the data stays in cache from call to "
            f"call, a varying part, so there is no bandwidth verdict; speedups against torch "
            f"are judged everywhere.")


def default_path() -> Path:
    """bench/runs/cpu-<host>-<YYYYmmdd-HHMMSS>.json under the current folder."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in platform.node()) or "host"
    return RUNS_DIR / f"cpu-{host}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def dumps(value: object) -> str:
    """``value`` as compact JSON, newline-terminated: a list, and the ``rows`` list of a dict,
    one element a line (so a file diffs by row); everything else on one line."""
    def one(v: object) -> str:
        return json.dumps(v, separators=(",", ":"))

    def rows(items: list) -> str:
        return "[\n" + ",\n".join(one(r) for r in items) + "\n]" if items else "[]"

    if isinstance(value, list):
        return rows(value) + "\n"
    if isinstance(value, dict):
        return "{" + ",\n".join(
            f"{one(k)}:{rows(v) if k == 'rows' and isinstance(v, list) else one(v)}"
            for k, v in value.items()) + "}\n"
    return one(value) + "\n"


def save(result: dict, path: Path) -> Path:
    """Write a run (``{"meta": ..., "rows": [...]}``) to ``path`` as :func:`dumps` gives it;
    returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(result))
    return path


def load(path: Path) -> dict:
    """A run saved by :func:`save`. Rows of older files get what they lack: ``norm``
    LayerNorm's, ``regime`` unknown (their cache size was not recorded), no speedup spreads
    (so no speedup verdicts), ``flags`` from :func:`flag_rows`."""
    result = json.loads(Path(path).read_text())
    if not isinstance(result, dict) or set(result) != {"meta", "rows"}:
        raise ValueError(f"{path}: expected a JSON object with keys 'meta' and 'rows'")
    for row in result["rows"]:
        row.setdefault("norm", "layer_norm")
        row.setdefault("regime", UNKNOWN)
        row.setdefault("llc_bytes", None)
        row.setdefault("speedup_p20_p80", {})
    if any("flags" not in row for row in result["rows"]):
        flag_rows(result["rows"])
    return result


def _title(r: dict) -> str:
    return family_norm(r["norm"]).title


def _case_text(r: dict) -> str:
    """``LayerNorm 4x1024x4096 float32``."""
    return f"{_title(r)} {'x'.join(map(str, r['shape']))} {r['dtype']}"


def _key(r: dict) -> tuple:
    return (r["norm"], r["shape"], r["dtype"])


def _find(rows: list[dict], case: tuple, impl: str, op: str) -> dict | None:
    """The row of ``case`` (norm, shape, dtype), ``impl`` and ``op``, or None."""
    for r in rows:
        if _key(r) == case and r["impl"] == impl and r["op"] == op:
            return r
    return None


def _cases(rows: list[dict]) -> list[tuple]:
    """The (norm, shape, dtype) of the rows, in order of appearance."""
    cases = []
    for r in rows:
        if _key(r) not in cases:
            cases.append(_key(r))
    return cases


def _times(x: float) -> str:
    """``1.23x``, or ``2727x`` from 10 up."""
    return f"{x:.0f}x" if x >= 10 else f"{x:.2f}x"


def flag_rows(rows: list[dict]) -> list[dict]:
    """Set every row's ``flags`` (a list of strings, empty for a plain result) from the rows of
    its case, as the module doc lists them; returns ``rows``."""
    for r in rows:
        r["flags"] = []
    for case in _cases(rows):
        mine = [r for r in rows if _key(r) == case]
        copy = _find(rows, case, "copy", "copy")
        first = mine[0]
        case_flags = []
        other = first.get("other_cores")
        spare = max(0, first.get("cpus", 0) - first["threads"])
        if other is not None and other > spare + BUSY_CORES:
            case_flags.append(f"busy machine (other processes used {other:.1f} cores)")
        if copy is not None and copy["p50_ms"] * 1e-3 < OVERHEAD_S:
            case_flags.append(f"overhead-bound (copy {copy['p50_ms'] * 1e3:.0f} us per call)")
        for r in mine:
            r["flags"] += case_flags
            if r["impl"] != "copy" and r["frac_copy"] > FRACTION_MARGIN:
                r["flags"].append(f"implausible: {_times(r['frac_copy'])} copy")
        for impl in dict.fromkeys(r["impl"] for r in mine):
            step = _find(rows, case, impl, "fwd+bwd")
            for op in ("fwd", "bwd"):
                part = _find(rows, case, impl, op)
                if step is not None and part is not None and step["p50_ms"] < part["p50_ms"]:
                    step["flags"].append(f"implausible: fwd+bwd faster than {op} alone")
                    part["flags"].append("implausible: slower than fwd+bwd")
    return rows


def noisy(*measurements: dict) -> str | None:
    """"too noisy to tell" with the widest p20-p80 of times among ``measurements`` (dicts
    with ``p20_ms`` and ``p80_ms``) where one's p80/p20 reaches :data:`STEADY`, else None."""
    wide = [m for m in measurements if m["p80_ms"] >= STEADY * m["p20_ms"]]
    if not wide:
        return None
    m = max(wide, key=lambda m: m["p80_ms"] / m["p20_ms"])
    return f"too noisy to tell (p20-p80 {_ms(m['p20_ms'])}-{_ms(m['p80_ms'])})"


def _ms(ms: float) -> str:
    return f"{ms * 1e3:.1f} us" if ms < 1 else f"{ms:.2f} ms"


def verdict(lo: float, hi: float, goal: float, fmt: str = "{:.2f}x") -> str:
    """A goal (at least ``goal``) judged on a measurement's p20-p80 spread ``lo``-``hi``:
    "met" when p20 clears it by :data:`CLOSE`, "missed" when p80 falls short of it by CLOSE;
    else "noisy: rerun" with the spread when the spread contains the goal, "too close to
    call" when it lies within CLOSE of it (module doc)."""
    if lo >= goal * (1 + CLOSE):
        return "met"
    if hi < goal * (1 - CLOSE):
        return "missed"
    spread = f"{fmt.format(lo)}-{fmt.format(hi)}"
    if lo < goal <= hi:
        return f"noisy: rerun ({spread})"
    return f"too close to call ({spread}, within {CLOSE:.0%} of {fmt.format(goal)})"


def _short(flags: list[str]) -> str:
    """Flags without their details in brackets, joined: ``busy machine; overhead-bound``."""
    return "; ".join(dict.fromkeys(f.split(" (")[0] for f in flags))


def fraction_verdict(row: dict, goal: float) -> str:
    """The goal "fraction of copy >= ``goal``" for ``row``: its flags if it has any (without
    their details), no verdict outside :data:`JUDGED_REGIMES`, else :func:`verdict` on its
    p20-p80."""
    if row["flags"]:
        return _short(row["flags"])
    if row["regime"] not in JUDGED_REGIMES:
        return f"{row['regime']}: no verdict"
    return noisy(row) or verdict(*row["frac_copy_p20_p80"], goal, "{:.0%}")


def _ratio(row: dict | None, peer: str) -> tuple[float, float, float] | None:
    """``peer``'s time over ``row``'s, (p50, p20, p80) over per-round ratios, or None."""
    if row is None or peer not in row["speedup_p20_p80"]:
        return None
    lo, hi = row["speedup_p20_p80"][peer]
    return row["speedup"][peer], lo, hi


def speedup_verdict(rows: list[dict], row: dict, peer: str, goal: float) -> str | None:
    """The goal "``peer``'s time over ``row``'s >= ``goal``": the flags on either row that
    make a time unfit (without their details), else :func:`verdict` on the per-round ratios'
    p20-p80; None where the peer was not timed."""
    ratio = _ratio(row, peer)
    if ratio is None:
        return None
    peer_row = _find(rows, _key(row), peer, row["op"])
    unfit = [f for r in (row, peer_row) if r for f in r["flags"] if f.startswith(_TIME_FLAGS)]
    if unfit:
        return _short(unfit)
    return noisy(*(r for r in (row, peer_row) if r)) or verdict(*ratio[1:], goal)


def format_table(rows: list[dict], markdown: bool = False) -> str:
    """Every row: where its data lives, p50 (p20-p80) ms, GB/s, fraction of copy (p50 and
    p20-p80 of per-round ratios), speedups against the peers, check, flags."""
    head = ["norm", "shape", "dtype", "data in", "impl", "op", "p50 ms (p20-p80)", "GB/s",
            "of copy (p20-p80)", "speedup vs peers", "check", "flags"]
    body = []
    for r in rows:
        sp = ", ".join(f"{v:.2f}x vs {k}" for k, v in r["speedup"].items())
        chk = "" if r["check"] is None else ("ok" if r["check"] <= 1 else
                                             f"{r['check']:.1f}x tol")
        lo, hi = r["frac_copy_p20_p80"]
        body.append([
            _title(r), "x".join(map(str, r["shape"])), r["dtype"], r["regime"], r["impl"],
            r["op"], f"{r['p50_ms']:.3f} ({r['p20_ms']:.3f}-{r['p80_ms']:.3f})",
            f"{r['gbps']:.1f}", f"{r['frac_copy']:.0%} ({lo:.0%}-{hi:.0%})", sp, chk,
            "; ".join(r["flags"]),
        ])
    return render(head, body, markdown)


def _fraction_cell(r: dict | None) -> str:
    """A fraction of copy with its spread, or the row's flags instead of it."""
    if r is None:
        return "-"
    if r["flags"]:
        return _short(r["flags"])
    lo, hi = r["frac_copy_p20_p80"]
    return f"{r['frac_copy']:.0%} ({lo:.0%}-{hi:.0%})"


def summary_table(rows: list[dict], markdown: bool = False) -> str:
    """Per case: where its data lives, copy GB/s, fused and PyTorch fractions of copy, fused
    speedup vs PyTorch, and the goals' verdicts (:func:`fraction_verdict`,
    :func:`speedup_verdict`)."""
    head = ["norm", "shape", "dtype", "data in", "threads", "copy GB/s", "fused fwd",
            "fused bwd", "torch fwd", "torch bwd", "fused/torch fwd+bwd", "goals"]
    body = []
    for case in _cases(rows):
        r = _find(rows, case, "copy", "copy")
        if r is None:
            continue
        goals = []
        for op, goal in (("fwd", FWD_GOAL), ("bwd", BWD_GOAL)):
            f = _find(rows, case, "fused", op)
            if f:
                goals.append(f"{op} " + fraction_verdict(f, goal))
        step = _find(rows, case, "fused", "fwd+bwd")
        speed = _ratio(step, "torch")
        if speed:
            goals.append("speedup " + speedup_verdict(rows, step, "torch", STEP_GOAL))
        body.append([
            _title(r), "x".join(map(str, r["shape"])), r["dtype"], r["regime"],
            str(r["threads"]), f"{r['copy_gbps']:.1f}",
            *(_fraction_cell(_find(rows, case, impl, op))
              for impl in ("fused", "torch") for op in ("fwd", "bwd")),
            "-" if speed is None else f"{speed[0]:.2f}x", ", ".join(goals),
        ])
    return render(head, body, markdown)


def _me_ratio(row: dict) -> tuple[float, float, float] | None:
    """The memory-efficient ``row``'s time over its default mode's, (p50, p20, p80) over
    per-round ratios, or None where the default was not timed."""
    r = _ratio(row, MEMORY_EFFICIENT[row["impl"]])
    return None if r is None else (1 / r[0], 1 / r[2], 1 / r[1])


def me_verdict(rows: list[dict], row: dict) -> str | None:
    """The goal "the memory-efficient backward takes at most :data:`ME_GOAL` times the
    default's": "met" when p80 of the per-round ratios is within it, "missed" when p20 is
    beyond it, else "within the noise" with the spread; a time unfit for a verdict (flags,
    :func:`noisy`) says so; None where the default mode was not timed."""
    ratio = _me_ratio(row)
    if ratio is None:
        return None
    base = _find(rows, _key(row), MEMORY_EFFICIENT[row["impl"]], row["op"])
    unfit = [f for r in (row, base) if r for f in r["flags"] if f.startswith(_TIME_FLAGS)]
    if unfit:
        return _short(unfit)
    if (why := noisy(*(r for r in (row, base) if r))):
        return why
    _, lo, hi = ratio
    return at_most_verdict(lo, hi, ME_GOAL)


def at_most_verdict(lo: float, hi: float, goal: float) -> str:
    """A goal "at most ``goal``" judged on a ratio's p20-p80 spread ``lo``-``hi``: "met" when
    p80 is within it, "missed" when p20 is beyond it, else "within the noise" with the
    spread."""
    if hi <= goal:
        return "met"
    if lo > goal:
        return "missed"
    return f"within the noise ({lo:.2f}-{hi:.2f})"


def me_table(rows: list[dict], markdown: bool = False) -> str:
    """Per case and implementation with a memory-efficient mode: the backward's p50 in each
    mode and the memory-efficient one's time over the default's (p50, p20-p80 of per-round
    ratios) against :data:`ME_GOAL`. Empty when no memory-efficient backend was timed."""
    head = ["norm", "shape", "dtype", "impl", "default bwd ms", "memory-efficient bwd ms",
            "ME / default", f"goal <= {ME_GOAL:.2f}x"]
    body = []
    for case in _cases(rows):
        for me_impl, impl in MEMORY_EFFICIENT.items():
            me, base = _find(rows, case, me_impl, "bwd"), _find(rows, case, impl, "bwd")
            ratio = None if me is None else _me_ratio(me)
            if ratio is None:
                continue
            body.append([_title(me), "x".join(map(str, me["shape"])), me["dtype"], impl,
                         f"{base['p50_ms']:.3f}", f"{me['p50_ms']:.3f}",
                         f"{ratio[0]:.2f}x ({ratio[1]:.2f}-{ratio[2]:.2f})",
                         me_verdict(rows, me)])
    return render(head, body, markdown) if body else ""


def torch_table(rows: list[dict], markdown: bool = False) -> str:
    """Per case timed with ``layernorm.torch``: torch eager's and torch.compile's fwd+bwd time
    over layernorm.torch's, p50 (p20-p80) of per-round ratios, and the goal: torch eager's over
    ours >= :data:`TORCH_API_GOAL` (:func:`speedup_verdict`; a result failing its check meets
    nothing). Empty when no case has both layernorm.torch and torch rows."""
    head = ["norm", "shape", "dtype", "threads", "layernorm.torch fwd+bwd ms",
            "torch / layernorm.torch", "torch.compile / layernorm.torch",
            f"goal >= {TORCH_API_GOAL}x torch"]
    body = []
    for case in _cases(rows):
        ours = _find(rows, case, "layernorm.torch", "fwd+bwd")
        eager = _ratio(ours, "torch")
        if eager is None:
            continue
        compiled = _ratio(ours, "torch.compile")
        ratios = ["-" if q is None else f"{q[0]:.2f}x ({q[1]:.2f}-{q[2]:.2f})"
                  for q in (eager, compiled)]
        goal = (speedup_verdict(rows, ours, "torch", TORCH_API_GOAL) if ours["check"] <= 1
                else f"fails its check ({ours['check']:.1f}x tol)")
        body.append([
            _title(ours), "x".join(map(str, ours["shape"])), ours["dtype"], str(ours["threads"]),
            f"{ours['p50_ms']:.3f} ({ours['p20_ms']:.3f}-{ours['p80_ms']:.3f})", *ratios, goal,
        ])
    return render(head, body, markdown) if body else ""


def _outcome(text: str) -> str:
    """The kind of a verdict cell: met, missed, undecided, no verdict, flagged."""
    if text in ("met", "missed"):
        return text
    if text.startswith(("noisy", "too close", "too noisy")):
        return "undecided"
    if text.endswith("no verdict"):
        return "no verdict"
    return "flagged"


def _goal_headline(what: str, judged: list[tuple[dict, str, tuple[float, float, float]]],
                   fmt: str, goal: float) -> str:
    """One clause of a headline: ``what`` (e.g. "forward") against ``goal``, from
    (row, verdict text, (p50, p20, p80)) per case; the one number shown is the weakest case's,
    or the strongest's when every case missed."""
    if not judged:
        return ""
    unit = " of copy" if fmt.endswith("%}") else ""
    tail = "" if unit else " torch"

    def number(item: tuple) -> str:
        row, _, (p50, lo, hi) = item
        return (f"{fmt.format(p50)}{unit}{tail} (p20-p80 {fmt.format(lo)}-{fmt.format(hi)}) "
                f"on {_case_text(row)} ({row['regime']})")

    if len(judged) == 1:
        row, text, _ = judged[0]
        if _outcome(text) == "flagged":  # the figure is no result: the flag, not the number
            return f"{what} on {_case_text(row)} ({row['regime']}): {text}, no verdict"
        return f"{what} {number(judged[0])}, goal {fmt.format(goal)}: {text}"
    kinds = [_outcome(text) for _, text, _ in judged]
    counts = [f"met in {kinds.count('met')} of {len(judged)} cases"]
    counts += [f"{kinds.count(k)} {k}" for k in ("missed", "undecided", "no verdict")
               if kinds.count(k)]
    flagged = [(row, t) for (row, t, _), k in zip(judged, kinds, strict=True) if k == "flagged"]
    if flagged:
        counts.append(f"{len(flagged)} flagged (e.g. {flagged[0][1]} on "
                      f"{_case_text(flagged[0][0])})")
    scored = [item for item, k in zip(judged, kinds, strict=True)
              if k in ("met", "missed", "undecided")]
    text = f"{what} >= {fmt.format(goal)}{unit}{tail}: " + ", ".join(counts)
    if scored:
        best = all(k == "missed" for k in kinds if k in ("met", "missed", "undecided"))
        pick = (max if best else min)(scored, key=lambda item: item[2][0])
        text += f"; {'best' if best else 'weakest'} {number(pick)}"
    return text


def _fraction_headline(rows: list[dict], impl: str, op: str) -> str:
    """One clause without a goal: ``impl``'s fraction of copy in ``op`` over the cases where it
    means something (a judged regime, no flags), and how many cases were left out, why."""
    found = [r for r in rows if r["impl"] == impl and r["op"] == op]
    shown = [r for r in found if not r["flags"] and r["regime"] in JUDGED_REGIMES]
    why = [_short(r["flags"]) if r["flags"] else r["regime"] for r in found if r not in shown]
    left = ", ".join(f"{why.count(w)} {w}" for w in dict.fromkeys(why))
    what = _OPS[op]
    if not shown:
        return f"{what}: no case to compare with a copy ({left})"
    if len(shown) == 1:
        r = shown[0]
        lo, hi = r["frac_copy_p20_p80"]
        text = (f"{what} {r['frac_copy']:.0%} of copy (p20-p80 {lo:.0%}-{hi:.0%}) "
                f"on {_case_text(r)} ({r['regime']})")
    else:
        fr = [r["frac_copy"] for r in shown]
        text = (f"{what} {min(fr):.0%}-{max(fr):.0%} of copy over {len(shown)} cases "
                f"(median {float(np.median(fr)):.0%})")
    return text + (f" (not compared: {left})" if left else "")


def headlines(rows: list[dict]) -> list[str]:
    """One short Markdown line per implementation timed (not the copy), in
    :data:`~layernorm.bench.providers.BACKENDS` order, with the number behind its verdict:
    ``fused`` its forward and backward fractions of copy against :data:`FWD_GOAL` and
    :data:`BWD_GOAL` and its fwd+bwd speedup over torch against :data:`STEP_GOAL`;
    ``layernorm.torch`` its fwd+bwd speedup over torch against :data:`TORCH_API_GOAL`; the
    others their fractions of copy, without a goal. Several cases are counted by outcome, with
    the weakest case's number (the best one's when every case missed); flags show."""
    lines = []
    for impl in BACKENDS:
        mine = [r for r in rows if r["impl"] == impl]
        if not mine:
            continue
        parts = []
        if impl in MEMORY_EFFICIENT:
            judged = [me_verdict(rows, r) for r in mine if r["op"] == "bwd"]
            ratios = [q[0] for r in mine if r["op"] == "bwd" and (q := _me_ratio(r))]
            if ratios:
                met = sum(v == "met" for v in judged)
                lines.append(f"`{impl}`: backward {min(ratios):.2f}x-{max(ratios):.2f}x the "
                             f"default mode's time (p50); goal <= {ME_GOAL:.2f}x met at {met} "
                             f"of {len(judged)} cases")
            continue
        if impl == "fused":
            for op, goal in (("fwd", FWD_GOAL), ("bwd", BWD_GOAL)):
                judged = [(r, fraction_verdict(r, goal),
                           (r["frac_copy"], *r["frac_copy_p20_p80"]))
                          for r in mine if r["op"] == op]
                parts.append(_goal_headline(_OPS[op], judged, "{:.0%}", goal))
        if impl in ("fused", "layernorm.torch"):
            goal = STEP_GOAL if impl == "fused" else TORCH_API_GOAL
            judged = [(r, speedup_verdict(rows, r, "torch", goal), _ratio(r, "torch"))
                      for r in mine if r["op"] == "fwd+bwd" and _ratio(r, "torch")]
            parts.append(_goal_headline("fwd+bwd", judged, "{:.2f}x", goal)
                         or "fwd+bwd: no speedup over torch to judge")
        else:
            parts += [_fraction_headline(rows, impl, op) for op in ("fwd", "bwd")]
            parts.append("no goal")
        lines.append(f"`{impl}`: " + "; ".join(p for p in parts if p))
    return lines


def bandwidth_figure(rows: list[dict]):
    """The bandwidth plot as a matplotlib Figure (Agg, headless): GB/s on minimal bytes per
    case and implementation, p50 bars with p20-p80 error bars, one panel per pass; each case's
    copy and, where a verdict is given, the goal as lines named in the legend; each tick says
    where the case's data lives. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _cases(rows)
    impls = [i for i in BACKENDS if any(r["impl"] == i for r in rows)]
    first = rows[0]
    # constrained layout makes room for the legends beside the axes and the slanted labels
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.9 * len(cases) + 3), 8), sharex=True,
                             layout="constrained")
    width = 0.8 / max(1, len(impls))
    for ax, op, goal in zip(axes, ("fwd", "bwd"), (FWD_GOAL, BWD_GOAL), strict=True):
        for k, impl in enumerate(impls):
            found = [_find(rows, c, impl, op) for c in cases]
            # GB/s at p50, and at p80 and p20 of the time (bytes / ms / 1e6 = GB/s)
            mid = np.array([r["gbps"] if r else np.nan for r in found])
            slow = np.array([r["bytes"] / r["p80_ms"] / 1e6 if r else np.nan for r in found])
            fast = np.array([r["bytes"] / r["p20_ms"] / 1e6 if r else np.nan for r in found])
            ax.bar(np.arange(len(cases)) + (k - (len(impls) - 1) / 2) * width, mid, width,
                   yerr=[mid - slow, fast - mid], capsize=2, error_kw={"lw": 0.8},
                   label=impl)
        copy_label = "copy of the same size, same run (p50)"
        goal_label = f"goal: {goal:.0%} of copy (cases in cache or DRAM)"
        for i, c in enumerate(cases):
            cp = _find(rows, c, "copy", "copy")
            if cp is None:
                continue
            ax.hlines(cp["gbps"], i - 0.45, i + 0.45, colors="black", label=copy_label)
            copy_label = None
            if cp["regime"] in JUDGED_REGIMES:
                ax.hlines(goal * cp["gbps"], i - 0.45, i + 0.45, colors="gray",
                          linestyles="dashed", label=goal_label)
                goal_label = None
        ax.set_title(f"{_OPS[op].capitalize()} pass", fontsize=10)
        ax.set_ylabel("GB/s on minimal bytes")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[1].set_xticks(np.arange(len(cases)))
    axes[1].set_xticklabels(
        [f"{family_norm(n).title} {'x'.join(map(str, s))} {d}\n"
         f"({(_find(rows, (n, s, d), 'copy', 'copy') or {}).get('regime', '?')})"
         for n, s, d in cases], fontsize=7, rotation=35, ha="right", rotation_mode="anchor")
    axes[1].set_xlabel("case: norm, shape, dtype (where its data lives)")
    fig.suptitle("Bandwidth of each pass on the CPU: p50 over rounds, bars p20-p80\n"
                 f"{first.get('machine', {}).get('cpu', 'unknown CPU')}, "
                 f"{n_threads(first['threads'])}", fontsize=10)
    return fig


def plot_bandwidth(rows: list[dict], path: Path) -> Path:
    """:func:`bandwidth_figure` saved as a PNG at ``path``; returns ``path``. Raises
    ImportError without matplotlib."""
    fig = bandwidth_figure(rows)
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_latency(latency: dict[str, dict[str, float]]) -> str:
    """One line: import, forward and backward seconds of each fresh-process run."""
    return "first call, fresh process (float32): " + "; ".join(
        f"{label}: import {t['import_s']:.2f} s, forward {t['forward_s']:.2f} s, "
        f"backward {t['backward_s']:.2f} s" for label, t in latency.items())
