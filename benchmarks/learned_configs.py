"""The recipes ``benchmarks.learned`` runs on SmolLM2-135M: each a name, the sparsity, one or
more ``compress-model`` stages (a method and its extra flags; a later stage may name an earlier
stage's output as ``{stage1}``, ``{stage2}``, ...) and a note. The SparseGPT rows are the
baselines every learned row is divided by: run them on the same machine with the same thread
count (``OMP_NUM_THREADS``) as the learned rows."""

from __future__ import annotations

from typing import Any

from benchmarks.subnet_configs import BLOCKWISE as SUBNET_BLOCKWISE

# fmt: off
# MaskLLM block-wise, the best recipe of benchmarks.maskllm (blockwise-refit-20-st): 20 steps of
# one batch of 4 windows per block, straight-through hard samples in the last 20 %.
MASKLLM_BLOCKWISE = [
    "--blockwise", "--steps", "20", "--batch-size", "4", "--lr", "1e-3", "--tau", "4", "0.05",
    "--kappa", "100", "500", "--prior", "sparsegpt", "--prior-strength", "3",
    "--weight-reg", "1e-5", "--eval-windows", "2", "--straight-through-from", "0.8",
]
# The end-to-end pass after it (from the dense weights): the block-wise masks as the prior,
# distillation from the dense model's logits, then the kept weights re-fitted (SparseGPT's OBS
# updates under the mask).
def maskllm_e2e(steps: int, *extra: str, prior: tuple[str, ...] = ("--prior-from", "{stage1}")
                ) -> list[str]:
    return [
        "--steps", str(steps), "--batch-size", "1", "--lr", "2e-4", "--tau", "4", "0.05",
        "--kappa", "100", "500", *prior, "--prior-strength", "3",
        "--weight-reg", "1e-5", "--distill", "--refit", "sparsegpt", "--eval-windows", "2",
        "--eval-every", str(max(steps // 4, 1)), "--noise", "pool", *extra,
    ]


def two_pass(steps: int, *extra: str) -> list[dict[str, Any]]:
    return [
        {"method": "maskllm", "args": [*MASKLLM_BLOCKWISE, "--refit", "sparsegpt"]},
        {"method": "maskllm", "args": maskllm_e2e(steps, *extra)},
    ]


# W8A8 int8 (dynamic per-token activations) on an earlier stage's output: the 2:4 -> int8 rows
INT8_AFTER_STAGE1 = {"method": "int8", "sparsity": None, "checkpoint": "{stage1}", "args": []}
# each block's kept weights then trained on the block error, the masks fixed
TUNE = ["--tune-steps", "20", "--tune-lr", "1e-3"]
MASKLLM_BLOCKWISE_REFIT = {
    "method": "maskllm", "args": [*MASKLLM_BLOCKWISE, "--refit", "sparsegpt"],
}

CONFIGS: dict[str, dict[str, Any]] = {
    "sparsegpt-24": {
        "sparsity": "2:4", "stages": [{"method": "sparsegpt", "args": []}],
        "note": "SparseGPT 2:4, the baseline of every 2:4 row (this machine, this thread count)",
    },
    "maskllm-blockwise": {
        "sparsity": "2:4",
        "stages": [MASKLLM_BLOCKWISE_REFIT],
        "note": "block-wise (20 steps x 4 windows per block, straight-through in the last 20 %), "
                "then the kept weights re-fitted: the best recipe before this benchmark",
    },
    "maskllm-2pass-100": {
        "sparsity": "2:4", "stages": two_pass(100),
        "note": "maskllm-blockwise (stage 1, scored too), then 100 end-to-end steps of one "
                "window (pooled noise) with distillation from the dense weights, the block-wise "
                "masks as the prior; then the re-fit",
    },
    "maskllm-e2e-refit-100": {
        "sparsity": "2:4",
        "stages": [{"method": "maskllm",
                    "args": maskllm_e2e(100, prior=("--prior", "sparsegpt"))}],
        "note": "the paper's end-to-end pass (SparseGPT prior on the dense weights, 100 steps "
                "of one window, pooled noise) with distillation, then the re-fit: the "
                "block-wise masks start the end-to-end pass at hard ppl ~250 on the dense "
                "weights (maskllm-2pass-100), the SparseGPT prior at ~85",
    },
    "sparsegpt-24-int8": {
        "sparsity": "2:4", "baseline": "sparsegpt-24",
        "stages": [{"method": "sparsegpt", "args": []}, INT8_AFTER_STAGE1],
        "note": "prune then quantize: SparseGPT 2:4, then int8 (W8A8, per-channel weights, "
                "per-token activations) on its output; the baseline of the int8 rows",
    },
    "maskllm-blockwise-int8": {
        "sparsity": "2:4", "baseline": "sparsegpt-24-int8",
        "stages": [MASKLLM_BLOCKWISE_REFIT, INT8_AFTER_STAGE1],
        "note": "maskllm-blockwise's masks (learned in float), then int8",
    },
    "maskllm-blockwise-tune": {
        "sparsity": "2:4",
        "stages": [{"method": "maskllm",
                    "args": [*MASKLLM_BLOCKWISE, "--refit", "sparsegpt", *TUNE]}],
        "note": "maskllm-blockwise, then each block's kept weights trained 20 steps (AdamW, lr "
                "1e-3, cosine, no weight decay) on the block error under the fixed masks",
    },
    "maskllm-blockwise-tune-int8": {
        "sparsity": "2:4", "baseline": "sparsegpt-24-int8",
        "stages": [{"method": "maskllm",
                    "args": [*MASKLLM_BLOCKWISE, "--refit", "sparsegpt", *TUNE]},
                   INT8_AFTER_STAGE1],
        "note": "maskllm-blockwise-tune's masks and tuned weights, then int8",
    },
    "maskllm-blockwise-qa-int8": {
        "sparsity": "2:4", "baseline": "sparsegpt-24-int8",
        "stages": [
            {"method": "maskllm",
             "args": [*MASKLLM_BLOCKWISE, "--refit", "sparsegpt", "--quant-aware", "int8"]},
            INT8_AFTER_STAGE1,
        ],
        "note": "maskllm-blockwise learned under int8 fake quantization (weights per channel, "
                "inputs per token, straight-through), the re-fit quantizing column by column "
                "(GPTQ-style), then int8",
    },
    "sparsegpt-50": {
        "sparsity": "0.5", "stages": [{"method": "sparsegpt", "args": []}],
        "note": "SparseGPT 50 % unstructured, the baseline of the 50 % rows",
    },
    "subnet-50-blockwise-tune": {
        "sparsity": "0.5",
        "stages": [{"method": "subnet",
                    "args": [*SUBNET_BLOCKWISE, "--constraint", "penalty", "--refit", "sparsegpt",
                             *TUNE]}],
        "note": "subnet block-wise (benchmarks.subnet's subnet-50-refit: 20 steps x 4 windows "
                "per block, AdamW lr 0.3 on the keep logits, row scales, keep-rate penalty), "
                "the kept weights re-fitted, then tuned 20 steps as maskllm-blockwise-tune",
    },
    "subnet-24-blockwise-tune": {
        "sparsity": "2:4",
        "stages": [{"method": "subnet",
                    "args": [*SUBNET_BLOCKWISE, "--refit", "sparsegpt", *TUNE]}],
        "note": "subnet block-wise with 2:4 patterns (benchmarks.subnet's subnet-24-refit), "
                "re-fitted, then tuned: the same budget as maskllm-blockwise-tune",
    },
    "subnet-24-blockwise-tune-schedules": {
        "sparsity": "2:4",
        "stages": [{"method": "subnet",
                    "args": [*SUBNET_BLOCKWISE, "--tau", "4", "--tau-end", "0.05", "--kappa", "0.5",
                             "2.5", "--refit", "sparsegpt", *TUNE]}],
        "note": "subnet-24-blockwise-tune with MaskLLM's schedules on the 2:4 sampler: tau 4 "
                "-> 0.05, kappa 0.5 -> 2.5, where MaskLLM's 100 -> 500 put its prior's "
                "candidate logits (0.03 per shared weight at init std 0.01) at 3 -> 15 per "
                "shared weight, subnet's +-3 logits at 6 -> 30",
    },
}
# fmt: on
