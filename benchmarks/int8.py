"""int8 quality ablation on SmolLM2-135M: W8A8, then the 8-bit softmax, then its bias correction.

    python -m benchmarks.int8                              # every row
    python -m benchmarks.int8 --only "W8A8 dynamic + softmax8"
    python -m benchmarks.int8 --render-only

Each row is one ``compress-model --method int8`` process (``benchmarks.runner``: wall time and
peak RSS of the whole process, evaluation included) scoring wiki-test and lee at seq-len 512;
the first row also scores the dense fp32 model. The ``interop`` row reloads the first row's
output in a fresh process (``benchmarks.child.int8_interop``) with plain
``AutoModelForCausalLM.from_pretrained`` (its ``model.safetensors`` is in the
compressed-tensors int-quantized layout) and scores it, with the library's evaluate step, beside
our simulation of the same scheme (compressed-tensors' activation rounding: absmax/127.5,
``lmcompress.compressor.io.compressed_tensors.simulated_linear``). Writes
``benchmarks/results/int8.{json,md}`` and ``int8_curves.png`` (perplexities, and the per-head
softmax bias β of the head-corrected row, layer × head).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import add_harness_args, row_table, run_table
from benchmarks.render import markdown_table
from benchmarks.runner import CLI, PYTHON, STDOUT, Job, run_job

NAME = "int8"
CORPORA = ("wiki-test", "lee")
CALIB = ("--nsamples", "32")  # static ranges and softmax bias: 32 x 512 calibration tokens
SOFTMAX = ("--softmax-bits", "8")
JOBS = [  # name, compress-model flags after --method int8
    {"name": "W8A8 dynamic", "flags": ()},
    {"name": "W8A8 static", "flags": ("--activations", "static", *CALIB)},
    {"name": "W8A8 dynamic, SmoothQuant 0.5", "flags": ("--smooth-alpha", "0.5", *CALIB)},
    {
        "name": "W8A8 static, SmoothQuant 0.5",
        "flags": ("--activations", "static", "--smooth-alpha", "0.5", *CALIB),
    },
    {"name": "W8A8 dynamic, int8 head", "flags": ("--head", "int8")},
    {"name": "W8A8 dynamic + softmax8", "flags": SOFTMAX},
    {
        "name": "+ bias correction per layer",
        "flags": (*SOFTMAX, "--bias-correction", "layer", *CALIB),
    },
    {
        "name": "+ bias correction per head",
        "flags": (*SOFTMAX, "--bias-correction", "head", *CALIB),
    },
    {"name": "interop", "flags": ()},  # reloads the first row's output
]
ORDER = [j["name"] for j in JOBS]


def _out(work: Path, name: str) -> Path:
    return work / "outputs" / name.replace(" ", "-").replace("+", "plus").replace(",", "")


def compress_job(spec: dict[str, Any], work: Path, settings: dict[str, Any]) -> Job:
    dense = () if spec["name"] == "W8A8 dynamic" else ("--skip-dense",)
    command = (
        *CLI,
        settings["checkpoint"],
        "--method",
        "int8",
        *spec["flags"],
        "--eval",
        *CORPORA,
        *dense,
        "--eval-tokens",
        str(settings["eval_tokens"]),
        "-o",
        str(_out(work, spec["name"])),
        "-q",
    )
    return Job(spec["name"], command, _out(work, spec["name"]) / "compression.json")


def run_row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    work, settings = args.work, settings_of(args)
    if name == "interop":
        out = _out(work, JOBS[0]["name"])
        command = (PYTHON, "-m", "benchmarks.child.int8_interop", str(out))
        command += (str(settings["eval_tokens"]), *CORPORA)
        run = run_job(Job("interop", command, STDOUT), work)
        return {"name": "interop", **run.result, "wall_seconds": run.wall_seconds}
    spec = next(j for j in JOBS if j["name"] == name)
    run = run_job(compress_job(spec, work, settings), work)
    manifest = run.result
    results = manifest["results"]
    row: dict[str, Any] = {
        "name": spec["name"],
        "command": "compress-model --method int8 " + " ".join(spec["flags"]),
        "wall_seconds": run.wall_seconds,
        "peak_rss_mb": run.peak_rss_mb,
        "compressed": {c: results["compressed"][c]["perplexity"] for c in CORPORA},
        "softmax": manifest["report"]["extra"].get("softmax"),
    }
    if "dense" in results:
        row["dense"] = {c: results["dense"][c]["perplexity"] for c in CORPORA}
    return row


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    return {"checkpoint": args.checkpoint, "eval_tokens": args.eval_tokens}


def record(args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    return {"settings": settings_of(args), "results": rows}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render(payload: dict[str, Any]) -> str:
    rows = payload["results"]
    by_name = {r["name"]: r for r in rows}
    first = by_name.get("W8A8 dynamic", {})
    dense = first.get("dense")
    table = []
    if dense:
        table.append(["fp32 (dense)", "-", "-", *(_fmt(dense[c]) for c in CORPORA), "-", "-"])
    for r in rows:
        if r["name"] == "interop":
            continue
        softmax = r.get("softmax") or {}
        bias = softmax.get("bias") or {}
        rel = [
            f"{100 * (r['compressed'][c] / dense[c] - 1):+.2f} %" if dense else "-" for c in CORPORA
        ]
        table.append(
            [
                r["name"],
                r["wall_seconds"],
                r["peak_rss_mb"],
                *(_fmt(r["compressed"][c]) for c in CORPORA),
                " / ".join(rel),
                f"{bias['mean_abs'] / bias['scale']:.3f}" if bias else "-",
            ]
        )
    header = [
        "configuration",
        "wall s",
        "peak RSS MiB",
        *(f"{c} ppl" for c in CORPORA),
        "vs fp32 (wiki-test / lee)",
        "mean abs β (steps)",
    ]
    settings = payload["settings"]
    text = (
        f"# int8 on SmolLM2-135M (`python -m benchmarks.int8`)\n\nEvery linear in the decoder "
        f"blocks; perplexity at seq-len 512 over the first {settings['eval_tokens']} tokens of "
        "each corpus; static ranges and softmax bias from 32 × 512 tokens of wiki-calib. Wall "
        "time and peak RSS: the whole `compress-model` process (evaluation included).\n\n"
        + markdown_table(header, table)
    )
    recovered = _recovered(by_name)
    if recovered:
        text += "\n" + recovered
    interop = by_name.get("interop")
    if interop:
        lines = [
            [
                c,
                _fmt(interop["transformers"][c]),
                _fmt(interop["simulated"][c]),
                f"{abs(interop['transformers'][c] / interop['simulated'][c] - 1):.1e}",
                _fmt(interop["runtime"][c]),
            ]
            for c in CORPORA
        ]
        text += (
            "\nInteroperability: the `W8A8 dynamic` output loaded in a fresh process by plain "
            "`AutoModelForCausalLM.from_pretrained` (compressed-tensors), against our simulation "
            "of the same scheme (absmax/127.5 per token, as compressed-tensors rounds), and our "
            "int8 runtime (absmax/127, vLLM's convention) reloaded by `load_compressed`:\n\n"
            + markdown_table(
                ["corpus", "transformers ppl", "simulated ppl", "relative diff", "our runtime"],
                lines,
            )
        )
    return text


def _recovered(by_name: dict[str, Any]) -> str:
    """How much of the perplexity the 8-bit softmax costs each correction wins back."""
    base, soft = by_name.get("W8A8 dynamic"), by_name.get("W8A8 dynamic + softmax8")
    if not base or not soft:
        return ""
    lines = []
    for name in ("+ bias correction per layer", "+ bias correction per head"):
        row = by_name.get(name)
        if not row:
            continue
        cells = []
        for c in CORPORA:
            lost = soft["compressed"][c] - base["compressed"][c]
            won = soft["compressed"][c] - row["compressed"][c]
            cells.append(f"{100 * won / lost:.0f} %" if lost > 0 else "-")
        lines.append([name, *cells])
    return (
        "Share of the perplexity lost to the 8-bit softmax that the correction recovers:\n\n"
        + markdown_table(["correction", *CORPORA], lines)
    )


def plot(payload: dict[str, Any], results_dir: Path, path: Path) -> None:
    # Only the PNG needs these; the heatmap takes torch tensors (tests/benchmarks/test_layout.py)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from lmcompress.methods.int8.bias_plot import plot_bias_heatmap

    rows = [r for r in payload["results"] if r["name"] != "interop"]
    head = next((r for r in rows if r["name"] == "+ bias correction per head"), None)
    fig, axes = plt.subplots(1, len(CORPORA), figsize=(12, 4))
    for ax, corpus in zip(axes, CORPORA, strict=True):
        names = [r["name"] for r in rows]
        ax.barh(names, [r["compressed"][corpus] for r in rows], color="tab:blue")
        dense = rows[0].get("dense") if rows else None
        if dense:
            ax.axvline(dense[corpus], color="black", linestyle="--", label="fp32")
            ax.legend()
        ax.set_xlabel(f"{corpus} perplexity")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    if head and head.get("softmax", {}).get("bias"):
        bias = head["softmax"]["bias"]
        tensors = {layer["name"]: torch.tensor(layer["per_head"]) for layer in bias["layers"]}
        plot_bias_heatmap(tensors, results_dir / "int8_bias_heads.png", scale=bias["scale"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="smollm2-135m")
    parser.add_argument("--eval-tokens", type=int, default=32768, help="per corpus, 0 = all")
    add_harness_args(parser, "rerun just these rows (names as in the table)")
    table = row_table(NAME, render, ORDER, run_row, record, plot=plot)
    return run_table(table, parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
