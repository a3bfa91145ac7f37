"""Rewrite the docs' speed tables from their result files under bench/results/.

    python tools/doc_tables.py [--check]

Each table lives between ``<!-- generated: NAME (...) -->`` and ``<!-- end: NAME -->``;
``layernorm.bench.doc_tables.BLOCKS`` says which result file under bench/results/ makes it.
``--check`` changes nothing and exits 1 naming the stale tables (tests/test_docs.py runs the
same check).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layernorm.bench import doc_tables

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a table differs from its file")
    args = parser.parse_args()
    if args.check:
        names = doc_tables.stale(ROOT)
        for name in names:
            block = doc_tables.BLOCKS[name]
            print(f"{block.doc}: table {name!r} is not what bench/results/{block.result} gives",
                  file=sys.stderr)
        return 1 if names else 0
    names = doc_tables.update(ROOT)
    print("rewrote: " + ", ".join(names) if names else "every table is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
