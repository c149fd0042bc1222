"""Multi-stage recipes: every file in recipes/ parses, the two-stage ones run end to end on a
tiny checkpoint through ``compress-model --config``, and bad recipes fail in one line before
the model is loaded, with nothing written."""

import json
import time
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from lmcompress.cli.main import main
from lmcompress.compressor.io.layout import MANIFEST, MODEL_CARD
from lmcompress.errors import ConfigError, shown
from lmcompress.jobs import run as run_module
from lmcompress.jobs.options import RunOptions
from lmcompress.jobs.recipe import MAX_ALIAS_NODES, MAX_RECIPE_BYTES, load_recipe, parse_recipe

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
        # int8 composes after pruning, not after low rank (issue 39, item 6): refused before
        # stage 1 runs, as is a layer that two stages compressed already
        ([{"method": "svd"}, {"method": "int8"}], (), "stage 2 (int8) has no layer left"),
        (
            [{"method": "magnitude", "sparsity": 0.5}, {"method": "int8"}, {"method": "int8"}],
            (),
            "stage 3 (int8) has no layer left",
        ),
        ([{"method": "int8"}], ("--sparsity", "2:4"), "--sparsity: a multi-stage recipe"),
        ([{"method": "int8"}], ("--method", "int8"), "--method does not go"),
        ([], (), "non-empty list"),
        (
            [{"method": "svd", "ratio": 1e-9, "include": ["model.layers.*.mlp.*"]}],
            (),
            "--ratio 1e-09 leaves every selected layer dense",
        ),
        (  # no per-layer ratio: the low-rank methods take one ratio (or greedy allocation)
            [{"method": "svd", "layer_ratio": ["*.q_proj=0.5"]}],
            (),
            "stage 1 (svd): unknown option(s) for method 'svd': layer_ratio",
        ),
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


# --- recipe files: duplicate keys, sizes, aliases, bounded messages ----------------------------


def _write(tmp_path, text, name="r.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, message",
    [
        ("method: svd\nratio: 0.5\nmethod: svd\n", "key 'method' is given twice (lines 1 and 3)"),
        (
            "stages:\n  - method: svd\n    ratio: 0.5\n    ratio: 0.3\n",
            "key 'ratio' is given twice (lines 3 and 4)",
        ),
        (
            "method: maskllm\ntraining:\n  steps: 3\n  lr: 0.1\n  steps: 4\n",
            "key 'steps' is given twice (lines 3 and 5)",
        ),
        (
            "calib-batch-size: 2\ncalib_batch_size: 3\n",
            "key 'calib_batch_size' is given twice (line 1 as 'calib-batch-size', line 2)",
        ),
        ('{"method": "svd", "ratio": 0.5, "ratio": 0.3}\n', "key 'ratio' is given twice (line 1)"),
    ],
    ids=["top level", "in a stage", "in an option group", "two spellings", "json"],
)
def test_a_key_given_twice_is_named_with_its_lines(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    assert str(err.value) == f"recipe {path}: {message}"


def test_merge_keys_may_be_overridden(tmp_path):
    text = "base: &b {seed: 1, nsamples: 4}\nstages:\n  - <<: *b\n    seed: 2\n"
    assert load_recipe(_write(tmp_path, text))["stages"] == [{"seed": 2, "nsamples": 4}]


def _laughs(levels: int) -> str:
    """A billion-laughs document: each level lists the previous one 9 times (9**levels)."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _inline_laughs(levels: int) -> str:
    """The same as one flow sequence, each level anchored where it first appears."""
    node = f"&l0 [{', '.join(['lol'] * 9)}]"
    for i in range(1, levels):
        node = f"&l{i} [{', '.join([node] + [f'*l{i - 1}'] * 8)}]"
    return node


@pytest.mark.parametrize(
    "text",
    [
        _laughs(9) + "eval: *l8\n",
        _laughs(9) + "stages:\n  - {method: svd, include: *l8}\n",
        _laughs(5) + "eval: *l4\n",  # 9**5 = 59049 strings: past the limit, built in a blink
    ],
    ids=["eval", "include", "just past the limit"],
)
def test_an_alias_bomb_is_refused_before_it_is_built(tmp_path, text):
    path = _write(tmp_path, text)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    assert time.perf_counter() - start < 1.0
    assert str(err.value) == (
        f"recipe {path}: too many alias expansions (limit {MAX_ALIAS_NODES} nodes)"
    )


def test_aliases_within_the_limit_are_expanded(tmp_path):
    text = _laughs(3) + "eval: *l2\n"  # 9**3 = 729 strings
    assert load_recipe(_write(tmp_path, text))["eval"] == [[["lol"] * 9] * 9] * 9


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="refers to the node that contains it"):
        load_recipe(_write(tmp_path, "eval: &a [wiki-test, *a]\n"))


def test_a_recipe_over_the_size_limit_is_refused_unread(tmp_path, monkeypatch):
    path = _write(tmp_path, "seed: 1\n" + "#" * MAX_RECIPE_BYTES)

    def never(*_args, **_kwargs):
        raise AssertionError("the recipe was read")

    monkeypatch.setattr(Path, "read_text", never)
    with pytest.raises(ConfigError, match=r"is 1\.0 MiB: a recipe is a page of options"):
        load_recipe(path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("seed: 1" + "0" * 5000 + "\n", "is not valid YAML/JSON: Exceeds the limit"),
        ("eval: " + "[" * 20_000 + "]" * 20_000 + "\n", "recipe"),
    ],
    ids=["int of 5000 digits", "deeply nested"],
)
def test_pathological_values_are_one_line(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_recipe(_write(tmp_path, text))
    assert "\n" not in str(err.value) and len(str(err.value)) < 300


@pytest.mark.parametrize(
    "text, key",
    [
        ("exclude: [[" + ", ".join(["lm_head"] * 20_000) + "]]\n", "exclude must be a list"),
        # 6561 strings through aliases: under the limit, but not to be written out in a message
        (f"exclude: {_inline_laughs(4)}\n", "exclude must be a list"),
        ("sparsity: '" + "9" * 200_000 + "'\n", "sparsity ratio"),
        ("layer_sparsity: ['" + "x" * 200_000 + "']\n", "layer_sparsity entry"),
        ("method: [" + ", ".join(["svd"] * 100_000) + "]\n", "unknown method"),
        ("eval_batch_size: -1" + "0" * 4000 + "\n", "eval_batch_size must be at least 1"),
        ("ratio: 1" + "0" * 400 + "\nmethod: svd\n", "ratio must be a finite number"),
        ("? " + "k" * 100_000 + "\n: 1\n", "recipe has unknown option(s)"),
    ],
    ids=[
        "huge list",
        "aliased list",
        "huge text",
        "huge rule",
        "method list",
        "huge int",
        "int beyond float",
        "huge key",
    ],  # fmt: skip
)
def test_a_huge_value_is_shown_cut_in_one_line(
    text, key, tiny_checkpoint, corpus, tmp_path, capsys
):
    path = _write(tmp_path, text)
    out = tmp_path / "out"
    assert main(["--config", str(path), *_job(tiny_checkpoint, corpus, out)]) == 2
    err = capsys.readouterr().err.strip()
    assert key in err and "\n" not in err and len(err) < 400, err[:500]
    assert not out.exists()


def test_shown_cuts_what_it_renders():
    nested = ["x"]
    for _ in range(50):  # 9**50 leaves if written out
        nested = [nested] * 9
    start = time.perf_counter()
    text = shown(nested)
    assert time.perf_counter() - start < 0.1 and len(text) == 80 and text.endswith("…")
    assert shown("abc") == "'abc'" and shown(0.5) == "0.5"
    assert shown("y" * 1000, limit=20) == repr("y" * 1000)[:19] + "…"
