"""Multi-stage recipes: every file in recipes/ parses, the two-stage ones run end to end on a
tiny checkpoint through ``compress-model --config``, and bad recipes fail in one line before
the model is loaded, with nothing written."""

import json
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from lmcompress.cli.main import main
from lmcompress.compressor.io.layout import MANIFEST, MODEL_CARD
from lmcompress.jobs import run as run_module
from lmcompress.jobs.options import RunOptions
from lmcompress.jobs.recipe import parse_recipe

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))
RUN_FIELDS = [f.name for f in fields(RunOptions)]
TEXT = "\n\n".join(
    f"Document {i}. The quick brown fox jumps over the lazy dog {i}." for i in range(60)
)


def _load(path):
    return {str(k).replace("-", "_"): v for k, v in yaml.safe_load(path.read_text()).items()}


def _job(checkpoint, corpus, out, *extra):
    return [str(checkpoint), "--eval", str(corpus), "--calib", str(corpus), "--seq-len", "32",
            "--nsamples", "4", "--eval-tokens", "0", "-o", str(out), "-q", *extra]  # fmt: skip


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def test_recipes_parse():
    assert {p.name for p in RECIPES} >= {
        "sparsegpt24-int8.yaml",
        "gfwsvd-then-sparsegpt.yaml",
        "maskllm-sparsegpt-prior.yaml",
    }
    for path in RECIPES:
        shared, configs = parse_recipe(_load(path), RUN_FIELDS)
        RunOptions(**shared)
        assert configs and all(c.method for c in configs), path.name


@pytest.mark.parametrize(
    "name, formats",
    [
        ("sparsegpt24-int8.yaml", {"nm_packed_int8"}),
        ("gfwsvd-then-sparsegpt.yaml", {"low_rank", "nm_packed"}),
    ],
)
def test_two_stage_recipe_runs(name, formats, tiny_checkpoint, corpus, tmp_path, capsys):
    path = Path(__file__).parents[2] / "recipes" / name
    out = tmp_path / "out"
    assert main(["--config", str(path), *_job(tiny_checkpoint, corpus, out)]) == 0
    printed = capsys.readouterr().out
    assert "2 stages" in printed and "dense" in printed
    manifest = json.loads((out / MANIFEST).read_text())
    stages = manifest["results"]["stages"]
    assert [s["method"] for s in stages] == [
        c.method for c in parse_recipe(_load(path), RUN_FIELDS)[1]
    ]
    assert all(str(corpus) in s["compressed"] for s in stages)  # a perplexity after each stage
    assert manifest["results"]["compressed"] == stages[-1]["compressed"]
    layers = manifest["compressed_layers"]
    assert {entry["format"] for entry in layers.values()} == formats
    first = {x["name"] for x in stages[0]["report"]["layers"]}
    second = {x["name"] for x in stages[1]["report"]["layers"]}
    if name.startswith("gfwsvd"):  # on the rest: the factorised layers are not pruned again
        assert first and second and not first & second
        assert stages[1]["skipped_layers"] == len(first)
    else:
        assert first == second == set(layers)
    assert "## Stages" in (out / MODEL_CARD).read_text()
    # the export reloads (by replay) to the model the job scored last
    argv = ["eval", str(out), "--data", str(corpus), "--seq-len", "32", "--eval-tokens", "0"]
    assert main([*argv, "--json", "-q"]) == 0
    scored = json.loads(capsys.readouterr().out)["perplexity"][str(corpus)]["perplexity"]
    assert scored == pytest.approx(stages[-1]["compressed"][str(corpus)]["perplexity"], rel=1e-5)


@pytest.mark.parametrize(
    "stages, extra, message",
    [
        ([{"method": "nope"}], (), "stage 1 (nope): unknown method"),
        ([{"method": "sparsegpt", "sparsity": "3:2"}], (), "stage 1 (sparsegpt): impossible"),
        ([{"method": "int8", "nsamples": 8}], (), "nsamples is a job option"),
        ([{"method": "int8"}, {"method": "sparsegpt"}], (), "stage 2 (sparsegpt) has no layer"),
        ([{"method": "int8"}], ("--sparsity", "2:4"), "--sparsity: a multi-stage recipe"),
        ([{"method": "int8"}], ("--method", "int8"), "--method does not go"),
        ([], (), "non-empty list"),
    ],
)
def test_bad_recipe(stages, extra, message, tiny_checkpoint, corpus, tmp_path, capsys, monkeypatch):
    def never(*_args, **_kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run_module, "load_model", never)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"stages": stages}))
    out = tmp_path / "out"
    assert main(["--config", str(path), *_job(tiny_checkpoint, corpus, out), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
