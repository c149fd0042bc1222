"""Write ``lmcompress/cli/parsers.json``, the description of every ``compress-model`` parser
that answers ``--help`` without importing torch (:mod:`lmcompress.cli.help_spec`).

    PYTHONPATH=. python scripts/write_help_spec.py

Run it after changing a flag, a method option or a help text: ``tests/cli/test_help_spec.py``
fails until the file matches the parsers again.
"""

from __future__ import annotations

import json

from lmcompress.cli.help_spec import SPEC
from lmcompress.cli.parsers import described_parsers


def main() -> None:
    SPEC.write_text(json.dumps(described_parsers(), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {SPEC}")


if __name__ == "__main__":
    main()
