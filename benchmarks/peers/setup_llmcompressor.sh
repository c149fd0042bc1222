#!/usr/bin/env bash
# Set up llm-compressor in its own venv, to run it as a peer of lmcompress.
#   usage: benchmarks/peers/setup_llmcompressor.sh [VENV_DIR]   (default: <repo>/.venv-llmc)
#   - llm-compressor 0.14.0.1 pins transformers<=5.17 and compressed-tensors==0.19, which
#     conflict with our transformers: hence a separate venv.
#   - torch==2.13.0 goes in FIRST: it is the CPU build served from local disk; letting
#     llm-compressor resolve an unpinned torch would pull a multi-GB CUDA build.
#   - Idempotent: a venv whose llmcompressor already reports 0.14.0.1 is left as it is.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-$REPO/.venv-llmc}"
PYTHON=${PYTHON:-python3}
LLMC_VERSION=0.14.0.1
TORCH_VERSION=2.13.0

installed() {
  "$VENV/bin/python" - "$LLMC_VERSION" "$TORCH_VERSION" 2>/dev/null <<'PY'
import sys
from importlib.metadata import version
want_llmc, want_torch = sys.argv[1:]
ok = version("llmcompressor") == want_llmc and version("torch").split("+")[0] == want_torch
sys.exit(0 if ok else 1)
PY
}

if [ -x "$VENV/bin/python" ] && installed; then
  echo "llm-compressor $LLMC_VERSION is already set up in $VENV"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
# Keep torch where it is while llm-compressor resolves its own pins.
"$VENV/bin/python" -m pip install -q "llmcompressor==$LLMC_VERSION" "torch==$TORCH_VERSION"
"$VENV/bin/python" -m pip check || true
"$VENV/bin/python" - <<'PY'
from importlib.metadata import version
print(" ".join(f"{p}=={version(p)}" for p in
      ("llmcompressor", "torch", "transformers", "compressed-tensors", "datasets")))
PY
echo "llm-compressor is set up in $VENV"
