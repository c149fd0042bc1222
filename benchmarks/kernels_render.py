"""The tables and the figure of ``benchmarks.kernels``, drawn from ``kernels.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.render import markdown_table


def _ms(cell: dict | None) -> str:
    return f"{cell['seconds'] * 1e3:.3f}" if cell else "—"


def render(payload: dict[str, Any]) -> str:
    s, m = payload["settings"], payload["machine"]
    where = (
        f"{m.get('gpu', m['device'])} ({m.get('sms', '?')} SMs), CUDA {m.get('cuda')}"
        if m["device"].startswith("cuda")
        else f"CPU tensors in Triton's interpreter ({m['device']})"
    )
    text = (
        f"`y = x Wᵀ` with a 2:4-sparse random `W (out, in)` and `x (tokens, in)`, on {where}; "
        f"torch {m['torch']}, triton {m.get('triton')}. Median of `do_bench` (ms); TFLOP/s "
        "count the dense-equivalent 2·tokens·out·in; GB/s the bytes each row moves (x, its "
        "weight form, y). × dense: dense time / row time.\n\n"
    )
    if s["smoke"]:
        text += (
            "**Smoke run**: tiny shapes in Triton's interpreter on the CPU. Times are "
            "meaningless; the run checks that the script works and the kernel is correct.\n\n"
        )
    header = ["dtype", "model", "proj", "out × in", "tokens", "dense ms", "ours ms"]
    header += ["cuSPARSELt ms", "dense TFLOP/s", "ours TFLOP/s", "ours GB/s", "ours × dense"]
    header += ["cuSPARSELt × dense", "max rel err"]
    table, skipped, errors, failures = [], [], set(), []
    for r in payload["rows"]:
        if "skipped" in r:
            skipped.append(f"{r['dtype']} {r['model']} {r['projection']}")
            continue
        dense, ours, semi = r.get("dense"), r.get("ours"), r.get("cusparselt")
        if "cusparselt_error" in r:
            errors.add(r["cusparselt_error"])
        table.append([
            r["dtype"], r["model"], r["projection"], f"{r['out']} × {r['in']}", r["tokens"],
            _ms(dense), _ms(ours), _ms(semi),
            f"{dense['tflops']:.1f}" if dense else "—",
            f"{ours['tflops']:.1f}" if ours else "—",
            f"{ours['gbps']:.0f}" if ours else "—",
            f"{dense['seconds'] / ours['seconds']:.2f}" if dense and ours else "—",
            f"{dense['seconds'] / semi['seconds']:.2f}" if dense and semi else "—",
            "—" if r["max_rel_err"] is None else f"{r['max_rel_err']:.1e}",
        ])  # fmt: skip
        failures += [
            f"{r['dtype']} {r['model']} {r['projection']} × {r['tokens']} tokens, {name}: "
            + r[f"{name}_error"]
            for name in ("dense", "ours") if f"{name}_error" in r
        ]  # fmt: skip
    text += markdown_table(header, table)
    if errors:
        text += "\ncuSPARSELt unavailable: " + "; ".join(sorted(errors)) + ".\n"
    if failures:
        text += "\nFailed: " + "; ".join(failures) + ".\n"
    if skipped:
        text += "\nSkipped (time budget): " + ", ".join(skipped) + ".\n"
    e2e = payload.get("end_to_end")
    if e2e:
        c = e2e["config"]
        text += (
            f"\nEnd to end: greedy decode, batch 1, {e2e['prompt_tokens']} prompt tokens then "
            f"{e2e['new_tokens']} new, random Llama (hidden {c['hidden_size']}, "
            f"{c['num_hidden_layers']} layers, MLP {c['intermediate_size']}, vocab "
            f"{c['vocab_size']}) in {e2e['dtype']}, eager transformers; packed = magnitude 2:4, "
            'saved and reloaded with `runtime="packed"`.\n\n'
        )
        rows = []
        for name in ("dense", "packed"):
            got = e2e[name]
            ratio = got["decode_tokens_per_second"] / e2e["dense"]["decode_tokens_per_second"]
            rows.append([
                name, f"{got['weight_bytes'] / 2**20:.1f}", f"{got['prefill_seconds'] * 1e3:.1f}",
                f"{got['decode_tokens_per_second']:.1f}", f"{ratio:.2f}",
            ])  # fmt: skip
        text += markdown_table(
            ["model", "weights MiB", "prefill ms", "decode tokens/s", "× dense"], rows
        )
    return text


def plot(payload: dict[str, Any], results_dir: Path, path: Path) -> None:  # noqa: ARG001
    """Speedup over dense against tokens, one line per shape, a panel per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["rows"] if "skipped" not in r and r.get("dense")]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows)) or ["none"]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        shapes = dict.fromkeys((r["model"], r["projection"]) for r in rows if r["dtype"] == dtype)
        for i, (model, projection) in enumerate(shapes):
            mine = [
                r for r in rows if (r["dtype"], r["model"], r["projection"]) ==
                (dtype, model, projection)
            ]  # fmt: skip
            for key, style in (("ours", "-o"), ("cusparselt", ":x")):
                points = [(r["tokens"], r["dense"]["seconds"] / r[key]["seconds"])
                          for r in mine if r.get(key)]  # fmt: skip
                if points:
                    ax.plot(*zip(*points, strict=True), style, color=f"C{i % 10}", ms=4,
                            label=f"{model} {projection}" if key == "ours" else None)  # fmt: skip
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("tokens (M)")
        ax.set_ylabel("speedup over dense (solid: ours, dotted: cuSPARSELt)")
        ax.set_title(
            f"2:4 packed matmul, {dtype}" + (" (smoke)" if payload["settings"]["smoke"] else "")
        )
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
