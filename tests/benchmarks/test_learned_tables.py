"""The tables of learned masks (benchmarks/tables/subnet.yaml, learned.yaml): each row's recipe
(each stage's) is the job the old per-sweep program ran (its command, recorded in the committed
results, parsed by compress-model's own parser to the same options and method config); a
``learned`` row keeps the method's training record, its note and the copied one-shot rows; a
``stages`` row chains its stages and reuses one run before; the ratio column divides by the
right row. No model runs."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from benchmarks import harness, sweep
from benchmarks.columns import row_name
from benchmarks.learned_rows import stage_job
from benchmarks.render import RESULTS_DIR
from benchmarks.runner import Run
from benchmarks.table import Row, load_table
from lmcompress.cli.compress import add_job_arguments
from lmcompress.cli.terminal import Parser
from lmcompress.jobs.recipe import job_from


class LastWins(Parser):
    """compress-model's parser as it was when the committed commands ran: an option given twice
    kept its last value (the old programs passed a table default, then a row's override). The
    parser now refuses a repeat; the table's own commands are parsed by the strict one."""

    def refuse_repeats(self, args):
        pass


def job_of(argv, parser_class=Parser):
    """What compress-model runs for ``argv``: (RunOptions, [method config per stage])."""
    parser = parser_class(prog="compress-model")
    flags = add_job_arguments(parser, argv)
    given = vars(parser.parse_args(argv))
    given.pop("quiet"), given.pop("config", None)
    return job_from(flags.recipe, given, flags.method_class)


def table_command(table, name, work, out):
    row = table.row(name)
    job = sweep._compress_job(row, out, {**table.settings, **row.settings}, work)
    return [str(part) for part in job.command[len(sweep.CLI) :]]


def recorded(file):
    """The rows of a committed results file that recorded the command they ran."""
    rows = json.loads((RESULTS_DIR / f"{file}.json").read_text())["results"]
    return [(r["name"], r["command"]) for r in rows if "command" in r]


@pytest.mark.parametrize(("name", "command"), recorded("subnet_smollm2"))
def test_a_subnet_row_is_the_job_the_old_program_ran(tmp_path, name, command):
    out = tmp_path / "out"
    old = list(command)
    old[old.index("-o") + 1] = str(out)
    new = table_command(load_table("subnet"), name, tmp_path, out)
    assert "--config" in new and "--method" not in new
    assert job_of(new) == job_of(old, LastWins)


def test_the_job_comparison_sees_one_option_changed(tmp_path):
    name, command = recorded("subnet_smollm2")[0]
    old = [*command, "--lr", "0.31"]
    old[old.index("-o") + 1] = str(tmp_path / "out")
    new = table_command(load_table("subnet"), name, tmp_path, tmp_path / "out")
    assert job_of(new) != job_of(old, LastWins)


def _manifest(job):
    command = [str(part) for part in job.command]
    tokens = int(command[command.index("--eval-tokens") + 1])
    ppl = {"perplexity": 30.0, "tokens": tokens, "seconds": 7.0}
    layers = [{"params": 4, "params_kept": 2}, {"params": 4, "params_kept": 2}]
    extra = {"steps": 20, "hard_ppl": [{"step": 20, "hard_ppl": 27.0}],
             "block_curves": [{"block": 0, "hard_before": 0.5, "hard_after": 0.25}]}  # fmt: skip
    return {
        "results": {"compressed": {"wiki-test": ppl, "lee": ppl}},
        "report": {"summary": {}, "seconds": 100.0, "layers": layers, "extra": extra},
        "compressed_layers": {},
    }


@pytest.mark.parametrize("name", ["subnet-50", "ablation: no scale"])
def test_a_learned_row_keeps_its_training_note_and_the_copied_rows(tmp_path, monkeypatch, name):
    shutil.copy(RESULTS_DIR / "subnet_smollm2.json", tmp_path)
    shutil.copy(RESULTS_DIR / "pruning.json", tmp_path)
    old = json.loads((tmp_path / "subnet_smollm2.json").read_text())

    def run_job(job, work):
        return Run(job.name, 9.0, 99.0, 0, _manifest(job), Path(work) / "x", Path(work) / "y")

    monkeypatch.setattr(sweep, "run_job", run_job)
    monkeypatch.setattr(harness, "machine", lambda: {"cpu_count": 0})
    argv = ["subnet", "--only", name, "--results-dir", str(tmp_path), "--work", str(tmp_path)]
    assert sweep.main(argv) == 0

    new = json.loads((tmp_path / "subnet_smollm2.json").read_text())
    # copied again from pruning.json, as before (now with their calibration tokens)
    copied = [{k: v for k, v in b.items() if k != "tokens"} for b in new["baselines"]]
    assert copied == old["baselines"] and new["baselines"][1]["tokens"] == 128 * 512
    row = next(r for r in new["results"] if r["name"] == name)
    assert (row["train_seconds"], row["eval_seconds"], row["steps"]) == (100.0, 14.0, 20)
    assert (row["achieved_sparsity"], row["block_hard"][0]["hard_after"]) == (0.5, 0.25)
    md = (tmp_path / "subnet_smollm2.md").read_text()
    if name == "subnet-50":  # a line of the main table, and a note
        assert row["ppl"]["lee"]["tokens"] == 32768
        assert "| subnet-50 | 0.5 | 0.5000 | 30.00 | 30.00 | 0.900 | 9 | 14 | 100 | 99 |" in md
        assert "- **subnet-50**: block-wise, keep-rate penalty" in md
        assert "--blockwise --steps 20 --batch-size 4 --optimizer adamw --lr 0.3" in md
    else:  # a line of the ablations, scored over the row's 8192 tokens
        assert row["ppl"]["lee"]["tokens"] == 8192
        assert "| no scale | 0.5000 | 0.2500 | 0.500 | 30.00 | 30.00 | 100 |" in md
    assert [r["name"] for r in new["results"]] == [r["name"] for r in old["results"]]


def test_merge_joins_the_rows_of_runs_made_side_by_side(tmp_path):
    main, side = tmp_path / "main", tmp_path / "side"
    main.mkdir(), side.mkdir()
    shutil.copy(RESULTS_DIR / "subnet_smollm2.json", main)
    payload = json.loads((main / "subnet_smollm2.json").read_text())
    row = {**payload["results"][1], "train_seconds": 1.0}
    (side / "subnet_smollm2.json").write_text(json.dumps({"machine": {}, "results": [row]}))

    assert sweep.main(["subnet", "--merge", str(side), "--results-dir", str(main)]) == 0
    merged = json.loads((main / "subnet_smollm2.json").read_text())
    assert merged["results"][1] == row and merged["results"][0] == payload["results"][0]
    assert (
        "| subnet-50 | 0.5 | 0.5000 | 37.41 | 68.31 | 1.123 | 1695 | 271 | 1 |"
        in (main / "subnet_smollm2.md").read_text()
    )


def _stage1(command):
    """The stage-1 output an old stage-2 command read (``{stage1}``)."""
    if command[0] != "smollm2-135m":
        return command[0]  # compressed again (int8)
    return command[command.index("--prior-from") + 1] if "--prior-from" in command else None


def _stages(file):
    rows = json.loads((RESULTS_DIR / file).read_text())["results"]
    return [(r["name"], i, c) for r in rows for i, c in enumerate(r["commands"])]


@pytest.mark.parametrize(
    ("name", "index", "command"),
    _stages("learned.json") + _stages("learned_epyc/learned.json"),
)
def test_a_learned_stage_is_the_job_the_old_program_ran(tmp_path, name, index, command):
    table = load_table("learned")
    row = table.row(name)
    spec, settings = stage_job(row.recipe["stages"][index], {"stage1": _stage1(command)},
                               table.settings)  # fmt: skip
    old = list(command)
    old[old.index("-o") + 1] = str(tmp_path / "out")
    job = sweep._compress_job(Row(name, "recipe", spec), tmp_path / "out", settings, tmp_path)
    new = [str(part) for part in job.command[len(sweep.CLI) :]]
    assert job_of(new) == job_of(old, LastWins)


def _stage_manifest(ppl, steps=10, batch=2, seconds=100.0):
    compressed = {
        c: {"perplexity": ppl, "tokens": 32768, "seconds": 5.0} for c in ("wiki-test", "lee")
    }
    return {
        "results": {"compressed": compressed},
        "report": {"seconds": seconds, "extra": {"steps": steps, "hard_ppl": []},
                   "config": {"training": {"batch_size": batch, "grad_accum": 1}}},
    }  # fmt: skip


def test_stages_chain_and_a_repeated_stage_is_reused(tmp_path, monkeypatch):
    """A ``stages`` row: stage 2 reads stage 1's stored output (``{stage1}``); a row whose
    stages were run before in the same work directory runs nothing and says so."""
    recipes = []

    def run_job(job, work):
        command = [str(part) for part in job.command]
        recipe = yaml.safe_load(Path(command[command.index("--config") + 1]).read_text())
        recipes.append(recipe)
        Path(job.reads).parent.mkdir(parents=True)
        ppl = 50.0 if "prior_from" in recipe else 60.0
        return Run(
            job.name, 30.0, 1000.0, 0, _stage_manifest(ppl), Path(work) / "x", Path(work) / "y"
        )

    monkeypatch.setattr(sweep, "run_job", run_job)
    first = {"method": "maskllm", "sparsity": "2:4", "blockwise": True}
    stages = {"stages": [first, {"method": "maskllm", "sparsity": "2:4", "prior_from": "{stage1}"}]}
    settings = load_table("learned").settings
    row = sweep.run_row(Row("two", "stages", stages), settings, tmp_path, tmp_path)
    assert len(recipes) == 2
    assert Path(recipes[1]["prior_from"]).parent.parent.name == "stages"  # stage 1's stored output
    assert row["ppl"]["wiki-test"] == 50.0 and row["stages"][0]["ppl"]["lee"] == 60.0
    assert row["tokens"] == 2 * 10 * 2 * settings["seq_len"]
    assert row["train_seconds"] == 200.0 and row["wall_seconds"] == 60.0
    assert not any(s["reused"] for s in row["stages"]) and row["sparsity"] == "2:4"
    assert row["recipes"][1]["prior_from"] == recipes[1]["prior_from"]

    again = sweep.run_row(Row("two-again", "stages", stages), settings, tmp_path, tmp_path)
    assert len(recipes) == 2  # both stages reused: nothing ran
    assert all(s["reused"] for s in again["stages"])
    assert again["ppl"] == row["ppl"] and again["wall_seconds"] == row["wall_seconds"]
    md = sweep.render(load_table("learned"), {"machine": {}, "results": [{**again, "note": "n"}]})
    assert "[run " in md and "; stage 1, 2 reused from an identical run]" in md
    assert "| two-again (stage 1) | 2:4 | 60.00 | 60.00 |" in md


def _row(name, wiki, lee, threads="1", stages=None):
    stages = [{"method": "maskllm"}] if stages is None else stages
    ppl = {"wiki-test": wiki, "lee": lee}
    return {"name": name, "sparsity": "2:4", "note": "", "finished": "-", "commands": [],
            "stages": stages, "ppl": ppl, "threads": threads}  # fmt: skip


def test_rows_are_divided_by_the_sparsegpt_row_of_the_table():
    rows = [_row("sparsegpt-24", 60.0, 120.0, stages=[{"method": "sparsegpt"}]),
            _row("m", 42.0, 90.0), _row("t", 30.0, 60.0, "2")]  # fmt: skip
    md = sweep.render(load_table("learned"), {"machine": {}, "results": rows})
    assert "| m | 2:4 | 42.00 | 90.00 | 0.700 / 0.750 |" in md
    assert "0.500 / 0.500 (other threads)" in md
    assert "| sparsegpt-24 | 2:4 | 60.00 | 120.00 | - |" in md


def test_a_row_naming_its_baseline_is_divided_by_that_row():
    float_stage = {"method": "maskllm", "ppl": {"wiki-test": 50.0, "lee": 100.0}, "tokens": 10,
                   "train_seconds": 1.0, "wall_seconds": 2.0, "peak_rss_mb": 1.0}  # fmt: skip
    rows = [
        _row("sparsegpt-24", 60.0, 120.0, stages=[{"method": "sparsegpt"}]),
        _row("sparsegpt-24-int8", 62.0, 124.0, stages=[{"method": "sparsegpt"}, {}]),
        _row("maskllm-blockwise-int8", 46.5, 93.0, stages=[float_stage, {}]),
        _row("m", 45.0, 90.0),
    ]
    md = sweep.render(load_table("learned"), {"machine": {}, "results": rows})
    expected = [
        "| maskllm-blockwise-int8 | 2:4 | 46.50 | 93.00 | 0.750 / 0.750 (÷ sparsegpt-24-int8) |",
        "| sparsegpt-24-int8 | 2:4 | 62.00 | 124.00 | 1.033 / 1.033 (÷ sparsegpt-24) |",
        "| maskllm-blockwise-int8 (stage 1) | 2:4 | 50.00 | 100.00 | 0.833 / 0.833 |",  # ÷ float
        "| m | 2:4 | 45.00 | 90.00 | 0.750 / 0.750 |",
    ]
    assert all(line in md for line in expected)


@pytest.mark.parametrize("name", ["subnet", "learned", "maskllm", "lowrank"])
def test_the_table_orders_its_rows_as_the_committed_file(name):
    """A rerun merges its rows in the table's order (harness.merge_rows): the committed rows'
    order is the table's, so a rerun row lands where it was and the md keeps its order."""
    table = load_table(name)
    committed = [
        row_name(r) for r in json.loads((RESULTS_DIR / f"{table.file}.json").read_text())["results"]
    ]
    assert [r.name for r in table.rows if r.name in committed] == committed
    assert set(committed) <= {r.name for r in table.rows}
