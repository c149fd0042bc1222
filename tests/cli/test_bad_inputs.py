"""Bad input to ``compress-model``: one line on stderr, exit 2, nothing written, and (except for
what only the weights can reveal) no weight loaded: every check runs before any work.

Each case is ``name -> (argv, part of the message)``; argv is completed with a tiny corpus,
``--seq-len 32`` and ``-o OUT`` unless the case gives its own.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import make_odd_llama, make_tiny_model

import lmcompress.jobs.run as pipeline
from lmcompress.cli.main import main

TEXT = "\n\n".join(f"Document {i}. The quick brown fox jumps over the lazy dog." for i in range(60))

# Cases that only the weights can reveal: the model is loaded, then the error comes. (None now:
# a corrupt safetensors file is found in its header, before loading.)
NEEDS_WEIGHTS: set[str] = set()


def _recipe(tmp_path, name, text):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def _cases(tmp_path, good, corpus):  # noqa: PLR0915 - one table
    only_bin = tmp_path / "only-bin"
    only_bin.mkdir()
    (only_bin / "config.json").write_text((good / "config.json").read_text())
    (only_bin / "pytorch_model.bin").write_bytes(b"pickle")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in good.iterdir():
        (corrupt / f.name).write_bytes(f.read_bytes())
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 100)
    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    no_type = tmp_path / "no-type"
    no_type.mkdir()
    (no_type / "config.json").write_text(json.dumps({"hidden_size": 8}))
    fake_gguf = tmp_path / "model.gguf"
    fake_gguf.write_text("not a gguf file")
    bert = tmp_path / "bert"
    transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    ).save_pretrained(bert)
    odd = tmp_path / "odd"
    make_odd_llama().save_pretrained(odd)
    for f in good.glob("*token*"):
        (odd / f.name).write_bytes(f.read_bytes())
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("x")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    empty_ckpt_dir = tmp_path / "no-checkpoints"
    empty_ckpt_dir.mkdir()
    gpt2 = tmp_path / "gpt2"
    make_tiny_model("gpt2").save_pretrained(gpt2)
    for f in good.glob("*token*"):
        (gpt2 / f.name).write_bytes(f.read_bytes())
    g, c = str(good), str(corpus)
    r = _recipe
    return {
        # --- the checkpoint ---
        "missing checkpoint": ([str(tmp_path / "nope")], "not found"),
        "only pickled weights": ([str(only_bin)], "safetensors"),
        "corrupt safetensors": ([str(corrupt)], "corrupt"),
        "config not json": ([str(bad_json)], "not valid JSON"),
        "config without model_type": ([str(no_type)], "no model_type"),
        "foreign gguf": ([str(fake_gguf)], "gguf"),
        "unsupported architecture": ([str(bert)], "unsupported architecture 'bert'"),
        "indivisible layer": ([str(odd), "--sparsity", "4:8"], "not divisible by M=8"),
        # --- the method and its options ---
        "unknown method": ([g, "--method", "prune-it"], "unknown method 'prune-it'"),
        "impossible N:M": ([g, "--sparsity", "5:4"], "impossible N:M"),
        "zero N": ([g, "--sparsity", "0:4"], "impossible N:M"),
        "N equals M": ([g, "--sparsity", "4:4"], "impossible N:M"),
        "sparsity not a number": ([g, "--sparsity", "half"], "neither N:M"),
        "ratio out of range": ([g, "--sparsity", "1.5"], "between 0 and 1"),
        "ratio zero": ([g, "--sparsity", "0"], "between 0 and 1"),
        "layer rule without =": ([g, "--layer-sparsity", "q_proj"], "is not GLOB=SPARSITY"),
        "layer rule impossible": ([g, "--layer-sparsity", "*.q_proj=3:2"], "impossible N:M"),
        "layer rule matching nothing": (
            [g, "--layer-sparsity", "nomatch.*=0.3"],
            "matches none of the",
        ),
        "include matching nothing": ([g, "--include", "nomatch.*"], "nomatch"),
        "bad literal option": (
            [g, "--method", "sparsegpt", "--hessian-dtype", "half"],
            "argument --hessian-dtype: invalid choice: 'half' (choose from 'float32', 'float64')",
        ),
        "svd ratio above 1": ([g, "--method", "svd", "--ratio", "1.5"], "ratio"),
        "maskllm zero steps": ([g, "--method", "maskllm", "--steps", "0"], "steps must be"),
        "maskllm negative lr": ([g, "--method", "maskllm", "--lr", "-1"], "lr must be positive"),
        "maskllm resume without dir": (
            [g, "--method", "maskllm", "--resume"],
            "--resume needs --checkpoint-dir",
        ),
        "maskllm resume from nothing": (
            [g, "--method", "maskllm", "--resume", "--checkpoint-dir", str(empty_ckpt_dir)],
            "no checkpoint in",
        ),
        "maskllm prior-from nothing": (
            [g, "--method", "maskllm", "--prior-from", str(tmp_path / "none")],
            "--prior-from",
        ),
        "maskllm blockwise fsdp": (
            [g, "--method", "maskllm", "--blockwise", "--fsdp"],
            "--fsdp",
        ),
        # --- job options ---
        "unknown flag": ([g, "--sparsityy", "2:4"], "unrecognized arguments"),
        "zero seq-len": ([g, "--seq-len", "0"], "seq_len must be at least 1"),
        "seq-len beyond positions": ([g, "--seq-len", "129"], "maximum of 128 positions"),
        "zero nsamples": ([g, "--nsamples", "0"], "nsamples must be at least 1"),
        "nsamples beyond memory": ([g, "--method", "wanda", "--nsamples", str(10**9)], "available"),
        "zero eval batch": ([g, "--eval-batch-size", "0"], "eval_batch_size must be"),
        "negative eval tokens": ([g, "--eval-tokens", "-1"], "eval_tokens must be >= 0"),
        "bad save dtype": ([g, "--save-dtype", "int3"], "invalid choice: 'int3'"),
        "bad compute dtype": ([g, "--dtype", "int8"], "invalid choice: 'int8'"),
        "cuda without cuda": ([g, "--device", "cuda"], "this torch has no CUDA"),
        "unknown device": ([g, "--device", "tpu9"], "device"),
        "unknown corpus": ([g, "--eval", "wikitext-999"], "wikitext-999"),
        "missing calibration file": (
            [g, "--method", "wanda", "--calib", str(tmp_path / "none.txt")],
            "none.txt",
        ),
        "unknown lm-eval task": ([g, "--lm-eval-tasks", "nonexistent_task"], "nonexistent_task"),
        # --- the output ---
        "empty output": ([g, "--eval", c, "-o", ""], "-o is empty"),
        "non-empty output": ([g, "--eval", c, "-o", str(full)], "not empty"),
        "output is a file": ([g, "--eval", c, "-o", str(a_file)], "a-file"),
        "output under a file": ([g, "--eval", c, "-o", str(a_file / "out")], "not a directory"),
        "output under /proc": ([g, "--eval", c, "-o", "/proc/lmcompress-out"], "cannot write"),
        "output is the input": (
            [g, "--eval", c, "--overwrite", "-o", g],
            "would destroy the input",
        ),
        "output inside the input": (
            [g, "--eval", c, "-o", str(good / "pruned")],
            "would destroy the input",
        ),
        "output contains the input": (
            [g, "--eval", c, "--overwrite", "-o", str(tmp_path)],
            "would destroy the input",
        ),
        # --- recipes ---
        "bad recipe key": ([g, "--config", r(tmp_path, "key", "spars1ty: '2:4'\n")], "spars1ty"),
        "missing recipe": ([g, "--config", str(tmp_path / "none.yaml")], "not found"),
        "recipe not yaml": ([g, "--config", r(tmp_path, "yaml", "a: [\n")], "not valid YAML"),
        "recipe not a mapping": ([g, "--config", r(tmp_path, "list", "- 1\n")], "mapping"),
        "recipe unknown method": (
            [g, "--config", r(tmp_path, "method", "method: nope\n")],
            "unknown method 'nope'",
        ),
        "recipe int as text": (
            [g, "--config", r(tmp_path, "ns", "nsamples: many\n")],
            "nsamples",
        ),
        "recipe method int as text": (
            [g, "--config", r(tmp_path, "bs", "method: sparsegpt\nblocksize: big\n")],
            "blocksize",
        ),
        "recipe list as text": (
            [g, "-o", str(tmp_path / "out"), "--config", r(tmp_path, "ev", "eval: wiki-test\n")],
            "eval must be a list",
        ),
        "recipe bool as text": (
            [g, "--config", r(tmp_path, "sd", "skip_dense: maybe\n")],
            "skip_dense",
        ),
        "recipe float for int": ([g, "--config", r(tmp_path, "seed", "seed: 1.5\n")], "seed"),
        "maskllm resume with other sparsity": (
            [
                g,
                "--method",
                "maskllm",
                "--sparsity",
                "4:8",
                "--resume",
                "--checkpoint-dir",
                _maskllm_checkpoint(tmp_path / "ckpt-2-4"),
            ],
            "was written with other options: sparsity: 2:4 → 4:8; rerun without --resume",
        ),
        "maskllm resume truncated state.safetensors": (
            [
                g,
                "--method",
                "maskllm",
                "--sparsity",
                "2:4",
                "--resume",
                "--checkpoint-dir",
                _maskllm_checkpoint(tmp_path / "ckpt-truncated", truncate=True),
            ],
            "state.safetensors is corrupt or incomplete",
        ),
        "recipe key twice": (
            [g, "--config", r(tmp_path, "twice", "seed: 1\nnsamples: 4\nseed: 2\n")],
            "key 'seed' is given twice (lines 1 and 3)",
        ),
        "recipe alias bomb": (
            [g, "--config", r(tmp_path, "bomb", _alias_bomb())],
            "too many alias expansions (limit",
        ),
        "recipe too large": (
            [g, "--config", r(tmp_path, "large", "seed: 1\n" + "#" * 2**21)],
            "a recipe is a page of options",
        ),
        "svd ratio compresses nothing": (
            [g, "--method", "svd", "--ratio", "1e-9"],
            "leaves every selected layer dense",
        ),
        "greedy ratio below rank 8": (
            [g, "--method", "asvd", "--allocation", "greedy", "--ratio", "0.01"],
            "below what rank 8 in every selected layer keeps",
        ),
        "streaming with eval": ([g, "--streaming"], "--streaming does not evaluate: drop --eval"),
        # --- 4-bit (issue 40) ---
        "gptq bits 5": ([g, "--method", "gptq", "--bits", "5"], "bits must be one of 3, 4, 8"),
        "rtn bits 2": ([g, "--method", "rtn", "--bits", "2"], "bits must be one of 3, 4, 8, got 2"),
        "gptq group size not dividing": (
            [g, "--method", "gptq", "--group-size", "24"],
            "group_size 24 does not divide model.layers.0.self_attn.q_proj's 32 input columns "
            "(-1: one group per output row; 16 divides every selected layer)",
        ),
        "gptq group size 0": ([g, "--method", "gptq", "--group-size", "0"], "or -1 (per output"),
        "gptq act-order with 2:4": (
            [g, "--method", "gptq", "--act-order", "--sparsity", "2:4", "--group-size", "16"],
            "act-order visits the columns out of order",
        ),
        "gptq keep-mask with a ratio": (
            [g, "--method", "gptq", "--keep-mask", "--sparsity", "0.5", "--group-size", "16"],
            "--keep-mask keeps the existing zeros",
        ),
        "rtn quantized head streamed": (
            [g, "--method", "rtn", "--group-size", "16", "--head", "quantized", "--streaming",
             "--eval"],
            "--streaming never holds the output head",
        ),  # fmt: skip
        "gptq scale dtype bfloat16": (
            [g, "--method", "gptq", "--scale-dtype", "bfloat16"],
            "argument --scale-dtype: invalid choice: 'bfloat16'",
        ),
        # --- structured extraction (issue 42) ---
        "structured heads of gpt2": (
            [str(gpt2), "--method", "structured", "--structure", "heads"],
            "'gpt2' derives its head size from the hidden size",
        ),
        "structured budget removes every block": (
            [g, "--method", "structured", "--structure", "layers", "--ratio", "0.2"],
            "removing whole layers keeps 0.500 of the decoder at the closest",
        ),
        "structured budget removes every head": (
            [g, "--method", "structured", "--structure", "heads", "--ratio", "0.3"],
            "removing whole heads keeps",
        ),
        "subnet structure at N:M": (
            [g, "--method", "subnet", "--structure", "channels"],
            "--structure removes whole structures at one --sparsity fraction: no N:M",
        ),
        "subnet per-layer widths without a structure": (
            [g, "--method", "subnet", "--sparsity", "0.2", "--widths", "per-layer"],
            "--distill-steps, --widths, --channel-multiple and --layer-sample are for a structured "
            "extraction",
        ),
        "structured channel multiple without channels": (
            [g, "--method", "structured", "--structure", "layers", "--channel-multiple", "32"],
            "--channel-multiple rounds the MLP width: it needs --structure channels",
        ),
    }


def _alias_bomb() -> str:
    """A billion laughs under ``eval``: 9 levels of 9 aliases to the level below."""
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\neval: *l8\n"


def _no_loading(*_args, **_kwargs):
    raise AssertionError("the model was loaded before the error")


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture
def cases(tmp_path, tiny_checkpoint, corpus):
    return _cases(tmp_path, tiny_checkpoint, corpus)


CASE_NAMES = [
    "missing checkpoint",
    "only pickled weights",
    "corrupt safetensors",
    "config not json",
    "config without model_type",
    "foreign gguf",
    "unsupported architecture",
    "indivisible layer",
    "unknown method",
    "impossible N:M",
    "zero N",
    "N equals M",
    "sparsity not a number",
    "ratio out of range",
    "ratio zero",
    "layer rule without =",
    "layer rule impossible",
    "layer rule matching nothing",
    "include matching nothing",
    "bad literal option",
    "svd ratio above 1",
    "maskllm zero steps",
    "maskllm negative lr",
    "maskllm resume without dir",
    "maskllm resume from nothing",
    "maskllm prior-from nothing",
    "maskllm blockwise fsdp",
    "unknown flag",
    "zero seq-len",
    "seq-len beyond positions",
    "zero nsamples",
    "nsamples beyond memory",
    "zero eval batch",
    "negative eval tokens",
    "bad save dtype",
    "bad compute dtype",
    "cuda without cuda",
    "unknown device",
    "unknown corpus",
    "missing calibration file",
    "unknown lm-eval task",
    "empty output",
    "non-empty output",
    "output is a file",
    "output under a file",
    "output under /proc",
    "output is the input",
    "output inside the input",
    "output contains the input",
    "bad recipe key",
    "missing recipe",
    "recipe not yaml",
    "recipe not a mapping",
    "recipe unknown method",
    "recipe int as text",
    "recipe method int as text",
    "recipe list as text",
    "recipe bool as text",
    "recipe float for int",
    "maskllm resume with other sparsity",
    "maskllm resume truncated state.safetensors",
    "recipe key twice",
    "recipe alias bomb",
    "recipe too large",
    "svd ratio compresses nothing",
    "greedy ratio below rank 8",
    "streaming with eval",
    "gptq bits 5",
    "rtn bits 2",
    "gptq group size not dividing",
    "gptq group size 0",
    "gptq act-order with 2:4",
    "gptq keep-mask with a ratio",
    "rtn quantized head streamed",
    "gptq scale dtype bfloat16",
    "structured heads of gpt2",
    "structured budget removes every block",
    "structured budget removes every head",
    "subnet structure at N:M",
    "subnet per-layer widths without a structure",
    "structured channel multiple without channels",
]


def test_every_case_is_listed_and_a_different_input(cases):
    assert sorted(cases) == sorted(CASE_NAMES)
    assert len({tuple(argv) for argv, _ in cases.values()}) == len(cases) >= 40


# case -> its error line (tmp_path as <tmp>), filled as the cases run: no two bad inputs may get
# the same error, so that each is diagnosed, not just refused
_ERRORS: dict[str, str] = {}


@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_input_is_one_line_exit_2_before_any_work(
    case, cases, tmp_path, corpus, monkeypatch, capsys
):
    argv, message = cases[case]
    out = tmp_path / "out"
    if "-o" not in argv:  # the defaults the case does not give (a flag given twice is an error)
        defaults = {"--eval": str(corpus), "--calib": str(corpus), "--seq-len": "32"}
        given = [arg.split("=")[0] for arg in argv]
        defaults = [x for flag, v in defaults.items() if flag not in given for x in (flag, v)]
        argv = [argv[0], *defaults, "-o", str(out), *argv[1:]]
    if case not in NEEDS_WEIGHTS:
        monkeypatch.setattr(pipeline, "load_model", _no_loading)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # any machine: no GPU
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    with torch.no_grad():
        code = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, err
    assert "Traceback" not in err and captured.out == ""
    errors = [line for line in err.splitlines() if "compress-model" in line]
    assert len(errors) == 1 and err.endswith(errors[0]), err
    assert errors[0].startswith("compress-model: error:") and message in errors[0], errors[0]
    line = errors[0].replace(str(tmp_path), "<tmp>")
    assert line not in {v for k, v in _ERRORS.items() if k != case}, (case, line, _ERRORS)
    _ERRORS[case] = line
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temp dirs either


def _maskllm_checkpoint(directory, truncate=False):
    """A training checkpoint as ``compress-model --method maskllm --sparsity 2:4`` writes it
    (one toy parameter: validation reads only the JSON and the tensor file's header)."""
    from lmcompress.compressor.training import checkpoint
    from lmcompress.methods.maskllm.config import MaskLLMConfig

    meta = {
        "state": {"step": 1, "history": [], "evals": []},
        "config": {},
        "options": checkpoint.options_fingerprint(MaskLLMConfig(sparsity="2:4")),
        "params": {"x": [2]},
        "data": None,
    }
    tensors = {"param.x": torch.zeros(2), "rng.torch": torch.get_rng_state()}
    checkpoint.write_checkpoint(directory / checkpoint.CHECKPOINT, tensors, meta)
    if truncate:
        path = directory / checkpoint.CHECKPOINT / "state.safetensors"
        path.write_bytes(path.read_bytes()[:-4])
    return str(directory)


def test_maskllm_resume_may_change_the_checkpoint_interval(tiny_checkpoint, corpus, tmp_path):
    """Bookkeeping is not a training option: a run checkpointed every step resumes without
    ``--checkpoint-every`` (and with evaluations every step) to the same masks."""
    from safetensors.torch import load_file

    def job(out, *flags):
        argv = [str(tiny_checkpoint), "--calib", str(corpus), "--eval", str(corpus)]
        argv += ["--eval-tokens", "64", "--skip-dense", "--seq-len", "32", "-o", str(out)]
        train = ["--method", "maskllm", "--sparsity", "2:4", "--steps", "2", "--prior", "magnitude"]
        common = ["--nsamples", "4", "--checkpoint-dir", str(tmp_path / "ckpt"), "-q"]
        return main([*argv, *train, *common, *flags])

    assert job(tmp_path / "first", "--checkpoint-every", "1") == 0
    assert job(tmp_path / "again", "--resume", "--eval-every", "1") == 0
    first = load_file(tmp_path / "first" / "stats.safetensors")
    again = load_file(tmp_path / "again" / "stats.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
