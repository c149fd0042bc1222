"""compress-model called in process: the happy paths and at least ten bad inputs."""

import json

import pytest
import torch
import transformers
from conftest import make_odd_llama

from lmcompress.cli.main import main
from lmcompress.compressor.export import MANIFEST

TEXT = "\n\n".join(
    f"Document {i}. The quick brown fox jumps over the lazy dog {i} times, then rests."
    for i in range(60)
)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def _job(checkpoint, corpus, out, *extra):
    return [
        str(checkpoint),
        "--eval",
        str(corpus),
        "--calib",
        str(corpus),
        "--seq-len",
        "32",
        "--eval-tokens",
        "0",
        "-o",
        str(out),
        *extra,
    ]


def test_compress_evaluates_and_exports(tiny_checkpoint, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        main(_job(tiny_checkpoint, corpus, out, "--method", "magnitude", "--sparsity", "2:4", "-q"))
        == 0
    )
    printed = capsys.readouterr().out
    assert "dense ppl" in printed and "compressed ppl" in printed and str(out) in printed
    manifest = json.loads((out / MANIFEST).read_text())
    results = manifest["results"]
    dense = results["dense"][str(corpus)]["perplexity"]
    pruned = results["compressed"][str(corpus)]["perplexity"]
    assert dense > 1 and pruned > 1 and dense != pruned
    assert manifest["config"]["sparsity"] == "2:4"

    # `compress-model eval` on the output scores what the job reported for the compressed model
    assert (
        main(
            [
                "eval",
                str(out),
                "--data",
                str(corpus),
                "--seq-len",
                "32",
                "--eval-tokens",
                "0",
                "--json",
                "-q",
            ]
        )
        == 0
    )
    scored = json.loads(capsys.readouterr().out)["perplexity"][str(corpus)]["perplexity"]
    assert scored == pytest.approx(pruned, rel=1e-5)


def test_recipe_and_flag_override(tiny_checkpoint, corpus, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "method: magnitude\nsparsity: '4:8'\nexclude: ['*.o_proj']\nskip-dense: true\n"
    )
    out = tmp_path / "out"
    assert (
        main(_job(tiny_checkpoint, corpus, out, "--config", str(recipe), "--sparsity", "1:4", "-q"))
        == 0
    )
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["config"]["sparsity"] == "1:4"  # the flag beats the recipe
    assert manifest["config"]["exclude"] == ["*.o_proj"]
    assert "dense" not in manifest["results"]
    assert all(not layer["name"].endswith("o_proj") for layer in manifest["report"]["layers"])


@pytest.mark.parametrize(
    "flags",
    [
        ["--blockwise", "--refit", "sparsegpt", "--prior", "wanda"],
        ["--noise", "pool", "--straight-through-from", "0.5", "--refit", "sparsegpt"],
    ],
)
def test_maskllm_options_beyond_the_paper(tiny_checkpoint, corpus, tmp_path, flags):
    out = tmp_path / "out"
    argv = ["--method", "maskllm", "--sparsity", "2:4", "--steps", "2", "--batch-size", "2"]
    assert main(_job(tiny_checkpoint, corpus, out, *argv, "--nsamples", "8", *flags, "-q")) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    config = manifest["config"]
    assert config["refit"] == "sparsegpt"
    assert config["blockwise"] == ("--blockwise" in flags)
    assert config["noise"] == ("pool" if "pool" in flags else "exact")
    assert (out / "stats.safetensors").exists()
    layers = manifest["report"]["layers"]
    assert layers and all(layer["pattern"] == "2:4" for layer in layers)
    assert ("block_curves" in manifest["report"]["extra"]) == ("--blockwise" in flags)


def test_maskllm_transfer_from_an_output_dir(tiny_checkpoint, corpus, tmp_path):
    """``--prior-from OUT`` reads the logits the first job exported; learning nothing keeps
    exactly its mask (in the exported packed form too)."""
    from safetensors.torch import load_file

    first, second = tmp_path / "first", tmp_path / "second"
    argv = ["--method", "maskllm", "--sparsity", "2:4", "--batch-size", "2", "--nsamples", "8"]
    assert (
        main(_job(tiny_checkpoint, corpus, first, *argv, "--steps", "3", "--lr", "0.05", "-q")) == 0
    )
    transfer = ["--steps", "1", "--lr", "1e-12", "--prior-from", str(first), "-q"]
    assert main(_job(tiny_checkpoint, corpus, second, *argv, *transfer)) == 0
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    pruned = [k for k in a if k.endswith("proj.weight")]
    assert pruned and all(torch.equal(a[k] != 0, b[k] != 0) for k in pruned)


def test_methods_lists_options_generated_from_configs(capsys):
    assert main(["methods"]) == 0
    printed = capsys.readouterr().out
    assert "magnitude:" in printed and "--sparsity" in printed and "'2:4'" in printed
    assert "[float32|float64]" in printed  # SparseGPT's hessian_dtype Literal


def test_layer_sparsity_matching_no_layer_warns(tiny_checkpoint, corpus, tmp_path, caplog):
    out = tmp_path / "out"
    flags = ["--layer-sparsity", "nomatch.*=0.3", "*.q_proj=0.25", "--skip-dense", "-q"]
    with caplog.at_level("WARNING", logger="lmcompress"):
        assert main(_job(tiny_checkpoint, corpus, out, *flags)) == 0
    warned = [r.getMessage() for r in caplog.records if "matches none" in r.getMessage()]
    assert len(warned) == 1 and "nomatch.*=0.3" in warned[0], warned
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["config"]["layer_sparsity"] == ["nomatch.*=0.3", "*.q_proj=0.25"]
    layers = manifest["report"]["layers"]
    patterns = {layer["name"].rsplit(".", 1)[-1]: layer["pattern"] for layer in layers}
    assert patterns["q_proj"] == "0.25" and patterns["k_proj"] == "2:4"


def _bad(tmp_path, tiny_checkpoint, corpus):
    """name -> (argv, expected message part)."""
    only_bin = tmp_path / "only-bin"
    only_bin.mkdir()
    (only_bin / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    (only_bin / "pytorch_model.bin").write_bytes(b"pickle")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in tiny_checkpoint.iterdir():
        (corrupt / f.name).write_bytes(f.read_bytes())
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 100)
    fake_gguf = tmp_path / "model.gguf"
    fake_gguf.write_text("not a gguf file")
    bert = tmp_path / "bert"
    transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    ).save_pretrained(bert)
    odd = tmp_path / "odd"
    make_odd_llama().save_pretrained(odd)
    for f in tiny_checkpoint.glob("*token*"):
        (odd / f.name).write_bytes(f.read_bytes())
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("method: magnitude\nspars1ty: '2:4'\n")
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("x")
    good = str(tiny_checkpoint)
    return {
        "missing checkpoint": ([str(tmp_path / "nope")], "not found"),
        "unknown method": ([good, "--method", "prune-it"], "unknown method 'prune-it'"),
        "impossible N:M": ([good, "--sparsity", "5:4"], "impossible N:M"),
        "ratio out of range": ([good, "--sparsity", "1.5"], "between 0 and 1"),
        "indivisible layer": ([str(odd), "--sparsity", "4:8"], "not divisible by M=8"),
        "only pickled weights": ([str(only_bin)], "safetensors"),
        "corrupt safetensors": ([str(corrupt)], "corrupt"),
        "foreign gguf": ([str(fake_gguf)], "gguf"),
        "unsupported architecture": ([str(bert)], "unsupported architecture 'bert'"),
        "unknown corpus": ([good, "--eval", "wikitext-999"], "wikitext-999"),
        "non-empty output": ([good, "--eval", str(corpus), "-o", str(full)], "not empty"),
        "bad recipe key": ([good, "--config", str(recipe)], "spars1ty"),
        "missing recipe": ([good, "--config", str(tmp_path / "none.yaml")], "not found"),
        "unknown flag": ([good, "--sparsityy", "2:4"], "unrecognized arguments"),
        "zero seq-len": ([good, "--seq-len", "0"], "seq_len must be at least 1"),
        "bad save dtype": ([good, "--save-dtype", "int3"], "invalid choice: 'int3'"),
        "bad literal option": (
            [good, "--method", "sparsegpt", "--hessian-dtype", "half"],
            "argument --hessian-dtype: invalid choice: 'half' (choose from 'float32', 'float64')",
        ),
    }


BAD = [
    "missing checkpoint",
    "unknown method",
    "impossible N:M",
    "ratio out of range",
    "indivisible layer",
    "only pickled weights",
    "corrupt safetensors",
    "foreign gguf",
    "unsupported architecture",
    "unknown corpus",
    "non-empty output",
    "bad recipe key",
    "missing recipe",
    "unknown flag",
    "zero seq-len",
    "bad save dtype",
    "bad literal option",
]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(
    case, tmp_path, tiny_checkpoint, corpus, capsys
):
    argv, message = _bad(tmp_path, tiny_checkpoint, corpus)[case]
    out = tmp_path / "out"
    if "-o" not in argv:  # defaults first, so that the case's own flags win
        argv = [argv[0], "--eval", str(corpus), "--seq-len", "32", "-o", str(out), *argv[1:]]
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()  # drop what building the fixtures printed
    with torch.no_grad():
        code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    # Progress bars of work done before the error may precede it; the error is one line.
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "compress-model" in line]
    assert len(errors) == 1 and err.endswith(errors[0]), err
    assert errors[0].startswith("compress-model: error:") and message in errors[0], errors[0]
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temp dirs either


def test_a_non_main_process_compresses_but_neither_evaluates_nor_writes(
    tiny_checkpoint, corpus, tmp_path, monkeypatch, capsys
):
    """Under ``accelerate launch`` only rank 0 evaluates, prints and writes the outputs."""
    import lmcompress.pipeline as pipeline

    def no_evaluation(*_args, **_kwargs):
        raise AssertionError("a non-main process evaluated")

    monkeypatch.setattr(pipeline, "evaluate", no_evaluation)
    monkeypatch.setenv("RANK", "1")
    out = tmp_path / "out"
    assert main(_job(tiny_checkpoint, corpus, out, "--sparsity", "2:4", "-q")) == 0
    assert not out.exists()
    assert capsys.readouterr().out == ""
