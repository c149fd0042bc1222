"""The benchmark renderer, the sweep program and the benchmarks' shared flags (render.py,
sweep.py): every committed results file is regenerated from its JSON byte for byte, and
``--only`` merges rerun rows into the results file. No model runs (jobs are replaced by
canned runs)."""

import importlib
import json
import shutil
from pathlib import Path

import pytest
import yaml

from benchmarks import BENCHMARKS, harness, maskllm_fsdp, sweep
from benchmarks.child import maskllm_fsdp as fsdp_child
from benchmarks.columns import row_name
from benchmarks.render import RESULTS_DIR, merge_rows
from benchmarks.runner import Run
from benchmarks.table import load_table, table_names


@pytest.mark.parametrize("name", BENCHMARKS)
def test_committed_markdown_is_rendered_from_its_json(name):
    module = importlib.import_module(f"benchmarks.{name}")
    payload = json.loads((RESULTS_DIR / f"{module.NAME}.json").read_text())
    assert module.render(payload) == (RESULTS_DIR / f"{module.NAME}.md").read_text()


@pytest.mark.parametrize("name", table_names())
def test_committed_markdown_of_every_table_is_rendered_from_its_json(name):
    table = load_table(name)
    payload = json.loads((RESULTS_DIR / f"{table.file}.json").read_text())
    assert sweep.render(table, payload) == (RESULTS_DIR / f"{table.file}.md").read_text()


# results of a table run on another host than its main file's (table, results JSON);
# (speed_compiled*/ hold ``compress-model bench -o`` outputs, another format)
OTHER_HOSTS = [("learned", "learned_epyc/learned.json")]


# results of a benchmark program run on another host than its main file's (module, results JSON)
OTHER_HOST_PROGRAMS = [("speed", "speed_xeon/speed.json")]


@pytest.mark.parametrize(("name", "path"), OTHER_HOST_PROGRAMS)
def test_the_programs_of_other_hosts_are_rendered_from_their_json(name, path):
    module = importlib.import_module(f"benchmarks.{name}")
    payload = json.loads((RESULTS_DIR / path).read_text())
    assert module.render(payload) == (RESULTS_DIR / path).with_suffix(".md").read_text()


@pytest.mark.parametrize(("name", "path"), OTHER_HOSTS)
def test_the_tables_of_other_hosts_are_rendered_from_their_json(tmp_path, name, path):
    payload = json.loads((RESULTS_DIR / path).read_text())
    md = (RESULTS_DIR / path).with_suffix(".md")
    assert sweep.render(load_table(name), payload) == md.read_text()
    shutil.copy(RESULTS_DIR / path, tmp_path)  # and its PNG
    assert sweep.main([name, "--render-only", "--results-dir", str(tmp_path)]) == 0
    png = md.with_name(f"{load_table(name).file}_curves.png")
    assert (tmp_path / png.name).read_bytes() == png.read_bytes()


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


@pytest.mark.parametrize("names", [[name] for name in table_names()] + [[]])
def test_sweep_render_only_rewrites_the_md_of_its_tables_and_nothing_else(tmp_path, names):
    """``python -m benchmarks.sweep [TABLE] --render-only`` (no name: every table)."""
    shutil.copytree(RESULTS_DIR, tmp_path, dirs_exist_ok=True)
    files = [load_table(name).file for name in names or table_names()]
    drawn = [f"{file}.md" for file in files]
    drawn += [p.name for file in files for p in tmp_path.glob(f"{file}_*.png")]
    for file in drawn:
        (tmp_path / file).unlink()
    before = _files(tmp_path)

    assert sweep.main([*names, "--render-only", "--results-dir", str(tmp_path)]) == 0
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
        command = [str(part) for part in job.command]
        assert command[3:5] == ["eval", "smollm2-135m"]  # a row of kind eval
        assert command[command.index("--eval-tokens") + 1] == "64"
        ppl = {"perplexity": 42.0, "tokens": 64}
        return {"perplexity": {"wiki-test": ppl, "lee": ppl}}

    monkeypatch.setattr(sweep, "run_job", _canned(result))
    monkeypatch.setattr(harness, "machine", lambda: {"cpu_count": 0})
    argv = ["magnitude", "--only", "dense", "--set", "eval_tokens=64"]
    assert sweep.main([*argv, "--results-dir", str(tmp_path), "--work", str(tmp_path / "w")]) == 0

    assert ran == ["eval dense"]
    new = json.loads((tmp_path / "magnitude.json").read_text())
    assert [r["name"] for r in new["results"]] == [r["name"] for r in old["results"]]
    dense = new["results"][0]
    assert (dense["ppl"]["wiki-test"]["perplexity"], dense["wall_seconds"]) == (42.0, 12.5)
    assert (dense["peak_rss_mb"], new["settings"]["eval_tokens"]) == (321.0, 64)
    assert new["results"][1:] == old["results"][1:]
    md = (tmp_path / "magnitude.md").read_text()
    assert "| dense | 42.00 | 42.00 | 12.5 | 321.0 |" in md
    assert "| magnitude 2:4 | 1160.35 |" in md


def test_a_recipe_row_runs_compress_model_on_its_recipe_and_reads_its_output(tmp_path, monkeypatch):
    """magnitude 2:4: ``compress-model --config ROW.yaml`` with the table's settings as flags;
    the row's record from its output's compression.json."""
    shutil.copy(RESULTS_DIR / "magnitude.json", tmp_path)
    old = json.loads((tmp_path / "magnitude.json").read_text())

    def result(job):
        command = [str(part) for part in job.command]
        config = Path(command[command.index("--config") + 1])
        assert yaml.safe_load(config.read_text()) == {"method": "magnitude", "sparsity": "2:4"}
        assert command[command.index("--config") + 2] == "smollm2-135m"
        assert command[command.index("--eval") + 1 : command.index("--eval") + 3] == [
            "wiki-test",
            "lee",
        ]
        assert {"--skip-dense", "--no-dense-copy", "-o"} <= set(command)
        ppl = {"perplexity": 1000.0, "tokens": 32704}
        summary = {"bytes_compressed": 1, "bytes_dense": 2}
        return {
            "results": {"compressed": {"wiki-test": ppl, "lee": ppl}},
            "report": {"summary": summary},
            "compressed_layers": {"a": {"format": "nm_packed"}},
        }

    monkeypatch.setattr(sweep, "run_job", _canned(result))
    monkeypatch.setattr(harness, "machine", lambda: {"cpu_count": 0})
    argv = ["magnitude", "--only", "magnitude 2:4", "--results-dir", str(tmp_path)]
    assert sweep.main([*argv, "--work", str(tmp_path / "w")]) == 0

    row = json.loads((tmp_path / "magnitude.json").read_text())["results"][1]
    assert (row["name"], row["formats"]) == ("magnitude 2:4", ["nm_packed"])
    assert row["summary"] == {"bytes_compressed": 1, "bytes_dense": 2}
    assert (row["method"], row["sparsity"], row["tool"]) == ("magnitude", "2:4", "lmcompress")
    assert (
        "| magnitude 2:4 | 1000.00 | 1000.00 | 12.5 | 321.0 |"
        in (tmp_path / "magnitude.md").read_text()
    )
    assert old["results"][0] == json.loads((tmp_path / "magnitude.json").read_text())["results"][0]


def test_pruning_only_reruns_our_row_and_scores_its_output(tmp_path, monkeypatch):
    shutil.copy(RESULTS_DIR / "pruning.json", tmp_path)
    old = json.loads((tmp_path / "pruning.json").read_text())
    ran = []

    def result(job):
        ran.append(job.name)
        if job.name.startswith("eval "):
            ppl = {"perplexity": 60.0, "tokens": 32704}
            return {"perplexity": {"wiki-test": ppl, "lee": ppl}}
        command = [str(part) for part in job.command]
        config = Path(command[command.index("--config") + 1])
        assert yaml.safe_load(config.read_text()) == {"method": "sparsegpt", "sparsity": "2:4"}
        tail = command[command.index("--config") + 2 :]
        assert tail[:9] == ["smollm2-135m", "--nsamples", "128", "--seq-len", "512",
                            "--calib", "wiki-calib", "--seed", "0"]  # fmt: skip
        assert tail[9:11] == ["--eval", "-o"]  # scored apart: the job evaluates nothing
        return {"results": {}, "report": {"summary": {}}, "compressed_layers": {}}

    monkeypatch.setattr(sweep, "run_job", _canned(result))
    monkeypatch.setattr(harness, "machine", lambda: {"cpu_count": 0})
    argv = ["pruning", "--only", "lmcompress:sparsegpt:2:4", "--results-dir", str(tmp_path)]
    assert sweep.main([*argv, "--work", str(tmp_path / "work")]) == 0

    assert ran == ["lmcompress:sparsegpt:2:4", "eval lmcompress:sparsegpt:2:4"]
    new = json.loads((tmp_path / "pruning.json").read_text())
    assert [row_name(r) for r in new["results"]] == [row_name(r) for r in old["results"]]
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


def test_skip_peers_runs_none_of_the_peer_rows(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(sweep, "run_table", lambda _table, args, _p: ran.extend(args.only) or 0)
    assert sweep.main(["pruning", "--skip-peers", "--results-dir", str(tmp_path)]) == 0
    assert ran and not [name for name in ran if name.startswith("llm-compressor:")]
    assert "lmcompress:wanda:2:4" in ran


@pytest.mark.parametrize("table", ["magnitude", "pruning"])
def test_only_rejects_an_unknown_job_before_running_anything(tmp_path, table, monkeypatch):
    monkeypatch.setattr(sweep, "run_job", _canned(lambda _job: pytest.fail("ran")))
    with pytest.raises(SystemExit):
        sweep.main([table, "--only", "no-such-job", "--results-dir", str(tmp_path)])
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


def test_runtime_reloads_each_output_in_every_runtime_and_runs_the_readme_command(
    tmp_path, monkeypatch
):
    """runtime: a recipe row is compressed, then reloaded by ``compress-model eval --runtime``
    in each runtime of the ``reload`` setting (a line each); the ``readme`` row runs the
    recipe as flags from an empty cache, and is a line of its section."""
    shutil.copy(RESULTS_DIR / "runtime.json", tmp_path)
    ran, caches = [], []

    def result(job):
        command = [str(part) for part in job.command]
        ran.append(job.name)
        ppl = {"wiki-test": {"perplexity": 70.0}, "lee": {"perplexity": 140.0}}
        if "eval" in command[3:4]:
            load = {"resident_bytes": 2**20, "ratio_to_dense_fp16": 0.5, "peak_rss_mib": 9.0}
            return {"perplexity": ppl, "load": load}
        if job.name == "main job":
            assert command[3:9] == [
                "--method",
                "sparsegpt",
                "--sparsity",
                "2:4",
                "--nsamples",
                "64",
            ]
            assert "LMCOMPRESS_CACHE" in job.env and "--config" not in command
            assert Path(job.env["LMCOMPRESS_CACHE"]).is_dir()  # empty, made for this job
            caches.append(job.env["LMCOMPRESS_CACHE"])
        else:
            assert command[command.index("--save-dtype") + 1] == "bfloat16"
        summary = {"params_kept": 1, "params_compressed_layers": 2}
        results = {"compressed": ppl, "dense": {"wiki-test": {"perplexity": 18.0}}}
        return {"results": results, "report": {"summary": summary}, "compressed_layers": {}}

    monkeypatch.setattr(sweep, "run_job", _canned(result))
    monkeypatch.setattr(harness, "machine", lambda: {"cpu_count": 0})
    argv = ["runtime", "--only", "svd 0.8", "main job", "--results-dir", str(tmp_path)]
    assert sweep.main([*argv, "--work", str(tmp_path / "w")]) == 0

    assert ran == ["svd 0.8", "eval svd 0.8 packed", "eval svd 0.8 dense", "main job"]
    assert len(caches) == 1 and not Path(caches[0]).exists()  # removed after the job
    md = (tmp_path / "runtime.md").read_text()
    row = "| svd 0.8 | 0.500 | 12.5 | 321.0 | 70.00 | 140.00 | {} | 70.00 | 140.00 | 1.0 | 0.5000 |"
    assert row.format("packed") in md and row.format("dense") in md
    main = "| `compress-model --method sparsegpt --sparsity 2:4 --nsamples 64` | 18.00 | 70.00 |"
    assert main in md and "| sparsegpt 2:4 | 0.500 | 501.7 |" in md  # a row kept


def test_int8_row_settings_and_the_interop_row_reading_its_source(tmp_path, monkeypatch):
    """int8: the first row scores the dense model too (its own settings); the interop row
    reads that row's output, which is kept for it."""
    shutil.copy(RESULTS_DIR / "int8.json", tmp_path)
    outputs = []

    def result(job):
        command = [str(part) for part in job.command]
        if job.name == "interop":
            assert command[1:3] == ["-m", "benchmarks.child.int8_interop"]
            assert Path(command[3]) == outputs[0] and command[4:] == ["32768", "wiki-test", "lee"]
            ppl = {"wiki-test": 20.0, "lee": 30.0}
            return {"transformers": ppl, "simulated": ppl, "runtime": ppl}
        assert "--skip-dense" not in command  # the table's skip_dense, overridden by the row's
        outputs.append(Path(command[command.index("-o") + 1]))
        outputs[0].mkdir(parents=True)
        ppl = {"wiki-test": {"perplexity": 19.0}, "lee": {"perplexity": 31.0}}
        results = {"compressed": ppl, "dense": ppl}
        report = {"summary": {}, "extra": {"softmax": None}}
        return {"results": results, "report": report, "compressed_layers": {}}

    monkeypatch.setattr(sweep, "run_job", _canned(result))
    monkeypatch.setattr(harness, "machine", lambda: {"cpu_count": 0})
    argv = ["int8", "--only", "W8A8 dynamic", "interop", "--results-dir", str(tmp_path)]
    assert sweep.main([*argv, "--work", str(tmp_path / "w")]) == 0

    assert outputs[0].is_dir()  # kept for the interop row
    md = (tmp_path / "int8.md").read_text()
    assert "| fp32 (dense) | - | - | 19.000 | 31.000 | - | - |" in md
    assert "| W8A8 dynamic | 12.5 | 321.0 | 19.000 | 31.000 | +0.00 % / +0.00 % | - |" in md
    assert "| wiki-test | 20.000 | 20.000 | 0.0e+00 | 20.000 |" in md


def test_memory_estimate_rows_on_made_checkpoints_record_the_estimate(tmp_path, monkeypatch):
    """tiny:FAMILY and cached:smollm2 checkpoints come from one run of the child; a streamed
    row evaluates nothing; each row records the estimate its job was admitted with."""
    shutil.copy(RESULTS_DIR / "memory_estimate.json", tmp_path)
    ran = []

    def result(job):
        command = [str(part) for part in job.command]
        ran.append(job.name)
        if job.name == "tiny checkpoints":
            assert command[1:3] == ["-m", "benchmarks.child.memory_estimate"]
            return {"families": ["llama"], "smollm2": "/cache/smollm2-135m", "factor": 1.5}
        tail = command[command.index("--config") + 2 :]
        if job.name.startswith("tiny"):
            assert tail[0] == str(tmp_path / "w" / "tiny" / "llama")
            assert tail[1:5] == ["--nsamples", "8", "--seq-len", "64"]
            assert tail[5:9] == ["--eval", "wiki-test", "--eval-tokens", "512"]
        else:
            assert tail[:6] == ["/cache/smollm2-135m", "--nsamples", "16", "--seq-len", "512",
                                "--streaming"]  # fmt: skip
            assert "--eval" not in command
        parts = {"model weights": 3 * 2**20, "tokenizing a corpus": 2**20}
        estimate = {"total": 4 * 2**20 * 321, "parts": parts}
        results = {"memory_estimate": estimate}
        return {"results": results, "report": {"summary": {}}, "compressed_layers": {}}

    monkeypatch.setattr(sweep, "run_job", _canned(result))
    monkeypatch.setattr(harness, "machine", lambda: {"cpu_count": 0})
    rows = ["tiny llama: magnitude", "smollm2-135m: sparsegpt --streaming"]
    argv = ["memory_estimate", "--only", *rows, "--results-dir", str(tmp_path)]
    assert sweep.main([*argv, "--work", str(tmp_path / "w")]) == 0

    assert ran.count("tiny checkpoints") == 1 and len(ran) == 3
    md = (tmp_path / "memory_estimate.md").read_text()
    line = "| sparsegpt --streaming | 1284 | 321 | 4.00 | **no** | model weights 3, tokenizing a "
    assert line + "corpus 1 | 12 |" in md
    assert "| magnitude | 4.00 ✗ |" in md  # the tiny llama's cell of the grid
    assert "Outside the factor: smollm2-135m: sparsegpt --streaming, tiny llama: magnitude." in md


def test_the_memory_estimate_table_states_the_library_factor():
    from lmcompress.compressor.model.budget import ESTIMATE_FACTOR

    assert load_table("memory_estimate").settings["factor"] == ESTIMATE_FACTOR


def test_a_peer_row_runs_run_peer_in_its_venv_and_scores_its_output(tmp_path, monkeypatch):
    shutil.copy(RESULTS_DIR / "pruning.json", tmp_path)
    ran = []

    def result(job):
        command = [str(part) for part in job.command]
        ran.append(job.name)
        if job.name.startswith("eval "):
            ppl = {"perplexity": 70.0, "tokens": 32704}
            return {"perplexity": {"wiki-test": ppl, "lee": ppl}}
        assert command[1:3] == ["-m", "benchmarks.peers.run_peer"]
        options = dict(zip(command[3::2], command[4::2], strict=True))
        assert options == {
            "--method": "sparsegpt", "--sparsity": "2:4", "--out": options["--out"],
            "--venv": str(tmp_path / "venv"), "--model": "smollm2-135m", "--nsamples": "128",
            "--seq-len": "512", "--seed": "0", "--calib": "wiki-calib",
        }  # fmt: skip
        return {"wall_seconds": 100.04, "peak_rss_mb": 2000.06}

    monkeypatch.setattr(sweep, "run_job", _canned(result))
    monkeypatch.setattr(harness, "machine", lambda: {"cpu_count": 0})
    argv = ["pruning", "--only", "llm-compressor:sparsegpt:2:4", "--results-dir", str(tmp_path)]
    argv += ["--peer-venv", str(tmp_path / "venv"), "--work", str(tmp_path / "w")]
    assert sweep.main(argv) == 0

    assert ran == ["llm-compressor:sparsegpt:2:4", "eval llm-compressor:sparsegpt:2:4"]
    md = (tmp_path / "pruning.md").read_text()
    assert "| sparsegpt | 2:4 | llm-compressor | 70.00 | 70.00 | 100.0 | 2000.1 | - | - | - |" in md
    assert "| sparsegpt | 2:4 | lmcompress | 65.76 | 131.29 | 321.9 | 1667.1 | 0.939 |" in md


def test_merge_joins_rows_run_side_by_side_into_the_results_file(tmp_path):
    shutil.copy(RESULTS_DIR / "magnitude.json", tmp_path)
    side = tmp_path / "side"
    side.mkdir()
    ppl = {"perplexity": 7.0, "tokens": 64}
    row = {"name": "magnitude 4:8", "ppl": {"wiki-test": ppl, "lee": ppl}, "wall_seconds": 1.0}
    (side / "magnitude.json").write_text(json.dumps({"machine": {"x": 1}, "results": [row]}))
    assert sweep.main(["magnitude", "--merge", str(side), "--results-dir", str(tmp_path)]) == 0
    names = [r["name"] for r in json.loads((tmp_path / "magnitude.json").read_text())["results"]]
    assert names == ["dense", "magnitude 2:4", "magnitude 4:8", "magnitude 50%"]
    assert "| magnitude 4:8 | 7.00 | 7.00 | 1.0 | - |" in (tmp_path / "magnitude.md").read_text()


def test_a_recipe_row_of_stages_records_and_draws_each_stage(tmp_path):
    """record_of keeps each stage's scores; stage_rows draws every stage but the last."""
    ppl = {"wiki-test": {"perplexity": 70.0}, "lee": {"perplexity": 140.0}}
    after = {"wiki-test": {"perplexity": 68.0}, "lee": {"perplexity": 139.0}}
    manifest = {
        "results": {
            "compressed": ppl,
            "dense": {"wiki-test": {"perplexity": 18.0}, "lee": {"perplexity": 29.0}},
            "stages": [
                {"method": "sparsegpt", "compressed": after, "seconds": 3.14},
                {"method": "int8", "compressed": ppl, "seconds": 1.0},
            ],
        },
        "report": {"summary": {"bytes_compressed": 2**20, "bytes_dense": 2**22}},
        "compressed_layers": {"a": {"format": "nm_packed_int8"}},
    }
    (tmp_path / "compressed.safetensors").write_bytes(b"x" * 2**19)
    row = {"name": "two stages", "wall_seconds": 5.0, "peak_rss_mb": 6.0}
    row.update(sweep.record_of(manifest, tmp_path))
    assert row["stages"][0] == {"method": "sparsegpt", "ppl": after, "seconds": 3.1}
    payload = {"settings": {"eval_tokens": 64}, "results": [row]}
    md = sweep.render(load_table("recipes"), payload)
    assert "(dense: wiki-test 18.000, lee 29.000)" in md
    assert (
        "| two stages | nm_packed_int8 | 70.000 | 140.000 | 1.0 | 0.2500 | 0.5 | 5.0 | 6.0 |" in md
    )
    assert "| ↳ after stage 1 (sparsegpt) |  | 68.000 | 139.000 |  |  |  |  |  |" in md
