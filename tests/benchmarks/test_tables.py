"""The table schema (benchmarks/table.py): every committed table loads, and each mistake in a
table file is one line that names the file and what is wrong."""

import pytest
import yaml

from benchmarks import sweep
from benchmarks.table import TableError, load_table, table_names

GOOD = {
    "settings": {"checkpoint": "smollm2-135m", "corpora": ["wiki-test"]},
    "rows": [
        {"name": "dense", "kind": "eval"},
        {"name": "magnitude 2:4", "recipe": {"method": "magnitude", "sparsity": "2:4"}},
    ],
    "baseline": "dense",
    "columns": ["name", "ppl:wiki-test", "ratio:ppl:wiki-test"],
    "caption": "seq-len {seq_len}, scored tokens: {tokens}",
}


def _load(tmp_path, **changes):
    table = {**GOOD, **changes}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(table, sort_keys=False))
    return load_table("t", path)


@pytest.mark.parametrize("name", table_names())
def test_every_committed_table_loads(name):
    table = load_table(name)
    assert table.rows and table.columns and table.name == name


def test_a_good_table_loads_with_its_baselines(tmp_path):
    table = _load(tmp_path)
    assert [r.kind for r in table.rows] == ["eval", "recipe"]
    assert table.baselines == {"dense": "dense", "magnitude 2:4": "dense"}
    assert [c.header for c in table.columns] == ["name", "wiki-test ppl", "ppl ratio (wiki-test)"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"columns": ["name", "ppl:wiki-test", "perplexity"]}, "unknown column 'perplexity'"),
        ({"columns": ["ratio:wall"]}, "unknown column 'ratio:wall'"),
        ({"columns": [{"column": "wall_s", "width": 3}]}, "column 'wall_s': unknown key(s) width"),
        ({"colums": ["name"]}, "table: unknown key(s) colums"),
        ({"rows": [{"name": "dense", "kind": "eval", "recipie": {}}]}, "unknown key(s) recipie"),
        ({"settings": {"threads": 2}}, "settings: unknown key(s) threads"),
        ({"baseline": "dnese"}, "baseline: 'dnese' names no row"),
        (
            {
                "rows": [{"name": "a", "recipe": {"method": "wanda"}, "baseline": "b"}],
                "baseline": None,
            },
            "row 'a': baseline: 'b' names no row",
        ),
        ({"rows": [{"name": "a", "kind": "evil"}]}, "row 'a': unknown kind 'evil'"),
        ({"rows": [{"name": "a", "kind": "eval", "recipe": {}}]}, "takes no recipe"),
        ({"rows": [{"name": "a"}]}, "row 'a': a row of kind recipe takes a recipe"),
        ({"rows": GOOD["rows"] * 2}, "row name(s) given twice: dense, magnitude 2:4"),
        ({"caption": "{sequence_length}"}, "caption: unknown variable(s) sequence_length"),
        ({"plot": "curves"}, "plot: unknown plot 'curves'"),
        ({"rows": [{"name": "a", "kind": "int8_interop"}]}, "row 'a': a source"),
        (
            {"rows": [{"name": "a", "kind": "eval", "settings": {"nsample": 1}}], "baseline": None},
            "row 'a': settings: unknown key(s) nsample",
        ),
        ({"sections": [{"rows": ["dense"], "render": "x"}]}, "unknown render 'x'"),
        ({"sections": [{"rows": ["dnese"], "columns": ["name"]}]}, "sections[0]: rows: 'dnese'"),
        ({"notes": "footer"}, "notes: unknown notes 'footer'"),
        ({"copy": {"from": "pruning", "rows": []}}, "copy: rows: a mapping"),
        ({"copy": {"form": "pruning", "rows": {"a": "b"}}}, "copy: unknown key(s) form"),
    ],
)
def test_a_mistake_is_one_line_naming_the_file(tmp_path, changes, message):
    with pytest.raises(TableError) as caught:
        _load(tmp_path, **changes)
    text = str(caught.value)
    assert message in text and "\n" not in text
    assert text.startswith(str(tmp_path / "t.yaml"))


def test_not_yaml_is_one_line(tmp_path):
    (tmp_path / "t.yaml").write_text("rows: [\n")
    with pytest.raises(TableError, match="not YAML") as caught:
        load_table("t", tmp_path / "t.yaml")
    assert "\n" not in str(caught.value)


def test_the_sweep_reports_a_bad_table_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as caught:
        sweep.main(["no-such-table", "--render-only"])
    assert caught.value.code == 2
    assert "no table 'no-such-table'" in capsys.readouterr().err


def test_running_needs_one_table_named(capsys):
    with pytest.raises(SystemExit):
        sweep.main([])
    assert "name one table to run" in capsys.readouterr().err


def test_set_names_a_known_setting(capsys):
    with pytest.raises(SystemExit):
        sweep.main(["magnitude", "--set", "eval_token=64"])
    assert "--set: unknown setting(s) eval_token" in capsys.readouterr().err


@pytest.mark.parametrize("name", table_names())
def test_no_row_command_gives_an_option_twice(name, tmp_path):
    """compress-model refuses an option given twice: a row whose own settings repeat a table
    flag (the old programs relied on the last one winning) would fail only when it runs. Every
    compress-model command a recipe, learned, readme or stages row builds is checked."""
    from benchmarks.learned_rows import stage_job
    from benchmarks.table import Row
    from lmcompress.cli.compress import add_job_arguments
    from lmcompress.cli.terminal import Parser

    table, checked = load_table(name), 0
    outs = {f"stage{i}": str(tmp_path / f"stage{i}") for i in range(1, 9)}
    for row in table.rows:
        settings = {**table.settings, **row.settings}
        if row.kind == "stages":
            jobs = [Row(row.name, "recipe", spec) for spec in row.recipe["stages"]]
            jobs = [(job, *stage_job(job.recipe, outs, settings)) for job in jobs]
            jobs = [(Row(job.name, "recipe", spec), given) for job, spec, given in jobs]
        elif row.kind in ("recipe", "learned", "readme"):
            jobs = [(row, settings)]
        else:
            continue
        build = sweep._readme_job if row.kind == "readme" else sweep._compress_job
        for job_row, given in jobs:
            job = build(job_row, tmp_path / "out", given, tmp_path)
            argv = [str(part) for part in job.command[len(sweep.CLI) :]]
            parser = Parser(prog="compress-model")
            add_job_arguments(parser, argv)
            parser.refuse_repeats(argv)  # ConfigError on a repeat
            checked += 1
    assert checked or name == "lowrank", f"{name}: no command checked"


def test_a_peer_row_passes_its_quantization_grid_and_no_sparsity(tmp_path):
    """A gptq peer row runs llm-compressor with its bits and group size (no --sparsity); a
    pruning peer row with its sparsity (and no grid flags)."""
    from benchmarks.table import Row

    settings = {"checkpoint": "smollm2-135m", "nsamples": 128}
    quant = Row("peer", "peer", {"method": "gptq", "bits": 3, "group_size": 64})
    command = sweep._peer_job(quant, tmp_path, settings, tmp_path).command
    assert command[command.index("--bits") + 1] == "3"
    assert command[command.index("--group-size") + 1] == "64"
    assert "--sparsity" not in command and "--observer" not in command  # its default
    mse = Row("peer", "peer", {"method": "gptq", "bits": 4, "group_size": 64, "observer": "mse"})
    command = sweep._peer_job(mse, tmp_path, settings, tmp_path).command
    assert command[command.index("--observer") + 1] == "mse"
    from benchmarks.peers import run_peer

    assert set(run_peer.OBSERVERS) == {"minmax", "mse"}
    prune = Row("peer", "peer", {"method": "wanda", "sparsity": "2:4"})
    command = sweep._peer_job(prune, tmp_path, settings, tmp_path).command
    assert command[command.index("--sparsity") + 1] == "2:4" and "--bits" not in command
    assert sweep._what(quant)["sparsity"] == "w3 g64"
    joint = Row("x", "recipe", {"method": "gptq", "sparsity": "2:4", "bits": 4, "group_size": 64})
    assert sweep._what(joint)["sparsity"] == "2:4 + w4 g64"
