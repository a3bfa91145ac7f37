"""README.md and docs/*.md stay true: Markdown rather than reST, nothing about how they were
written, links to files that exist, and every figure quoted from a command either checked
here against what the command printed (the appendix of docs/numerics.md, the cost model, the
result files under bench/results/) or quoted with the date of the run that printed it."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

import pytest

from layernorm.bench.gpu import latest_results

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NUMERICS = ROOT / "docs" / "numerics.md"
COMPLEXITY = ROOT / "docs" / "complexity.md"
TORCH = ROOT / "docs" / "torch.md"
GPU = ROOT / "docs" / "gpu-fusion.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]

# Words about how a document came to be rather than about the library.
HISTORY = re.compile(r"\b(issues?|tickets?|sessions?|commit\w*|git archive)\b", re.I)
# reST: a ``literal`` (two backticks, not three of a code fence) and Sphinx roles.
REST = re.compile(r"(?<!`)``(?!`)|:(?:func|mod|class|data|meth|attr|exc|obj|ref):`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
# A figure: digits with a decimal point, optionally an exponent (9.1e-08, 0.49, 58.4).
FIGURE = re.compile(r"(?<![\w.^])\d+\.\d+(?:e[+-]\d+)?(?![\w.])")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
NORM_NAMES = {"LayerNorm": "layer_norm", "RMSNorm": "rms_norm",
              "add+LayerNorm": "add_layer_norm", "add+RMSNorm": "add_rms_norm"}


def _rel(doc: Path) -> str:
    return doc.relative_to(ROOT).as_posix()


def markup_problems(text: str) -> list[str]:
    """'line N: match' for each history word or piece of reST markup in ``text``."""
    return [f"line {n}: {m.group(0)!r}"
            for n, line in enumerate(text.splitlines(), 1)
            for m in (*HISTORY.finditer(line), *REST.finditer(line))]


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_history_words_or_rest_markup(doc):
    """Protects the docs from words about issues, tickets, sessions or commits, and from reST
    markup that Markdown shows literally (double backticks, :func: and other roles)."""
    assert markup_problems(doc.read_text()) == [], f"{_rel(doc)}: reword these"


def test_the_scan_finds_what_it_looks_for():
    """Protects the scan above: each kind of planted word or markup is found; Markdown code
    spans and fences are not."""
    for planted in ("see the Issue", "as committed", "one session", "a ticket", "git archive",
                    "``x``", ":func:`f`", ":mod:`layernorm`", ":class:`C`", ":meth:`m`"):
        assert markup_problems(planted), planted
    assert markup_problems("```python\n`x` and `y`\n```\n") == []


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = FENCE.sub("", doc.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def test_relative_links_point_to_existing_files():
    """Protects every relative link of the docs: its file exists, and so does its heading."""
    bad = []
    for doc in DOCS:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{_rel(doc)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{_rel(doc)}: {target} (no such heading)")
    assert bad == []


def _cited_results() -> dict[str, str]:
    """Each result file the docs name (a bare name is under bench/results/; a pattern such as
    gpu-<time>.json is not a file), with a document that names it."""
    named = {}
    for doc in DOCS:
        for name in re.findall(r"[\w./<>-]+\.json", doc.read_text()):
            if "<" not in name:
                named[name if "/" in name else f"bench/results/{name}"] = _rel(doc)
    return named


def test_result_files_named_in_the_docs_exist():
    """Protects the docs' citations of measurements: each bench/results/*.json they name
    exists."""
    named = _cited_results()
    assert named, "the docs cite no result file"
    assert {p: d for p, d in named.items() if not (ROOT / p).is_file()} == {}


def test_every_result_file_is_cited():
    """Protects bench/results/ as the record: it holds only files a document names (the
    generated tables' files among them) and the newest GPU results, which the report shows,
    so a run left there by mistake, or one whose citation was removed, fails here."""
    record = ROOT / "bench" / "results"
    kept = {p.relative_to(ROOT).as_posix() for p in record.glob("*")}
    assert kept, "bench/results/ is empty"
    cited = set(_cited_results())
    newest_gpu = latest_results(record)  # what the report shows
    if newest_gpu is not None:
        cited.add(newest_gpu.relative_to(ROOT).as_posix())
    assert sorted(kept - cited) == []


# ---------------------------------------------------------------- figures of layernorm stability

# Figures docs/numerics.md derives rather than measures, with what each is.
DERIVED = {
    "6.0e-8": "u of float32, 2^-24",
    "1.1e-12": "u*offset^2 at offset 1e2, float64",
    "1.1e-08": "u*offset^2 at offset 1e4, float64",
    "3.2e-3": "sqrt(eps) for eps = 1e-5",
    "0.0625": "the spacing of float32 numbers near 1e6",
}


def _appendix() -> str:
    match = re.search(r"<!-- stability:begin -->\n(.*?)\n<!-- stability:end -->",
                      NUMERICS.read_text(), re.S)
    assert match, "docs/numerics.md lacks the appendix between the stability markers"
    return match.group(1)


def _units(text: str) -> list[str]:
    """Paragraphs outside code fences, with each list item and table row a unit of its own."""
    units = []
    for para in re.split(r"\n\s*\n", FENCE.sub("", text)):
        units += [u for u in re.split(r"\n(?=\s*(?:[-*] |\||\d+\. ))", para) if u.strip()]
    return units


def _stability_quotes() -> list[tuple[str, str]]:
    """(doc, unit) for every unit that quotes `layernorm stability`: all of numerics.md above
    its appendix, and elsewhere each unit that names the command. A unit with a date quotes
    timings, which are cited with that date instead."""
    out = [("docs/numerics.md", u)
           for u in _units(NUMERICS.read_text().split("<!-- stability:begin -->")[0])]
    out += [(_rel(doc), u) for doc in DOCS if doc != NUMERICS
            for u in _units(doc.read_text()) if "layernorm stability" in u]
    return [(doc, u) for doc, u in out if not DATE.search(u)]


def test_figures_quoted_from_layernorm_stability_are_in_the_appendix():
    """Protects the prose of docs/numerics.md, and the README's summary, from drifting away from
    the appendix (which tests/test_stability.py keeps equal to the command's output): every
    figure they quote is one the appendix prints, or one derived rather than measured."""
    printed = {Decimal(f) for f in FIGURE.findall(_appendix())}
    missing = [f"{doc}: {fig} in {unit.strip()[:70]!r}"
               for doc, unit in _stability_quotes()
               for fig in FIGURE.findall(unit)
               if fig not in DERIVED and Decimal(fig) not in printed]
    assert missing == []
    assert any("README" in doc for doc, _ in _stability_quotes())


def _appendix_rows(title: str) -> list[list[str]]:
    """The cells of the appendix's Markdown table that follows ``title`` (an escaped pipe
    stays in its cell)."""
    table = _appendix().split(title, 1)[1].split("\n\n")[1]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            for line in table.splitlines()[2:]]


def _doc_table(doc: Path, header: str) -> list[list[str]]:
    """The cells of the Markdown table of ``doc`` whose header row starts with ``header``."""
    lines = doc.read_text().split(header, 1)[1].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _case(text: str) -> str:
    return text.replace("−", "-").replace("1e5", "1e+05")


def test_numerics_float64_table_is_table_2():
    """Protects section 7's table of float64 rows: each figure is that case's in table 2, for
    the reference and the fused CPU kernels."""
    rows = _appendix_rows("The library against the targets")
    for case, ref, fused in _doc_table(NUMERICS, "| float64 case (table 2) |"):
        for backend, quoted in (("reference", ref), ("fused CPU", fused)):
            row = next(r for r in rows if r[1:3] == ["float64", backend]
                       and (r[0] == _case(case) or r[0].startswith(_case(case) + ":")))
            assert [Decimal(f) for f in quoted.split(", ")] == [Decimal(f) for f in row[3:5]], \
                f"{case}, {backend}"


def test_numerics_family_summary_is_the_worst_of_table_4():
    """Protects section 8's summary: the worst y and dx of table 4 per norm and dtype (ulps for
    the half dtypes) over its rows and both backends, and the dgamma over many rows."""
    worst: dict[tuple[str, str], list[Decimal]] = {}
    for norm, case, dtype, _backend, y, dx, dgamma, y_ulps, dx_ulps, *_ in \
            _appendix_rows("The family against the targets"):
        if "many rows" in case:
            worst[norm, "dgamma"] = [Decimal(dgamma)]
            continue
        got = [y_ulps, dx_ulps] if dtype in ("float16", "bfloat16") else [y, dx]
        old = worst.get((norm, dtype), [Decimal(0), Decimal(0)])
        worst[norm, dtype] = [max(a, Decimal(b)) for a, b in zip(old, got, strict=True)]
    for norm, f64, f32, f16, bf16, dgamma in _doc_table(NUMERICS, "| norm | float64 y, dx |"):
        if norm == "target":
            continue
        for dtype, quoted in (("float64", f64), ("float32", f32), ("float16", f16),
                              ("bfloat16", bf16), ("dgamma", dgamma)):
            if quoted:
                assert [Decimal(f) for f in quoted.split(", ")] == worst[norm, dtype], \
                    f"{norm} {dtype}"


# ---------------------------------------------------------------- the cost model and benchmarks

def test_complexity_cost_table_is_what_the_command_prints(capsys):
    """Protects docs/complexity.md's cost table: it is the output of the command it names."""
    from layernorm.commands import cli

    argv = ["cost", "--shape", "4096x4096", "--dtype", "float32", "--dtype", "bfloat16"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out.strip()
    text = COMPLEXITY.read_text()
    assert f"`layernorm {' '.join(argv)}`" in " ".join(text.split())
    assert printed in text, "docs/complexity.md is stale: paste the command's table"


def test_every_speed_table_is_its_result_file():
    """Protects the docs' speed tables from going stale: each generated block (docs/torch.md's
    peers, docs/complexity.md's benchmark, docs/cpu-kernels.md's bandwidth, call cost and
    kernel times) is what its committed file under bench/results/ gives, as
    `python tools/doc_tables.py` writes it."""
    from layernorm.bench import doc_tables

    assert doc_tables.stale(ROOT) == []
    for block in doc_tables.BLOCKS.values():
        assert (ROOT / "bench" / "results" / block.result).is_file()


def test_a_changed_result_file_makes_its_table_stale(tmp_path):
    """Protects the check itself: a figure changed in a result file shows as its one stale
    table, the tool rewrites exactly that table, and a document without a block's markers is
    an error naming the block."""
    import shutil

    from layernorm.bench import doc_tables

    for sub in ("docs", "bench/results"):
        shutil.copytree(ROOT / sub, tmp_path / sub)
    path = tmp_path / "bench" / "results" / "call-cost.json"
    saved = json.loads(path.read_text())
    saved["rows"][0]["us"] += 1.0
    path.write_text(json.dumps(saved))
    assert doc_tables.stale(tmp_path) == ["call-cost"]
    assert doc_tables.update(tmp_path) == ["call-cost"]
    assert doc_tables.stale(tmp_path) == []
    assert f"| {saved['rows'][0]['part']} | {saved['rows'][0]['us']:.2f} |" in (
        tmp_path / "docs" / "cpu-kernels.md").read_text()
    doc = tmp_path / "docs" / "complexity.md"
    doc.write_text(doc.read_text().replace("<!-- end: complexity-bench -->", ""))
    with pytest.raises(ValueError, match="no block 'complexity-bench'"):
        doc_tables.stale(tmp_path)


def test_gpu_register_summary_is_its_listing():
    """Protects docs/gpu-fusion.md's summary of the compile listing it shows: the number of
    kernels and the largest register counts."""
    text = GPU.read_text()
    listing = re.search(r"\$ PYTHONPATH=src python tools/compile_kernels.py 90\n(.*?)```",
                        text, re.S).group(1)
    rows = [line for line in listing.splitlines() if " warps " in line]

    def most(warps: int, kind: str = "") -> int:
        return max(int(re.search(r"reg\s+(\d+)", line).group(1)) for line in rows
                   if re.search(rf"warps\s+{warps}\b", line) and line.startswith(kind))

    flat = " ".join(text.split())
    assert f"{len(rows)} distinct kernels" in flat
    assert f"use at most {most(32)} of the 64 registers" in flat
    assert f"at most {most(16)} of 128" in flat
    assert f"the short backward takes up to {most(16, 'bwd short')}" in flat


# ---------------------------------------------------------------- the README's commands and code

def test_readme_shows_what_make_report_prints():
    """Protects the README's account of `make report`: one line per section of the report, in
    order, then where the report went."""
    from layernorm.commands.report import SECTIONS

    lines = [f"report: {title} ..." for title, _ in SECTIONS]
    assert "\n".join([*lines, "report written to report/README.md"]) in README.read_text()


def test_readme_examples_run():
    """Protects the README's NumPy and fused-CPU examples: they run as written, in order (the
    PyTorch one needs a model of the reader's)."""
    namespace: dict = {}
    for code in re.findall(r"```python\n(.*?)```", README.read_text(), re.S):
        if "import torch" in code:
            continue
        if "layernorm.cpu" in code:
            pytest.importorskip("torch")
        exec(compile(code, str(README), "exec"), namespace)
    assert namespace["dx"].shape == namespace["x"].shape
