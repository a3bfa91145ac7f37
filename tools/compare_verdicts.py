"""Do runs of `layernorm bench` agree on every verdict they print?

    python tools/compare_verdicts.py RUN1.json RUN2.json [RUN3.json ...]

Prints one Markdown row per (case, goal) with each run's figure and verdict and the median of
the runs' figures (each run is a fresh process: where the data straddles the last-level cache,
the figures move from process to process more than within a run's rounds), then how many
goals every run decided ("met" or "missed") alike and how many were met in one run and missed
in another; exit status 1 if any.
"""

from __future__ import annotations

import sys
from pathlib import Path

from layernorm.bench import results as R

DECIDED = ("met", "missed")


def verdicts(rows: list[dict]) -> dict[tuple[str, str], tuple[str, str, str]]:
    """(case, goal) -> (verdict, figure, regime) for every goal the tables judge."""
    out = {}
    for case in R._cases(rows):
        tag = f"{case[0]} {'x'.join(map(str, case[1]))} {case[2]}"
        for op, goal in (("fwd", R.FWD_GOAL), ("bwd", R.BWD_GOAL)):
            r = R._find(rows, case, "fused", op)
            if r:
                out[tag, f"fused {op} >= {goal:.0%} of copy"] = (
                    R.fraction_verdict(r, goal), f"{r['frac_copy']:.0%}", r["regime"])
        for impl, goal in (("fused", R.STEP_GOAL), ("layernorm.torch", R.TORCH_API_GOAL)):
            r = R._find(rows, case, impl, "fwd+bwd")
            v = r and R.speedup_verdict(rows, r, "torch", goal)
            if v:
                out[tag, f"{impl} fwd+bwd >= {goal}x torch"] = (
                    v, f"{r['speedup']['torch']:.2f}x", r["regime"])
        for me_impl in R.MEMORY_EFFICIENT:
            r = R._find(rows, case, me_impl, "bwd")
            v = r and R.me_verdict(rows, r)
            if v:
                out[tag, f"{me_impl} bwd <= {R.ME_GOAL:.2f}x default"] = (
                    v, f"{R._me_ratio(r)[0]:.2f}x", r["regime"])
    return out


def _median_figure(figures: list[str]) -> str:
    """The median of figures such as "1.07x" or "64%", in their unit; "-" where one is not a
    number (a goal missing from a run)."""
    unit = figures[0][-1:]
    try:
        values = sorted(float(f[:-1]) for f in figures)
    except ValueError:
        return "-"
    if any(f[-1:] != unit for f in figures):
        return "-"
    n = len(values)
    mid = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
    return f"{mid:.0f}%" if unit == "%" else f"{mid:.2f}{unit}"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    runs = [verdicts(R.load(Path(p))["rows"]) for p in argv]
    n = len(runs)
    head = " | ".join(f"run {i + 1}" for i in range(n))
    print(f"| case | goal | regime | {head} | median |\n|---|---|---|"
          + "---|" * (n + 1))
    alike = opposite = 0
    for key, (_, _, regime) in runs[0].items():
        cells = [run.get(key, (f"not in run {i + 1}", "-", "")) for i, run in enumerate(runs)]
        row = " | ".join(f"{figure}: {verdict}" for verdict, figure, _ in cells)
        print(f"| {key[0]} | {key[1]} | {regime} | {row} | "
              f"{_median_figure([figure for _, figure, _ in cells])} |")
        decided = {verdict for verdict, _, _ in cells if verdict in DECIDED}
        if decided and all(verdict in DECIDED for verdict, _, _ in cells):
            alike += len(decided) == 1
        opposite += len(decided) == 2
    decided = [sum(v[0] in DECIDED for v in run.values()) for run in runs]
    print(f"\n{len(runs[0])} goals; decided in each run: {', '.join(map(str, decided))}; "
          f"decided alike by every run: {alike}; met in one run and missed in another: "
          f"{opposite}")
    return 1 if opposite else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
