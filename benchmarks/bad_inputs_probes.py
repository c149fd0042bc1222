"""The probes of ``benchmarks.bad_inputs``: each bad (or legal) input, the set-up it starts
from, and the fixtures (real exports, a MaskLLM checkpoint) the set-ups copy.

The rows of issue 10's table first, then issue 23's inputs: work silently lost, full disks and
bad paths, recipes and resumes, an INFO line before the error, tampered exports of every format
(each through ``compress-model eval`` and ``from_pretrained``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.tamperings import COMPACT, EDITS

QUICK = ("--method", "magnitude", "--eval", "--skip-dense")  # the cheapest real job
TEXT = "\n\n".join(
    f"Document {i}. The quick brown fox jumps over the lazy dog." for i in range(400)
)
LAYER = "model.layers.0.mlp.up_proj"  # the layer the tampered exports edit


@dataclass(frozen=True)
class Probe:
    """One bad (or legal) input. ``argv``: the ``compress-model`` arguments, or with
    ``python`` a Python program run with ``-c``; ``{cache}`` (the cached SmolLM2 directory),
    ``{fixtures}`` and ``{work}`` are filled in, in ``argv`` and ``env``. ``files``: created
    first; ``env``: overrides (``None`` unsets); ``setup``: one of :data:`SETUPS`, run first
    and undone after; ``expect``: the exit code that is right (0: a legal input)."""

    argv: tuple[str, ...]
    files: dict[str, str] = field(default_factory=dict)
    env: dict[str, str | None] = field(default_factory=dict)
    setup: str | None = None
    expect: int = 2
    python: bool = False
    lines: int = 1  # stderr lines of the error: 2 after --force's warning


def _bomb(key: str, levels: int = 9) -> str:
    """A recipe whose ``key`` holds a YAML alias bomb: 9 levels of 9 aliases, 9**9 strings."""
    lines = ["x0: &x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for level in range(1, levels):
        refs = ", ".join([f"*x{level - 1}"] * 9)
        lines.append(f"x{level}: &x{level} [{refs}]")
    return "\n".join([*lines, f"{key}: *x{levels - 1}", ""])


def _from_pretrained(path: str) -> tuple[str, ...]:
    """A program that loads ``path`` as an API user would and reports a refusal in one line."""
    return (
        "import sys, lmcompress, transformers\n"
        "from lmcompress.errors import LmcompressError\n"
        "transformers.utils.logging.disable_progress_bar()\n"
        "try:\n"
        f"    transformers.AutoModelForCausalLM.from_pretrained({path!r})\n"
        "except LmcompressError as err:\n"
        "    print(f'{{type(err).__name__}}: {{err}}', file=sys.stderr)\n"
        "    sys.exit(2)\n",
    )


STREAM = ("{cache}", "--streaming")
OFFLOAD = (*STREAM, "--method", "wanda", "--offload-activations")
RESUME = (
    "--method", "maskllm", "--resume", "--checkpoint-dir", "ckpt", "--steps", "3",
    *("--nsamples", "8", "--seq-len", "64", "--eval", "--skip-dense", "-o", "out"),
)  # fmt: skip
EVAL_FILE = ("--eval", "t.txt", "--skip-dense", "-o", "out")

# name -> probe
PROBES: dict[str, Probe] = {
    # --- issue 10's table ---
    "--device cuda": Probe(("--device", "cuda", "-o", "out")),
    "recipe nsamples: many": Probe(
        ("--config", "r.yaml", "-o", "out"), {"r.yaml": "nsamples: many\n"}
    ),
    "recipe blocksize: big": Probe(
        ("--config", "r.yaml", "-o", "out"), {"r.yaml": "method: sparsegpt\nblocksize: big\n"}
    ),
    "recipe eval: wiki-test": Probe(
        ("--config", "r.yaml", "-o", "out"), {"r.yaml": "eval: wiki-test\n"}
    ),
    "-o under /proc": Probe(("-o", "/proc/lmcompress-out")),
    "-o under a file": Probe(("-o", "a-file/out"), {"a-file": "x"}),
    "-o on a read-only mount": Probe(("-o", "ro/out"), setup="read-only mount"),
    "--nsamples 100000": Probe(("--method", "sparsegpt", "--nsamples", "100000", "-o", "out")),
    "--seq-len 100000": Probe(("--seq-len", "100000", "-o", "out")),
    "--overwrite -o the input": Probe(("--overwrite", "-o", "{cache}")),
    "--layer-sparsity nomatch": Probe(("--layer-sparsity", "nomatch.*=0.3", "-o", "out")),
    "maskllm --resume, empty dir": Probe(
        ("--method", "maskllm", "--resume", "--checkpoint-dir", "ckpt", "-o", "out"),
        {"ckpt/.keep": ""},
    ),
    "maskllm --steps 0": Probe(("--method", "maskllm", "--steps", "0", "-o", "out")),
    "--lm-eval-tasks nonexistent_task": Probe(("--lm-eval-tasks", "nonexistent_task", "-o", "out")),
    "hub id, offline": Probe(("some-org/some-model", "-o", "out")),
    "missing checkpoint": Probe(("./no-such-model", "-o", "out")),
    # --- issue 23: work silently lost or the wrong thing done ---
    "-o '' (an unset $OUT)": Probe((*QUICK, "-o", ""), {"mine.txt": "x"}),
    "recipe with method twice": Probe(
        ("--config", "r.yaml", "-o", "out"), {"r.yaml": "method: wanda\nmethod: svd\n"}
    ),
    "svd --ratio 1e-9": Probe(("--method", "svd", "--ratio", "1e-9", "-o", "out")),
    "--streaming --eval FILE": Probe((*STREAM, *EVAL_FILE), {"t.txt": TEXT}),
    # --- issue 23: full disks and bad paths ---
    "-o on a full disk": Probe((*QUICK, "-o", "disk/out"), setup="64 kB tmpfs"),
    "-o on a full disk, --force": Probe(
        (*QUICK, "--force", "-q", "-o", "disk/out"), setup="64 kB tmpfs", lines=2
    ),
    "--streaming -o on a full disk": Probe(
        (*STREAM, *QUICK, "-o", "disk/out"), setup="64 kB tmpfs"
    ),
    "--streaming -o on a full disk, --force": Probe(
        (*STREAM, *QUICK, "--force", "-q", "-o", "disk/out"), setup="64 kB tmpfs", lines=2
    ),
    "-o a dangling symlink": Probe(("-o", "dangling"), setup="symlinks"),
    "-o a symlink loop": Probe(("-o", "loop-a"), setup="symlinks"),
    "-o with a 300-character name": Probe(("-o", "x" * 300)),
    "-o longer than PATH_MAX": Probe(("-o", "/".join(["d" * 200] * 25))),
    "--offload-activations under /proc": Probe((*OFFLOAD, "/proc/lmc-act", "-o", "out")),
    "--offload-activations a file": Probe((*OFFLOAD, "a-file", "-o", "out"), {"a-file": "x"}),
    "--offload-activations on a full disk": Probe(
        (*OFFLOAD, "disk/act", "-o", "out"), setup="64 kB tmpfs"
    ),
    "--offload-activations on a full disk, --force": Probe(
        (*OFFLOAD, "disk/act", "--force", "-q", "-o", "out"), setup="64 kB tmpfs", lines=2
    ),
    "LMCOMPRESS_CACHE a file": Probe(
        (*QUICK, "-o", "out"), {"cache": "x"}, env={"LMCOMPRESS_CACHE": "{work}/cache"}
    ),
    "XDG_CACHE_HOME unwritable": Probe(
        (*QUICK, "-o", "out"), env={"LMCOMPRESS_CACHE": None, "XDG_CACHE_HOME": "/proc/lmc"}
    ),
    # --- issue 23: recipes, resumes, checkpoints ---
    "recipe alias bomb in eval": Probe(
        ("--config", "r.yaml", "-o", "out"), {"r.yaml": _bomb("eval")}
    ),
    "recipe alias bomb in include": Probe(
        ("--config", "r.yaml", "-o", "out"), {"r.yaml": _bomb("include")}
    ),
    "maskllm --resume, truncated state": Probe(RESUME, setup="maskllm checkpoint, truncated"),
    "maskllm --resume with --sparsity 4:8": Probe(
        (*RESUME, "--sparsity", "4:8"), setup="maskllm checkpoint"
    ),
    "maskllm --resume without --checkpoint-every": Probe(
        RESUME, setup="maskllm checkpoint", expect=0
    ),
    "config.json disagrees with the weights": Probe(
        ("mismatched", "-o", "out"), setup="mismatched"
    ),
    # --- issue 23: an INFO line came before the one-line error ---
    "--eval an empty file": Probe(EVAL_FILE, {"t.txt": ""}),
    "--eval a binary file": Probe(EVAL_FILE, setup="binary text"),
    "--eval a latin-1 file": Probe(EVAL_FILE, setup="latin-1 text"),
    "--eval /dev/null": Probe(("--eval", "/dev/null", "--skip-dense", "-o", "out")),
    "--eval jsonl without text": Probe(
        ("--eval", "t.jsonl", "--skip-dense", "-o", "out"), {"t.jsonl": '{"body": "x"}\n'}
    ),
    "--calib with 3 tokens": Probe(
        ("--method", "wanda", "--calib", "t.txt", "-o", "out"), {"t.txt": "a b c"}
    ),
    "--eval-tokens 1": Probe(("--eval-tokens", "1", "-o", "out")),
    "recipe int8 then sparsegpt": Probe(
        ("--config", "r.yaml", "-o", "out"),
        {"r.yaml": "stages:\n  - {method: int8}\n  - {method: sparsegpt}\n"},
    ),
    "recipe sparsegpt twice": Probe(
        ("--config", "r.yaml", "-o", "out"),
        {"r.yaml": "stages:\n  - {method: sparsegpt}\n  - {method: sparsegpt}\n"},
    ),
    # --- issue 39: inputs inside the output, stages that do not compose, flags ---
    "--overwrite with --eval inside -o": Probe(
        ("--eval", "out/t.txt", "--overwrite", "-o", "out"), {"out/t.txt": TEXT}
    ),
    "--overwrite with --calib inside -o": Probe(
        ("--method", "wanda", "--calib", "out/t.txt", "--overwrite", "-o", "out"),
        {"out/t.txt": TEXT},
    ),
    "--overwrite with --config inside -o": Probe(
        ("--config", "out/r.yaml", "--overwrite", "-o", "out"),
        {"out/r.yaml": "method: magnitude\n"},
    ),
    "recipe svd then int8": Probe(
        ("--config", "r.yaml", "-o", "out"),
        {"r.yaml": "stages:\n  - {method: gfwsvd}\n  - {method: int8}\n"},
    ),
    "recipe magnitude 0.5 then int8 twice": Probe(
        ("--config", "r.yaml", "-o", "out"),
        {
            "r.yaml": "stages:\n  - {method: magnitude, sparsity: 0.5}\n  - {method: int8}\n"
            "  - {method: int8}\n"
        },
    ),
    "-o not UTF-8": Probe(
        (
            "import subprocess, sys\n"
            "cli = [sys.executable, '-m', 'lmcompress.cli.main', '-o', b'out\\xff']\n"
            "sys.exit(subprocess.run(cli).returncode)\n",
        ),
        python=True,
    ),
    "--sparsity given twice": Probe(("--sparsity", "0.5", "--sparsity", "0.6", "-o", "out")),
    "--sparsity 1e-300": Probe(("--sparsity", "1e-300", "-o", "out")),
    "bench --threads 0": Probe(("bench", "{cache}", "--threads", "0")),
    "bench --threads -1": Probe(("bench", "{cache}", "--threads", "-1")),
}
# --- issue 23: tampered exports, each through compress-model eval and from_pretrained ---
TAMPERED = {  # name -> (fixture export, tensor, edit)
    "repeated 2:4 positions": ("2:4", "indices", "repeat"),
    "2:6 positions out of range": ("2:6", "indices", "0xff"),
    "NaN in nm_packed values": ("2:4", "values", "nan"),
    "inf in a low-rank factor": ("svd", "A", "inf"),
    "NaN in an int8 weight scale": ("int8", "weight_scale", "nan"),
    "repeated positions in nm_packed_int8": ("2:4+int8", "indices", "repeat"),
}
for _name in TAMPERED:
    PROBES[f"eval: {_name}"] = Probe(
        ("eval", "t", "--eval-tokens", "1024", "--seq-len", "128"), setup=f"tampered: {_name}"
    )
    PROBES[f"from_pretrained: {_name}"] = Probe(
        _from_pretrained("t"), setup=f"tampered: {_name}", python=True
    )
# --- issue 39: every tampering of benchmarks.tamperings (stored dtypes, manifest fields, the two
# manifests, the dense part) on a real compact export, through eval and from_pretrained ---
for _name in [*EDITS, *COMPACT]:
    PROBES[f"eval: {_name}"] = Probe(
        ("eval", "t", "--eval-tokens", "1024", "--seq-len", "128"), setup=f"schema: {_name}"
    )
    # transformers never calls lmcompress without a quantization_config, and its own config
    # class refuses a hidden_size its heads do not divide (a ValueError) before any loader
    # runs: docs/formats.md says so; eval and load_compressed refuse both (above)
    if _name in (
        "quantization_config removed",
        "hidden_size 640",
        "hidden_size not a multiple of the heads",
    ):
        continue
    PROBES[f"from_pretrained: {_name}"] = Probe(
        _from_pretrained("t"), setup=f"schema: {_name}", python=True
    )
# --- issue 39: the API given the wrong kind of argument, and a hostile path on the terminal ---
API = "import sys, lmcompress as L\nfrom lmcompress.errors import LmcompressError\ntry:\n"
API += "    {call}\nexcept LmcompressError as err:\n"
API += "    print(f'{{{{type(err).__name__}}}}: {{{{err}}}}', file=sys.stderr)\n    sys.exit(2)\n"
for _name, _call in {
    "API: run() given a dict config": "L.run(L.RunOptions(), {{'method': 'magnitude'}})",
    "API: run() given a string config": "L.run(L.RunOptions(), 'magnitude')",
    "API: run() given None options": "L.run(None, L.MagnitudeConfig())",
    "API: load_compressed(None)": "L.load_compressed(None)",
    "API: load_compressed(device='cuda') without a GPU": (
        "L.load_compressed('{fixtures}/2-4', device='cuda')"
    ),
}.items():
    PROBES[_name] = Probe((API.format(call=_call),), python=True, setup="fixture: 2:4")
PROBES["a newline and ANSI escapes in the checkpoint path"] = Probe(
    ("./no-such\n\x1b[2J\x1b[31mmodel", "-o", "out")
)
KILLS = ("SIGKILL while saving", "SIGTERM while saving")
WRITERS = "two runs writing one -o at once"
# issue 39: two real processes on one output tree (bad_inputs.run_race)
RACES = {
    "a file written into -o during the job": ("written", ()),
    "a file written into -o during an --overwrite job": ("written", ("--overwrite",)),
    "-o a/b while -o a runs": ("nested", ("a", "a/b")),
    "-o a --overwrite while -o a/b runs, then a third -o a/b": ("nested", ("a/b", "a")),
}
MODES = "exported file modes"
ORDER = [*PROBES, WRITERS, *RACES, *KILLS, MODES]

# the exports and checkpoints the probes start from, built once per --work
FIXTURES: dict[str, tuple[str, ...]] = {
    "2:4": (*QUICK, "--sparsity", "2:4", "--no-dense-copy"),
    "2:6": (*QUICK, "--sparsity", "2:6", "--no-dense-copy"),
    "svd": ("--method", "svd", "--ratio", "0.5", "--eval", "--skip-dense", "--no-dense-copy"),
    "int8": (
        *("--method", "int8", "--nsamples", "8", "--seq-len", "128"),
        *("--eval", "--skip-dense", "--no-dense-copy"),
    ),
    "2:4+int8": ("--config", "{fixtures}/stages.yaml", "--no-dense-copy"),
    "maskllm": (
        "--method",
        "maskllm",
        "--steps",
        "3",
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
        "{fixtures}/maskllm-ckpt",
        "--nsamples",
        "8",
        "--seq-len",
        "64",
        "--eval",
        "--skip-dense",
    ),  # fmt: skip
}
STAGES = "eval: []\nskip_dense: true\nnsamples: 8\nseq_len: 128\nstages:\n"
STAGES += "  - {method: magnitude, sparsity: '2:4'}\n  - {method: int8}\n"
