"""The model card (README.md) and report.png of every export: what they say is what the
manifest records, the command in the card reruns the job exactly, and they are written in the
same atomic step as the weights."""

import json
import re
import shlex

import pytest
import yaml
from conftest import make_tiny_model, make_tiny_tokenizer

from lmcompress import compress, save_compressed
from lmcompress.cli.main import main
from lmcompress.compressor.io import save as export
from lmcompress.compressor.io.layout import MANIFEST, MODEL_CARD, REPORT_PNG
from lmcompress.compressor.io.model_card import model_card
from lmcompress.compressor.io.report_plot import _per_layer_panels
from lmcompress.methods.magnitude import MagnitudeConfig

PANEL_PX = 484  # report_plot: 4.4 inches a panel at 110 dpi, 3.9 inches (429 px) high
RED, GRAY = (214, 39, 40), (153, 153, 153)  # the bars: tab:red (compressed), "0.6" (dense)


def _report_png(path, per_layer_panels):
    """Decode report.png and check what it draws: one panel per per-layer quantity, each with
    coloured lines (one colour per kind of layer); then the perplexity panel. Returns the counts
    of the compressed (tab:red) and dense (grey) bars in that last panel."""
    from matplotlib.image import imread

    image = (imread(path)[..., :3] * 255).round().astype(int)  # (height, width, RGB)
    assert image.shape == (429, PANEL_PX * (per_layer_panels + 1), 3)
    panels = [image[:, i * PANEL_PX : (i + 1) * PANEL_PX] for i in range(per_layer_panels + 1)]
    for panel in panels[:-1]:
        colourful = panel.max(-1) - panel.min(-1) > 80  # not white, grey or black: the lines
        assert colourful.sum() > 100
    return tuple(int((panels[-1] == color).all(-1).sum()) for color in (RED, GRAY))


def _front_matter(card: str) -> dict:
    match = re.match(r"---\n(.*?)\n---\n", card, re.S)
    assert match, card[:200]
    return yaml.safe_load(match.group(1))


def _job(checkpoint, corpus, out):
    return [
        str(checkpoint),
        "--method",
        "wanda",
        "--sparsity",
        "2:4",
        "--exclude",
        "*.down_proj",
        "--calib",
        str(corpus),
        "--nsamples",
        "4",
        "--eval",
        str(corpus),
        "--seq-len",
        "32",
        "--eval-tokens",
        "0",
        "--save-dtype",
        "bfloat16",
        "-o",
        str(out),
        "-q",
    ]


def test_card_shows_the_run_and_its_command_reruns_it(tiny_checkpoint, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i}. The quick brown fox jumps." for i in range(40)))
    out = tmp_path / "out"
    assert main(_job(tiny_checkpoint, corpus, out)) == 0
    capsys.readouterr()
    manifest = json.loads((out / MANIFEST).read_text())
    card = (out / MODEL_CARD).read_text()

    meta = _front_matter(card)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["tags"] == ["lmcompress", "wanda", "pruned", "2:4-sparsity"]
    assert "base_model" not in meta  # a local directory is no hub id
    results = manifest["results"]
    dense = results["dense"][str(corpus)]["perplexity"]
    pruned = results["compressed"][str(corpus)]["perplexity"]
    assert f"| {corpus} | {dense:.3f} | {pruned:.3f} | {pruned / dense - 1:+.1%} |" in card
    assert f"| torch | {manifest['versions']['torch']} |" in card
    assert "| exclude | `*.down_proj` |" in card
    assert "| down_proj |" not in card and "| up_proj | 2 | 50.0% |" in card  # per-kind totals
    red, gray = _report_png(out / REPORT_PNG, 2)  # sparsity and relative error
    assert red > 10_000 and gray > 10_000  # the pruned and the dense perplexity bars

    # the card's command, run again into another directory, gives the same model and numbers
    (command,) = re.findall(r"```bash\n(.*?)\n```", card)
    argv = shlex.split(command)
    assert argv[:2] == ["compress-model", str(tiny_checkpoint)]
    assert argv[argv.index("-o") + 1] == str(out)
    assert results["command"] == command
    again = tmp_path / "again"
    argv[argv.index("-o") + 1] = str(again)
    assert main([*argv[1:], "-q"]) == 0
    rerun = json.loads((again / MANIFEST).read_text())
    assert rerun["config"] == manifest["config"] and rerun["dtype"] == "bfloat16"
    assert rerun["results"]["compressed"][str(corpus)]["perplexity"] == pruned
    assert rerun["report"]["layers"] == [
        {**layer, "seconds": rerun_layer["seconds"]}
        for layer, rerun_layer in zip(
            manifest["report"]["layers"], rerun["report"]["layers"], strict=True
        )
    ]


@pytest.fixture
def exported():
    """(model, tokenizer, report) of a magnitude-pruned tiny Llama."""
    model = make_tiny_model("llama")
    return model, make_tiny_tokenizer(), compress(model, MagnitudeConfig(sparsity="2:4"))


def test_saved_from_python_without_results(exported, tmp_path):
    model, tokenizer, report = exported
    out = save_compressed(model, tmp_path / "out", report, tokenizer=tokenizer)
    card = (out / MODEL_CARD).read_text()
    assert "Not measured (saved without an evaluation)." in card
    assert "no command line recorded" in card
    assert card.startswith("---\n") and "\n# out\n" in card
    red, gray = _report_png(out / REPORT_PNG, 2)
    assert red < 100 and gray < 100  # no bars ("not measured"): at most a neighbour's line


def test_a_failed_report_leaves_nothing_behind(exported, tmp_path, monkeypatch):
    def broken(*_args):
        raise RuntimeError("no plot")

    monkeypatch.setattr(export, "write_report_png", broken)
    model, tokenizer, report = exported
    with pytest.raises(RuntimeError, match="no plot"):
        save_compressed(model, tmp_path / "out", report, tokenizer=tokenizer)
    assert list(tmp_path.iterdir()) == []  # neither the output nor its temporary sibling


def test_base_model_only_for_a_hub_id(exported, tmp_path):
    model, tokenizer, report = exported
    out = save_compressed(model, tmp_path / "out", report, extra={"checkpoint": "org/tiny-llama"})
    manifest = json.loads((out / MANIFEST).read_text())
    assert _front_matter(model_card(manifest, "x"))["base_model"] == "org/tiny-llama"
    manifest["results"]["checkpoint"] = str(tmp_path)  # exists: a local path, not a hub id
    assert "base_model" not in _front_matter(model_card(manifest, "x"))
    manifest["dense_copy"] = False  # only lmcompress reads it
    assert _front_matter(model_card(manifest, "x"))["library_name"] == "lmcompress"


@pytest.mark.parametrize(
    ("fields", "titles"),
    [
        ({"sparsity": 0.5, "rel_error": 0.3}, ["sparsity", "relative error"]),
        ({"rank": 4, "rel_error": 0.2, "error_kind": "output"}, ["rank", "relative error"]),
        ({"bits": 8, "rel_error": 0.01}, ["quantization error"]),
        ({}, []),
    ],
)
def test_report_panels_follow_the_report(fields, titles):
    layer = {"name": "model.layers.3.mlp.up_proj", "shape": [64, 32], **fields}
    panels = _per_layer_panels([layer])
    assert [title for title, _, _ in panels] == titles
    values = {title: value(layer) for title, _, value in panels}
    if "rank" in values:
        assert values["rank"] == 4 / 32  # of the full rank, min(out, in)
