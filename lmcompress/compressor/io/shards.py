"""Raw safetensors I/O for sharded checkpoints and outputs: reading tensors without a memory
map (:func:`read_tensors`), concatenating files without loading them (:func:`merge_safetensors`),
and the header dtype names (:data:`SAFETENSORS_DTYPES`)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lmcompress.errors import ModelLoadError

# safetensors header dtypes -> torch (those lmcompress writes)
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_tensors(path: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """``keys`` of one safetensors file, each read (``readinto``) straight into its tensor.

    Not through a memory map: the pages of a mapped shard that a tensor is copied from count
    in the process's RSS until the map closes, doubling a block's footprint while it loads;
    read this way they stay in the kernel's page cache, which RSS does not count."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
            tensors = {}
            for key in keys:
                entry = header[key]
                begin, end = entry["data_offsets"]
                tensor = torch.empty(entry["shape"], dtype=SAFETENSORS_DTYPES[entry["dtype"]])
                view = tensor.reshape(-1).view(torch.uint8).numpy()
                if view.nbytes != end - begin:
                    raise ValueError(f"{key}: {end - begin} bytes for {view.nbytes}")
                f.seek(8 + length + begin)
                if f.readinto(memoryview(view)) != view.nbytes:
                    raise ValueError(f"{key} is truncated")
                tensors[key] = tensor
    except (OSError, ValueError, KeyError, struct.error, UnicodeDecodeError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from None
    return tensors


def merge_safetensors(
    parts: Iterable[Path], out: Path, metadata: dict[str, str] | None = None
) -> None:
    """Concatenate safetensors files into one without loading a tensor: the headers are
    merged (offsets shifted) and the data sections copied in order. Keys must be distinct."""
    parts = list(parts)
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    sections: list[tuple[Path, int, int]] = []  # (file, data start, data length)
    offset = 0
    for part in parts:
        with part.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            entries = json.loads(f.read(length))
        entries.pop("__metadata__", None)
        size = max((e["data_offsets"][1] for e in entries.values()), default=0)
        for key, entry in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if key in header:
                raise ValueError(f"{key} is in more than one part")
            begin, end = entry["data_offsets"]
            header[key] = {**entry, "data_offsets": [begin + offset, end + offset]}
        sections.append((part, 8 + length, size))
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with out.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for part, start, size in sections:
            with part.open("rb") as src:
                src.seek(start)
                while size:
                    chunk = src.read(min(size, 16 * 2**20))
                    if not chunk:
                        raise ValueError(f"{part} is truncated")
                    f.write(chunk)
                    size -= len(chunk)
    with safe_open(str(out), framework="pt"):  # the merged header parses
        pass
