"""One real ``compress-model -q`` job per registered method, run once per test session for the
two tests that read them: ``tests/cli/test_quiet.py`` (nothing on stderr, the perplexity on
stdout) and ``tests/jobs/test_memory_estimate.py`` (the estimate the job was admitted with
against the peak RSS it reached). Running them once for both saves the fourteen processes'
start-up, about a minute and a half on a 2-core host.

Each job runs in a fresh process with a minimal environment (no ``TQDM_DISABLE`` that would hide
a bar ``-q`` forgot) and one empty HOME for all of them: the first job that needs the CPU
kernels builds them there (a build that must be silent too; the compiler's own peak, ~250 MB,
stays below a job's), the others load that build. Two run at a time, one thread each; the peak
RSS is the job's ``ru_maxrss``, measured by ``benchmarks.runner``'s small parent process (a
child forked from pytest itself would start at pytest's peak: 1027 MiB late in a CI run).
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import matplotlib
from conftest import FAMILY_NAMES, make_tiny_model, make_tiny_tokenizer

from benchmarks.runner import CLI, measured_argv
from lmcompress.compressor.io.layout import MANIFEST

TEXT = "\n\n".join(f"Document {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
METHOD_FLAGS = {  # every method: its bars (per layer, per block, per step) all silenced
    "magnitude": [],
    "wanda": [],
    "sparsegpt": [],
    "maskllm": ["--steps", "2"],
    "subnet": ["--steps", "2"],
    "structured": ["--structure", "channels", "layers", "--distill-steps", "1"],
    "svd": [],
    "asvd": [],
    "svd-llm": [],
    "fwsvd": [],
    "gfwsvd": [],
    "int8": [],
    "rtn": ["--group-size", "32"],  # the default 128 does not divide the tiny widths
    "gptq": ["--group-size", "32"],
}
# every method, each on a family in turn: all seven families are covered too
PAIRS = [(method, FAMILY_NAMES[i % len(FAMILY_NAMES)]) for i, method in enumerate(METHOD_FLAGS)]


@dataclass(frozen=True)
class MethodJob:
    family: str
    returncode: int
    stdout: str
    stderr: str
    peak_rss_bytes: int
    record: dict | None  # the output's manifest (compression.json), None where none was written


def run_method_jobs(root: Path) -> dict[str, MethodJob]:
    """``{method: MethodJob}`` of one job per :data:`PAIRS` entry, under ``root``."""
    corpus, home = root / "corpus.txt", root / "home"
    corpus.write_text(TEXT)
    home.mkdir()
    for family in sorted({family for _, family in PAIRS}):
        make_tiny_model(family).save_pretrained(root / family)
        make_tiny_tokenizer().save_pretrained(root / family)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "OMP_NUM_THREADS": "1",
        # report.png: matplotlib's font cache from this user's (in an empty HOME, building it
        # takes seconds and, past 5 s, warns on stderr)
        "MPLCONFIGDIR": matplotlib.get_cachedir(),
    }

    def run(pair: tuple[str, str]) -> MethodJob:
        method, family = pair
        out, stem = root / "out" / method, root / method
        argv = [str(root / family), "--method", method, *METHOD_FLAGS[method]]
        argv += ["--calib", str(corpus), "--nsamples", "8", "--eval", str(corpus)]
        argv += ["--seq-len", "32", "-o", str(out), "-q"]
        command = measured_argv(f"{stem}.measured", [*CLI, *argv])
        with open(f"{stem}.out", "w") as stdout, open(f"{stem}.err", "w") as stderr:
            subprocess.run(command, stdout=stdout, stderr=stderr, env=env, check=False)
        _, max_rss_kib, returncode = Path(f"{stem}.measured").read_text().split()
        manifest = out / MANIFEST
        return MethodJob(
            family=family,
            returncode=int(returncode),
            stdout=Path(f"{stem}.out").read_text(),
            stderr=Path(f"{stem}.err").read_text(),
            peak_rss_bytes=int(max_rss_kib) * 1024,  # Linux reports KiB
            record=json.loads(manifest.read_text()) if manifest.is_file() else None,
        )

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(METHOD_FLAGS, pool.map(run, PAIRS), strict=True))
