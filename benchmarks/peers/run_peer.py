"""Run llm-compressor's Wanda, SparseGPT or GPTQ on the same calibration windows as lmcompress.

Run with OUR venv's python. It tokenizes the calibration corpus with our corpora code, draws
the windows exactly as our pipeline does (``calibration_windows``, seeded), writes them to a
safetensors file, then runs ``llmcompressor_prune.py`` (``--method wanda|sparsegpt``) or
``llmcompressor_gptq.py`` (``--method gptq``: W4A16, ``--bits`` 4 and ``--group-size`` 128 by
default, no ``--sparsity``) in the peer venv (made by
``setup_llmcompressor.sh``) as one job of the benchmark runner (``benchmarks.runner``: its own
process, wall time and peak RSS of that process alone, as GNU ``time -v`` measured them before)
and writes ``{"wall_seconds", "peak_rss_mb", "sparsity_check" (pruning) or "quant_check"
(gptq), "output", ...}`` to ``OUT/peer_run.json``. The pruned model (dense zeros) or the
quantized one (its quantize-dequantized weights, dense) is saved in ``OUT`` itself, ready for
``compress-model eval OUT``; the peer's stderr goes to ``OUT/peer.log``, its stdout
(llm-compressor logs there; the last line is the check) to ``OUT/peer.out``.

    python -m benchmarks.peers.run_peer --method sparsegpt --sparsity 2:4 --out out/peer-sgpt
    python -m benchmarks.peers.run_peer --method gptq --out out/peer-gptq   # W4A16 g128
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from benchmarks.runner import STDOUT, Job, run_job
from lmcompress.compressor.calibration.windows import calibration_windows
from lmcompress.compressor.model import loading as models
from lmcompress.evaluation.corpora import tokenize

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = HERE.parents[1] / ".venv-llmc"
PRUNE_SCRIPT = HERE / "llmcompressor_prune.py"
GPTQ_SCRIPT = HERE / "llmcompressor_gptq.py"
METHODS = ("wanda", "sparsegpt", "gptq")
SPARSITIES = ("2:4", "0.5")
QUANT_METHODS = ("gptq",)  # no --sparsity; --bits and --group-size instead
OBSERVERS = ("minmax", "mse")  # gptq's weight observer: llm-compressor's default, or its "mse"


def model_dir(checkpoint: str) -> tuple[Path, object]:
    """A local safetensors directory for ``checkpoint`` (made on first use), and its tokenizer."""
    model, tokenizer = models.load_model(checkpoint)  # converts and caches an alias once
    del model
    path = Path(checkpoint).expanduser()
    return (path if path.is_dir() else models.cache_dir() / checkpoint), tokenizer


def run_peer(
    method: str,
    sparsity: str | None,
    out_dir: str | os.PathLike,
    nsamples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
    calib: str = "wiki-calib",
    venv: str | os.PathLike = DEFAULT_VENV,
    checkpoint: str = models.DEFAULT_CHECKPOINT,
    bits: int = 4,
    group_size: int = 128,
    observer: str = "minmax",
) -> dict:
    """Prune (or, ``method="gptq"``, quantize: ``sparsity`` must then be ``None``, ``bits`` and
    ``group_size`` apply) ``checkpoint`` with llm-compressor into ``out_dir``; the
    peer_run.json record.

    Raises ``RuntimeError`` if the peer process fails or its saved model fails the check
    (decoder linears 2:4 / 50% sparse, or on the quantization grid; everything else
    untouched); peer_run.json is written first whenever the check ran.
    """
    quantizes = method in QUANT_METHODS
    if method not in METHODS or (sparsity is not None if quantizes else sparsity not in SPARSITIES):
        raise ValueError(
            f"method in {METHODS} and sparsity in {SPARSITIES} (none for {QUANT_METHODS}), "
            f"got {method} {sparsity}"
        )
    python = Path(venv) / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(f"{python} missing: run benchmarks/peers/setup_llmcompressor.sh")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source, tokenizer = model_dir(checkpoint)
    windows = calibration_windows(tokenize(tokenizer, calib), nsamples, seq_len, seed)

    with tempfile.TemporaryDirectory() as tmp:
        calib_file = Path(tmp, "calib.safetensors")
        save_file({"input_ids": windows.contiguous()}, calib_file)  # (nsamples, seq_len)
        if quantizes:
            command = (
                python, GPTQ_SCRIPT, "--model", source, "--bits", str(bits),
                "--group-size", str(group_size), "--observer", observer, "--calib", calib_file,
                "--output", out,
            )  # fmt: skip
            what = f"w{bits}a16 g{group_size} observer {observer}"
        else:
            command = (
                python, PRUNE_SCRIPT, "--model", source, "--method", method,
                "--sparsity", sparsity, "--calib", calib_file, "--output", out,
            )  # fmt: skip
            what = sparsity
        logger.info(
            "llm-compressor %s %s: %d x %d tokens of %s", method, what, nsamples, seq_len, calib
        )
        logger.info("output model -> %s (log: %s)", out, out / "peer.log")
        env = {"TOKENIZERS_PARALLELISM": "false"}
        # check=False: a model that fails the check exits 1 but still prints the check
        run = run_job(Job("peer", command, STDOUT, env, check=False), out)

    if not isinstance(run.result, dict):
        raise RuntimeError(f"the peer failed (exit {run.returncode}); see {out / 'peer.log'}")
    check = "quant_check" if quantizes else "sparsity_check"
    record = {
        "wall_seconds": run.wall_seconds,
        "peak_rss_mb": run.peak_rss_mb,
        check: run.result,
        "output": str(out),
        "method": method,
        "sparsity": sparsity,
        "calibration": {"corpus": calib, "nsamples": nsamples, "seq_len": seq_len, "seed": seed},
    }
    if quantizes:
        record.update(bits=bits, group_size=group_size, observer=observer)
    (out / "peer_run.json").write_text(json.dumps(record, indent=2) + "\n")
    if run.returncode != 0 or not record[check].get("ok"):
        raise RuntimeError(f"the peer's output model failed its check: {out / 'peer_run.json'}")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", required=True, choices=METHODS)
    parser.add_argument("--sparsity", choices=SPARSITIES, help="pruning methods only")
    parser.add_argument("--bits", type=int, default=4, help="gptq only")
    parser.add_argument("--group-size", type=int, default=128, help="gptq only")
    parser.add_argument("--observer", default="minmax", choices=OBSERVERS,
                        help="gptq only: its weights' observer")  # fmt: skip
    parser.add_argument("--out", required=True, help="directory for the pruned model")
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calib", default="wiki-calib", help="calibration corpus")
    parser.add_argument("--venv", default=str(DEFAULT_VENV), help="llm-compressor's venv")
    parser.add_argument("--model", default=models.DEFAULT_CHECKPOINT, help="alias or directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sparsity = None if args.sparsity in (None, "None", "none") else args.sparsity
    if args.method not in QUANT_METHODS and sparsity is None:
        parser.error(f"--method {args.method} needs --sparsity")
    record = run_peer(
        args.method, sparsity, args.out, args.nsamples, args.seq_len, args.seed,
        args.calib, args.venv, args.model, args.bits, args.group_size, args.observer,
    )  # fmt: skip
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
