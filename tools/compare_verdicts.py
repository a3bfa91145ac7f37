"""Do two runs of `layernorm bench` agree on every verdict they print?

    python tools/compare_verdicts.py RUN1.json RUN2.json

Prints one Markdown row per (case, goal) with each run's figure and verdict, then how many
goals both runs decided ("met" or "missed") alike and how many they decided oppositely; exit
status 1 if any.
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


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    a, b = (verdicts(R.load(Path(p))["rows"]) for p in argv)
    print("| case | goal | regime | run 1 | run 2 |\n|---|---|---|---|---|")
    same = opposite = 0
    for key, (va, fa, regime) in a.items():
        vb, fb, _ = b.get(key, ("not in run 2", "-", ""))
        print(f"| {key[0]} | {key[1]} | {regime} | {fa}: {va} | {fb}: {vb} |")
        if va in DECIDED and vb in DECIDED:
            same += va == vb
            opposite += va != vb
    decided = [sum(v[0] in DECIDED for v in run.values()) for run in (a, b)]
    print(f"\n{len(a)} goals; decided in run 1: {decided[0]}, in run 2: {decided[1]}; "
          f"decided alike by both: {same}; oppositely: {opposite}")
    return 1 if opposite else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
