"""Tampered exports: one edit each of a real export's stored tensors, manifests or dense part
(issue 39), shared by the load-check tests (on a tiny model) and ``benchmarks.bad_inputs`` (on
SmolLM2, through ``compress-model eval`` and ``from_pretrained``).

    python -m benchmarks.tamperings NAME EXPORT_DIR    # apply EDITS[NAME] to EXPORT_DIR

The edits need torch (a cast to bfloat16 has no numpy dtype) but importing this module does
not: the bad-inputs driver, which imports no torch, reads the names here and runs the edits in a
process of its own.
"""

from __future__ import annotations

import importlib
import json as _json
import struct
import sys
from pathlib import Path

from lmcompress.compressor.io.layout import COMPRESSED_TENSORS, DENSE_TENSORS, MANIFEST

LAYER = "model.layers.0.mlp.up_proj"  # the layer the edits touch


def _torch():
    return importlib.import_module("torch")


def edit_tensors(path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def cast_tensor(key, dtype: str, file=COMPRESSED_TENSORS):
    """``key`` cast to the torch dtype named ``dtype``."""

    def edit(out):
        edit_tensors(out / file, lambda t: t.update({key: t[key].to(getattr(_torch(), dtype))}))

    return edit


def relabel(key, dtype):
    """The same bytes, another dtype in the safetensors header (same element size)."""

    def edit(out):
        path = out / COMPRESSED_TENSORS
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = _json.loads(raw[8 : 8 + length])
        header[key]["dtype"] = dtype
        text = _json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (length - len(text))
        assert len(text) == length
        path.write_bytes(raw[:8] + text + raw[8 + length :])

    return edit


def edit_json(file, edit):
    def apply(out):
        data = _json.loads((out / file).read_text())
        edit(data)
        (out / file).write_text(_json.dumps(data))

    return apply


def edit_meta(edit):
    return edit_json(MANIFEST, lambda m: edit(m["compressed_layers"][LAYER]["meta"]))


def extra_tensor(listed):
    def edit(out):
        edit_tensors(out / COMPRESSED_TENSORS, lambda t: t.update({f"{LAYER}.scales": t[
            f"{LAYER}.values"].clone()}))  # fmt: skip
        if listed:
            edit_json(
                MANIFEST, lambda m: m["compressed_layers"][LAYER]["tensors"].append("scales")
            )(out)

    return edit


def edit_dense(edit):
    return lambda out: edit_tensors(out / DENSE_TENSORS, edit)


def set_fields(data, **fields):
    data.update(fields)


EDITS = {  # name -> (the export it edits, the edit)
    "2:4 values cast to int32": ("2:4", cast_tensor(f"{LAYER}.values", "int32")),
    "2:4 values relabelled I32": ("2:4", relabel(f"{LAYER}.values", "I32")),
    "int8 weight_scale relabelled I32": ("int8", relabel(f"{LAYER}.weight_scale", "I32")),
    "2:4 values as float16": ("2:4", cast_tensor(f"{LAYER}.values", "float16")),
    "2:4 values as bfloat16": ("2:4", cast_tensor(f"{LAYER}.values", "bfloat16")),
    "2:4 values as float64": ("2:4", cast_tensor(f"{LAYER}.values", "float64")),
    "low-rank A as float16": ("svd", cast_tensor(f"{LAYER}.A", "float16")),
    "low-rank A as int8": ("svd", cast_tensor(f"{LAYER}.A", "int8")),
    "int8 meta.dtype edited": ("int8", edit_meta(lambda m: m.update(dtype="int32"))),
    "low-rank meta.rank removed": ("svd", edit_meta(lambda m: m.pop("rank"))),
    "2:4 meta.n a string": ("2:4", edit_meta(lambda m: m.update(n="2"))),
    "an unlisted tensor": ("2:4", extra_tensor(listed=False)),
    "a listed tensor the format does not know": ("2:4", extra_tensor(listed=True)),
    "report removed": ("2:4", edit_json(MANIFEST, lambda m: m.pop("report"))),
    "report.layers a string": (
        "2:4",
        edit_json(MANIFEST, lambda m: m["report"].update(layers="all")),
    ),
    "a malformed transform entry": (
        "2:4",
        edit_json(MANIFEST, lambda m: set_fields(m, transforms=[{"kind": 3}])),
    ),
    "manifest dtype edited": ("2:4", edit_json(MANIFEST, lambda m: set_fields(m, dtype="int8"))),
    "hidden_size 640": ("2:4", edit_json("config.json", lambda c: set_fields(c, hidden_size=640))),
    "hidden_size not a multiple of the heads": (
        "2:4",
        edit_json(
            "config.json", lambda c: set_fields(c, hidden_size=c["num_attention_heads"] * 8 + 1)
        ),
    ),
    "vocab_size + 1": (
        "2:4",
        edit_json("config.json", lambda c: set_fields(c, vocab_size=c["vocab_size"] + 1)),
    ),
    "num_hidden_layers 1": (
        "2:4",
        edit_json("config.json", lambda c: set_fields(c, num_hidden_layers=1)),
    ),
    "num_hidden_layers + 1": (
        "2:4",
        edit_json(
            "config.json", lambda c: set_fields(c, num_hidden_layers=c["num_hidden_layers"] + 1)
        ),
    ),
    "model.norm.weight shape [33]": (
        "2:4",
        edit_dense(lambda t: t.update({"model.norm.weight": _torch().ones(33)})),
    ),
    "a dense weight NaN": (
        "2:4",
        edit_dense(lambda t: t["model.norm.weight"].view(-1)[1].fill_(float("nan"))),
    ),
    "a dense weight missing": ("2:4", edit_dense(lambda t: t.pop("model.norm.weight"))),
    "a dense weight as float16": (
        "2:4",
        cast_tensor("model.norm.weight", "float16", DENSE_TENSORS),
    ),
    "an extra dense tensor": (
        "2:4",
        edit_dense(lambda t: t.update({"model.extra.weight": _torch().ones(3)})),
    ),
}


COMPACT = {  # a compact export's config.json quantization_config edited: name -> edit
    "quantization_config: one layer missing": lambda qc: qc["compressed_layers"].pop(LAYER),
    "quantization_config: a layer's meta edited": lambda qc: qc["compressed_layers"][LAYER][
        "meta"
    ].update(n=1),
    "quantization_config: transforms edited": lambda qc: qc.update(
        transforms=[{"kind": "int8_softmax", "meta": {}, "tensors": []}]
    ),
    "quantization_config removed": None,
}


def compact_edit(name: str):
    """The export edit of ``COMPACT[name]`` (on config.json)."""
    edit = COMPACT[name]
    if edit is None:
        return edit_json("config.json", lambda c: c.pop("quantization_config"))
    return edit_json("config.json", lambda c: edit(c["quantization_config"]))


def apply(name: str, export: str | Path) -> None:
    """Apply the tampering ``name`` (of :data:`EDITS` or :data:`COMPACT`) to ``export``."""
    export = Path(export)
    if name in EDITS:
        EDITS[name][1](export)
    else:
        compact_edit(name)(export)


if __name__ == "__main__":
    apply(*sys.argv[1:3])
