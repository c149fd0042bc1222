"""Check that every measured number in the README and the docs comes from a results file.

    python scripts/check_numbers.py [FILE.md ...]     # default: README.md and docs/**/*.md

A "measured number" is a decimal (``45.35``, ``0.682``) or a number with thousands separators
(``2,789``) in the prose and tables, outside code (fenced blocks and `inline code` are
commands and settings, not results). Each must appear, as written (thousands separators
aside), in the text of a committed results file under ``benchmarks/results/`` (``.md`` or
``.json``): quote a number as its results file prints it, not rounded again. Settings written
as decimals (a ratio of 0.8, a learning rate) are found there too, since every benchmark
records its settings. Version numbers (``2.13.0``, ``Python 3.11``, ``≥ 3.10``) are skipped.
A match is by text, so a claim with few digits (``0.5``) can match by chance; one with four
or more rarely does.

Prints each number it cannot trace, with its file and line, and exits 1 if there is one.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NUMBER = re.compile(
    r"(?<![\w.,/:-])(?<!Python )(?<!≥ )"  # not inside a word, path, ratio or version
    r"(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+)"  # 2,789 or 45.35
    r"(?![\w.]*\d)"
)
FENCE = re.compile(r"^\s*```")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")


def _claims(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, number as written) for every measured number outside code."""
    in_code = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if in_code:
            continue
        prose = LINK_TARGET.sub("]", INLINE_CODE.sub(" ", line))
        for match in NUMBER.finditer(prose):
            yield number, match.group(1)


class Sources:
    """Every number written in the results files."""

    def __init__(self, results: Path = RESULTS):
        texts = [p.read_text() for p in sorted(results.rglob("*")) if p.suffix in (".md", ".json")]
        plain = "\n".join(texts).replace(",", "")
        self.numbers = set(re.findall(r"\d+(?:\.\d+)?", plain))

    def traces(self, claim: str) -> bool:
        return claim.replace(",", "") in self.numbers


def check(paths: list[Path], sources: Sources | None = None) -> list[str]:
    """One line for every number in ``paths`` that no results file holds."""
    sources = sources or Sources()
    missing = []
    for path in paths:
        for line, claim in _claims(path):
            if not sources.traces(claim):
                name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                missing.append(f"{name}:{line}: {claim}")
    return missing


def default_paths() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def main(argv: list[str]) -> int:
    paths = [Path(arg).resolve() for arg in argv] or default_paths()
    missing = check(paths)
    for line in missing:
        print(f"untraced: {line}")
    print(f"{len(missing)} number(s) not found in benchmarks/results/", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
