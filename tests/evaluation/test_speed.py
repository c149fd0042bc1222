"""The speed bench on tiny models: what it records, the CLI command and its one-line errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import count_calls, make_tiny_model

from lmcompress import MagnitudeConfig, compress, save_compressed
from lmcompress.cli.main import main
from lmcompress.compressor.io.speed_report import SPEED_JSON, SPEED_MD, SPEED_PNG
from lmcompress.compressor.lean_decode import LeanDecoder
from lmcompress.errors import ConfigError
from lmcompress.evaluation.speed import (
    SpeedOptions,
    bench,
    bytes_read_per_token,
    compile_limits,
    parse_prefill,
    weight_bytes,
)

FAST = SpeedOptions(prefill=(2, 16), decode=3, prompt=4, repeats=2, warmup=1)


@pytest.fixture
def export(tmp_path, tiny_tokenizer):
    model = make_tiny_model("llama")
    report = compress(model, MagnitudeConfig(sparsity="2:4"))
    save_compressed(model, tmp_path / "out24", report, tokenizer=tiny_tokenizer)
    return tmp_path / "out24"


def test_weight_bytes_count_each_storage_once():
    model = make_tiny_model("llama")  # tied embeddings: the head reads the whole table
    params = {p.untyped_storage().data_ptr(): p.nbytes for p in model.parameters()}
    buffers = sum(b.nbytes for b in model.buffers())
    assert weight_bytes(model) == sum(params.values()) + buffers
    assert bytes_read_per_token(model) == weight_bytes(model)
    untied = make_tiny_model("mistral")  # a lookup reads one row of an untied embedding
    table = untied.get_input_embeddings().weight.nbytes
    assert bytes_read_per_token(untied) == weight_bytes(untied) - table
    from lmcompress import Int8Config

    compress(model, Int8Config(head="int8"))  # the head's own int8 codes: the table is read once
    table = model.get_input_embeddings().weight.nbytes
    assert bytes_read_per_token(model) == weight_bytes(model) - table


def test_bench_records_every_row_against_the_best_dense_one(tiny_checkpoint, export):
    record = bench(str(tiny_checkpoint), [export], FAST)
    names = [row["name"] for row in record["rows"]]
    assert names == ["dense float32", "dense bfloat16", "out24"]
    dense = record["rows"][:2]
    for key in ("prefill_vs_best_dense", "decode_vs_best_dense"):
        assert max(row[key] for row in dense) == pytest.approx(1.0)
    for row in record["rows"]:
        assert len(row["rounds"]["prefill_s"]) == FAST.repeats  # warm-up left out
        assert row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0
        limit = record["bandwidth_bytes_per_s"] / row["bytes_per_token"]
        assert row["decode_fraction_of_limit"] == pytest.approx(row["decode_tokens_per_s"] / limit)
    assert record["rows"][2]["weight_bytes"] < record["rows"][0]["weight_bytes"]  # packed 2:4
    assert record["rows"][1]["dtype"] == "bfloat16" and record["host"]["torch"] == torch.__version__


def test_lean_rows_decode_through_the_lean_step_against_the_best_lean_dense_row(
    tiny_checkpoint, export, monkeypatch
):
    steps = count_calls(monkeypatch, LeanDecoder, "step")
    options = dataclasses.replace(FAST, dense_dtypes=("float32",), lean=True)
    record = bench(str(tiny_checkpoint), [export], options)
    names = [row["name"] for row in record["rows"]]
    assert names == ["dense float32", "dense float32 lean", "out24", "out24 lean"]
    rows = {row["name"]: row for row in record["rows"]}
    assert [rows[n]["lean"] for n in names] == [False, True, False, True]
    for name in ("dense float32", "dense float32 lean"):  # each the best of its own kind
        assert rows[name]["decode_vs_best_dense"] == pytest.approx(1.0)
    lean_dense = rows["dense float32 lean"]["decode_tokens_per_s"]
    ratio = rows["out24 lean"]["decode_tokens_per_s"] / lean_dense
    assert rows["out24 lean"]["decode_vs_best_dense"] == pytest.approx(ratio)
    rounds = options.warmup + options.repeats
    assert steps["n"] == 2 * rounds * options.decode  # every decode step of both lean rows


def test_plain_rows_load_a_smaller_dense_model_in_each_dtype(tiny_checkpoint, tmp_path):
    """``--plain``: a structured export, loaded by transformers, in every dense dtype; its
    bytes are the smaller model's, its modules plain linears."""
    from lmcompress.methods.structured import StructuredConfig

    model = make_tiny_model("llama")
    report = compress(model, StructuredConfig(ratio=0.6, score="magnitude"))
    save_compressed(model, tmp_path / "width", report)
    options = dataclasses.replace(FAST, plain=True)
    record = bench(str(tiny_checkpoint), [tmp_path / "width"], options)
    rows = {row["name"]: row for row in record["rows"]}
    assert list(rows) == ["dense float32", "dense bfloat16", "width float32", "width bfloat16"]
    assert rows["width bfloat16"]["dtype"] == "bfloat16"
    for dtype in ("float32", "bfloat16"):
        assert rows[f"width {dtype}"]["weight_bytes"] < rows[f"dense {dtype}"]["weight_bytes"]


def test_cli_bench_writes_and_prints(tiny_checkpoint, export, tmp_path, capsys):
    out = tmp_path / "speed"
    argv = ["bench", str(tiny_checkpoint), str(export), "--prefill", "2x16", "--decode", "2"]
    argv += ["--prompt", "4", "--repeats", "1", "--warmup", "0", "-o", str(out), "-q"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| out24 |" in printed and "× best dense" in printed
    assert {p.name for p in out.iterdir()} == {SPEED_JSON, SPEED_MD, SPEED_PNG}
    assert json.loads((out / SPEED_JSON).read_text())["rows"][2]["name"] == "out24"


def test_compress_with_bench_adds_the_table_to_the_export(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [str(tiny_checkpoint), "--method", "magnitude", "--sparsity", "2:4", "--eval"]
    argv += ["--seq-len", "32"]
    assert main([*argv, "--bench", "-o", str(out), "-q"]) == 0
    printed = capsys.readouterr().out
    assert "| out | float32 |" in printed and "| dense bfloat16 |" in printed
    card = (out / "README.md").read_text()
    assert "## Speed" in card and "| out | float32 |" in card
    rows = json.loads((out / "compression.json").read_text())["results"]["speed"]["rows"]
    assert [r["name"] for r in rows] == ["dense float32", "dense bfloat16", "out"]
    assert json.loads((out / SPEED_JSON).read_text())["rows"] == rows
    assert (out / SPEED_PNG).stat().st_size > 0 and (out / SPEED_MD).is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left


def test_compress_bench_needs_an_output(tiny_checkpoint, capsys):
    assert main([str(tiny_checkpoint), "--method", "magnitude", "--bench", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--bench times the saved export: add -o OUT" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prefill", "4y256"], "BATCHxTOKENS"),
        (["--decode", "0"], "decode must be at least 1"),
        (["nowhere"], "not an lmcompress output directory"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),  # issue 39: tracebacks
        (["--threads", "-1"], "--threads must be at least 1, got -1"),
        (["--threads", "2", "--threads", "4"], "--threads is given twice: give it once"),
    ],
)
def test_cli_bench_bad_input_is_one_line(tiny_checkpoint, extra, message, capsys):
    assert main(["bench", str(tiny_checkpoint), *extra, "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_parse_prefill():
    assert parse_prefill("4x256") == (4, 256)
    with pytest.raises(ConfigError):
        parse_prefill("4x")


def test_expanded_runtime_rows_compute_the_same_and_hold_more(tiny_checkpoint, tmp_path):
    from lmcompress import Int8Config, RunOptions, run
    from lmcompress.compressor.formats.int8 import QuantLinear
    from lmcompress.compressor.formats.nm_packed_int8 import PackedNMInt8Linear
    from lmcompress.compressor.io.load import load_compressed

    options = RunOptions(checkpoint=str(tiny_checkpoint), eval=(), seq_len=32)
    configs = [MagnitudeConfig(sparsity="2:4"), Int8Config()]  # composed: nm_packed_int8
    run(dataclasses.replace(options, output=str(tmp_path / "both")), configs)
    packed = load_compressed(tmp_path / "both", "packed")[0]
    expanded = load_compressed(tmp_path / "both", "expanded")[0]
    assert any(isinstance(m, PackedNMInt8Linear) for m in packed.modules())
    assert not any(isinstance(m, PackedNMInt8Linear) for m in expanded.modules())
    assert any(isinstance(m, QuantLinear) for m in expanded.modules())
    ids = torch.randint(3, 200, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(expanded(ids).logits, packed(ids).logits, rtol=0, atol=0)
    assert weight_bytes(expanded) > weight_bytes(packed)
    options = dataclasses.replace(FAST, runtimes=("packed", "expanded"))
    record = bench(str(tiny_checkpoint), [tmp_path / "both"], options)
    rows = {r["name"]: r for r in record["rows"]}
    assert rows["both (expanded)"]["weight_bytes"] > rows["both"]["weight_bytes"]
    with pytest.raises(ConfigError, match="runtimes must be some of"):
        SpeedOptions(runtimes=("fast",))


def test_a_compiled_row_past_the_recompile_limit_is_an_error_not_an_eager_row():
    """Past dynamo's recompile limit a compiled function silently runs eager (a first compiled
    bench had its later rows timed that way); under bench's limits it raises instead."""
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        torch._dynamo.reset()
        with compile_limits(0), pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            for size in range(1, 5):  # a new shape: a new graph
                double(torch.ones(size))
        torch._dynamo.reset()
        with compile_limits(1):  # 4 graphs a compiled row
            for size in range(1, 5):
                double(torch.ones(size))
    torch._dynamo.reset()
