"""The MaskLLM benchmark (benchmarks/maskllm.py, maskllm_results.py, maskllm_plot.py): parsing a
``compression.json``, merging rows, and rendering the table and the curves. No model runs."""

import copy
import json
from pathlib import Path

import pytest

from benchmarks import harness, maskllm_plot
from benchmarks import maskllm as bench
from benchmarks.runner import Run

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
            "seconds": 20.04,
            "extra": {
                "loss_curve": loss_curve,
                "hard_ppl": [{"step": 0, "hard_ppl": 70.0}, {"step": steps, "hard_ppl": 60.0}],
                "steps": steps,
                **(extra or {}),
            },
        },
    }


def _row(name, manifest, wall=100.0, rss=900.0, args=("--steps", "4")):
    row, curves = bench.parse_manifest(manifest)
    row = {"name": name, "args": list(args), "note": f"note of {name}", **row}
    row.update(wall_seconds=wall, peak_rss_mb=rss, settings={"nsamples": 8})
    return row, curves


@pytest.fixture
def results_dir(tmp_path):
    """Baseline files as benchmarks/pruning.py and magnitude.py write them (magnitude 2:4 only in
    magnitude.json, to exercise the fallback)."""

    def ppl(value):
        return {"wiki-test": {"perplexity": value, "tokens": 256}}

    pruning = {
        "settings": {"nsamples": 128, "seq_len": 512},
        "results": [
            {"method": "dense", "sparsity": "-", "tool": "-", "ppl": ppl(18.0)},
            {
                "method": "wanda",
                "sparsity": "2:4",
                "tool": "lmcompress",
                "ppl": ppl(140.0),
                "wall_seconds": 200.0,
                "peak_rss_mb": 1500.0,
            },
            {
                "method": "sparsegpt",
                "sparsity": "2:4",
                "tool": "lmcompress",
                "ppl": ppl(SGPT_PPL),
                "wall_seconds": 300.0,
                "peak_rss_mb": 1600.0,
            },
            {  # the peer's row must not be taken for ours
                "method": "sparsegpt",
                "sparsity": "2:4",
                "tool": "llm-compressor",
                "ppl": ppl(49.0),
            },
        ],
    }
    magnitude = {
        "results": [
            {
                "name": "magnitude 2:4",
                "wiki-test": {"perplexity": 1000.0},
                "wall_seconds": 140.0,
                "peak_rss_mb": 2300.0,
            }
        ]
    }
    (tmp_path / "pruning.json").write_text(json.dumps(pruning))
    (tmp_path / "magnitude.json").write_text(json.dumps(magnitude))
    return tmp_path


def test_parse_manifest_reads_ppl_curves_and_tokens():
    row, curves = bench.parse_manifest(_manifest())
    assert row["ppl"] == 45.0
    assert row["tokens"] == 4 * 2 * 3 * 16
    assert row["tokens_formula"] == "steps × batch_size × grad_accum × seq_len"
    assert (row["steps"], row["prior_hard_ppl"], row["final_hard_ppl"]) == (4, 70.0, 60.0)
    assert row["final_lm_loss"] == 2.0
    assert (row["eval_seconds"], row["train_seconds"], row["pipeline_seconds"]) == (2.5, 20.0, 30.0)
    assert [p["step"] for p in curves["loss"]] == [1, 2, 3, 4]
    assert curves["hard_ppl"] == [{"step": 0, "hard_ppl": 70.0}, {"step": 4, "hard_ppl": 60.0}]
    assert curves["blocks"] == {} and curves["ppl"] == 45.0


def test_parse_manifest_prefers_reported_tokens_and_survives_missing_keys():
    row, _ = bench.parse_manifest(_manifest(extra={"tokens": 1234}))
    assert (row["tokens"], row["tokens_formula"]) == (1234, "report.extra.tokens")

    row, curves = bench.parse_manifest({"format_version": 1})
    assert row["ppl"] is None and row["tokens"] is None and row["final_hard_ppl"] is None
    assert curves["loss"] == [] and curves["hard_ppl"] == [] and curves["blocks"] == {}


def test_blockwise_curves_are_kept_and_concatenated():
    blocks = [
        {"block": b, "curve": [{"step": s, "loss": 1.0 / s, "rel_err": 0.5} for s in (1, 2, 3)]}
        for b in (0, 1)
    ]
    manifest = _manifest(extra={"block_curves": blocks})
    manifest["report"]["extra"]["loss_curve"] = []
    row, curves = bench.parse_manifest(manifest)
    assert row["blocks"] == 2 and "per block" in row["tokens_formula"]
    assert curves["blocks"]["block_curves"] == blocks
    joined = maskllm_plot.block_losses(curves)
    assert [e["block"] for e in joined] == [0, 0, 0, 1, 1, 1]
    assert maskllm_plot._xs(joined) == [1, 2, 3, 4, 5, 6]  # steps restart per block: global index


def test_build_command_puts_the_config_args_last():
    settings = {
        "checkpoint": "smollm2-135m",
        "sparsity": "2:4",
        "calib": "wiki-calib",
        "eval": "wiki-test",
        "nsamples": 128,
        "seq_len": 512,
        "seed": 0,
        "eval_tokens": 32768,
    }
    cmd = bench.build_command(["--nsamples", "256", "--blockwise"], Path("OUT"), settings)
    tail = cmd[len(bench.CLI) :]
    assert tail[:3] == ["smollm2-135m", "--method", "maskllm"]
    assert "--skip-dense" in tail and tail[tail.index("-o") + 1] == "OUT"
    assert tail[-3:] == ["--nsamples", "256", "--blockwise"]
    assert all(isinstance(spec["args"], list) for spec in bench.CONFIGS.values())
    assert "paper" in bench.CONFIGS


def test_ratio():
    assert bench.ratio(45.0, SGPT_PPL) == pytest.approx(0.9)
    assert bench.ratio(None, SGPT_PPL) is None and bench.ratio(45.0, None) is None


def test_a_run_writes_rows_curves_and_baselines_then_render_only(results_dir, monkeypatch):
    """Two configurations through main() (their compress-model jobs canned): the rows with
    their ratio to SparseGPT 2:4, the curves file, the baselines; then --render-only redraws."""
    blocks = [{"block": 0, "curve": [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]}]
    block_manifest = _manifest(ppl=55.0, extra={"block_curves": blocks})
    block_manifest["report"]["extra"]["loss_curve"] = []
    manifests = {"paper": _manifest(ppl=45.0), "blockwise-refit": block_manifest}

    def run_job(job, work):
        assert job.reads == Path(job.command[job.command.index("-o") + 1]) / "compression.json"
        return Run(job.name, 100.0, 900.0, 0, manifests[job.name], Path(work), Path(work))

    monkeypatch.setattr(bench, "run_job", run_job)
    monkeypatch.setattr(harness, "machine", lambda: {"cpu_count": 2})
    argv = ["--only", "blockwise-refit", "paper", "--nsamples", "8", "--seq-len", "16"]
    argv += ["--work", str(results_dir / "work")]
    assert bench.main([*argv, "--results-dir", str(results_dir)]) == 0
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
    assert by_name["paper"][col["÷ SparseGPT 2:4"]] == "0.900"
    assert by_name["blockwise-refit"][col["÷ SparseGPT 2:4"]] == "1.100"
    assert by_name["SparseGPT 2:4"][col["÷ SparseGPT 2:4"]] == "1.000"
    assert by_name["paper"][col["wall s"]] == "100.0"
    assert by_name["paper"][col["train tokens"]] == "384"
    assert by_name["paper"][col["args"]] == "`" + " ".join(bench.CONFIGS["paper"]["args"]) + "`"
    assert bench.CONFIGS["paper"]["note"] in table

    saved = json.loads((results_dir / "maskllm.json").read_text())
    assert [r["name"] for r in saved["results"]] == ["paper", "blockwise-refit"]  # CONFIGS order
    assert saved["results"][0]["ratio_to_sparsegpt"] == 0.9
    assert [b["name"] for b in saved["baselines"]][-1] == "SparseGPT 2:4"
    assert saved["machine"] == {"cpu_count": 2}
    saved_curves = json.loads((results_dir / "maskllm_curves.json").read_text())
    assert saved_curves["blockwise-refit"]["blocks"]["block_curves"] == blocks
    png = results_dir / "maskllm_curves.png"
    assert png.stat().st_size > 0

    # --render-only redraws the md and png from the JSON, touching nothing else
    (results_dir / "maskllm.md").unlink()
    png.unlink()
    before = copy.deepcopy(saved)
    assert bench.main(["--render-only", "--results-dir", str(results_dir)]) == 0
    assert (results_dir / "maskllm.md").read_text() == table
    assert png.stat().st_size > 0
    assert json.loads((results_dir / "maskllm.json").read_text()) == before
