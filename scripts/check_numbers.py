"""Check that every measured number in the README and the docs comes from the results file it
cites.

    python scripts/check_numbers.py [FILE.md ...]     # default: README.md and docs/**/*.md

A "measured number" is, outside code (fenced blocks and `inline code` are commands and
settings, not results):

- a decimal (``45.35``, ``0.682``) or a number with thousands separators (``2,789``);
- an integer with a unit of time, memory or speed (``8230 s``, ``539 s``, ``6332 MiB``,
  ``12 tok/s``);
- a ratio (``1.220×``, ``within 1.3 × dense``), which is derived, not printed by a benchmark.

**Which file.** A number is looked up in the results files (``benchmarks/results/``, ``.md`` or
``.json``; a cited directory means its files) that its context cites, by a link or by naming
the file (``benchmarks/results/lowrank.md``): its sentence (a table row is one), else its
paragraph or table, else its section (from its heading to the next), else its page. Only a
page that cites no results file at all is checked against every results file. A number must
appear there as written (thousands separators aside): quote a number as its results file
prints it, not rounded again. Version numbers (``2.13.0``, ``Python 3.11``, ``≥ 3.10``) are
skipped.

**Ratios.** A ratio is traced when the cited files print it as a ratio (``1.09×``, ``1.09x``,
or in a table column headed ``× dense``, ``÷ SparseGPT``, ``vs fp32``), or when it is the
quotient, rounded as written, of two numbers of its sentence (``23.65 / 19.38 = 1.220×``), or
of the two named in a marker on its line, ``<!-- derived: 23.65 / 19.38 -->`` (each looked up
as any number), or when its line marks it as a goal, not a measurement: ``<!-- goal -->``.

Prints each number it cannot trace, with its file, line and the files it was looked up in, and
exits 1 if there is one.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NOT_AFTER = r"(?<![\w.,/:-])(?<!Python )(?<!≥ )"  # not inside a word, path, ratio or version
UNIT = r"\s?(?:s|ms|min|h|MiB|GiB|KiB|MB|GB|kB|tok/s|tokens/s)(?![\w/])"
NUMBER = re.compile(
    NOT_AFTER + r"(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+)(?![\w.]*\d)"  # 2,789 or 45.35
    r"|" + NOT_AFTER + r"(\d+)(?=" + UNIT + r")"  # 8230 s, 6332 MiB
)
RATIO_SIGN = re.compile(r"\s?[×x](?!\s?\d)(?!\w)")  # 1.220×, 1.3 × dense; not 576 × 1,024
FENCE = re.compile(r"^\s*```")
HEADING = re.compile(r"^#{1,6}\s")
LIST_ITEM = re.compile(r"^\s{0,3}(?:[-*+]|\d+\.)\s")  # a paragraph of its own
MASKED = re.compile(r"`[^`]*`|\]\([^)]*\)|<!--.*?-->")  # inline code, link targets, comments
CITE = re.compile(r"results/([\w.-]+(?:/[\w.-]+)*/?)")
DERIVED = re.compile(r"<!--\s*derived:\s*([\d.,]+)\s*/\s*([\d.,]+)\s*-->")
GOAL = re.compile(r"<!--\s*goal\s*-->")
SENTENCE_END = re.compile(r"(?<=[.!?;])\s+(?=[A-Z(*_\[])|\n(?=\s*(?:[-*+]|\d+\.|\|)\s)")


def _numbers(text: str) -> set[str]:
    return set(re.findall(r"\d+(?:\.\d+)?", text.replace(",", "")))


def _ratio_columns(text: str) -> Iterator[str]:
    """The cells of every Markdown table column whose header is a ratio (``× dense``, ``÷
    SparseGPT``, ``vs fp32``)."""
    columns: list[bool] = []
    for line in text.splitlines():
        if not line.startswith("|"):
            columns = []
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not columns:
            columns = [bool(re.search(r"[×÷]|\bvs\b|\bx\b", cell)) for cell in cells]
        elif not set(line) <= set("|-: "):
            yield from (cell for cell, ratio in zip(cells, columns, strict=False) if ratio)


def _ratios(text: str) -> set[str]:
    """Numbers printed as ratios: followed by ``×`` or ``x``, or in a ratio column."""
    printed = re.findall(r"(\d+(?:\.\d+)?)\s?[×x]", text.replace(",", ""))
    return set(printed) | _numbers(" ".join(_ratio_columns(text)))


class Sources:
    """The numbers (and the ratios) each results file prints."""

    def __init__(self, results: Path = RESULTS):
        self.results = results
        files = [p for p in sorted(results.rglob("*")) if p.suffix in (".md", ".json")]
        texts = {p.relative_to(results).as_posix(): p.read_text() for p in files}
        self.numbers = {name: _numbers(text) for name, text in texts.items()}
        self.ratios = {name: _ratios(text) for name, text in texts.items()}

    def files(self, cited: str) -> list[str]:
        """The results files a citation (``lowrank.md``, ``speed_compiled/``) names."""
        cited = cited.rstrip("/.")
        if cited in self.numbers:
            return [cited]
        return [name for name in self.numbers if name.startswith(f"{cited}/")]

    def traces(self, claim: str, files: list[str] | None = None) -> bool:
        names = self.numbers if files is None else files
        return any(claim.replace(",", "") in self.numbers[name] for name in names)

    def traces_ratio(self, claim: str, files: list[str] | None) -> bool:
        names = self.numbers if files is None else files
        return any(claim.replace(",", "") in self.ratios[name] for name in names)


class Claim(NamedTuple):
    line: int
    text: str
    ratio: bool
    sentence: str  # its sentence, code and link targets blanked
    cited: list[str]  # the results files its context cites (empty: none anywhere on the page)
    raw_line: str


def _mask(line: str) -> str:
    """``line`` with inline code, link targets and comments blanked, offsets kept."""
    return MASKED.sub(lambda m: " " * len(m.group()), line)


def _blocks(lines: list[str]) -> Iterator[tuple[int, list[int]]]:
    """(section index, line indices) of each paragraph, list item or table outside fenced
    code."""
    section, block, in_code = 0, [], False
    for index, line in enumerate(lines):
        if FENCE.match(line):
            in_code = not in_code
        if in_code or FENCE.match(line) or not line.strip() or HEADING.match(line):
            if block:
                yield section, block
            block = []
            section += bool(HEADING.match(line)) and not in_code
            continue
        if LIST_ITEM.match(line) and block:
            yield section, block
            block = []
        block.append(index)
    if block:
        yield section, block


def _cited(text: str, sources: Sources) -> list[str]:
    return sorted({name for cite in CITE.findall(text) for name in sources.files(cite)})


def _claims(path: Path, sources: Sources) -> Iterator[Claim]:
    lines = path.read_text().splitlines()
    blocks = list(_blocks(lines))
    sections: dict[int, list[str]] = {}
    for section, block in blocks:
        sections.setdefault(section, [])
        sections[section] += _cited("\n".join(lines[i] for i in block), sources)
    page = sorted({name for names in sections.values() for name in names})
    for section, block in blocks:
        raw = "\n".join(lines[i] for i in block)
        masked = "\n".join(_mask(lines[i]) for i in block)
        starts = [0, *(m.end() for m in SENTENCE_END.finditer(masked)), len(masked) + 1]
        block_cited = _cited(raw, sources)
        for start, end in zip(starts, starts[1:], strict=False):
            sentence_cited = _cited(raw[start:end], sources)
            cited = sentence_cited or block_cited or sorted(set(sections[section])) or page
            for match in NUMBER.finditer(masked, start, end):
                index = block[masked.count("\n", 0, match.start())]
                ratio = bool(RATIO_SIGN.match(masked, match.end()))
                text = match.group(1) or match.group(2)
                yield Claim(index + 1, text, ratio, masked[start:end], cited, lines[index])


def _quotient_matches(claim: str, numerator: str, denominator: str) -> bool:
    a, b = float(numerator.replace(",", "")), float(denominator.replace(",", ""))
    decimals = len(claim.partition(".")[2])
    return b != 0 and f"{a / b:.{decimals}f}" == claim


def _traced(claim: Claim, sources: Sources) -> bool:
    files = claim.cited or None
    if not claim.ratio:
        return sources.traces(claim.text, files)
    if GOAL.search(claim.raw_line) or sources.traces_ratio(claim.text, files):
        return True
    for a, b in DERIVED.findall(claim.raw_line):
        if sources.traces(a) and sources.traces(b) and _quotient_matches(claim.text, a, b):
            return True
    numbers = [m.group(1) or m.group(2) for m in NUMBER.finditer(claim.sentence)]
    numbers = [n for n in numbers if n != claim.text and sources.traces(n, files)]
    return any(_quotient_matches(claim.text, a, b) for a in numbers for b in numbers if a != b)


def check(paths: list[Path], sources: Sources | None = None) -> list[str]:
    """One line for every number in ``paths`` that the results files its context cites do not
    hold (or, for a ratio, that nothing recomputes)."""
    sources = sources or Sources()
    missing = []
    for path in paths:
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for claim in _claims(path, sources):
            if not _traced(claim, sources):
                where = ", ".join(claim.cited) if claim.cited else "any results file"
                kind = "ratio " if claim.ratio else ""
                missing.append(f"{name}:{claim.line}: {kind}{claim.text} (looked in {where})")
    return missing


def default_paths() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def main(argv: list[str]) -> int:
    paths = [Path(arg).resolve() for arg in argv] or default_paths()
    missing = check(paths)
    for line in missing:
        print(f"untraced: {line}")
    print(f"{len(missing)} number(s) not traced to the results file cited", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
