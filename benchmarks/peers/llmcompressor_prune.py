"""Prune a local HF model with llm-compressor's Wanda or SparseGPT, as a peer of lmcompress.

Run it with the peer venv's python (``benchmarks/peers/setup_llmcompressor.sh``), not ours:
llm-compressor 0.14.0.1 pins an older transformers. ``run_peer.py`` drives it.

The calibration windows come from ``--calib`` (a safetensors file with one int64 tensor
``input_ids`` of shape (nsamples, seq_len)), written by our side, so both tools calibrate on
exactly the same tokens. llm-compressor is run on CPU in float32 with:

- ``targets`` naming the decoder blocks (``model.layers.<i>``): the modifier hooks every
  ``Linear`` *inside* each matched block (``SparsityModifierBase.on_calibration_start``), so
  q/k/v/o and gate/up/down are pruned; ``lm_head`` is ignored explicitly. With the default
  ``targets=["Linear"]`` it would prune ``lm_head`` too, i.e. SmolLM2's tied embeddings.
- ``shuffle_calibration_samples=False``: the default shuffle draws from an unseeded sampler.

The model is saved as dense zeros (``save_compressed=False``) that plain transformers loads.
The saved weights are then checked against the input model, and the check is printed as one
JSON line at the end of stdout (``run_peer.py`` parses it).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

logger = logging.getLogger("llmcompressor_prune")

BLOCK_TARGETS = [r"re:model\.layers\.\d+$"]
IGNORE = ["re:.*lm_head"]
MASK_STRUCTURES = {"2:4": "2:4", "0.5": "0:0"}  # --sparsity -> mask_structure
_DECODER_LINEAR = re.compile(r"model\.layers\.\d+\..+\.weight")


def make_modifier(method: str, sparsity: str):
    common = {
        "sparsity": 0.5,
        "mask_structure": MASK_STRUCTURES[sparsity],
        "targets": BLOCK_TARGETS,
        "ignore": IGNORE,
    }
    if method == "sparsegpt":
        return SparseGPTModifier(block_size=128, dampening_frac=0.01, **common)
    return WandaPruningModifier(**common)


def load_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def calibration_dataset(calib: str) -> Dataset:
    input_ids = load_file(calib)["input_ids"]  # (nsamples, seq_len) int64
    if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
        raise SystemExit(
            f"{calib}: input_ids must be 2-D int64, got {input_ids.dtype} {tuple(input_ids.shape)}"
        )
    # Every window is full-length text, so the mask is all ones (no padding).
    return Dataset.from_dict(
        {"input_ids": input_ids.tolist(), "attention_mask": torch.ones_like(input_ids).tolist()}
    )


def check_pruned(original: dict, pruned: dict, sparsity: str) -> dict:
    """Compare the saved weights with the input model's.

    Every decoder linear (a 2-D ``model.layers.<i>.*.weight``) must be 2:4 (each group of 4
    consecutive input weights has >= 2 zeros) or ~50% sparse; every other tensor (embeddings,
    norms, and ``lm_head`` where it is stored) must be bit-identical.
    """
    linears = sorted(k for k, v in pruned.items() if _DECODER_LINEAR.fullmatch(k) and v.dim() == 2)
    fractions, changed_kept, pattern_ok = [], [], True
    for name in linears:
        W, W0 = pruned[name], original[name]  # (out, in)
        zero = W == 0
        fractions.append(zero.float().mean().item())
        if sparsity == "2:4":
            pattern_ok &= bool((zero.view(-1, 4).sum(-1) >= 2).all())
        kept = ~zero
        changed_kept.append((W[kept] != W0[kept]).float().mean().item())
    others = [k for k in original if k not in linears]
    changed_others = [k for k in others if k in pruned and not torch.equal(pruned[k], original[k])]
    missing = sorted(set(original) - set(pruned))
    if sparsity == "0.5":
        pattern_ok = all(0.5 <= f <= 0.51 for f in fractions)
    return {
        "decoder_linears": len(linears),
        "pattern_ok": pattern_ok,
        "sparsity_min": round(min(fractions), 5),
        "sparsity_max": round(max(fractions), 5),
        "kept_weights_changed": round(sum(changed_kept) / len(changed_kept), 5),
        "others_untouched": not changed_others and not missing,
        "changed_others": changed_others,
        "missing": missing,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="local safetensors HF model directory")
    parser.add_argument("--method", required=True, choices=["wanda", "sparsegpt"])
    parser.add_argument("--sparsity", required=True, choices=sorted(MASK_STRUCTURES))
    parser.add_argument("--calib", required=True, help="safetensors file with input_ids")
    parser.add_argument("--output", required=True, help="directory to save the pruned model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    dataset = calibration_dataset(args.calib)
    nsamples, seq_len = len(dataset), len(dataset[0]["input_ids"])
    model, tokenizer = load_model(args.model), AutoTokenizer.from_pretrained(args.model)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    logger.info("%s %s on %d x %d tokens", args.method, args.sparsity, nsamples, seq_len)
    model = oneshot(
        model=model,
        processor=tokenizer,
        dataset=dataset,
        recipe=[make_modifier(args.method, args.sparsity)],
        num_calibration_samples=nsamples,
        max_seq_length=seq_len,
        shuffle_calibration_samples=False,
    )
    out = Path(args.output)
    model.save_pretrained(out, save_compressed=False)
    tokenizer.save_pretrained(out)
    del model

    saved = load_model(str(out))  # what an evaluator will load, through plain transformers
    summary = check_pruned(original, saved.state_dict(), args.sparsity)
    summary["tied_embeddings"] = saved.lm_head.weight is saved.model.embed_tokens.weight
    summary.update(method=args.method, sparsity=args.sparsity, nsamples=nsamples, seq_len=seq_len)
    ok = summary["pattern_ok"] and summary["others_untouched"] and summary["decoder_linears"] > 0
    summary["ok"] = ok
    print(json.dumps(summary), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
