"""The benchmark job runner (benchmarks/runner.py): a process per job, its wall time and peak RSS
from the kernel, its result read back. Jobs here are tiny ``python -c`` programs."""

import json
import sys

import pytest

from benchmarks.runner import STDOUT, Job, JobFailed, json_at_end, run_job, slug


def _python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def test_peak_rss_is_the_jobs_own(tmp_path):
    """A job that touches 300 MiB peaks above it; one that touches nothing stays far below."""
    big = run_job(Job("big", _python("b = b'x' * (300 * 2**20)")), tmp_path)
    small = run_job(Job("small", _python("pass")), tmp_path)
    assert big.peak_rss_mb > 300
    assert small.peak_rss_mb < 60  # not the ~250 MiB of this pytest process
    assert big.returncode == small.returncode == 0


def test_wall_time_covers_the_job(tmp_path):
    run = run_job(Job("sleep", _python("import time; time.sleep(0.6)")), tmp_path)
    assert 0.6 <= run.wall_seconds < 10


def test_reads_a_record_after_log_lines_and_an_indented_document(tmp_path):
    code = "import json; print('loading...'); print('{not json'); print(json.dumps({'a': 1}))"
    assert run_job(Job("line", _python(code), STDOUT), tmp_path).result == {"a": 1}
    code = "import json; print('log'); print(json.dumps({'b': [1, {'c': 2}]}, indent=2))"
    assert run_job(Job("doc", _python(code), STDOUT), tmp_path).result == {"b": [1, {"c": 2}]}


def test_reads_a_file_the_job_writes_and_passes_the_environment(tmp_path):
    target = tmp_path / "result.json"
    code = (
        "import json, os, sys; "
        "env = {k: os.environ.get(k) for k in ('TQDM_DISABLE', 'EXTRA')}; "
        "json.dump(env, open(sys.argv[1], 'w'))"
    )
    job = Job("file", (*_python(code), str(target)), target, env={"EXTRA": "yes"})
    assert run_job(job, tmp_path).result == {"TQDM_DISABLE": "1", "EXTRA": "yes"}


def test_logs_go_to_the_work_directory(tmp_path):
    code = "import sys; print('to stdout'); print('to stderr', file=sys.stderr)"
    run = run_job(Job("lmcompress:wanda:2:4", _python(code)), tmp_path)
    assert run.stdout == tmp_path / "lmcompress-wanda-2-4.out"
    assert run.stdout.read_text() == "to stdout\n"
    assert run.stderr.read_text() == "to stderr\n"
    assert run.result is None


def test_a_failed_job_raises_with_its_log_tail(tmp_path):
    code = "import sys; print('the reason', file=sys.stderr); sys.exit(3)"
    with pytest.raises(JobFailed, match=r"(?s)exit 3.*the reason"):
        run_job(Job("fails", _python(code)), tmp_path)
    # without check the caller decides: the exit status and whatever result there is
    code = "import sys; print('{\"ok\": false}'); sys.exit(1)"
    run = run_job(Job("unchecked", _python(code), STDOUT, check=False), tmp_path)
    assert (run.returncode, run.result) == (1, {"ok": False})


def test_a_missing_result_is_a_failure(tmp_path):
    with pytest.raises(JobFailed, match="no result"):
        run_job(Job("silent", _python("print('no json here')"), STDOUT), tmp_path)
    with pytest.raises(JobFailed, match="no result"):
        run_job(Job("nofile", _python("pass"), tmp_path / "absent.json"), tmp_path)


def test_json_at_end():
    assert json_at_end('x\n{"a": 1}\n') == {"a": 1}
    assert json_at_end(json.dumps({"a": {"b": 1}}, indent=2) + "\n") == {"a": {"b": 1}}
    assert json_at_end("[1, 2]") == [1, 2]
    with pytest.raises(ValueError, match="no JSON"):
        json_at_end('{"a": 1}\ntrailing log line\n')


def test_slug():
    assert slug("2 processes, FSDP") == "2-processes-FSDP"
    assert slug("magnitude 50%") == "magnitude-50"
    assert slug("eval sparsegpt:0.5") == "eval-sparsegpt-0.5"
