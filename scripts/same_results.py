"""Same results before and after a refactor: every method, through the CLI, on every tiny family.

Runs ``compress-model`` in process (the job a user runs: preflight, calibration, compression,
evaluation, export) for each case below on a saved tiny checkpoint of each family, plus a
multi-stage recipe, ``--streaming``, ``--no-dense-copy`` and ``compress-model eval``, and
records every tensor every output directory holds and its ``compression.json`` (timings,
versions and memory readings left out). Run it once on the tree before a change and once after,
then compare::

    PYTHONPATH=/path/to/old/tree python scripts/same_results.py --out /tmp/before
    PYTHONPATH=. python scripts/same_results.py --out /tmp/after
    python scripts/same_results.py --compare /tmp/before /tmp/after

``--compare`` exits 1 unless every tensor is ``torch.equal`` and every recorded result equal;
``--compare-outputs A B`` compares two ``compress-model`` output directories the same way (the
real model's SparseGPT / Wanda 2:4 before and after a change).
It uses only the CLI (``lmcompress.cli.main.main``) and the tiny models of ``tests/conftest.py``,
which every tree has. One thread, so that BLAS rounding is the same in both runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TEXT = "\n\n".join(
    f"Document {i}. The quick brown fox jumps over the lazy dog {i} times, then rests."
    for i in range(60)
)
CASES: dict[str, list[str]] = {
    "magnitude-50": ["--method", "magnitude", "--sparsity", "0.5"],
    "magnitude-24": ["--method", "magnitude", "--sparsity", "2:4"],
    "magnitude-24-compact": ["--method", "magnitude", "--sparsity", "2:4", "--no-dense-copy"],
    "wanda-50": ["--method", "wanda", "--sparsity", "0.5"],
    "wanda-24": ["--method", "wanda", "--sparsity", "2:4"],
    "sparsegpt-50": ["--method", "sparsegpt", "--sparsity", "0.5"],
    "sparsegpt-24": ["--method", "sparsegpt", "--sparsity", "2:4"],
    "sparsegpt-24-streaming": ["--method", "sparsegpt", "--sparsity", "2:4", "--streaming"],
    "wanda-24-streaming-compact": [
        *("--method", "wanda", "--sparsity", "2:4", "--streaming", "--no-dense-copy"),
    ],
    "maskllm-24": ["--method", "maskllm", "--steps", "2", "--batch-size", "2"],
    "maskllm-24-distill": [
        *("--method", "maskllm", "--steps", "2", "--batch-size", "2", "--distill"),
    ],
    "maskllm-blockwise": [
        *("--method", "maskllm", "--steps", "2", "--batch-size", "2", "--blockwise"),
        *("--refit", "sparsegpt", "--prior", "wanda"),
    ],
    "subnet-50": ["--method", "subnet", "--sparsity", "0.5", "--steps", "2"],
    "subnet-24-blockwise": [
        *("--method", "subnet", "--sparsity", "2:4", "--steps", "2", "--blockwise"),
        *("--refit", "sparsegpt", "--scale", "row"),
    ],
    "svd": ["--method", "svd", "--ratio", "0.8"],
    "asvd": ["--method", "asvd", "--ratio", "0.8"],
    "svd-llm-greedy": ["--method", "svd-llm", "--ratio", "0.7", "--allocation", "greedy"],
    "fwsvd": ["--method", "fwsvd", "--ratio", "0.8", "--calib-batch-size", "4"],
    "gfwsvd": ["--method", "gfwsvd", "--ratio", "0.8", "--calib-batch-size", "4"],
    "gfwsvd-nearest": [
        *("--method", "gfwsvd", "--ratio", "0.8", "--calib-batch-size", "2"),
        *("--kronecker", "nearest"),
    ],
    "int8": ["--method", "int8"],
    "int8-softmax-head": [
        *("--method", "int8", "--softmax-bits", "8", "--bias-correction", "head"),
    ],
    "int8-static-smooth": [
        *("--method", "int8", "--activations", "static", "--smooth-alpha", "0.5"),
    ],
    "int8-group-simulated": ["--method", "int8", "--group-size", "8", "--path", "simulated"],
    "int8-compact": ["--method", "int8", "--no-dense-copy"],
    "recipe-sparsegpt-int8": ["--config", "{recipe}"],
    "rtn-4": ["--method", "rtn", "--group-size", "16"],
    "gptq-4": ["--method", "gptq", "--group-size", "16"],
    "gptq-4-in-order": ["--method", "gptq", "--group-size", "16", "--no-act-order"],
    "gptq-3-asym-act-order": [
        *("--method", "gptq", "--bits", "3", "--group-size", "16", "--no-sym", "--act-order"),
    ],
    "gptq-24": ["--method", "gptq", "--group-size", "16", "--sparsity", "2:4"],
    "gptq-4-streaming": [
        *("--method", "gptq", "--group-size", "16", "--act-order", "--streaming"),
    ],
}
RECIPE = "stages:\n  - {method: sparsegpt, sparsity: '2:4'}\n  - {method: int8}\n"
# Recorded values that differ from run to run.
VOLATILE = re.compile(r"seconds|rss|versions|wall|elapsed|^time$|tokens_per_s")


def stable(value):
    """``value`` without timings, memory readings and versions (recursively)."""
    if isinstance(value, dict):  # keys normalised first: a temporary path may spell "rss"
        keys = {k: stable(k) for k in value}
        return {keys[k]: stable(v) for k, v in value.items() if not VOLATILE.search(str(keys[k]))}
    if isinstance(value, list):
        return [stable(v) for v in value]
    if isinstance(value, str):  # temporary paths differ between runs
        return re.sub(r"/tmp/[^ /]+", "/TMP", value)
    return value


def cli(argv: list[str]) -> tuple[int, str, str]:
    from lmcompress.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue().strip().splitlines()[-1:] if code else []


def record(out_dir: Path, key: str, tensors: dict, results: dict) -> None:
    results[key]["files"] = sorted(p.name for p in out_dir.iterdir())
    for path in sorted(out_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            tensors[f"{key}/{path.name}/{name}"] = tensor.contiguous()
    manifest = json.loads((out_dir / "compression.json").read_text())
    results[key]["manifest"] = stable(manifest)


def run_all(out: Path, families: list[str], cases: list[str] | None = None) -> None:
    from tests.conftest import make_tiny_model, make_tiny_tokenizer

    torch.set_num_threads(1)
    tensors: dict[str, torch.Tensor] = {}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="same-results-", dir="/tmp") as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.txt"
        corpus.write_text(TEXT)
        recipe = tmp / "recipe.yaml"
        recipe.write_text(RECIPE)
        for family in families:
            checkpoint = tmp / family
            make_tiny_model(family).save_pretrained(checkpoint)
            make_tiny_tokenizer().save_pretrained(checkpoint)
            for case, flags in CASES.items():
                if cases and case not in cases:
                    continue
                key = f"{family}/{case}"
                out_dir = tmp / "out" / key
                flags = [f.format(recipe=recipe) for f in flags]
                # a streamed job evaluates nothing: --eval with --streaming is refused (issue 23)
                evals = [] if "--streaming" in flags else ["--eval", str(corpus)]
                argv = [str(checkpoint), *evals, "--calib", str(corpus)]
                argv += [*("--seq-len", "32", "--eval-tokens", "0", "--nsamples", "8")]
                argv += ["-o", str(out_dir), "-q", *flags]
                torch.manual_seed(0)
                code, printed, error = cli(argv)
                results[key] = {"exit": code, "error": stable(error)}
                print(f"{key}: exit {code} {error[0] if error and code else ''}", flush=True)
                if code == 0:
                    record(out_dir, key, tensors, results)
                    evaluated = cli(
                        ["eval", str(out_dir), "--data", str(corpus), "--seq-len", "32"]
                        + ["--eval-tokens", "0", "--json", "-q"]
                    )
                    results[key]["eval"] = stable(
                        json.loads(evaluated[1]) if evaluated[0] == 0 else evaluated
                    )
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "tensors.safetensors"))
    (out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"{len(tensors)} tensors of {len(results)} runs in {out}")


def compare(before: Path, after: Path) -> int:
    a, b = (
        load_file(str(before / "tensors.safetensors")),
        load_file(str(after / "tensors.safetensors")),
    )
    ra = json.loads((before / "results.json").read_text())
    rb = json.loads((after / "results.json").read_text())
    bad = [f"tensor only before: {k}" for k in sorted(set(a) - set(b))]
    bad += [f"tensor only after: {k}" for k in sorted(set(b) - set(a))]
    bad += [f"tensor differs: {k}" for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
    for key in sorted(set(ra) | set(rb)):
        if ra.get(key) != rb.get(key):
            bad.append(f"results differ: {key}")
    for line in bad:
        print(line)
    runs = sum(r["exit"] == 0 for r in ra.values())
    print(f"{len(a)} tensors of {runs} successful runs ({len(ra)} in all): {len(bad)} differences")
    return 1 if bad else 0


def compare_outputs(before: Path, after: Path) -> int:
    """Every tensor of two output directories (``compress-model -o``), ``torch.equal``."""
    bad, count = [], 0
    names = sorted({p.name for d in (before, after) for p in d.glob("*.safetensors")})
    for name in names:
        a, b = before / name, after / name
        if not (a.is_file() and b.is_file()):
            bad.append(f"{name} only in one output")
            continue
        ta, tb = load_file(str(a)), load_file(str(b))
        bad += [f"{name}: {k} in one only" for k in sorted(set(ta) ^ set(tb))]
        bad += [
            f"{name}: {k} differs"
            for k in sorted(set(ta) & set(tb))
            if not torch.equal(ta[k], tb[k])
        ]
        count += len(ta)
    for line in bad:
        print(line)
    print(f"{count} tensors in {len(names)} files: {len(bad)} differences")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write this tree's tensors and results here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument(
        "--compare-outputs",
        nargs=2,
        type=Path,
        metavar=("BEFORE", "AFTER"),
        help="compare every tensor of two compress-model output directories",
    )
    parser.add_argument("--families", nargs="+", default=None)
    parser.add_argument("--cases", nargs="+", default=None, help="only these cases (names)")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.compare_outputs:
        return compare_outputs(*args.compare_outputs)
    from tests.conftest import FAMILY_NAMES

    run_all(args.out, args.families or FAMILY_NAMES, args.cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
