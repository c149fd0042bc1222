"""Run llm-compressor's Wanda or SparseGPT on the same calibration windows as lmcompress.

Run with OUR venv's python. It tokenizes the calibration corpus with our corpora code, draws
the windows exactly as our pipeline does (``calibration_windows``, seeded), writes them to a
safetensors file, then runs ``llmcompressor_prune.py`` in the peer venv (made by
``setup_llmcompressor.sh``) under ``/usr/bin/time -v`` and writes
``{"wall_seconds", "peak_rss_mb", "sparsity_check", "output"}`` to ``OUT/peer_run.json``.
The pruned model (dense zeros) is saved in ``OUT`` itself, ready for ``lmcompress eval OUT``;
the peer's log goes to ``OUT/peer.log``.

    python benchmarks/peers/run_peer.py --method sparsegpt --sparsity 2:4 --out out/peer-sgpt
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from lmcompress.compressor import models
from lmcompress.evaluation.corpora import calibration_windows, tokenize

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = HERE.parents[1] / ".venv-llmc"
PRUNE_SCRIPT = HERE / "llmcompressor_prune.py"
METHODS = ("wanda", "sparsegpt")
SPARSITIES = ("2:4", "0.5")

_WALL = re.compile(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)")
_RSS = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")


def parse_time_v(text: str) -> tuple[float, float]:
    """``(wall seconds, peak RSS in MiB)`` from GNU ``time -v`` output."""
    wall, rss = _WALL.search(text), _RSS.search(text)
    if wall is None or rss is None:
        raise ValueError(f"not GNU time -v output: {text[-500:]!r}")
    seconds = 0.0
    for part in wall.group(1).split(":"):  # h:mm:ss or m:ss.ss
        seconds = seconds * 60 + float(part)
    return seconds, int(rss.group(1)) / 1024


def model_dir(checkpoint: str) -> tuple[Path, object]:
    """A local safetensors directory for ``checkpoint`` (made on first use), and its tokenizer."""
    model, tokenizer = models.load_model(checkpoint)  # converts and caches an alias once
    del model
    path = Path(checkpoint).expanduser()
    return (path if path.is_dir() else models.cache_dir() / checkpoint), tokenizer


def run_peer(
    method: str,
    sparsity: str,
    out_dir: str | os.PathLike,
    nsamples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
    calib: str = "wiki-calib",
    venv: str | os.PathLike = DEFAULT_VENV,
    checkpoint: str = models.DEFAULT_CHECKPOINT,
) -> dict:
    """Prune ``checkpoint`` with llm-compressor into ``out_dir``; the peer_run.json record.

    Raises ``RuntimeError`` if the peer process fails or its saved model fails the check
    (decoder linears 2:4 / 50% sparse, everything else untouched); peer_run.json is written
    first whenever the check ran.
    """
    if method not in METHODS or sparsity not in SPARSITIES:
        raise ValueError(
            f"method in {METHODS} and sparsity in {SPARSITIES}, got {method} {sparsity}"
        )
    python = Path(venv) / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(f"{python} missing: run benchmarks/peers/setup_llmcompressor.sh")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source, tokenizer = model_dir(checkpoint)
    windows = calibration_windows(tokenize(tokenizer, calib), nsamples, seq_len, seed)

    with tempfile.TemporaryDirectory() as tmp:
        calib_file, time_file = Path(tmp, "calib.safetensors"), Path(tmp, "time.txt")
        save_file({"input_ids": windows.contiguous()}, calib_file)  # (nsamples, seq_len)
        command = [
            "/usr/bin/time", "-v", "-o", str(time_file), str(python), str(PRUNE_SCRIPT),
            "--model", str(source), "--method", method, "--sparsity", sparsity,
            "--calib", str(calib_file), "--output", str(out),
        ]  # fmt: skip
        log_file = out / "peer.log"
        logger.info(
            "llm-compressor %s %s: %d x %d tokens of %s", method, sparsity, nsamples, seq_len, calib
        )
        logger.info("pruned model -> %s (log: %s)", out, log_file)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        with open(log_file, "w") as log:
            proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            log.write(proc.stdout)  # llm-compressor logs to stdout; its last line is the check
        time_text = time_file.read_text() if time_file.is_file() else ""

    lines = proc.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{") or not _RSS.search(time_text):
        raise RuntimeError(f"the peer failed (exit {proc.returncode}); see {out / 'peer.log'}")
    wall_seconds, peak_rss_mb = parse_time_v(time_text)
    record = {
        "wall_seconds": round(wall_seconds, 1),
        "peak_rss_mb": round(peak_rss_mb, 1),
        "sparsity_check": json.loads(lines[-1]),
        "output": str(out),
        "method": method,
        "sparsity": sparsity,
        "calibration": {"corpus": calib, "nsamples": nsamples, "seq_len": seq_len, "seed": seed},
    }
    (out / "peer_run.json").write_text(json.dumps(record, indent=2) + "\n")
    if proc.returncode != 0 or not record["sparsity_check"].get("ok"):
        raise RuntimeError(f"the peer's pruned model failed its check: {out / 'peer_run.json'}")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", required=True, choices=METHODS)
    parser.add_argument("--sparsity", required=True, choices=SPARSITIES)
    parser.add_argument("--out", required=True, help="directory for the pruned model")
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calib", default="wiki-calib", help="calibration corpus")
    parser.add_argument("--venv", default=str(DEFAULT_VENV), help="llm-compressor's venv")
    parser.add_argument("--model", default=models.DEFAULT_CHECKPOINT, help="alias or directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    record = run_peer(
        args.method, args.sparsity, args.out, args.nsamples, args.seq_len, args.seed,
        args.calib, args.venv, args.model,
    )  # fmt: skip
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
