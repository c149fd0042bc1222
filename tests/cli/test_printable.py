"""What a user named (a path with a newline, ANSI escapes, bidi overrides, bytes that are not
UTF-8) reaches the terminal escaped: the one-line error, the log lines and the end summary."""

from __future__ import annotations

import logging
import os

import pytest

from lmcompress.cli.main import main
from lmcompress.cli.summary import describe_output, print_summary
from lmcompress.cli.terminal import PrintableFormatter
from lmcompress.compressor.io.layout import COMPRESSED_TENSORS, MANIFEST, STATS
from lmcompress.compressor.report import CompressionReport, LayerReport
from lmcompress.errors import printable

HOSTILE = "out\n\x1b[2J\x1b[31mred\u202eevil\x07\x7f"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("a\nb", "a\\nb"),
        ("\x1b[31m", "\\x1b[31m"),
        ("tab\there", "tab\\there"),
        ("\u202egnp.exe", "\\u202egnp.exe"),
        ("del\x7f c1\x9b", "del\\x7f c1\\x9b"),
        (os.fsdecode(b"caf\xe9"), "caf\\xe9"),  # Latin-1 bytes, not UTF-8
        (os.fsdecode(b"\x80\xff"), "\\x80\\xff"),  # the first and last such byte
        ("café ünïcode 中文 ✓", "café ünïcode 中文 ✓"),  # printable text is left alone
    ],
)
def test_printable_escapes_what_a_terminal_would_act_on(text, shown):
    assert printable(text) == shown
    printable(text).encode("utf-8")  # always encodable


def _one_line_without_controls(text: str) -> None:
    assert text.endswith("\n") and text.count("\n") == 1, repr(text)
    assert not any(ord(c) < 32 and c != "\n" or 0x7F <= ord(c) <= 0x9F for c in text), repr(text)


def test_the_error_line_escapes_a_hostile_checkpoint_path(tmp_path, capsys):
    missing = tmp_path / HOSTILE
    assert main([str(missing), "--method", "magnitude", "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    _one_line_without_controls(err)
    assert "\\x1b[2J" in err and "\\n" in err


def test_log_lines_escape_their_message():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "saving to %s", (HOSTILE,), None)
    line = PrintableFormatter("%(message)s").format(record)
    assert "\n" not in line and "\x1b" not in line and "\\x1b[31m" in line


def test_the_end_summary_escapes_the_output_path_and_corpus_names(tmp_path, capsys):
    out = tmp_path / "plain"
    out.mkdir()
    (out / MANIFEST).write_text("{}")
    layers = [LayerReport("a", (8, 8), 64, 32, 256, 128, sparsity=0.5)]
    results = {
        "report": CompressionReport("magnitude", {"method": "magnitude"}, layers, 100),
        "checkpoint": HOSTILE,
        "compressed": {HOSTILE: {"perplexity": 3.0, "tokens": 10}},
        "seconds": 1.0,
        "options": {"dtype": "float32"},
        "output": str(out),
    }
    print_summary(results)
    printed = capsys.readouterr().out
    assert "\x1b" not in printed and "\u202e" not in printed
    assert printed.count(printable(HOSTILE)) == 2  # the header and the corpus row


def _sized(path, size: int) -> None:
    path.write_bytes(b"\0" * size)


def test_the_end_line_does_not_count_learned_statistics_as_the_dense_copy(tmp_path):
    """The README's MaskLLM recipe keeps its logits (stats.safetensors, larger than the model):
    they are reported on their own, not inside "dense copy"."""
    _sized(tmp_path / COMPRESSED_TENSORS, 2_000_000)
    _sized(tmp_path / "model.safetensors", 5_000_000)
    _sized(tmp_path / STATS, 7_000_000)
    (tmp_path / MANIFEST).write_text('{"dense_copy": true}')
    line = describe_output(tmp_path)
    assert "dense copy 5.0 MB" in line
    assert "learned statistics 7.0 MB (stats.safetensors" in line
    assert line.startswith("14.0 MB in all")  # the total counts everything


def test_no_statistics_no_mention(tmp_path):
    _sized(tmp_path / COMPRESSED_TENSORS, 2_000_000)
    _sized(tmp_path / "model.safetensors", 5_000_000)
    (tmp_path / MANIFEST).write_text('{"dense_copy": true}')
    assert "statistics" not in describe_output(tmp_path)
