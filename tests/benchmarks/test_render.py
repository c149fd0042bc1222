"""The benchmark renderer and the benchmarks' shared flags (benchmarks/render.py): every committed
results file is regenerated from its JSON byte for byte, and ``--only`` merges rerun rows into
the results file. No model runs (jobs are replaced by canned runs)."""

import importlib
import json
import shutil
from pathlib import Path

import pytest

from benchmarks import BENCHMARKS, harness, magnitude, maskllm_fsdp, pruning
from benchmarks.child import maskllm_fsdp as fsdp_child
from benchmarks.render import RESULTS_DIR, merge_rows
from benchmarks.runner import Run


@pytest.mark.parametrize("name", BENCHMARKS)
def test_committed_markdown_is_rendered_from_its_json(name):
    module = importlib.import_module(f"benchmarks.{name}")
    payload = json.loads((RESULTS_DIR / f"{module.NAME}.json").read_text())
    assert module.render(payload) == (RESULTS_DIR / f"{module.NAME}.md").read_text()


# tables of a benchmark run on another host than its main file's (benchmark, results JSON);
# (speed_compiled*/ hold ``compress-model bench -o`` outputs, another format)
OTHER_HOSTS = [("learned", "learned_epyc/learned.json")]


@pytest.mark.parametrize(("name", "path"), OTHER_HOSTS)
def test_the_tables_of_other_hosts_are_rendered_from_their_json(name, path):
    module = importlib.import_module(f"benchmarks.{name}")
    payload = json.loads((RESULTS_DIR / path).read_text())
    assert module.render(payload) == (RESULTS_DIR / path).with_suffix(".md").read_text()


@pytest.mark.parametrize("name", BENCHMARKS)
def test_render_only_rewrites_the_md_and_png_and_nothing_else(tmp_path, name):
    module = importlib.import_module(f"benchmarks.{name}")
    shutil.copytree(RESULTS_DIR, tmp_path, dirs_exist_ok=True)
    pngs = (
        [p.name for p in RESULTS_DIR.glob(f"{module.NAME}_*.png")]
        if getattr(module, "plot", None)
        else []
    )
    drawn = [f"{module.NAME}.md", *pngs]
    for file in drawn:
        (tmp_path / file).unlink()
    before = _files(tmp_path)

    assert module.main(["--render-only", "--results-dir", str(tmp_path)]) == 0
    after = _files(tmp_path)
    assert sorted(set(after) - set(before)) == sorted(drawn)
    assert all(after[f] == before[f] for f in before)  # the JSON files untouched
    for file in drawn:  # the committed md (and PNG) again, byte for byte
        assert after[file] == (RESULTS_DIR / file).read_bytes(), file


def _files(root):
    """Every file under ``root`` (``compress-model bench -o`` outputs are directories)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_merge_rows_replaces_by_key_and_keeps_the_table_order():
    def key(r):
        return r["name"]

    old = [{"name": "b", "v": 1}, {"name": "zz-retired", "v": 2}, {"name": "a", "v": 3}]
    merged = merge_rows(old, [{"name": "b", "v": 9}], key=key, order=["a", "b", "c"])
    assert merged == [{"name": "a", "v": 3}, {"name": "b", "v": 9}, {"name": "zz-retired", "v": 2}]


def _canned(result, wall=12.5, rss=321.0):
    def run_job(job, work):
        return Run(job.name, wall, rss, 0, result(job), Path(work) / "x.out", Path(work) / "x.log")

    return run_job


def test_magnitude_only_reruns_one_row_and_keeps_the_others(tmp_path, monkeypatch):
    shutil.copy(RESULTS_DIR / "magnitude.json", tmp_path)
    old = json.loads((tmp_path / "magnitude.json").read_text())
    ran = []

    def result(job):
        ran.append(job.name)
        assert job.command[1:3] == ("-m", "benchmarks.child.magnitude")
        spec = json.loads(job.command[3])
        assert (spec["name"], spec["method"], spec["eval_tokens"]) == ("dense", None, 64)
        ppl = {"perplexity": 42.0, "tokens": 64}
        return {"name": "dense", "wiki-test": ppl, "lee": ppl, "seconds": 1.0}

    monkeypatch.setattr(magnitude, "run_job", _canned(result))
    monkeypatch.setattr(harness, "machine", lambda: {"cpu_count": 0})
    argv = ["--only", "dense", "--eval-tokens", "64", "--results-dir", str(tmp_path)]
    assert magnitude.main([*argv, "--work", str(tmp_path / "work")]) == 0

    assert ran == ["dense"]
    new = json.loads((tmp_path / "magnitude.json").read_text())
    assert [r["name"] for r in new["results"]] == [r["name"] for r in old["results"]]
    dense = new["results"][0]
    assert (dense["wiki-test"]["perplexity"], dense["wall_seconds"], dense["peak_rss_mb"]) == (
        42.0,
        12.5,
        321.0,
    )
    assert new["results"][1:] == old["results"][1:]
    md = (tmp_path / "magnitude.md").read_text()
    assert "| dense | 42.00 | 42.00 | 12.5 | 321.0 |" in md
    assert "| magnitude 2:4 | 1160.35 |" in md


def test_pruning_only_reruns_our_row_and_scores_its_output(tmp_path, monkeypatch):
    shutil.copy(RESULTS_DIR / "pruning.json", tmp_path)
    old = json.loads((tmp_path / "pruning.json").read_text())
    ran = []

    def result(job):
        ran.append(job.name)
        if job.name.startswith("eval "):
            ppl = {"perplexity": 60.0, "tokens": 32704}
            return {"perplexity": {"wiki-test": ppl, "lee": ppl}}
        tail = job.command[3:]
        assert tail[:5] == ("smollm2-135m", "--method", "sparsegpt", "--sparsity", "2:4")
        return None

    monkeypatch.setattr(pruning, "run_job", _canned(result))
    monkeypatch.setattr(harness, "machine", lambda: {"cpu_count": 0})
    argv = ["--only", "lmcompress:sparsegpt:2:4", "--results-dir", str(tmp_path)]
    assert pruning.main([*argv, "--work", str(tmp_path / "work")]) == 0

    assert ran == ["lmcompress:sparsegpt:2:4", "eval lmcompress:sparsegpt:2:4"]
    new = json.loads((tmp_path / "pruning.json").read_text())
    assert [pruning.row_name(r) for r in new["results"]] == [
        pruning.row_name(r) for r in old["results"]
    ]
    pairs = zip(old["results"], new["results"], strict=True)
    changed = [i for i, (a, b) in enumerate(pairs) if a != b]
    assert changed == [4]
    row = new["results"][4]
    assert (row["wall_seconds"], row["ppl"]["wiki-test"]["perplexity"]) == (12.5, 60.0)
    # its ratio column now compares with the peer's row, which was kept
    assert (
        "| sparsegpt | 2:4 | lmcompress | 60.00 | 60.00 | 12.5 | 321.0 | 0.919 |"
        in (tmp_path / "pruning.md").read_text()
    )


@pytest.mark.parametrize("module", [magnitude, pruning])
def test_only_rejects_an_unknown_job_before_running_anything(tmp_path, module, monkeypatch):
    monkeypatch.setattr(module, "run_job", _canned(lambda _job: pytest.fail("ran")))
    with pytest.raises(SystemExit):
        module.main(["--only", "no-such-job", "--results-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_fsdp_only_launches_the_module_and_reads_every_process_record(tmp_path, monkeypatch):
    shutil.copy(RESULTS_DIR / "maskllm_fsdp.json", tmp_path)
    old = json.loads((tmp_path / "maskllm_fsdp.json").read_text())

    def result(job):
        command = [str(part) for part in job.command]
        assert command[1] == "launch" and command[command.index("--num_processes") + 1] == "2"
        assert command[command.index("-m") + 1] == "benchmarks.child.maskllm_fsdp"
        assert json.loads(command[-2])["options"] == {"fsdp": True}
        assert job.env == {"OMP_NUM_THREADS": "1"}
        for rank in (0, 1):  # what each process of the launch writes
            record = {"rank": rank, "peak_rss_mb": 100.0 + rank, "logits_held": 5, "seconds": 2}
            record.update(losses=[1.0, 0.5], logits_abs_sum=3.0)
            Path(command[-1], f"rank{rank}.json").write_text(json.dumps(record))
        return None

    monkeypatch.setattr(maskllm_fsdp, "run_job", _canned(result))
    monkeypatch.setattr(harness, "machine", lambda: {"cpu_count": 0})
    argv = ["--only", "2 processes, FSDP", "--results-dir", str(tmp_path)]
    assert maskllm_fsdp.main([*argv, "--work", str(tmp_path / "work")]) == 0

    new = json.loads((tmp_path / "maskllm_fsdp.json").read_text())
    assert new["runs"][:2] == old["runs"][:2]
    fsdp = new["runs"][2]
    assert (fsdp["name"], fsdp["wall_seconds"], [r["rank"] for r in fsdp["ranks"]]) == (
        "2 processes, FSDP",
        12.5,
        [0, 1],
    )
    md = (tmp_path / "maskllm_fsdp.md").read_text()
    assert "| 2 processes, FSDP | 100 / 101 | 5 / 5 | 2 | 1.000 0.500 | 3 |" in md


def test_fsdp_child_records_what_the_report_says(tiny_checkpoint, tmp_path):
    """One process of a launch, in process, on a tiny checkpoint: the logits it holds come from
    ``report.extra`` (all of them without FSDP), its peak RSS and losses from the run."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    job = {"checkpoint": str(tiny_checkpoint), "calib": str(corpus), "nsamples": 4}
    job.update(seq_len=16, seed=0, steps=2, batch_size=2, options={})
    fsdp_child.run(job, tmp_path)

    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["rank"] == 0 and len(record["losses"]) == 2
    assert record["logits_held"] == record["logits_total"] > 0
    assert record["peak_rss_mb"] > 0 and record["logits_abs_sum"] > 0


def test_lowrank_end_to_end_rows_are_paragraphs_with_their_threads():
    from benchmarks import lowrank

    row = {"method": "gfwsvd", "ratio": 0.8, "command": "C", "wall_seconds": 10.0,
           "peak_rss_mb": 5.0, "params_kept_fraction": 0.8, "compressed_bytes": 4004,
           "expected_bytes": 4000, "ppl": {"wiki-test": 23.456, "lee": 39.123},
           "reloaded_ppl": {"wiki-test": 23.456, "lee": 39.123}}  # fmt: skip
    payload = {"nsamples": 128, "seq_len": 512, "eval_tokens": 16384, "results": [
        {"name": "cli", **row},
        {"name": "recipe", **row, "machine": {"torch_threads": 2}},
    ]}  # fmt: skip
    text = lowrank.render(payload)
    assert "| GFWSVD" not in text  # no table row: paragraphs of their own
    payload["results"] += [
        {"name": "sparsegpt 2:4", **row, "method": "sparsegpt", "apply_seconds": 7.0},
        {"name": lowrank.RESIDUAL.format("uniform"), **row, "ratio": 0.3, "allocation": "uniform",
         "residual": "2:4", "apply_seconds": 9.0, "params_kept_fraction": 0.79},
    ]  # fmt: skip
    table = lowrank.render(payload)
    assert "| SparseGPT 2:4 | - | - | 80.00 | 23.46 | 39.12 | 7.0 | 5 | - |" in table
    assert (
        "| GFWSVD (K-FAC factors), SparseGPT 2:4 on the residual | 0.3 | uniform | 79.00 |" in table
    )
    cli, recipe = text.split("End to end")[1:]
    assert cli.startswith(": `C`") and "gradient pass on 32 windows" in cli
    assert recipe.startswith(", 2 threads: `C`") and "distillation on 512" in recipe
    assert "23.46 / lee 39.12" in recipe and "1.0010 ×" in recipe
