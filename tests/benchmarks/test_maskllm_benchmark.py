"""The MaskLLM table (benchmarks/tables/maskllm.yaml, benchmarks/learned_rows.py,
maskllm_plot.py): a run's record and curves read from its ``compression.json``, the one-shot rows
copied, the table and the curves drawn, and each row the job the old program ran. No model
runs."""

import copy
import json
from pathlib import Path

import pytest
from test_learned_tables import job_of, table_command

from benchmarks import harness, maskllm_plot, sweep
from benchmarks.learned_rows import curves_of, learned_of
from benchmarks.render import RESULTS_DIR
from benchmarks.runner import Run
from benchmarks.table import load_table

SGPT_PPL = 50.0


def _manifest(ppl=45.0, steps=4, batch_size=2, grad_accum=3, seq_len=16, extra=None):
    """A compression.json-like dict as ``compress-model --method maskllm --skip-dense`` writes."""
    loss_curve = [
        {"step": s, "loss": 5.0 - s, "lm_loss": 6.0 - s, "tau": 4.0, "kappa": 100.0, "flipped": 0}
        for s in range(1, steps + 1)
    ]
    return {
        "format_version": 1,
        "method": "maskllm",
        "versions": {"lmcompress": "0.1.0"},
        "results": {
            "options": {"seq_len": seq_len, "nsamples": 8},
            "checkpoint": "tiny",
            "compressed": {
                "wiki-test": {"perplexity": ppl, "tokens": 256, "windows": 16, "seconds": 2.5}
            },
            "summary": {},
            "seconds": 30.0,
        },
        "report": {
            "method": "maskllm",
            "config": {"steps": steps, "batch_size": batch_size, "grad_accum": grad_accum},
            "layers": [],
            "summary": {},
            "seconds": 20.04,
            "extra": {
                "loss_curve": loss_curve,
                "hard_ppl": [{"step": 0, "hard_ppl": 70.0}, {"step": steps, "hard_ppl": 60.0}],
                "steps": steps,
                **(extra or {}),
            },
        },
        "compressed_layers": {},
    }


@pytest.fixture
def results_dir(tmp_path):
    """Baseline files as the pruning and magnitude tables write them (magnitude 2:4 only in
    magnitude.json, to exercise the fallback)."""

    def ppl(value):
        return {"wiki-test": {"perplexity": value, "tokens": 256}}

    def row(method, value, tool="lmcompress", **measured):
        return {"method": method, "sparsity": "2:4", "tool": tool, "ppl": ppl(value), **measured}

    pruning = {
        "settings": {"nsamples": 128, "seq_len": 512},
        "results": [
            {"method": "dense", "sparsity": "-", "tool": "-", "ppl": ppl(18.0)},
            row("wanda", 140.0, wall_seconds=200.0, peak_rss_mb=1500.0),
            row("sparsegpt", SGPT_PPL, wall_seconds=300.0, peak_rss_mb=1600.0),
            row("sparsegpt", 49.0, tool="llm-compressor"),  # the peer's: not ours
        ],
    }
    magnitude = {
        "results": [
            {
                "name": "magnitude 2:4",
                "method": "magnitude",
                "sparsity": "2:4",
                "wiki-test": {"perplexity": 1000.0},
                "wall_seconds": 140.0,
                "peak_rss_mb": 2300.0,
            }
        ]
    }
    (tmp_path / "pruning.json").write_text(json.dumps(pruning))
    (tmp_path / "magnitude.json").write_text(json.dumps(magnitude))
    return tmp_path


def test_a_learned_record_reads_tokens_seconds_and_hard_ppl():
    row = learned_of(_manifest(), {"method": "maskllm", "sparsity": "2:4", "steps": 4})
    assert row["tokens"] == 4 * 2 * 3 * 16
    assert (row["steps"], row["eval_seconds"], row["train_seconds"]) == (4, 2.5, 20.0)
    assert row["hard_ppl"][0] == {"step": 0, "hard_ppl": 70.0} and row["args"] == ["--steps", "4"]
    curves = curves_of(_manifest())
    assert [p["step"] for p in curves["loss"]] == [1, 2, 3, 4]
    assert curves["hard_ppl"] == [{"step": 0, "hard_ppl": 70.0}, {"step": 4, "hard_ppl": 60.0}]
    assert curves["blocks"] == {} and curves["ppl"] == 45.0 and curves["steps"] == 4


def test_reported_tokens_win_and_missing_keys_give_none():
    row = learned_of(_manifest(extra={"tokens": 1234}), {})
    assert row["tokens"] == 1234
    row, curves = learned_of({}, {}), curves_of({})
    assert (row["tokens"], row["train_seconds"], row["steps"]) == (0, None, None)
    assert curves["loss"] == [] and curves["hard_ppl"] == [] and curves["blocks"] == {}
    assert curves["ppl"] is None


def test_blockwise_curves_are_kept_and_concatenated():
    blocks = [
        {"block": b, "curve": [{"step": s, "loss": 1.0 / s, "rel_err": 0.5} for s in (1, 2, 3)]}
        for b in (0, 1)
    ]
    manifest = _manifest(extra={"block_curves": blocks})
    manifest["report"]["extra"]["loss_curve"] = []
    curves = curves_of(manifest)
    assert curves["blocks"]["block_curves"] == blocks
    joined = maskllm_plot.block_losses(curves)
    assert [e["block"] for e in joined] == [0, 0, 0, 1, 1, 1]
    assert maskllm_plot._xs(joined) == [1, 2, 3, 4, 5, 6]  # steps restart per block: global index


def _commands():
    rows = json.loads((RESULTS_DIR / "maskllm.json").read_text())["results"]
    return [(r["name"], r["command"]) for r in rows]


@pytest.mark.parametrize(("name", "command"), _commands())
def test_a_row_is_the_job_the_old_program_ran(tmp_path, name, command):
    """The old program put a row's flags after the common ones (so they won): the recipe and
    the settings give compress-model the same job."""
    old = list(command)
    old[old.index("-o") + 1] = str(tmp_path / "out")
    new = table_command(load_table("maskllm"), name, tmp_path, tmp_path / "out")
    assert job_of(new) == job_of(old)


def test_a_run_writes_rows_curves_and_baselines_then_render_only(results_dir, monkeypatch):
    """Two rows through the sweep (their compress-model jobs canned): the rows, the ratio to the
    copied SparseGPT 2:4, the curves file, the copied rows; then --render-only redraws."""
    blocks = [{"block": 0, "curve": [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]}]
    block_manifest = _manifest(ppl=55.0, extra={"block_curves": blocks})
    block_manifest["report"]["extra"]["loss_curve"] = []
    manifests = {"paper": _manifest(ppl=45.0), "blockwise-refit": block_manifest}

    def run_job(job, work):
        assert job.reads == Path(job.command[job.command.index("-o") + 1]) / "compression.json"
        return Run(job.name, 100.0, 900.0, 0, manifests[job.name], Path(work), Path(work))

    monkeypatch.setattr(sweep, "run_job", run_job)
    monkeypatch.setattr(harness, "machine", lambda: {"cpu_count": 2})
    argv = ["maskllm", "--only", "blockwise-refit", "paper", "--set", "nsamples=8", "seq_len=16"]
    argv += ["--work", str(results_dir / "work")]
    assert sweep.main([*argv, "--results-dir", str(results_dir)]) == 0
    table = (results_dir / "maskllm.md").read_text()

    lines = [line for line in table.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]
    names = [c[0] for c in cells]
    assert names == [
        "dense", "magnitude 2:4", "Wanda 2:4", "SparseGPT 2:4", "paper", "blockwise-refit"
    ]  # fmt: skip
    by_name = {c[0]: c for c in cells}
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    col = {h: i for i, h in enumerate(header)}
    assert by_name["SparseGPT 2:4"][col["source"]] == "baseline (pruning.json)"
    assert by_name["SparseGPT 2:4"][col["wiki-test ppl"]] == "50.00"  # ours, not the peer's
    assert by_name["magnitude 2:4"][col["source"]] == "baseline (magnitude.json)"
    assert by_name["Wanda 2:4"][col["train tokens"]] == "65,536 (calib)"
    assert by_name["paper"][col["÷ SparseGPT 2:4"]] == "0.900"
    assert by_name["blockwise-refit"][col["÷ SparseGPT 2:4"]] == "1.100"
    assert by_name["SparseGPT 2:4"][col["÷ SparseGPT 2:4"]] == "1.000"
    assert by_name["paper"][col["wall s"]] == "100.0"
    assert by_name["paper"][col["train tokens"]] == "384"
    assert by_name["paper"][col["hard ppl step 0 → last"]] == "70.00 → 60.00"
    paper = load_table("maskllm").row("paper")
    assert by_name["paper"][col["args"]].startswith("`--steps 100 --batch-size 1 --grad-accum 1")
    assert "--no-weight-reg-norm --no-distill" in by_name["paper"][col["args"]]
    assert paper.note in table
    assert "wiki-test ppl / 50.00 (goal ≤ 0.9)" in table

    saved = json.loads((results_dir / "maskllm.json").read_text())
    assert [r["name"] for r in saved["results"]] == ["paper", "blockwise-refit"]  # table order
    assert [b["name"] for b in saved["baselines"]][-1] == "SparseGPT 2:4"
    assert saved["machine"] == {"cpu_count": 2} and "curves" not in saved["results"][0]
    saved_curves = json.loads((results_dir / "maskllm_curves.json").read_text())
    assert saved_curves["blockwise-refit"]["blocks"]["block_curves"] == blocks
    png = results_dir / "maskllm_curves.png"
    assert png.stat().st_size > 0

    # --render-only redraws the md and png from the JSON, touching nothing else
    (results_dir / "maskllm.md").unlink()
    png.unlink()
    before = copy.deepcopy(saved)
    assert sweep.main(["maskllm", "--render-only", "--results-dir", str(results_dir)]) == 0
    assert (results_dir / "maskllm.md").read_text() == table
    assert png.stat().st_size > 0
    assert json.loads((results_dir / "maskllm.json").read_text()) == before
