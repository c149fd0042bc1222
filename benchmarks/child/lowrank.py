"""The jobs of the ``lowrank`` table (``benchmarks/tables/lowrank.yaml``), each in a process of
its own.

    python -m benchmarks.child.lowrank stats KIND STATS_DIR SETTINGS_JSON    # collect, cache
    python -m benchmarks.child.lowrank apply SPEC_JSON STATS_DIR SETTINGS_JSON   # one row

``stats``: one calibration pass of the dense model (``activations``: ASVD's and SVD-LLM's input
statistics; ``gradients``: FWSVD's and both GFWSVD variants' gradient statistics), saved as each
method's Stats file. ``apply``: factorise with the cached statistics (``Method.apply``; block by
block with a ``variant``) and score with the library's evaluate step on the text a job reads
(:class:`JobText`). A row's spec is its name and recipe: ``method`` (a key of :data:`METHODS`),
its options (``ratio``, ``allocation``, ``distill_steps``, ...; ``calib`` and ``nsamples`` are
the job's text), ``variant`` (its name: block by block) and ``residual`` (then SparseGPT on
each factorised layer's residual). The settings are the table's (checkpoint, corpora, seq_len,
nsamples, calib, seed, eval_tokens). Each prints its numbers as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmcompress import compress
from lmcompress.compressor.calibration.gradients import gradient_statistics
from lmcompress.compressor.formats.low_rank import LowRankLinear
from lmcompress.compressor.method import Stats
from lmcompress.compressor.model.loading import load_model
from lmcompress.compressor.model.surgery import LayerSelection, replace_module, weight_matrix
from lmcompress.jobs.evaluate import JobText, evaluate
from lmcompress.jobs.options import RunOptions
from lmcompress.methods import get_method
from lmcompress.methods.sparsegpt import SparseGPTConfig
from lmcompress.methods.svd import ASVDConfig, SVDLLMConfig
from lmcompress.methods.svd.activation import ASVD, SVDLLM, forward_statistics
from lmcompress.methods.svd.fisher import SampleStore, fwsvd_stats, gfwsvd_stats, sample_count
from lmcompress.methods.svd.sequential import compress_sequential

# a row's method -> (its cached stats file, option overrides)
METHODS = {
    "svd": (None, {}),
    "asvd": ("asvd", {}),
    "svd-llm": ("svd-llm", {}),
    "fwsvd": ("fwsvd", {}),
    "gfwsvd": ("gfwsvd-kfac", {}),
    "gfwsvd-nearest": ("gfwsvd-nearest", {"kronecker": "nearest"}),
}
JOB_KEYS = ("calib", "nsamples")  # a row's options that change the job's text
NOT_OPTIONS = ("name", "method", "variant", "residual", *JOB_KEYS)
SETTINGS = {"checkpoint": "smollm2-135m", "corpora": ["wiki-test", "lee"], "seq_len": 512,
            "nsamples": 128, "calib": "wiki-calib", "seed": 0}  # fmt: skip


def setup(settings: dict[str, Any], evaluates: bool = True) -> tuple[nn.Module, JobText]:
    """The dense model and the text of the job: ``nsamples`` calibration windows (wiki-calib,
    or sampled from the dense model with ``calib="self"``), and the eval corpora."""
    torch.set_grad_enabled(False)
    settings = {**SETTINGS, **settings}
    model, tokenizer = load_model(settings["checkpoint"])
    options = RunOptions(
        checkpoint=settings["checkpoint"],
        calib=settings["calib"],
        nsamples=settings["nsamples"],
        seq_len=settings["seq_len"],
        seed=settings["seed"],
        eval=tuple(settings["corpora"]),
        eval_tokens=settings.get("eval_tokens") or 0,
    )
    return model, JobText(tokenizer, options, evaluates=evaluates, model=model)


def activation_stats(model: nn.Module, calib: torch.Tensor, stats_dir: Path) -> dict[str, Any]:
    start = time.perf_counter()
    asvd, svdllm = ASVD(ASVDConfig()), SVDLLM(SVDLLMConfig())
    layers = asvd.validate(model)
    observers = {name: [asvd.observer(), svdllm.observer()] for name in layers}
    forward_statistics(model, calib, observers, 4, torch.device("cpu"), "inputs")
    for index, method in enumerate((asvd, svdllm)):
        tensors = {f"{n}.{method.key}": method.read(o[index]) for n, o in observers.items()}
        Stats(tensors=tensors).save(stats_dir / f"{method.name}.safetensors")
    return {"pass_seconds": round(time.perf_counter() - start, 1)}


def gradient_stats(model: nn.Module, calib: torch.Tensor, stats_dir: Path) -> dict[str, Any]:
    start, nsamples = time.perf_counter(), calib.shape[0]
    layers = LayerSelection().select(model)
    samples = SampleStore(layers, sample_count(nsamples, 8))
    torch.set_grad_enabled(True)
    found = gradient_statistics(
        model, calib, layers, batch_size=8, checkpointing=True, on_sample=samples
    )
    pass_seconds = time.perf_counter() - start
    fwsvd_stats(found, nsamples).save(stats_dir / "fwsvd.safetensors")
    gfwsvd_stats(found, nsamples).save(stats_dir / "gfwsvd-kfac.safetensors")
    for layer in found.values():  # free what the nearest product does not need
        layer.fisher = layer.dd = None  # (gfwsvd_stats reads only xx when given samples)
    nearest = gfwsvd_stats(found, nsamples, samples)
    nearest.save(stats_dir / "gfwsvd-nearest.safetensors")
    return {
        "pass_seconds": round(pass_seconds, 1),
        "samples": nearest.meta["samples"],
        "power_seconds": nearest.meta["power_seconds"],
        "power_iterations": nearest.meta["power_iterations"],
    }


def stats(kind: str, stats_dir: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Collect the statistics of ``kind`` once and save each method's Stats file."""
    model, text = setup(settings, evaluates=False)
    stats_dir.mkdir(parents=True, exist_ok=True)
    collect = activation_stats if kind == "activations" else gradient_stats
    return collect(model, text.calibration(), stats_dir)


def factorise(model: nn.Module, spec: dict[str, Any], stats_dir: Path, text: JobText) -> dict:
    """The row's method with its cached statistics (``combined``: GFWSVD on the MLP layers,
    then SparseGPT 2:4 on the attention layers); its timings, kept fraction and ranks."""
    combined = spec["name"] == "combined"
    name = "gfwsvd" if combined else spec["method"]
    stats_file, overrides = METHODS[name]
    method_class = get_method("gfwsvd" if name.startswith("gfwsvd") else name)
    options = {"allocation": "uniform", **{k: v for k, v in spec.items() if k not in NOT_OPTIONS}}
    if combined:
        options["include"] = ("model.layers.*.mlp.*",)
    method = method_class(method_class.config_class(**options, **overrides))
    cached = Stats() if stats_file is None else Stats.load(stats_dir / f"{stats_file}.safetensors")
    start = time.perf_counter()
    if spec.get("variant"):  # block by block on the compressed inputs (the calibration windows)
        with torch.no_grad():
            report = compress_sequential(method, model, text.calibration(), cached)
    else:
        report = method.apply(model, cached)
    result: dict[str, Any] = {"apply_seconds": round(time.perf_counter() - start, 1)}
    params, kept = report.params, report.params_kept
    if combined:
        start = time.perf_counter()
        attention = SparseGPTConfig(sparsity="2:4", include=("model.layers.*.self_attn.*",))
        pruned = compress(model, attention, text.calibration())
        result["sparsegpt_seconds"] = round(time.perf_counter() - start, 1)
        params, kept = params + pruned.params, kept + pruned.params_kept
    result["params_kept_fraction"] = kept / params
    result["ranks"] = report.extra["ranks"]
    if "block_curves" in report.extra:  # --tune-steps: each block's error before / after
        result["block_errors"] = [
            {"block": c["block"], "before": c["hard_before"], "after": c["hard_after"]}
            for c in report.extra["block_curves"]
        ]
    return result


class ResidualSum(nn.Module):
    """A factor pair beside a linear holding the rest of the dense weight, ``W − B A``; the
    output is their sum (the residual linear is then pruned 2:4)."""

    def __init__(self, low_rank: LowRankLinear, residual: torch.Tensor) -> None:
        super().__init__()
        self.low_rank = low_rank
        self.residual = nn.Linear(residual.shape[1], residual.shape[0], bias=False)
        self.residual.weight.data = residual  # (out, in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.low_rank(x) + self.residual(x)


def residual_row(model: nn.Module, spec: dict[str, Any], stats_dir: Path, text: JobText) -> dict:
    """GFWSVD at the row's ratio, then SparseGPT ``spec["residual"]`` (2:4) on every factorised
    layer's residual ``W − B A``, fitted to the layer's inputs in the compressed model (the
    layer-wise loop): kept = the factors plus the residual's non-zeros. ``apply_seconds``
    counts both steps."""
    dense = {
        n: weight_matrix(m).detach().clone() for n, m in LayerSelection().select(model).items()
    }
    start = time.perf_counter()
    result = factorise(model, spec, stats_dir, text)
    for name, rank in result["ranks"].items():
        if rank is not None:
            low_rank = model.get_submodule(name)
            replace_module(
                model, name, ResidualSum(low_rank, dense[name] - low_rank.dense_weight())
            )
    residual = SparseGPTConfig(sparsity=spec["residual"], include=("*.residual",))
    pruned = compress(model, residual, text.calibration())
    params = sum(w.numel() for w in dense.values())
    result["params_kept_fraction"] += pruned.params_kept / params
    result["sparsegpt_seconds"] = round(pruned.seconds, 1)
    result["apply_seconds"] = round(time.perf_counter() - start, 1)
    return result


def sparsegpt_row(model: nn.Module, text: JobText) -> dict[str, Any]:
    """SparseGPT 2:4 on every decoder linear, the baseline of the ``residual`` row."""
    start = time.perf_counter()
    report = compress(model, SparseGPTConfig(sparsity="2:4"), text.calibration())
    return {
        "apply_seconds": round(time.perf_counter() - start, 1),
        "params_kept_fraction": report.params_kept / report.params,
    }


def apply(spec: dict[str, Any], stats_dir: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Factorise (unless dense) and score; the row's numbers."""
    model, text = setup({**settings, **{k: spec[k] for k in JOB_KEYS if k in spec}})
    if spec["method"] == "dense":
        result = {}
    elif spec["method"] == "sparsegpt":
        result = sparsegpt_row(model, text)
    elif spec.get("residual"):
        result = residual_row(model, spec, stats_dir, text)
    else:
        result = factorise(model, spec, stats_dir, text)
    scores = evaluate(model, text.tokenizer, text.corpora, text.options)
    result["ppl"] = {corpus: found["perplexity"] for corpus, found in scores.items()}
    return result


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "stats":
        print(json.dumps(stats(rest[0], Path(rest[1]), json.loads(rest[2]))))
    else:
        print(json.dumps(apply(json.loads(rest[0]), Path(rest[1]), json.loads(rest[2]))))
