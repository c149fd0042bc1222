"""What ``compress-model`` prints when a job ends: perplexities beside the dense model's, what
was kept, and what the output directory holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmcompress.compressor.io.layout import COMPRESSED_TENSORS, MANIFEST, STATS, output_sizes
from lmcompress.compressor.io.speed_report import speed_table
from lmcompress.compressor.report import CompressionReport
from lmcompress.errors import printable
from lmcompress.methods import get_method


def say(line: str) -> None:
    """Print one line of the summary, :func:`printable` (a path or corpus name a user gave
    may hold a newline or an ANSI escape)."""
    print(printable(line))


def print_summary(results: dict[str, Any]) -> None:
    """One row per corpus (dense and compressed perplexity), then what was kept and saved."""
    report = results["report"]
    summary = report.summary()
    print()
    say(f"{report.method} on {results['checkpoint']}: {changed_options(report)}")
    if results["compressed"]:
        say(f"{'corpus':<14}{'dense ppl':>12}{'compressed ppl':>16}{'tokens':>9}")
    else:
        say("no corpus scored (--eval with none)")
    for corpus, res in results["compressed"].items():
        dense = results.get("dense", {}).get(corpus)
        dense_text = f"{dense['perplexity']:.3f}" if dense else "-"
        say(f"{corpus:<14}{dense_text:>12}{res['perplexity']:>16.3f}{res['tokens']:>9}")
    kept = summary["params_kept"] / max(summary["params_compressed_layers"], 1)
    dtype = results["options"]["dtype"]
    say(
        f"{_layer_count(report)} in {results['seconds']:.1f} s: {kept:.1%} of "
        f"their weights kept; their compressed form takes "
        f"{summary['bytes_compressed'] / max(summary['bytes_dense'], 1):.1%} of their dense "
        f"{dtype} bytes (values plus their metadata: N:M positions or scales)"
    )
    for name, metrics in results.get("lm_eval", {}).items():
        say(f"lm-eval {name}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    if results.get("output"):
        say(f"saved to {results['output']}: {describe_output(Path(results['output']))}")
    if results.get("speed"):
        print()
        print(speed_table(results["speed"]), end="")


def _layer_count(report: CompressionReport) -> str:
    """ "N layers compressed", and how many of the selected ones the method left as they were
    (low rank's greedy allocation keeps a layer dense where a factor pair would not pay)."""
    unchanged = sum(
        1
        for layer in report.layers
        if layer.params_kept == layer.params
        and not layer.sparsity
        and layer.rank is None
        and layer.bits is None
    )
    if not unchanged:
        return f"{len(report.layers)} layers compressed"
    return (
        f"{len(report.layers) - unchanged} layers compressed ({unchanged} of the "
        f"{len(report.layers)} selected left as they were)"
    )


def print_stages_summary(results: dict[str, Any]) -> None:
    """One row per corpus and stage: the perplexity after each stage, then bytes per stage."""
    stages = results["stages"]
    print()
    say(f"{len(stages)} stages on {results['checkpoint']}: {results['report'].method}")
    corpora = list(results.get("compressed") or {})
    if corpora:
        heads = ["dense", *(f"{i}:{s['method']}" for i, s in enumerate(stages, 1))]
        say(f"{'corpus':<14}" + "".join(f"{h:>16}" for h in heads))
        for corpus in corpora:
            dense = results.get("dense", {}).get(corpus)
            cells = [f"{dense['perplexity']:.3f}" if dense else "-"]
            cells += [f"{s['compressed'][corpus]['perplexity']:.3f}" for s in stages]
            say(f"{corpus:<14}" + "".join(f"{c:>16}" for c in cells))
    else:
        say("no corpus scored (--eval with none)")
    for index, stage in enumerate(stages, 1):
        summary = stage["summary"]
        say(
            f"stage {index} ({stage['method']}): {summary['layers']} layers in "
            f"{stage['seconds']:.1f} s, {stage['skipped_layers']} left to earlier stages"
        )
    total = results["summary"]
    say(
        f"{total['layers']} layers compressed in {results['seconds']:.1f} s; their stored form "
        f"takes {total['bytes_compressed'] / max(total['bytes_dense'], 1):.1%} of their dense "
        f"{results['options']['dtype']} bytes"
    )
    if results.get("output"):
        say(f"saved to {results['output']}: {describe_output(Path(results['output']))}")
    if results.get("speed"):
        print()
        print(speed_table(results["speed"]), end="")


def changed_options(report: CompressionReport) -> str:
    """The options that differ from the method's defaults, as ``key=value`` text."""
    defaults = get_method(report.method).config_class().to_dict()
    changed = []
    for key, value in report.config.items():
        if key == "method" or defaults.get(key) == value:
            continue
        text = " ".join(map(str, value)) if isinstance(value, list) else str(value)
        changed.append(f"{key}={text}")
    return ", ".join(changed) or "default options"


def describe_output(out: Path) -> str:
    """``"730.1 MB in all: compressed form 190.2 MB, dense copy 540.0 MB ..."``."""
    sizes = {key: value / 1e6 for key, value in output_sizes(out).items()}
    total, compressed, dense = sizes["total"], sizes["compressed"], sizes["dense"]
    text = f"{total:.1f} MB in all"
    if compressed:
        text += f"; compressed form {compressed:.1f} MB ({COMPRESSED_TENSORS})"
    manifest = json.loads((out / MANIFEST).read_text())
    interop = (manifest.get("interop") or {}).get("layout")
    if dense and compressed and not manifest.get("dense_copy", True):
        text += f"; the other parameters {dense:.1f} MB (no dense copy)"
    elif dense and compressed and interop:
        text += f"; model.safetensors {dense:.1f} MB in the {interop} layout"
    elif dense and compressed:
        text += (
            f"; dense copy {dense:.1f} MB for plain transformers (--no-dense-copy leaves it out)"
        )
    if sizes["stats"]:
        text += f"; learned statistics {sizes['stats']:.1f} MB ({STATS}, for --prior-from)"
    return text + "; per-layer detail in compression.json"
