"""Low-rank compression of SmolLM2-135M: plain SVD, ASVD, SVD-LLM, FWSVD and GFWSVD (K-FAC and
nearest-Kronecker factors), at three ratios of parameters kept, with uniform and allocated ranks.

    python -m benchmarks.lowrank [--eval-tokens 16384]
    python -m benchmarks.lowrank --only "gfwsvd 0.8 greedy"     # rerun rows (stats are cached)
    python -m benchmarks.lowrank --render-only

Every linear in the decoder blocks; statistics from the dense model on 128 × 512 tokens of
``wiki-calib`` (seed 0), collected once per kind by a job of its own (wall time and peak RSS of
that job: one forward pass for ASVD and SVD-LLM, one gradient pass of 8 windows per backward
for FWSVD and both GFWSVD variants) and cached under ``--work``; each row then loads them,
factorises (``Method.apply``) and scores perplexity on ``wiki-test`` and ``lee`` (seq-len 512)
in a process of its own. ``combined`` factorises the MLP layers with GFWSVD and prunes the
attention layers with SparseGPT 2:4. ``cli`` runs ``compress-model --method gfwsvd`` end to end
(gradient pass included) with the dense copy off, checks the size of ``compressed.safetensors``
against the kept parameters, and reloads it with ``compress-model eval --runtime packed``.
Writes ``benchmarks/results/lowrank.{json,md}`` and ``lowrank_curves.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.lowrank_plot import plot, render
from benchmarks.render import (
    add_harness_args,
    merge_rows,
    previous_rows,
    render_files,
    select_jobs,
    write_results,
)
from benchmarks.runner import CLI, PYTHON, STDOUT, Job, machine, run_job

log = logging.getLogger(__name__)

NAME = "lowrank"
CORPORA = ("wiki-test", "lee")
CHECKPOINT = "smollm2-135m"
NSAMPLES, SEQ_LEN, SEED = 128, 512, 0
RATIOS = (0.9, 0.8, 0.7)
# (method, stats file, option overrides); every one at every ratio, uniform ranks
METHODS = {
    "svd": (None, {}),
    "asvd": ("asvd", {}),
    "svd-llm": ("svd-llm", {}),
    "fwsvd": ("fwsvd", {}),
    "gfwsvd": ("gfwsvd-kfac", {}),
    "gfwsvd-nearest": ("gfwsvd-nearest", {"kronecker": "nearest"}),
}
GREEDY = {  # allocated ranks: every ratio for GFWSVD, 0.8 for the others
    "svd": (0.8,),
    "asvd": (0.8,),
    "svd-llm": (0.8,),
    "fwsvd": (0.8,),
    "gfwsvd": RATIOS,
    "gfwsvd-nearest": (0.8,),
}
STATS_JOBS = {"stats:activations": ("asvd", "svd-llm"), "stats:gradients": ("fwsvd", "gfwsvd")}


def row_name(method: str, ratio: float, allocation: str) -> str:
    return f"{method} {ratio:g} {allocation}"


def _rows() -> list[dict[str, Any]]:
    rows = [{"name": "dense", "method": "dense"}]
    for ratio in RATIOS:
        for method in METHODS:
            rows.append({"method": method, "ratio": ratio, "allocation": "uniform"})
            if ratio in GREEDY[method]:
                rows.append({"method": method, "ratio": ratio, "allocation": "greedy"})
    for row in rows[1:]:
        row["name"] = row_name(row["method"], row["ratio"], row["allocation"])
    rows.append({"name": "combined", "method": "gfwsvd+sparsegpt", "ratio": 0.8})
    rows.append({"name": "cli", "method": "gfwsvd", "ratio": 0.8})
    return rows


ROWS = _rows()
ORDER = [*STATS_JOBS, *(row["name"] for row in ROWS)]


def _stats_needed(row: dict[str, Any]) -> str | None:
    """The statistics job whose cached files the row reads (None: it reads none)."""
    method = "gfwsvd" if row["name"] == "combined" else row["method"]
    if row["name"] in ("cli", "dense") or method == "svd":
        return None
    return "stats:activations" if method in STATS_JOBS["stats:activations"] else "stats:gradients"


# --- children: run in their own processes -------------------------------------------------------


def _setup(eval_tokens: int | None = None):
    import torch

    from lmcompress.compressor.model.loading import load_model
    from lmcompress.evaluation.corpora import calibration_windows, tokenize

    torch.set_grad_enabled(False)
    model, tokenizer = load_model(CHECKPOINT)
    calib = calibration_windows(tokenize(tokenizer, "wiki-calib"), NSAMPLES, SEQ_LEN, SEED)
    corpora = {c: tokenize(tokenizer, c, eval_tokens) for c in CORPORA} if eval_tokens else {}
    return model, tokenizer, calib, corpora


def _score(model, tokenizer, corpora) -> dict[str, float]:
    from lmcompress.compressor.model.families import family_of
    from lmcompress.evaluation.perplexity import perplexity

    bos = tokenizer.bos_token_id if family_of(model).needs_bos else None
    return {
        c: perplexity(model, ids, SEQ_LEN, batch_size=4, bos_token_id=bos).perplexity
        for c, ids in corpora.items()
    }


def child_stats(job: str, stats_dir: Path) -> dict[str, Any]:
    """Collect the statistics of ``job`` once and save each method's Stats file."""
    import time

    import torch

    from lmcompress.compressor.method import Stats
    from lmcompress.methods.svd import ASVDConfig, SVDLLMConfig
    from lmcompress.methods.svd.activation import ASVD, SVDLLM, forward_statistics
    from lmcompress.methods.svd.fisher import (
        SampleStore,
        fwsvd_stats,
        gfwsvd_stats,
        sample_count,
    )

    model, _, calib, _ = _setup()
    stats_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if job == "stats:activations":
        asvd, svdllm = ASVD(ASVDConfig()), SVDLLM(SVDLLMConfig())
        layers = asvd.validate(model)
        observers = {name: [asvd.observer(), svdllm.observer()] for name in layers}
        forward_statistics(model, calib, observers, 4, torch.device("cpu"), "inputs")
        for method in (asvd, svdllm):
            index = 0 if method is asvd else 1
            tensors = {f"{n}.{method.key}": method.read(o[index]) for n, o in observers.items()}
            Stats(tensors=tensors).save(stats_dir / f"{method.name}.safetensors")
        return {"pass_seconds": round(time.perf_counter() - start, 1)}
    from lmcompress.compressor.calibration.gradients import gradient_statistics
    from lmcompress.compressor.model.surgery import LayerSelection

    layers = LayerSelection().select(model)
    samples = SampleStore(layers, sample_count(NSAMPLES, 8))
    torch.set_grad_enabled(True)
    found = gradient_statistics(
        model,
        calib,
        layers,
        batch_size=8,
        checkpointing=True,
        on_sample=samples,
    )
    pass_seconds = time.perf_counter() - start
    fwsvd_stats(found, NSAMPLES).save(stats_dir / "fwsvd.safetensors")
    gfwsvd_stats(found, NSAMPLES).save(stats_dir / "gfwsvd-kfac.safetensors")
    for layer in found.values():  # free what the nearest product does not need
        layer.fisher = layer.dd = None  # (gfwsvd_stats reads only xx when given samples)
    nearest = gfwsvd_stats(found, NSAMPLES, samples)
    nearest.save(stats_dir / "gfwsvd-nearest.safetensors")
    return {
        "pass_seconds": round(pass_seconds, 1),
        "samples": nearest.meta["samples"],
        "power_seconds": nearest.meta["power_seconds"],
        "power_iterations": nearest.meta["power_iterations"],
    }


def child_apply(spec: dict[str, Any], stats_dir: Path, eval_tokens: int) -> dict[str, Any]:
    """Factorise with cached statistics (``combined``: then SparseGPT 2:4 on the attention
    layers) and score; the row's numbers."""
    import time

    from lmcompress import compress
    from lmcompress.compressor.method import Stats
    from lmcompress.methods import get_method

    model, tokenizer, calib, corpora = _setup(eval_tokens)
    result: dict[str, Any] = {}
    if spec["method"] != "dense":
        combined = spec["name"] == "combined"
        name = "gfwsvd" if combined else spec["method"]
        stats_file, overrides = METHODS[name]
        method_name = "gfwsvd" if name.startswith("gfwsvd") else name
        method_class = get_method(method_name)
        options = {"ratio": spec["ratio"], "allocation": spec.get("allocation", "uniform")}
        if combined:
            options["include"] = ("model.layers.*.mlp.*",)
        method = method_class(method_class.config_class(**options, **overrides))
        stats = (
            Stats() if stats_file is None else Stats.load(stats_dir / f"{stats_file}.safetensors")
        )
        start = time.perf_counter()
        report = method.apply(model, stats)
        result["apply_seconds"] = round(time.perf_counter() - start, 1)
        params, kept = report.params, report.params_kept
        if combined:
            from lmcompress.methods.sparsegpt import SparseGPTConfig

            start = time.perf_counter()
            pruned = compress(
                model, SparseGPTConfig(sparsity="2:4", include=("model.layers.*.self_attn.*",)),
                calib,
            )  # fmt: skip
            result["sparsegpt_seconds"] = round(time.perf_counter() - start, 1)
            params, kept = params + pruned.params, kept + pruned.params_kept
        result["params_kept_fraction"] = kept / params
        result["ranks"] = report.extra["ranks"]
    result["ppl"] = _score(model, tokenizer, corpora)
    return result


# --- the driver ---------------------------------------------------------------------------------


def _cli_row(work: Path, eval_tokens: int) -> dict[str, Any]:
    """``compress-model --method gfwsvd --ratio 0.8`` end to end, then the packed reload."""
    out = work / "outputs" / "gfwsvd-0.8"
    command = (
        *CLI, CHECKPOINT, "--method", "gfwsvd", "--ratio", "0.8", "--nsamples", "32",
        "--seq-len", str(SEQ_LEN), "--eval", *CORPORA, "--skip-dense", "--eval-tokens",
        str(eval_tokens), "--no-dense-copy", "--overwrite", "-o", str(out), "-q",
    )  # fmt: skip
    run = run_job(Job("cli", command, out / "compression.json"), work)
    manifest = run.result
    reload_command = (*CLI, "eval", str(out), "--runtime", "packed", "--data", *CORPORA)
    reload_command += ("--eval-tokens", str(eval_tokens), "--json", "-q")
    reloaded = run_job(Job("cli reload", reload_command, STDOUT), work)
    summary = manifest["report"]
    kept = sum(layer["params_kept"] for layer in summary["layers"])
    params = sum(layer["params"] for layer in summary["layers"])
    tensors = out / "compressed.safetensors"
    return {
        "name": "cli",
        "method": "gfwsvd",
        "ratio": 0.8,
        "command": " ".join(str(c) for c in command[2:]).replace(str(work), "WORK"),
        "wall_seconds": run.wall_seconds,
        "peak_rss_mb": run.peak_rss_mb,
        "params_kept_fraction": kept / params,
        "ppl": {c: manifest["results"]["compressed"][c]["perplexity"] for c in CORPORA},
        "reloaded_ppl": {c: reloaded.result["perplexity"][c]["perplexity"] for c in CORPORA},
        "reload_peak_rss_mb": reloaded.peak_rss_mb,
        "compressed_bytes": tensors.stat().st_size,
        "expected_bytes": 4 * kept,  # fp32 factors; the header is the rest
    }


def run_row(spec: dict[str, Any], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    if spec["name"] == "cli":
        return _cli_row(work, args.eval_tokens)
    command = (PYTHON, "-m", "benchmarks.lowrank", "--child-apply", json.dumps(spec))
    command += ("--stats-dir", str(work / "stats"), "--eval-tokens", str(args.eval_tokens))
    run = run_job(Job(spec["name"], command, STDOUT), work)
    return {**spec, **run.result, "wall_seconds": run.wall_seconds, "peak_rss_mb": run.peak_rss_mb}


def run_stats(job: str, work: Path) -> dict[str, Any]:
    command = (PYTHON, "-m", "benchmarks.lowrank", "--child-stats", job)
    run = run_job(Job(job, (*command, "--stats-dir", str(work / "stats")), STDOUT), work)
    return {
        "name": job,
        **run.result,
        "wall_seconds": run.wall_seconds,
        "peak_rss_mb": run.peak_rss_mb,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(parser, "rerun only these jobs (names as in the table)")
    parser.add_argument("--eval-tokens", type=int, default=16384)
    parser.add_argument("--child-stats")
    parser.add_argument("--child-apply")
    parser.add_argument("--stats-dir", type=Path)
    args = parser.parse_args(argv)
    if args.child_stats:
        print(json.dumps(child_stats(args.child_stats, args.stats_dir)))
        return 0
    if args.child_apply:
        print(
            json.dumps(child_apply(json.loads(args.child_apply), args.stats_dir, args.eval_tokens))
        )
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.render_only:
        print(render_files(args.results_dir, NAME, render, plot))
        return 0
    names = select_jobs(parser, ORDER, args.only)
    work = args.work or Path(tempfile.mkdtemp(prefix="lowrank-"))
    rows = previous_rows(args.results_dir, NAME, args.only)
    key = lambda row: row["name"]  # noqa: E731
    payload = {
        "checkpoint": CHECKPOINT,
        "nsamples": NSAMPLES,
        "seq_len": SEQ_LEN,
        "eval_tokens": args.eval_tokens,
        "machine": machine(),
    }
    for name in names:
        spec = next((row for row in ROWS if row["name"] == name), None)
        needed = None if spec is None else _stats_needed(spec)
        if needed and not (work / "stats").is_dir() and needed not in names:
            parser.error(f"{name} needs {needed}'s cached statistics in {work}/stats")
        row = run_stats(name, work) if spec is None else run_row(spec, work, args)
        rows = merge_rows(rows, [row], key, ORDER)
        log.info("%s: %s", name, json.dumps(row)[:400])
        write_results(args.results_dir, NAME, {**payload, "results": rows}, render, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
