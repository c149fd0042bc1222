"""The model card (``README.md``) of an exported directory, from its manifest.

Hugging Face conventions: YAML front matter (``base_model`` when the checkpoint is a hub id,
``library_name``, ``pipeline_tag``, ``tags``), then what a person reading the hub page wants:
the method and its options, perplexity dense vs compressed, how to load it, the command that
reproduces it and the package versions. Everything comes from ``compression.json``'s content
(``manifest``), so the card never says anything the manifest does not record;
:func:`model_card` is a pure function of it, written by ``save_compressed`` in the same
temporary directory as the weights (nothing half-written).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from lmcompress.compressor.io.layout import REPORT_PNG
from lmcompress.compressor.io.speed_report import SPEED_PNG, speed_table
from lmcompress.compressor.model.structure import WIDTHS_FIELD

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_card(manifest: dict[str, Any], name: str) -> str:
    """Markdown for ``README.md``; ``name`` titles it (the output directory's name)."""
    results = manifest.get("results") or {}
    report = manifest["report"]
    checkpoint = str(results.get("checkpoint") or "")
    sections = [
        _front_matter(manifest, checkpoint),
        f"# {name}\n\n{_summary(manifest, checkpoint)}",
        _perplexity_section(results),
        _stages_section(results),
        _lm_eval_section(results.get("lm_eval") or {}),
        _speed_section(results.get("speed")),
        f"![per-layer report and perplexity]({REPORT_PNG})\n\n"
        f"`{REPORT_PNG}`: {_plot_caption(report)}",
        _options_section(manifest, results),
        _layers_section(report),
        _usage_section(manifest),
        _versions_section(manifest["versions"]),
    ]
    return "\n\n".join(s for s in sections if s) + "\n"


def _front_matter(manifest: dict[str, Any], checkpoint: str) -> str:
    meta: dict[str, Any] = {}
    if _HUB_ID.match(checkpoint) and not Path(checkpoint).exists():
        meta["base_model"] = checkpoint
    plain = manifest.get("dense_copy", True) and not _per_layer_widths(manifest)
    meta["library_name"] = "transformers" if plain else "lmcompress"
    meta["pipeline_tag"] = "text-generation"
    tags = ["lmcompress", manifest["method"], *_kind_tags(manifest["report"]["layers"])]
    meta["tags"] = list(dict.fromkeys(tags))  # the int8 method's tag is also its kind's
    return f"---\n{yaml.safe_dump(meta, sort_keys=False)}---"


def _kind_tags(layers: list[dict[str, Any]]) -> list[str]:
    tags = []
    patterns = {layer["pattern"] for layer in layers if layer.get("sparsity") is not None}
    if patterns:
        tags.append("pruned")
        tags += sorted(f"{p}-sparsity" for p in patterns if p and ":" in p)
    if any(layer.get("rank") is not None for layer in layers):
        tags.append("low-rank")
    tags += sorted({f"int{layer['bits']}" for layer in layers if layer.get("bits") is not None})
    return tags


def _summary(manifest: dict[str, Any], checkpoint: str) -> str:
    summary = manifest["report"]["summary"]
    base = f"`{checkpoint}`" if checkpoint else "a causal language model"
    kept = summary["params_kept"] / max(summary["params_compressed_layers"], 1)
    size = summary["bytes_compressed"] / max(summary["bytes_dense"], 1)
    return (
        f"{base} compressed with lmcompress "
        f"{manifest['versions'].get('lmcompress', '')}, method **{manifest['method']}**: "
        f"{summary['layers']} linear layers, {kept:.1%} of their weights kept, their compressed "
        f"form {size:.1%} of their dense bytes; the model has "
        f"{summary['model_params_after']:,} of its {summary['model_params']:,} parameters left. "
        f"Weights stored in {manifest['dtype']}."
    )


def _perplexity_section(results: dict[str, Any]) -> str:
    compressed = results.get("compressed") or {}
    if not compressed:
        return "## Perplexity\n\nNot measured (saved without an evaluation)."
    dense = results.get("dense") or {}
    rows = ["| corpus | dense | compressed | change | tokens |", "|---|---:|---:|---:|---:|"]
    for corpus, res in compressed.items():
        ppl = res["perplexity"]
        base = dense.get(corpus, {}).get("perplexity")
        change = f"{ppl / base - 1:+.1%}" if base else "-"
        base_text = f"{base:.3f}" if base else "not scored"
        rows.append(f"| {corpus} | {base_text} | {ppl:.3f} | {change} | {res['tokens']:,} |")
    options = results.get("options") or {}
    protocol = (
        "Token perplexity: the corpus's documents joined and tokenized once, non-overlapping "
        f"windows of {options.get('seq_len', '?')} tokens, mean next-token NLL, exponentiated "
        "(the SparseGPT / Wanda protocol)"
    )
    if options.get("eval_tokens"):
        protocol += f", over the first {options['eval_tokens']:,} tokens of each corpus"
    return "## Perplexity\n\n" + "\n".join(rows) + f"\n\n{protocol}."


def _stages_section(results: dict[str, Any]) -> str:
    """A multi-stage recipe's stages: each one's options, layers and perplexity after it, and
    the recipe that runs the job again (:mod:`lmcompress.jobs.recipe`)."""
    stages = results.get("stages") or []
    if not stages:
        return ""
    corpora = list(results.get("compressed") or {})
    rows = [
        "| stage | method | options | layers | stored / dense bytes | "
        + " | ".join(f"{Path(c).name} ppl" for c in corpora)
        + " |",
        "|---|---|---|---:|---:|" + "---:|" * len(corpora),
    ]
    written = (results.get("recipe") or {}).get("stages") or [s["config"] for s in stages]
    for index, (stage, config) in enumerate(zip(stages, written, strict=False), 1):
        options = ", ".join(f"{k}={_text(v)}" for k, v in config.items() if k != "method")
        summary = stage["summary"]
        size = summary["bytes_compressed"] / max(summary["bytes_dense"], 1)
        ppl = [
            f"{stage.get('compressed', {}).get(c, {}).get('perplexity', float('nan')):.3f}"
            for c in corpora
        ]
        rows.append(
            f"| {index} | {stage['method']} | `{options or 'defaults'}` | {summary['layers']} | "
            f"{size:.1%} | " + " | ".join(ppl) + " |"
        )
    text = (
        "## Stages\n\nEach stage compressed the model as the earlier ones left it; a layer an "
        "earlier stage compressed is left alone unless the formats compose (int8 codes of a "
        "2:4-pruned layer, stored packed). Perplexity after each stage:\n\n" + "\n".join(rows)
    )
    if results.get("recipe"):
        recipe = yaml.safe_dump(results["recipe"], sort_keys=False)
        text += (
            "\n\nThe recipe (`compress-model --config recipe.yaml -o OUT`):"
            f"\n\n```yaml\n{recipe}```"
        )
    return text


def _lm_eval_section(lm_eval: dict[str, dict[str, float]]) -> str:
    if not lm_eval:
        return ""
    rows = ["| task | metric | value |", "|---|---|---:|"]
    for task, metrics in lm_eval.items():
        rows += [f"| {task} | {metric} | {value:.4g} |" for metric, value in metrics.items()]
    return "## lm-eval (compressed model)\n\n" + "\n".join(rows)


def _speed_section(record: dict[str, Any] | None) -> str:
    """``compress-model ... --bench``'s table (:mod:`lmcompress.compressor.io.speed_report`)."""
    if not record:
        return ""
    return (
        "## Speed\n\nMeasured after saving (`--bench`: the dense checkpoint at fp32 and bf16 "
        "and this export in its compressed runtime, in one process; `speed.json`, "
        f"`{SPEED_PNG}`):\n\n{speed_table(record)}"
    )


def _plot_caption(report: dict[str, Any]) -> str:
    kinds = [
        label
        for key, label in (("sparsity", "sparsity"), ("rank", "rank"), ("rel_error", "error"))
        if any(layer.get(key) is not None for layer in report["layers"])
    ]
    per_layer = f"per-layer {', '.join(kinds)} by decoder block; " if kinds else ""
    return f"{per_layer}perplexity dense vs compressed."


def _options_section(manifest: dict[str, Any], results: dict[str, Any]) -> str:
    config = {k: v for k, v in manifest["config"].items() if k not in ("method", "stages")}
    rows = ["| option | value |", "|---|---|"]
    rows += [f"| {key} | `{_text(value)}` |" for key, value in config.items()]
    text = f"## Method: {manifest['method']}\n\n" + (
        "\n".join(rows) if config else "Options: per stage (Stages, above)."
    )
    options = results.get("options")
    if options:
        job = ["| option | value |", "|---|---|"]
        job += [f"| {key} | `{_text(value)}` |" for key, value in options.items()]
        text += "\n\nJob:\n\n" + "\n".join(job)
    command = results.get("command")
    if command:
        text += (
            f"\n\nReproduce (`optimum-cli lmcompress` takes the same options):\n\n"
            f"```bash\n{command}\n```"
        )
    else:
        text += "\n\nSaved from Python (`save_compressed`): no command line recorded."
    return text


def _text(value: Any) -> str:
    """An option's value as the card shows it; unset (``None`` / empty) reads "default", since
    e.g. ``include: None`` means every decoder linear, not none of them."""
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) if value else "default"
    return "default" if value is None else str(value)


def _layers_section(report: dict[str, Any]) -> str:
    """Totals per kind of layer (``q_proj``, ``down_proj``, ...): a few rows instead of one per
    layer (``compression.json`` and ``report.png`` have every layer)."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for layer in report["layers"]:
        groups[layer["name"].rsplit(".", 1)[-1]].append(layer)
    if not groups:
        return ""
    rows = [
        "| layers | count | weights kept | stored bytes | mean rel. error |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind, layers in groups.items():
        kept = sum(x["params_kept"] for x in layers) / max(sum(x["params"] for x in layers), 1)
        size = sum(x["bytes_compressed"] for x in layers) / max(
            sum(x["bytes_dense"] for x in layers), 1
        )
        errors = [x["rel_error"] for x in layers if x.get("rel_error") is not None]
        error = f"{sum(errors) / len(errors):.4f}" if errors else "-"
        rows.append(f"| {kind} | {len(layers)} | {kept:.1%} | {size:.1%} | {error} |")
    kinds = sorted({layer.get("error_kind", "weight") for layer in report["layers"]})
    note = (
        "Relative error: ||W - Ŵ|| / ||W|| of the weights, or of the layer's outputs on "
        f"calibration inputs where measured (here: {', '.join(kinds)}); stored bytes: the "
        "compressed form (values and their metadata) over the dense weights."
    )
    return "## Per layer\n\n" + "\n".join(rows) + f"\n\n{note}"


def _per_layer_widths(manifest: dict[str, Any]) -> dict[str, list[int]] | None:
    """A structured extraction's widths per block, where the blocks differ (else ``None``)."""
    sizes = (manifest["report"].get("extra") or {}).get("sizes")
    return sizes.get(WIDTHS_FIELD) if isinstance(sizes, dict) else None


def _usage_section(manifest: dict[str, Any]) -> str:
    lines = ["## Use", ""]
    widths = _per_layer_widths(manifest)
    if widths:
        listed = "; ".join(f"`{k}` {v}" for k, v in widths.items())
        lines += [
            f"The blocks have per-layer widths ({listed}; `{WIDTHS_FIELD}` in `config.json`): "
            "only lmcompress loads this checkpoint. A standard config has one width per kind, "
            "so plain transformers, vLLM or llama.cpp build the widest block's shapes and "
            "refuse the narrower weights (a size mismatch).",
            "",
        ]
    elif manifest.get("dense_copy", True):
        lines += [
            "Plain transformers (the dense copy in `model.safetensors`):",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            'model = AutoModelForCausalLM.from_pretrained("OUT")',
            'tokenizer = AutoTokenizer.from_pretrained("OUT")',
            "```",
            "",
            "lm-evaluation-harness on the same files: "
            "`lm_eval --model hf --model_args pretrained=OUT --tasks TASKS`.",
            "",
        ]
    else:
        lines += [
            "transformers, once lmcompress is imported (it registers the `lmcompress` "
            "quantization method that builds the compressed modules):",
            "",
            "```python",
            "import lmcompress  # noqa: F401",
            "from transformers import AutoModelForCausalLM",
            'model = AutoModelForCausalLM.from_pretrained("OUT")',
            "```",
            "",
        ]
    lines += [
        "lmcompress, with the compressed layers as compressed modules (`compressed.safetensors`):",
        "",
        "```python",
        "from lmcompress import load_compressed",
        'model, tokenizer, report = load_compressed("OUT", runtime="packed")',
        "```",
        "",
        "`OUT` is this directory. `compression.json` records the method, its options, every "
        "layer's report and format, and the perplexities above.",
    ]
    return "\n".join(lines)


def _versions_section(versions: dict[str, str]) -> str:
    rows = ["| package | version |", "|---|---|"]
    rows += [f"| {name} | {version} |" for name, version in versions.items()]
    return "## Versions\n\n" + "\n".join(rows)
