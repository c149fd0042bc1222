"""The low-rank table (benchmarks/tables/lowrank.yaml, benchmarks/lowrank_rows.py): each row is
the job the old program ran (the spec its child read, the command of an end-to-end row, as
the committed results recorded them), and the rows drawn as paragraphs are. No model runs."""

import json
from pathlib import Path

import pytest

from benchmarks import sweep
from benchmarks.lowrank_rows import run_lowrank
from benchmarks.render import RESULTS_DIR
from benchmarks.runner import Run
from benchmarks.table import load_table

SPEC = ("name", "method", "ratio", "allocation", "variant", "residual")
# fb875cf's benchmarks/lowrank.py: a variant's options (calib, nsamples: the job's text)
OLD_VARIANTS = {
    "refit": {"refit": "output"},
    "sequential": {"sequential": True},
    "sequential+refit": {"sequential": True, "refit": "output"},
    "distill": {"distill_steps": 128, "distill_lr": 1e-5},
    "distill lr 1e-4": {"distill_steps": 128, "distill_lr": 1e-4},
    "distill lr 3e-4": {"distill_steps": 128, "distill_lr": 3e-4},
    "distill 2 epochs lr 1e-4": {"distill_steps": 256, "distill_lr": 1e-4},
    "distill 4 epochs lr 1e-4": {"distill_steps": 512, "distill_lr": 1e-4},
    "distill 2 epochs lr 1e-4 calib self": {
        "distill_steps": 256,
        "distill_lr": 1e-4,
        "calib": "self",
    },  # fmt: skip
    "distill 512 windows lr 1e-4": {"distill_steps": 512, "distill_lr": 1e-4, "nsamples": 512},
}
COMMITTED = json.loads((RESULTS_DIR / "lowrank.json").read_text())["results"]


def _canned(result, ran):
    def run(job):
        ran.append([str(part) for part in job.command])
        if str(job.reads).endswith("compression.json"):
            Path(job.reads).parent.mkdir(parents=True, exist_ok=True)
            (Path(job.reads).parent / "compressed.safetensors").write_bytes(b"x" * 8)
        return Run(job.name, 3.0, 4.0, 0, result, Path("x"), Path("y"))

    return run


@pytest.mark.parametrize("old", [r for r in COMMITTED if "apply_seconds" in r or r["name"] ==
                                 "dense"], ids=lambda r: r["name"])  # fmt: skip
def test_a_factorised_row_gives_its_child_the_spec_the_old_program_gave(tmp_path, old):
    row, ran = load_table("lowrank").row(old["name"]), []
    settings = load_table("lowrank").settings
    record = run_lowrank(row.name, row.kind, row.recipe, settings, tmp_path, _canned({}, ran))
    spec = json.loads(ran[0][ran[0].index("apply") + 1])
    assert {k: spec[k] for k in SPEC if k in spec} == {k: old[k] for k in SPEC if k in old}
    options = {k: v for k, v in spec.items() if k not in SPEC}
    assert options == OLD_VARIANTS.get(old.get("variant"), {})
    assert json.loads(ran[0][-1]) == settings and record["wall_seconds"] == 3.0


@pytest.mark.parametrize("name", ["cli", "recipe"])
def test_an_end_to_end_row_runs_the_command_the_old_program_ran(tmp_path, name):
    table = load_table("lowrank")
    layers = [{"params": 10, "params_kept": 8, "rank": 2}, {"params": 10, "params_kept": 10}]
    ppl = {c: {"perplexity": 20.0} for c in ("wiki-test", "lee")}
    result = {"report": {"layers": layers}, "results": {"compressed": ppl}, "perplexity": ppl}
    row, ran = table.row(name), []
    record = run_lowrank(name, row.kind, row.recipe, table.settings, tmp_path, _canned(result, ran))
    old = next(r for r in COMMITTED if r["name"] == name)
    assert record["command"] == old["command"]
    out = tmp_path / "outputs" / Path(old["command"].split()[-2]).name
    assert ran[1][3:7] == ["eval", str(out), "--runtime", "packed"]
    assert (record["params_kept_fraction"], record["expected_bytes"]) == (0.9, 32)
    assert (record["method"], record["ratio"]) == ("gfwsvd", 0.8)


def test_a_statistics_row_runs_its_kind(tmp_path):
    table, ran = load_table("lowrank"), []
    row = table.row("stats:gradients")
    found = run_lowrank(row.name, row.kind, row.recipe, table.settings, tmp_path,
                        _canned({"pass_seconds": 1.0}, ran))  # fmt: skip
    assert ran[0][3:6] == ["stats", "gradients", str(tmp_path / "stats")]
    assert found == {"name": "stats:gradients", "pass_seconds": 1.0, "wall_seconds": 3.0,
                     "peak_rss_mb": 4.0}  # fmt: skip


def test_lowrank_end_to_end_rows_are_paragraphs_with_their_threads():
    table = load_table("lowrank")
    row = {"method": "gfwsvd", "ratio": 0.8, "command": "C", "wall_seconds": 10.0,
           "peak_rss_mb": 5.0, "params_kept_fraction": 0.8, "compressed_bytes": 4004,
           "expected_bytes": 4000, "ppl": {"wiki-test": 23.456, "lee": 39.123},
           "reloaded_ppl": {"wiki-test": 23.456, "lee": 39.123}}  # fmt: skip
    payload = {"nsamples": 128, "seq_len": 512, "eval_tokens": 16384, "results": [
        {"name": "cli", **row},
        {"name": "recipe", **row, "machine": {"torch_threads": 2}},
    ]}  # fmt: skip
    text = sweep.render(table, payload)
    assert "| GFWSVD" not in text  # no table row: paragraphs of their own
    payload["results"] += [
        {"name": "sparsegpt 2:4", **row, "method": "sparsegpt", "apply_seconds": 7.0},
        {"name": "gfwsvd 0.3 uniform + 2:4 residual", **row, "ratio": 0.3, "allocation": "uniform",
         "residual": "2:4", "apply_seconds": 9.0, "params_kept_fraction": 0.79},
    ]  # fmt: skip
    md = sweep.render(table, payload)
    assert "| SparseGPT 2:4 | - | - | 80.00 | 23.46 | 39.12 | 7.0 | 5 | - |" in md
    assert "| GFWSVD (K-FAC factors), SparseGPT 2:4 on the residual | 0.3 | uniform | 79.00 |" in md
    cli, recipe = text.split("End to end")[1:]
    assert cli.startswith(": `C`") and "gradient pass on 32 windows" in cli
    assert recipe.startswith(", 2 threads: `C`") and "distillation on 512" in recipe
    assert "23.46 / lee 39.12" in recipe and "1.0010 ×" in recipe
