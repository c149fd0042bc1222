"""Quantize a local HF model with llm-compressor's GPTQ (W4A16 by default), as a peer of lmcompress.

Run it with the peer venv's python (``benchmarks/peers/setup_llmcompressor.sh``), not ours:
llm-compressor 0.14.0.1 pins an older transformers. ``run_peer.py --method gptq`` drives it.

The calibration windows come from ``--calib`` (a safetensors file with one int64 tensor
``input_ids`` of shape (nsamples, seq_len)), written by our side, so both tools calibrate on
exactly the same tokens. llm-compressor is run on CPU in float32 with ``GPTQModifier``:

- one config group targeting every ``Linear`` but ``lm_head`` (SmolLM2's head is its tied
  embedding matrix: quantizing it would quantize the embeddings too), weights ``int``,
  ``--bits`` (4), symmetric, ``strategy: group`` with ``--group-size`` (128): W4A16 as the
  ``W4A16`` preset scheme defines it, no activation quantization;
- GPTQModifier's own defaults otherwise: ``block_size=128``, ``dampening_frac=0.01``,
  ``actorder="static"`` (act-order with groups fixed on the original column order: what a
  user of ``GPTQModifier(scheme="W4A16")`` gets; the same static groups as lmcompress' GPTQ);
- ``shuffle_calibration_samples=False``: the default shuffle draws from an unseeded sampler.

After ``oneshot`` every quantized layer's ``weight`` holds its quantize-dequantized values
(``q * weight_scale``). The script checks that they lie on the grid (every weight / its group's
scale an integer in ``[-2^(bits-1), 2^(bits-1) - 1]``, groups of consecutive input columns) and
saves them as a plain dense fp32 model (no ``quantization_config``), so that our
``compress-model eval OUT`` scores exactly the weights llm-compressor produced. The check is
printed as one JSON line at the end of stdout (``run_peer.py`` parses it).
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
from llmcompressor.modifiers.quantization import GPTQModifier
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

logger = logging.getLogger("llmcompressor_gptq")

IGNORE = ["lm_head"]
_DECODER_LINEAR = re.compile(r"model\.layers\.\d+\..+")


def make_modifier(
    bits: int, group_size: int, actorder: str | None, observer: str = "minmax"
) -> GPTQModifier:
    """``observer="mse"``: llm-compressor's "mse" weight observer at its own defaults (the
    range shrunk by up to 20 %, |error|^2.4, stopping after 5 steps without a better one);
    "minmax": its default observer (none named)."""
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": group_size,
    }
    if observer != "minmax":
        weights["observer"] = observer
    return GPTQModifier(
        config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
        ignore=IGNORE,
        block_size=128,
        dampening_frac=0.01,
        actorder=actorder,
    )


def load_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def calibration_dataset(calib: str) -> Dataset:
    input_ids = load_file(calib)["input_ids"]  # (nsamples, seq_len) int64
    if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
        raise SystemExit(
            f"{calib}: input_ids must be 2-D int64, got {input_ids.dtype} {tuple(input_ids.shape)}"
        )
    return Dataset.from_dict(
        {"input_ids": input_ids.tolist(), "attention_mask": torch.ones_like(input_ids).tolist()}
    )


@torch.no_grad()
def check_quantized(model, original: dict, bits: int, group_size: int) -> dict:
    """Every decoder linear quantized: weight / scale an integer in the signed ``bits`` range
    per group of ``group_size`` consecutive input columns; every other tensor untouched."""
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    names, worst, out_of_range, changed = [], 0.0, 0, []
    for name, module in model.named_modules():
        if not (isinstance(module, torch.nn.Linear) and _DECODER_LINEAR.fullmatch(name)):
            continue
        scale = getattr(module, "weight_scale", None)
        if scale is None:
            changed.append(f"{name} (not quantized)")
            continue
        names.append(name)
        W = module.weight.float()  # (out, in)
        out_features, in_features = W.shape
        groups = W.view(out_features, in_features // group_size, group_size)
        q = groups / scale.float().view(out_features, -1, 1)
        worst = max(worst, (q - q.round()).abs().max().item())
        out_of_range += int(((q.round() < low) | (q.round() > high)).sum())
    quantized = {f"{n}.weight" for n in names}
    state = model.state_dict()
    for key, value in original.items():
        if key in quantized:
            continue
        if key not in state or not torch.equal(state[key], value):
            changed.append(key)
    return {
        "decoder_linears": len(names),
        "grid_max_error": round(worst, 6),  # |w / s - round(w / s)|, in units of the step
        "out_of_range": out_of_range,
        "others_untouched": not changed,
        "changed_others": changed,
        "ok": bool(names) and worst < 1e-3 and out_of_range == 0 and not changed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="local safetensors HF model directory")
    parser.add_argument("--calib", required=True, help="safetensors file with input_ids")
    parser.add_argument("--output", required=True, help="directory to save the quantized model")
    parser.add_argument("--bits", type=int, default=4, choices=[3, 4, 8])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument(
        "--actorder", default="static", choices=["static", "none"], help="GPTQ column order"
    )
    parser.add_argument("--observer", default="minmax", choices=["minmax", "mse"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    dataset = calibration_dataset(args.calib)
    nsamples, seq_len = len(dataset), len(dataset[0]["input_ids"])
    model, tokenizer = load_model(args.model), AutoTokenizer.from_pretrained(args.model)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    actorder = None if args.actorder == "none" else args.actorder
    logger.info(
        "gptq w%da16 g%d actorder=%s on %d x %d tokens",
        args.bits, args.group_size, actorder, nsamples, seq_len,
    )  # fmt: skip
    model = oneshot(
        model=model,
        processor=tokenizer,
        dataset=dataset,
        recipe=[make_modifier(args.bits, args.group_size, actorder, args.observer)],
        num_calibration_samples=nsamples,
        max_seq_length=seq_len,
        shuffle_calibration_samples=False,
    )
    summary = check_quantized(model, original, args.bits, args.group_size)

    # A plain dense model holding the quantize-dequantized weights (no quantization_config).
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if k in original}
    del model
    dense = load_model(args.model)
    dense.load_state_dict(weights, strict=True)
    out = Path(args.output)
    dense.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary["tied_embeddings"] = dense.lm_head.weight is dense.model.embed_tokens.weight
    summary.update(
        method="gptq", bits=args.bits, group_size=args.group_size, actorder=actorder,
        observer=args.observer,
        nsamples=nsamples, seq_len=seq_len,
    )  # fmt: skip
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
