"""The GPU kernel benchmark (benchmarks/kernels.py), run as ``--smoke``: tiny shapes on CPU tensors
in Triton's interpreter (conftest.py selects it), so that the script is known to work before a
GPU runs it. Its table from a canned GPU payload; without a GPU only ``--smoke`` runs."""

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import kernels
from benchmarks.runner import ROOT

pytest.importorskip("triton")


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is here: --smoke runs on it, not in the interpreter"
)
def test_smoke_run_writes_json_md_png_and_checks_the_kernel(tmp_path):
    pytest.importorskip("matplotlib")
    assert kernels.main(["--smoke", "--results-dir", str(tmp_path)]) == 0

    payload = json.loads((tmp_path / "kernels.json").read_text())
    assert payload["settings"]["smoke"] and payload["machine"]["device"] == "cpu"
    rows = payload["rows"]
    shapes = [s for projections in kernels.SMOKE_SHAPES.values() for s in projections.values()]
    assert len(rows) == 2 * len(shapes) * len(kernels.SMOKE_TOKENS)  # fp16 and fp32
    assert {r["tokens"] for r in rows} == set(kernels.SMOKE_TOKENS)
    for r in rows:
        assert r["max_rel_err"] < (1e-3 if r["dtype"] == "fp16" else 1e-5), r
        assert r["dense"]["seconds"] > 0 and r["ours"]["seconds"] > 0
        assert "cusparselt" not in r and r["cusparselt_error"]  # no CUDA here
    e2e = payload["end_to_end"]
    assert e2e["packed"]["weight_bytes"] < e2e["dense"]["weight_bytes"]
    assert e2e["packed"]["decode_tokens_per_second"] > 0 < e2e["dense"]["decode_tokens_per_second"]

    md = (tmp_path / "kernels.md").read_text()
    assert md == kernels.render(payload) and "**Smoke run**" in md
    assert "| dense |" in md and "| packed |" in md
    png = (tmp_path / "kernels_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    (tmp_path / "kernels.md").unlink()
    assert kernels.main(["--render-only", "--results-dir", str(tmp_path)]) == 0
    assert (tmp_path / "kernels.md").read_text() == md
    assert (tmp_path / "kernels_curves.png").read_bytes() == png

    # --only reruns one model in one dtype; the other rows and the decode table are kept
    argv = ["--smoke", "--only", "tiny", "--dtypes", "fp16", "--no-e2e"]
    assert kernels.main([*argv, "--results-dir", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "kernels.json").read_text())
    assert [(r["dtype"], r["tokens"]) for r in again["rows"]] == [
        (r["dtype"], r["tokens"]) for r in rows
    ]
    assert [r for r in again["rows"] if r["dtype"] == "fp32"] == [
        r for r in rows if r["dtype"] == "fp32"
    ]
    assert again["end_to_end"] == e2e


def _cell(ms, tflops=100.0, gbps=1000.0):
    return {"seconds": ms / 1e3, "tflops": tflops, "gbps": gbps}


def test_render_of_a_gpu_payload():
    label = {"dtype": "fp16", "model": "Llama-2-7B", "projection": "q/k/v/o"}
    shape = {"out": 4096, "in": 4096, "max_rel_err": 2e-4}
    payload = {
        "settings": {"smoke": False},
        "machine": {"device": "cuda", "gpu": "H200", "sms": 132, "cuda": "12.8"}
        | {"torch": "2.9.0", "triton": "3.5.0"},
        "rows": [
            {**label, **shape, "tokens": 1, "dense": _cell(0.02), "ours": _cell(0.0125)}
            | {"cusparselt_error": "RuntimeError: too few rows"},
            {**label, **shape, "tokens": 2048, "dense": _cell(2.0), "ours": _cell(1.0)}
            | {"cusparselt": _cell(1.25)},
            {**label, **shape, "tokens": 8192, "dense": _cell(8.0), "max_rel_err": None}
            | {"ours_error": "OutOfResources: shared memory"},
            {**label, "dtype": "bf16", "skipped": "time budget"},
        ],
    }
    md = kernels.render(payload)
    assert "on H200 (132 SMs), CUDA 12.8" in md and "Smoke run" not in md
    lines = md.splitlines()
    assert (
        "| fp16 | Llama-2-7B | q/k/v/o | 4096 × 4096 | 2048 | 2.000 | 1.000 | 1.250 | 100.0 | "
        "100.0 | 1000 | 2.00 | 1.60 | 2.0e-04 |" in lines
    )
    assert "| fp16 | Llama-2-7B | q/k/v/o | 4096 × 4096 | 1 | 0.020 | 0.013 | — |" in md
    assert "cuSPARSELt unavailable: RuntimeError: too few rows." in md
    assert "| 8192 | 8.000 | — | — | 100.0 | — | — | — | — | — |" in md
    assert "Failed: fp16 Llama-2-7B q/k/v/o × 8192 tokens, ours: OutOfResources: shared" in md
    assert "Skipped (time budget): bf16 Llama-2-7B q/k/v/o." in md
    assert "End to end" not in md  # no end_to_end entry: no second table


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the full run would start")
def test_without_a_gpu_only_smoke_runs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        kernels.main([])
    assert exit_info.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_smoke_from_the_command_line_sets_the_interpreter_itself(tmp_path):
    """``python -m benchmarks.kernels --smoke`` without TRITON_INTERPRET in the environment (as
    a person types it): the driver sets it before anything imports Triton."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = ["--smoke", "--no-e2e", "--dtypes", "fp32", "--results-dir", str(tmp_path)]
    command = [sys.executable, "-m", "benchmarks.kernels", *argv]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert rows and all(r["max_rel_err"] < 1e-5 for r in rows)
