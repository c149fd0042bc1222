"""benchmarks.learned without a model: a recipe's stages chain (``{stage1}``), a stage with
the same command is reused, not rerun, and the row divides by the SparseGPT row of its table."""

import json
from pathlib import Path

from benchmarks import learned
from benchmarks.runner import Run


def _manifest(ppl, steps=10, batch=2, seconds=100.0):
    compressed = {c: {"perplexity": ppl, "tokens": 32768, "seconds": 5.0} for c in learned.CORPORA}
    return {
        "results": {"compressed": compressed},
        "report": {"seconds": seconds, "extra": {"steps": steps, "hard_ppl": []},
                   "config": {"training": {"batch_size": batch, "grad_accum": 1}}},
    }  # fmt: skip


def test_stages_chain_and_a_repeated_stage_is_reused(tmp_path, monkeypatch):
    commands = []

    def run_job(job, work):
        commands.append(list(job.command))
        out = Path(job.reads).parent
        out.mkdir(parents=True)
        ppl = 50.0 if "--prior-from" in job.command else 60.0
        return Run(job.name, 30.0, 1000.0, 0, _manifest(ppl), Path(work) / "x", Path(work) / "y")

    monkeypatch.setattr(learned, "run_job", run_job)
    monkeypatch.setitem(learned.CONFIGS, "two", {
        "sparsity": "2:4", "note": "n",
        "stages": [{"method": "maskllm", "args": ["--blockwise"]},
                   {"method": "maskllm", "args": ["--prior-from", "{stage1}"]}],
    })  # fmt: skip
    monkeypatch.setitem(learned.CONFIGS, "two-again", learned.CONFIGS["two"])
    args = type("Args", (), {"work": tmp_path})()
    row = learned.run_config("two", args)
    assert len(commands) == 2
    first_out = commands[1][commands[1].index("--prior-from") + 1]
    assert (Path(first_out) / "..").resolve().parent.name == "stages"  # stage 1's stored output
    assert row["ppl"]["wiki-test"] == 50.0 and row["stages"][0]["ppl"]["lee"] == 60.0
    assert row["tokens"] == 2 * 10 * 2 * learned.SETTINGS["seq_len"]
    assert row["train_seconds"] == 200.0 and row["wall_seconds"] == 60.0
    assert not any(s["reused"] for s in row["stages"])

    again = learned.run_config("two-again", args)
    assert len(commands) == 2  # both stages reused: nothing ran
    assert all(s["reused"] for s in again["stages"])
    assert again["ppl"] == row["ppl"] and again["wall_seconds"] == row["wall_seconds"]


def test_rows_are_divided_by_the_sparsegpt_row_of_the_table():
    def row(name, wiki, lee, threads="1"):
        ppl = {"wiki-test": wiki, "lee": lee}
        return {"name": name, "sparsity": "2:4", "note": "", "finished": "-", "commands": [],
                "stages": [], "ppl": ppl, "threads": threads}  # fmt: skip

    rows = [row("sparsegpt-24", 60.0, 120.0), row("m", 42.0, 90.0), row("t", 30.0, 60.0, "2")]
    payload = {"settings": learned.SETTINGS, "machine": {}, "results": rows}
    md = learned.render(payload)
    assert "| m | 2:4 | 42.00 | 90.00 | 0.700 / 0.750 |" in md
    assert "0.500 / 0.500 (other threads)" in md
    json.dumps(payload)


def test_a_row_naming_its_baseline_is_divided_by_that_row():
    def row(name, wiki, lee, baseline=None, stages=()):
        ppl = {"wiki-test": wiki, "lee": lee}
        return {"name": name, "sparsity": "2:4", "note": "", "finished": "-", "commands": [],
                "stages": list(stages), "ppl": ppl, "threads": "1",
                "baseline": baseline}  # fmt: skip

    float_stage = {"ppl": {"wiki-test": 50.0, "lee": 100.0}, "tokens": 10, "train_seconds": 1.0,
                   "wall_seconds": 2.0, "peak_rss_mb": 1.0}  # fmt: skip
    rows = [
        row("sparsegpt-24", 60.0, 120.0),
        row("sparsegpt-24-int8", 62.0, 124.0, baseline="sparsegpt-24"),
        row("m-int8", 46.5, 93.0, baseline="sparsegpt-24-int8", stages=[float_stage, {}]),
        row("m", 45.0, 90.0),
    ]
    md = learned.render({"settings": learned.SETTINGS, "machine": {}, "results": rows})
    assert "| m-int8 | 2:4 | 46.50 | 93.00 | 0.750 / 0.750 (÷ sparsegpt-24-int8) |" in md
    assert "| sparsegpt-24-int8 | 2:4 | 62.00 | 124.00 | 1.033 / 1.033 (÷ sparsegpt-24) |" in md
    assert "| m-int8 (stage 1) | 2:4 | 50.00 | 100.00 | 0.833 / 0.833 |" in md  # float: ÷ float
    assert "| m | 2:4 | 45.00 | 90.00 | 0.750 / 0.750 |" in md
