#!/usr/bin/env bash
# The GPU checks as one script, for a machine with a CUDA GPU (run from the repo root):
#   OUT=dir bash scripts/gpu_checks.sh
# 1. the tests marked `gpu`: the Triton kernels compiled (TRITON_INTERPRET=0), spies proving
#    the Triton path ran, results against the CPU reference;
# 2. the packed 2:4 kernel benchmark (benchmarks.kernels) against cuBLAS and cuSPARSELt, with
#    a time budget for the shape sweep (shapes left are recorded as skipped).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
nvidia-smi -L | tee "$OUT/machine.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" \
    | tee -a "$OUT/machine.txt"
timeout "${TESTS_TIMEOUT:-180}" python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
    tests/kernels tests/jobs/test_preflight_models.py tests/compressor/calibration/test_gradients.py \
    2>&1 | tee "$OUT/gpu_tests.log"
timeout "${BENCH_TIMEOUT:-240}" python3 -m benchmarks.kernels --results-dir "$OUT/kernels" \
    --budget-minutes "${BUDGET_MINUTES:-2}" 2>&1 | tee "$OUT/kernels.log"
