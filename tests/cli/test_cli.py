"""compress-model called in process: the happy paths (bad inputs: test_bad_inputs.py)."""

import inspect
import json
import logging

import pytest
import torch

from lmcompress.cli.flags import describe
from lmcompress.cli.main import main
from lmcompress.compressor.io.layout import MANIFEST
from lmcompress.methods import METHODS

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
    assert "magnitude:" in printed and "--sparsity" in printed and " 2:4 " in printed
    assert "[float32|float64]" in printed  # SparseGPT's hessian_dtype Literal
    assert "('" not in printed and " None " not in printed  # defaults as typed, not reprs
    assert " wiki-test " in printed or "decoder linears" in printed


def test_methods_prints_every_description_and_help_whole_in_wrapped_lines(capsys):
    """Nothing is cut (subnet's and int8's descriptions run over several lines): each
    config's first docstring paragraph and each option's help appear whole, modulo the line
    breaks, and no line is wider than 100 characters."""
    assert main(["methods"]) == 0
    printed = capsys.readouterr().out
    assert max(len(line) for line in printed.splitlines()) <= 100
    flat = " ".join(printed.split())
    for name, method_class in METHODS.items():
        paragraph = inspect.cleandoc(method_class.config_class.__doc__).split("\n\n")[0]
        assert f"{name}: {' '.join(paragraph.split())}" in flat, name
        for flag, _, help_text in describe(method_class.config_class):
            assert " ".join(help_text.split()) in flat, (name, flag)
    assert "Gumbel-softmax, frozen weights" in flat  # hyphenated words are not split either


def test_eval_takes_eval_as_the_same_flag_as_data(tiny_checkpoint, corpus, capsys):
    argv = ["eval", str(tiny_checkpoint), "--seq-len", "32", "--eval-tokens", "0", "--json"]
    scores = {}
    for flag in ("--data", "--eval"):
        assert main([*argv, flag, str(corpus), "-q"]) == 0
        scores[flag] = json.loads(capsys.readouterr().out)["perplexity"]
    assert list(scores["--eval"]) == [str(corpus)]
    ppl = {flag: score[str(corpus)]["perplexity"] for flag, score in scores.items()}
    assert ppl["--eval"] == ppl["--data"]  # the same windows of the same model


def test_eval_help_shows_every_default_and_says_eval_is_data(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--help"])
    assert exit_info.value.code == 0
    entries: list[str] = []  # one per option: its flags, then its help (on the next line
    for line in capsys.readouterr().out.splitlines():  # where the flags are too long)
        if line.strip().startswith("-"):
            entries.append(line.strip())
        elif entries and line.startswith(" "):
            entries[-1] += " " + line.strip()
    options = [entry for entry in entries if not entry.startswith("-h")]
    assert len(options) == 9, options
    for line in options:
        assert line.count("(default: ") == 1, line
    data = next(line for line in options if line.startswith("--data"))
    assert "--eval CORPUS" in data and "the same flag" in data and "(default: wiki-test)" in data
    runtime = next(line for line in options if line.startswith("--runtime"))
    assert "(default: packed;" in runtime and "load_compressed defaults to dense" in runtime


def test_layer_sparsity_overrides_the_target_per_layer(tiny_checkpoint, corpus, tmp_path):
    out = tmp_path / "out"
    flags = ["--layer-sparsity", "*.q_proj=0.25", "--skip-dense", "-q"]
    assert main(_job(tiny_checkpoint, corpus, out, *flags)) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["config"]["layer_sparsity"] == ["*.q_proj=0.25"]
    layers = manifest["report"]["layers"]
    patterns = {layer["name"].rsplit(".", 1)[-1]: layer["pattern"] for layer in layers}
    assert patterns["q_proj"] == "0.25" and patterns["k_proj"] == "2:4"


def test_a_job_without_output_says_nothing_is_saved_and_how_to_save(
    tiny_checkpoint, corpus, tmp_path, monkeypatch, caplog
):
    """One INFO line (shown by default, silenced by -q like every INFO line) naming -o DIR;
    none when -o is given."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # nothing may appear here either
    argv = [str(tiny_checkpoint), "--eval", str(corpus), "--calib", str(corpus), "--seq-len", "32"]
    argv += ["--eval-tokens", "64", "--skip-dense"]
    with caplog.at_level(logging.INFO, logger="lmcompress.jobs.run"):
        assert main(argv) == 0
    lines = [r for r in caplog.records if "nothing is saved" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "-o DIR" in lines[0].getMessage()
    assert list(cwd.iterdir()) == []
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmcompress.jobs.run"):
        assert main([*argv, "-o", str(tmp_path / "out")]) == 0
    assert not [r for r in caplog.records if "nothing is saved" in r.getMessage()]


# Bad inputs: tests/cli/test_bad_inputs.py


def test_a_non_main_process_compresses_but_neither_evaluates_nor_writes(
    tiny_checkpoint, corpus, tmp_path, monkeypatch, capsys
):
    """Under ``accelerate launch`` only rank 0 evaluates, prints and writes the outputs."""
    import lmcompress.jobs.run as pipeline

    def no_evaluation(*_args, **_kwargs):
        raise AssertionError("a non-main process evaluated")

    monkeypatch.setattr(pipeline, "evaluate", no_evaluation)
    monkeypatch.setenv("RANK", "1")
    out = tmp_path / "out"
    assert main(_job(tiny_checkpoint, corpus, out, "--sparsity", "2:4", "-q")) == 0
    assert not out.exists()
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("sparsity", "flags"),
    [("0.5", []), ("2:4", ["--blockwise", "--refit", "sparsegpt", "--optimizer", "adamw"])],
)
def test_subnet_end_to_end(tiny_checkpoint, corpus, tmp_path, sparsity, flags):
    """``--method subnet``: trained, extracted at exactly the target, scored and exported."""
    out = tmp_path / "out"
    argv = ["--method", "subnet", "--sparsity", sparsity, "--steps", "2", "--batch-size", "2"]
    assert main(_job(tiny_checkpoint, corpus, out, *argv, "--nsamples", "8", *flags, "-q")) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    layers = manifest["report"]["layers"]
    assert layers and all(layer["sparsity"] == pytest.approx(0.5, abs=1e-9) for layer in layers)
    assert manifest["report"]["extra"]["sparsity"] == pytest.approx(0.5, abs=1e-9)
    assert manifest["config"]["blockwise"] == ("--blockwise" in flags)
    assert (out / "stats.safetensors").exists()
