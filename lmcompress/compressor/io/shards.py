"""Safetensors I/O in one place: every lmcompress reader and writer of ``*.safetensors`` goes
through here.

- :func:`open_safetensors`: ``safe_open`` whose failures (missing, truncated, not safetensors)
  are one-line :class:`ModelLoadError` s;
- :class:`TensorFiles`: where each tensor of a checkpoint directory (``model.safetensors`` or
  its shards) or of a list of files is stored, and reads by key, memory-mapped or not
  (:func:`read_unmapped`: straight into the tensors, for streaming);
- :func:`merge_safetensors`: concatenate files without loading them;
- :func:`cast_tensor` / :func:`cast_state`: what a tensor becomes when it is written;
- :func:`check_weight_shapes`: a checkpoint's headers against the shapes its config builds;
- :data:`SAFETENSORS_DTYPES`: the header dtype names.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from lmcompress.compressor.io.layout import DENSE_TENSORS
from lmcompress.errors import ModelLoadError, first_line

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


@contextlib.contextmanager
def open_safetensors(path: str | Path, device: str | torch.device = "cpu") -> Iterator[Any]:
    """``safe_open(path)``; a missing, truncated or foreign file is a one-line
    :class:`ModelLoadError`."""
    try:
        handle = safe_open(str(path), framework="pt", device=str(device))
        opened = handle.__enter__()
    except (SafetensorError, OSError) as err:
        raise ModelLoadError(f"cannot read {path}: {first_line(err)}") from None
    try:
        yield opened
    finally:
        handle.__exit__(None, None, None)


def read_safetensors(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of one file, and its header metadata (``{}`` if none); one-line errors."""
    with open_safetensors(path, device) as f:
        return {key: f.get_tensor(key) for key in f.keys()}, f.metadata() or {}


class TensorFiles:
    """Where each tensor is stored (``key -> (file, stored name)``), and reads by key.

    Keys are the model's names; ``stored`` names may differ (``save_pretrained`` writes some
    families' keys in their original checkpoint names, which a ``rename`` maps back). Build one
    with :meth:`of_checkpoint` (a directory's ``model.safetensors`` or its shards) or
    :meth:`of_files` (every key of some files, with shapes and dtypes from their headers).
    """

    def __init__(
        self,
        files: dict[str, tuple[Path, str]],
        device: str | torch.device = "cpu",
        missing: str = "{key} is missing from " + DENSE_TENSORS,
    ) -> None:
        self.files, self.device, self.missing = files, torch.device(device), missing
        self.headers: dict[str, tuple[list[int], torch.dtype]] = {}

    @classmethod
    def of_checkpoint(
        cls,
        directory: Path,
        device: str | torch.device = "cpu",
        rename: Callable[[str], str] = str,
    ) -> TensorFiles:
        """The tensors of ``directory/model.safetensors`` or of the shards its index names
        (none if it has neither), under ``rename(stored key)``."""
        index = directory / f"{DENSE_TENSORS}.index.json"
        try:
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                files = {key: directory / file for key, file in weight_map.items()}
            elif (directory / DENSE_TENSORS).is_file():
                with open_safetensors(directory / DENSE_TENSORS, device) as f:
                    files = dict.fromkeys(f.keys(), directory / DENSE_TENSORS)
            else:
                files = {}
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise ModelLoadError(f"{index}: malformed index ({err})") from None
        return cls({rename(key): (path, key) for key, path in files.items()}, device)

    @classmethod
    def of_files(
        cls, paths: Iterable[str | Path], device: str | torch.device = "cpu"
    ) -> TensorFiles:
        """Every tensor of ``paths`` with its shape and dtype (headers only); a dtype
        lmcompress does not write is refused."""
        found = cls({}, device, missing="{key} is stored in none of the checkpoint files")
        for path in paths:
            with open_safetensors(path) as f:
                for key in f.keys():
                    piece = f.get_slice(key)
                    stored = piece.get_dtype()
                    if stored not in SAFETENSORS_DTYPES:
                        raise ModelLoadError(f"{path}: {key} has unsupported dtype {stored}")
                    found.files[key] = (Path(path), key)
                    found.headers[key] = (piece.get_shape(), SAFETENSORS_DTYPES[stored])
        return found

    def header(self, key: str) -> tuple[list[int], torch.dtype]:
        """``(shape, dtype)`` of ``key`` as stored (:meth:`of_files` only)."""
        if key not in self.headers:
            raise ModelLoadError(self.missing.format(key=key))
        return self.headers[key]

    def get(self, key: str, device: str | torch.device | None = None) -> torch.Tensor:
        if key not in self.files:
            raise ModelLoadError(self.missing.format(key=key))
        return self.read([key], device=device)[key]

    def read(
        self,
        keys: Iterable[str],
        mmap: bool = True,
        device: str | torch.device | None = None,
    ) -> dict[str, torch.Tensor]:
        """The stored tensors among ``keys`` (others are skipped), each file opened once, onto
        ``device`` (default: this reader's); ``mmap=False`` reads them without a memory map
        (:func:`read_unmapped`, CPU)."""
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for key in keys:
            if key in self.files:
                path, stored = self.files[key]
                by_file.setdefault(path, []).append((key, stored))
        tensors = {}
        for path, pairs in by_file.items():
            if mmap:
                with open_safetensors(path, device or self.device) as f:
                    tensors.update({key: f.get_tensor(stored) for key, stored in pairs})
            else:
                found = read_unmapped(path, [stored for _, stored in pairs])
                tensors.update({key: found[stored] for key, stored in pairs})
        return tensors


def read_unmapped(path: Path, keys: list[str]) -> dict[str, torch.Tensor]:
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


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` with every tensor through :func:`cast_tensor`; tied weights (one storage
    under several keys) stay one tensor, so ``save_pretrained`` stores them once."""
    cast: dict[tuple, torch.Tensor] = {}
    out = {}
    for key, value in state.items():
        view = (value.untyped_storage().data_ptr(), value.storage_offset(), value.shape)
        if view not in cast:
            cast[view] = cast_tensor(value, dtype)
        out[key] = cast[view]
    return out


def cast_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """On the CPU, in ``dtype`` if floating point (integer codes keep theirs); no copy when
    nothing changes."""
    target = dtype if tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(device="cpu", dtype=target).contiguous()


def check_weight_shapes(checkpoint: str, skeleton: nn.Module) -> None:
    """A local checkpoint directory's safetensors hold the shapes its ``config.json`` builds:
    a one-line :class:`ModelLoadError` naming the first weight that disagrees (and how many
    do), before ``from_pretrained`` would print its load report. Reads the headers only."""
    directory = Path(checkpoint).expanduser()
    if not directory.is_dir():
        return
    expected = {key: tuple(t.shape) for key, t in skeleton.state_dict().items()}
    wrong = []
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with open_safetensors(file) as handle:
                for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    shape = tuple(handle.get_slice(key).get_shape())
                    if key in expected and shape != expected[key]:
                        wrong.append((key, shape, expected[key]))
        except ModelLoadError as err:  # a truncated or foreign file: its header says so
            raise ModelLoadError(f"{checkpoint}: corrupt or unreadable weights: {err}") from None
    if wrong:
        key, found, built = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise ModelLoadError(
            f"{checkpoint}: config.json disagrees with the weights: {key} is {list(found)} in "
            f"the safetensors but {list(built)} by config.json{more}; fix config.json or "
            "use the checkpoint it belongs to"
        )
