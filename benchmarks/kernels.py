"""Speed of the packed 2:4 matmul kernel on one GPU, against dense cuBLAS and cuSPARSELt.

    python -m benchmarks.kernels                       # on a CUDA GPU: < 8 min on an H200
    python -m benchmarks.kernels --smoke --results-dir /tmp/kernels   # CPU, Triton interpreter
    python -m benchmarks.kernels --render-only         # redraw the md and PNG from the JSON

Nothing is downloaded: every weight is random. For each projection shape ``(out, in)`` of
SmolLM2-135M, Llama-2-7B and Llama-2-70B, and ``tokens`` = 1, 16, 128, 2048, 8192, with
``x (tokens, in)`` and a 2:4-sparse ``W`` (magnitude mask), three ways to compute ``x Wᵀ``:

- ``dense``: ``torch.nn.functional.linear`` on the dense (masked) fp16/bf16 weight (cuBLAS);
- ``ours``: :func:`lmcompress.kernels.nm_linear_triton.nm_linear_triton` on the packed weight
  (autotuned; the first call per shape tunes, untimed);
- ``cusparselt``: ``torch.sparse.to_sparse_semi_structured`` (cuSPARSELt, or CUTLASS), where this
  torch and GPU have it (its error is recorded otherwise).

Times are medians of ``triton.testing.do_bench``. TFLOP/s count the dense-equivalent
``2·tokens·out·in`` for every row (so they compare like for like); GB/s count the bytes each row
must move (``x``, its weight form: dense, packed at 56 %, or cuSPARSELt's, and ``y``). The
``max_rel_err`` column compares ours with the dense result (``|y - y_dense|max / |y_dense|max``).

End to end: greedy decode of a random TinyLlama-1.1B-shaped Llama in fp16 (64 prompt tokens,
128 new ones), the dense model against the same model after ``compress(model,
MagnitudeConfig())`` (2:4), ``save_compressed(dense_copy=False)`` and ``load_compressed(...,
runtime="packed", device="cuda")``: the path a user takes. Eager transformers decode at batch 1
is bound by kernel launches, not bytes, so this row shows the overhead as much as the kernel.

``--smoke`` runs the same code on tiny shapes with CPU tensors in Triton's interpreter (no GPU:
times are meaningless, correctness is checked) and a tiny Llama; ``tests/benchmarks`` runs it.
Writes ``kernels.{json,md}`` and ``kernels_curves.png`` under ``--results-dir``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.render import RESULTS_DIR, markdown_table, read_json, render_files, write_results
from benchmarks.runner import machine

log = logging.getLogger(__name__)

NAME = "kernels"
SHAPES = {  # model: {projection: (out, in)}
    "SmolLM2-135M": {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576)}
    | {"down": (576, 1536)},
    "Llama-2-7B": {"q/k/v/o": (4096, 4096), "gate/up": (11008, 4096), "down": (4096, 11008)},
    "Llama-2-70B": {"q/o": (8192, 8192), "k/v": (1024, 8192), "gate/up": (28672, 8192)}
    | {"down": (8192, 28672)},
}
TOKENS = (1, 16, 128, 2048, 8192)
BF16_MODELS = ("Llama-2-7B",)  # bf16 on these only (time)
SMOKE_SHAPES = {"tiny": {"a": (24, 64), "b": (40, 96)}}
SMOKE_TOKENS = (1, 5, 33)
E2E = {  # TinyLlama-1.1B's shape, random weights
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
}
SMOKE_E2E = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """Median seconds of ``fn()``: ``do_bench`` on a GPU (L2 flushed between runs; eager launches,
    so a tiny shape measures the launch overhead too), the wall clock of one run on the CPU
    (smoke: the interpreter, a check that it runs, not a speed)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3

    def wall(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return wall


def semi_structured(W: torch.Tensor) -> tuple[Any, str | None]:
    """``W`` in torch's semi-structured (cuSPARSELt / CUTLASS) form, or ``(None, reason)``."""
    if W.device.type != "cuda":
        return None, "needs CUDA"
    try:
        from torch.sparse import to_sparse_semi_structured

        return to_sparse_semi_structured(W), None
    except (ImportError, RuntimeError, ValueError, NotImplementedError) as err:
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"


def measure_shape(
    out_features: int, in_features: int, dtype: torch.dtype, tokens: list[int], device, bench
) -> list[dict[str, Any]]:
    """One weight shape at every token count: dense, ours and cuSPARSELt rows merged per count."""
    from lmcompress.compressor.sparsity import nm_mask
    from lmcompress.kernels.nm_linear_triton import nm_linear_triton
    from lmcompress.kernels.reference import pack_nm, packed_nm_nbytes

    g = torch.Generator(device=device).manual_seed(out_features * 7 + in_features)
    W = torch.randn(out_features, in_features, device=device, generator=g) / in_features**0.5
    W = (W * nm_mask(W.abs(), 2, 4)).to(dtype)  # (out, in) 2:4
    values, indices = pack_nm(W, 2, 4)
    W_semi, semi_error = semi_structured(W) if dtype != torch.float32 else (None, "fp16/bf16 only")
    size = W.element_size()
    weight_bytes = {
        "dense": W.numel() * size,
        "ours": packed_nm_nbytes((out_features, in_features), 2, 4, dtype),
    }
    if W_semi is not None:  # its compressed values and metadata
        names, _ = W_semi.__tensor_flatten__()
        parts = [getattr(W_semi, name) for name in names]
        weight_bytes["cusparselt"] = sum(t.numel() * t.element_size() for t in parts)
    rows = []
    for count in tokens:
        x = torch.randn(count, in_features, device=device, generator=g).to(dtype)
        row = {"out": out_features, "in": in_features, "tokens": count}
        runs = {
            "dense": lambda x=x: torch.nn.functional.linear(x, W),
            "ours": lambda x=x: nm_linear_triton(x, values, indices, 2, 4, in_features),
        }
        if W_semi is not None:
            runs["cusparselt"] = lambda x=x: torch.nn.functional.linear(x, W_semi)
        else:
            row["cusparselt_error"] = semi_error
        flops = 2 * count * out_features * in_features
        io_bytes = (count * in_features + count * out_features) * size
        y_dense = runs["dense"]().float()
        for name, fn in runs.items():
            # Anything may fail on a first GPU run (a compilation, a shape cuSPARSELt refuses):
            # record it and go on, so that one failure does not cost the whole run.
            try:
                y = fn().float()  # the first call autotunes (ours), untimed
                row[f"{name}_max_rel_err"] = float((y - y_dense).abs().max() / y_dense.abs().max())
                seconds = bench(fn)
            except Exception as err:
                log.exception(
                    "%s failed at (%d, %d), %d tokens", name, out_features, in_features, count
                )
                row[f"{name}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                continue
            row[name] = {
                "seconds": seconds,
                "tflops": flops / seconds / 1e12,
                "gbps": (io_bytes + weight_bytes[name]) / seconds / 1e9,
            }
        row["max_rel_err"] = row.get("ours_max_rel_err")  # None: ours failed
        rows.append(row)
        del x, y_dense
    return rows


def kernel_sweep(args, device, bench, deadline: float) -> list[dict[str, Any]]:
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    tokens = list(SMOKE_TOKENS if args.smoke else TOKENS)
    rows = []
    for dtype_name in args.dtypes:
        for model, projections in shapes.items():
            if dtype_name == "bf16" and not args.smoke and model not in BF16_MODELS:
                continue
            if args.only and model not in args.only:
                continue
            for projection, (out_features, in_features) in projections.items():
                label = {"dtype": dtype_name, "model": model, "projection": projection}
                if time.monotonic() > deadline:
                    log.warning("time budget spent: %s %s skipped", model, projection)
                    rows.append({**label, "skipped": "time budget"})
                    continue
                log.info(
                    "%s %s %s (%d, %d)", dtype_name, model, projection, out_features, in_features
                )
                for row in measure_shape(
                    out_features, in_features, DTYPES[dtype_name], tokens, device, bench
                ):
                    rows.append({**label, **row})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def decode_speed(model, prompt: torch.Tensor, new_tokens: int, device) -> dict[str, float]:
    """Greedy decode of ``new_tokens`` after ``prompt`` (warmed up once: autotuning, caches)."""

    def run(n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode():
        run(new_tokens)  # warm-up
        prefill = run(1)
        total = run(new_tokens + 1)
    return {
        "prefill_seconds": prefill,
        "decode_tokens_per_second": new_tokens / max(total - prefill, 1e-9),
    }


def end_to_end(args, device) -> dict[str, Any]:
    """Dense vs packed-runtime decode of a random Llama (module doc)."""
    import transformers

    from lmcompress.api import compress
    from lmcompress.compressor.io.load import load_compressed
    from lmcompress.compressor.io.save import save_compressed
    from lmcompress.methods.magnitude.config import MagnitudeConfig

    shape = SMOKE_E2E if args.smoke else E2E
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    config = transformers.LlamaConfig(**shape, max_position_embeddings=512)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    report = compress(model, MagnitudeConfig())  # 2:4 on every decoder linear
    prompt_len, new_tokens = (8, 4) if args.smoke else (64, 128)
    prompt = torch.randint(3, shape["vocab_size"], (1, prompt_len), device=device)
    result: dict[str, Any] = {"config": shape, "dtype": str(dtype).removeprefix("torch.")}
    result.update(prompt_tokens=prompt_len, new_tokens=new_tokens)
    result["dense"] = {
        "weight_bytes": _bytes(model),
        **decode_speed(model, prompt, new_tokens, device),
    }
    with tempfile.TemporaryDirectory() as tmp:
        save_compressed(model, Path(tmp) / "out", report, dense_copy=False)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        packed, _, _ = load_compressed(Path(tmp) / "out", runtime="packed", device=device)
    packed.eval()
    result["packed"] = {
        "weight_bytes": _bytes(packed),
        **decode_speed(packed, prompt, new_tokens, device),
    }
    return result


def _bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def gpu_info(device) -> dict[str, Any]:
    info = {"device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda)
        info["memory_gib"] = round(props.total_memory / 2**30, 1)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=None)
    parser.add_argument(
        "--budget-minutes", type=float, default=5.5, help="kernel sweep time limit (shapes left "
        "are recorded as skipped); the end-to-end decode comes after it"
    )  # fmt: skip
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end decode")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--render-only", action="store_true", help="redraw the md and PNG")
    parser.add_argument(
        "--only", nargs="+", default=[], metavar="JOB", choices=[*SHAPES, *SMOKE_SHAPES, "e2e"],
        help="rerun these models' shapes (or the end-to-end decode); the rest of the results "
        "file is kept",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.render_only:
        print(render_files(args.results_dir, NAME, render, plot))
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        if not args.smoke:
            parser.error("needs a CUDA GPU; --smoke runs tiny shapes in Triton's interpreter")
        # Read when @triton.jit runs, i.e. when the kernel module is first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from lmcompress.kernels import nm_linear_triton

    if device.type != "cuda" and not nm_linear_triton.interpreted():
        parser.error("--smoke on CPU: the kernel module was imported without TRITON_INTERPRET=1")
    args.dtypes = args.dtypes or (["fp16", "fp32"] if args.smoke else ["fp16", "bf16"])
    start = time.monotonic()
    previous = (read_json(args.results_dir / f"{NAME}.json") or {}) if args.only else {}
    settings = {"smoke": args.smoke, "dtypes": args.dtypes, "budget_minutes": args.budget_minutes}
    payload: dict[str, Any] = {"settings": settings, "machine": {**machine(), **gpu_info(device)}}
    rows = kernel_sweep(args, device, timer(device), start + 60 * args.budget_minutes)
    rerun = {(r["dtype"], r["model"]) for r in rows}
    kept = [r for r in previous.get("rows", []) if (r["dtype"], r["model"]) not in rerun]
    order = [*DTYPES], [*SHAPES, *SMOKE_SHAPES]  # the table's; a stable sort keeps the rest's
    payload["rows"] = sorted(
        kept + rows, key=lambda r: (order[0].index(r["dtype"]), order[1].index(r["model"]))
    )
    write_results(args.results_dir, NAME, payload, render, plot)  # kill-safe before the e2e
    if not args.no_e2e and (not args.only or "e2e" in args.only):
        payload["end_to_end"] = end_to_end(args, device)
    elif "end_to_end" in previous:
        payload["end_to_end"] = previous["end_to_end"]
    payload["seconds"] = round(time.monotonic() - start, 1)
    print(write_results(args.results_dir, NAME, payload, render, plot))
    errors = [r["max_rel_err"] for r in payload["rows"] if "skipped" not in r]
    bad = [e for e in errors if e is None or not e <= 1e-2]  # failed, NaN, or too far
    if bad:
        log.error("the kernel failed or disagrees with dense on %d row(s)", len(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
