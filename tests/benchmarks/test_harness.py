"""The loop of every benchmark (benchmarks/harness.py) on a toy table: rows merged in the table's
order, a failed job costs only its row (exit 1), the host is recorded, a smoke run never writes
into benchmarks/results; and the host record itself (lmcompress/evaluation/host.py)."""

import argparse
import json
import shutil

import pytest

from benchmarks import harness
from benchmarks.harness import Table, add_harness_args, row_table, run_table
from benchmarks.render import RESULTS_DIR, markdown_table
from benchmarks.runner import machine
from lmcompress.evaluation.host import ISA_FLAGS, cpu_info

HOST = {"cpu_model": "test CPU", "torch_threads": 3}


def _render(payload):
    return markdown_table(["job", "value"], [[r["name"], r["value"]] for r in payload["results"]])


def _parser(smoke=False):
    parser = argparse.ArgumentParser()
    add_harness_args(parser, "rerun these")
    if smoke:
        parser.add_argument("--smoke", action="store_true")
    return parser


@pytest.fixture(autouse=True)
def _host(monkeypatch):
    monkeypatch.setattr(harness, "machine", lambda: dict(HOST))


def _table(ran, fail=()):
    def run(name, args):
        ran.append(name)
        assert args.work.is_dir()
        if name in fail:
            raise RuntimeError(f"{name} broke")
        return {"name": name, "value": len(ran)}

    def record(_args, rows):
        return {"results": rows}

    return row_table("toy", _render, ["a", "b", "c"], run, record)


def test_rows_are_written_with_the_host_and_only_merges_in_table_order(tmp_path):
    ran = []
    parser = _parser()
    argv = ["--results-dir", str(tmp_path), "--work", str(tmp_path / "work")]
    assert run_table(_table(ran), parser.parse_args(argv), parser) == 0
    first = json.loads((tmp_path / "toy.json").read_text())
    assert ran == ["a", "b", "c"] and first["machine"] == HOST
    assert [r["value"] for r in first["results"]] == [1, 2, 3]

    ran.clear()
    assert run_table(_table(ran), parser.parse_args([*argv, "--only", "c", "a"]), parser) == 0
    again = json.loads((tmp_path / "toy.json").read_text())
    assert ran == ["a", "c"]  # the table's order, not the command line's
    assert [(r["name"], r["value"]) for r in again["results"]] == [("a", 1), ("b", 2), ("c", 2)]
    assert (tmp_path / "toy.md").read_text() == _render(again)


def test_a_failed_job_costs_its_row_only_and_the_exit_status(tmp_path):
    ran = []
    parser = _parser()
    args = parser.parse_args(["--results-dir", str(tmp_path)])
    assert run_table(_table(ran, fail=("b",)), args, parser) == 1
    written = json.loads((tmp_path / "toy.json").read_text())
    assert ran == ["a", "b", "c"]
    assert [r["name"] for r in written["results"]] == ["a", "c"]
    assert args.work.is_dir()  # the logs of the failed job are kept
    shutil.rmtree(args.work)


def test_a_smoke_run_writes_to_a_scratch_directory():
    def measure(args, names, previous):
        assert args.smoke and names == [] and previous == {}
        yield {"results": [{"name": "x", "value": 1}]}

    parser = _parser(smoke=True)
    args = parser.parse_args(["--smoke"])
    before = sorted(RESULTS_DIR.iterdir())
    try:
        assert run_table(Table("toy-smoke", _render, measure), args, parser) == 0
        assert args.results_dir != RESULTS_DIR
        assert json.loads((args.results_dir / "toy-smoke.json").read_text())["machine"] == HOST
    finally:
        shutil.rmtree(args.results_dir, ignore_errors=True)
        shutil.rmtree(args.work, ignore_errors=True)
    assert sorted(RESULTS_DIR.iterdir()) == before


def test_render_only_runs_nothing(tmp_path):
    (tmp_path / "toy.json").write_text(json.dumps({"results": [{"name": "a", "value": 7}]}))
    ran = []
    parser = _parser()
    args = parser.parse_args(["--render-only", "--results-dir", str(tmp_path)])
    assert run_table(_table(ran), args, parser) == 0
    assert (
        ran == [] and (tmp_path / "toy.md").read_text() == "| job | value |\n|---|---|\n| a | 7 |\n"
    )


def test_cpu_info_reads_the_model_and_the_isa_flags():
    text = (
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
        "flags\t\t: fpu avx2 avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n\n"
        "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n"
    )
    assert cpu_info(text) == {
        "cpu_model": "Intel(R) Xeon(R) Platinum 8480+",
        "isa": ["amx_int8", "amx_bf16", "avx512_vnni", "avx2"],
    }
    assert cpu_info("") == {"cpu_model": None, "isa": []}


def test_machine_records_the_cpu_threads_and_versions():
    host = machine()  # in a process of its own
    assert set(host["isa"] or ()) <= set(ISA_FLAGS)
    assert host["torch_threads"] >= 1 and host["torch"] and host["cpu_count"] >= 1
    assert {"cpu_model", "omp_num_threads", "torch_cpu_capability", "transformers"} <= set(host)


def test_a_row_merged_from_another_host_keeps_that_host(tmp_path):
    other_host = {"cpu_model": "other CPU", "torch_threads": 1}
    for name, host, row in [("main", HOST, "a"), ("same", HOST, "b"), ("other", other_host, "c")]:
        (tmp_path / name).mkdir()
        payload = {"machine": host, "results": [{"name": row, "value": 1}]}
        (tmp_path / name / "toy.json").write_text(json.dumps(payload))
    harness.merge_results(tmp_path / "main", [tmp_path / "same", tmp_path / "other"], "toy",
                          ["a", "b", "c"], lambda _d: {"results": []}, _render)  # fmt: skip
    merged = json.loads((tmp_path / "main" / "toy.json").read_text())
    assert merged["machine"] == HOST
    assert [r["name"] for r in merged["results"]] == ["a", "b", "c"]
    assert [r.get("machine") for r in merged["results"]] == [None, None, other_host]
