"""Inference speed of a dense checkpoint and its compressed exports, side by side in one process.

What a user runs a compressed model for: prefill throughput (a batch of prompts at once),
greedy decoding at batch 1 with a KV cache (one token after another) and the time to the first
token, next to the memory its weights take. Every row is timed in the same process, the rows
interleaved (row A, row B, ..., then again), warm-up rounds excluded, and each number is the
median of the repeats, so that a machine busy with something else slows every row alike.

Decoding one token reads every weight once: at batch 1 the memory bandwidth, not arithmetic,
sets its limit. :func:`measure_bandwidth` times a plain read of a large tensor, and each row's
decode tokens/s is also given as a fraction of ``bandwidth / bytes read per token``.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache, StaticCache

from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.formats.catalog import format_class
from lmcompress.compressor.io.load import RUNTIMES, load_compressed, read_manifest
from lmcompress.compressor.lean_decode import LeanDecoder
from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.model.loading import load_model
from lmcompress.compressor.util.memory import current_rss_mib, peak_rss_mib
from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError, LmcompressError
from lmcompress.evaluation.host import machine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpeedOptions:
    """What to time: ``prefill`` = (batch, tokens) of one forward; ``decode`` new tokens at
    batch 1 after a ``prompt``-token prompt; ``repeats`` timed rounds after ``warmup`` ones."""

    prefill: tuple[int, int] = (4, 256)
    decode: int = 32
    prompt: int = 64
    repeats: int = 3
    warmup: int = 1
    dense_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    device: str = "cpu"
    seed: int = 0
    compile: bool = False  # also time every row under torch.compile (static KV cache)
    runtimes: tuple[str, ...] = ("packed",)  # each export in each (load_compressed's runtimes)
    # each export loaded by plain transformers in each of dense_dtypes instead (a smaller dense
    # model, from structured extraction: what any engine runs)
    plain: bool = False
    # also time every row's decoding through the lean step (compressor/lean_decode.py)
    lean: bool = False

    def __post_init__(self) -> None:
        for name in ("decode", "prompt", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if len(self.prefill) != 2 or min(self.prefill) < 1:
            raise ConfigError(f"prefill must be BATCHxTOKENS with both >= 1, got {self.prefill}")
        if not self.runtimes or not set(self.runtimes) <= set(RUNTIMES):
            raise ConfigError(
                f"runtimes must be some of {', '.join(RUNTIMES)}, got {list(self.runtimes)}"
            )
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")


def parse_prefill(text: str) -> tuple[int, int]:
    """``"4x256"`` -> (4, 256); a one-line :class:`ConfigError` otherwise."""
    batch, sep, tokens = text.lower().partition("x")
    if not sep or not batch.isdigit() or not tokens.isdigit():
        raise ConfigError(f"--prefill takes BATCHxTOKENS (e.g. 4x256), got {text!r}")
    return int(batch), int(tokens)


@dataclass
class Row:
    """One model being timed, and what was measured (seconds per round)."""

    name: str
    model: nn.Module = field(repr=False)
    dtype: str
    weight_bytes: int
    bytes_per_token: int
    load_rss_mib: float
    compiled: bool = False
    lean: bool = False  # decoding through the lean step (LeanDecoder)
    forward: Any = field(default=None, repr=False)  # model.forward, its graph, a LeanDecoder
    compile_s: float | None = None  # the first (compiling) prefill and decode
    prefill_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.forward = self.forward or self.model.forward


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds, each storage once."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in chain(model.parameters(), model.buffers()):
        storage = tensor.untyped_storage()
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def bytes_read_per_token(model: nn.Module) -> int:
    """What decoding one token reads: every weight, except the rows of an input embedding that
    the head does not also use (a lookup reads one row)."""
    total = weight_bytes(model)
    family = family_of(model)
    embedding = model.get_input_embeddings().weight
    head = getattr(model.get_submodule(family.head), "weight", None)  # None: a compressed head
    if head is None or embedding.untyped_storage().data_ptr() != head.untyped_storage().data_ptr():
        total -= embedding.untyped_storage().nbytes()
    return total


def measure_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes per second of a plain read (``sum``) of an ``nbytes`` float32 tensor: the median of
    ``repeats`` after one warm-up."""
    values = torch.ones(nbytes // 4, dtype=torch.float32)
    values.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        values.sum()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_prefill(forward: Any, ids: torch.Tensor) -> float:
    """Seconds of one forward over ``ids`` (B, T), no cache."""
    _sync(ids.device)
    start = time.perf_counter()
    forward(input_ids=ids, use_cache=False)
    _sync(ids.device)
    return time.perf_counter() - start


@torch.inference_mode()
def time_decode(
    row: Row, prompt: torch.Tensor, new_tokens: int, cache: StaticCache | None = None
) -> tuple[float, float]:
    """Greedy decoding at batch 1 with a KV cache: ``(seconds to the first token, seconds of the
    ``new_tokens`` steps after it)``. ``prompt``: (1, T). A compiled row decodes into a
    ``StaticCache`` (fixed shapes: one graph for every step) with explicit positions."""
    device = prompt.device
    if cache is not None:
        cache.reset()
    cache = cache if cache is not None else DynamicCache()
    _sync(device)
    start = time.perf_counter()
    logits = row.model(input_ids=prompt, cache=cache, use_cache=True).logits
    token = logits[:, -1:].argmax(-1)  # (1, 1)
    _sync(device)
    first = time.perf_counter()
    for step in range(new_tokens):
        position = torch.tensor([prompt.shape[1] + step], device=device)
        logits = row.forward(
            input_ids=token, cache=cache, use_cache=True, cache_position=position
        ).logits
        token = logits[:, -1:].argmax(-1)
    _sync(device)
    return first - start, time.perf_counter() - first


def load_rows(checkpoint: str, exports: Sequence[str | Path], options: SpeedOptions) -> list[Row]:
    """The dense model in each of ``options.dense_dtypes``, then each export in each of
    ``options.runtimes`` (``packed``: its compressed runtime; a row of another runtime is named
    ``"NAME (runtime)"``); the RSS each load added."""
    rows = []
    loads = [
        (f"dense {dtype}", lambda d=dtype: load_model(checkpoint, d, options.device)[0], dtype)
        for dtype in options.dense_dtypes
    ]
    for export in exports:
        if options.plain:
            loads += [
                (
                    f"{Path(export).name} {d}",
                    lambda e=export, d=d: load_model(str(e), d, options.device)[0],
                    d,
                )
                for d in options.dense_dtypes
            ]
            continue
        for runtime in options.runtimes:
            if runtime == "expanded" and "packed" in options.runtimes and not _expands(export):
                continue  # the same modules as its packed row
            same = runtime == "expanded" and not _expands(export)  # its packed modules
            name = Path(export).name + ("" if runtime == "packed" or same else f" ({runtime})")
            loads.append(
                (
                    name,
                    lambda e=export, r=runtime: load_compressed(e, r, options.device)[0],
                    "",
                )
            )
    for name, load, dtype in loads:
        before = current_rss_mib()
        model = load().eval()
        dtype = dtype or str(next(model.parameters()).dtype).removeprefix("torch.")
        row = Row(
            name=name,
            model=model,
            dtype=dtype,
            weight_bytes=weight_bytes(model),
            bytes_per_token=bytes_read_per_token(model),
            load_rss_mib=round(current_rss_mib() - before, 1),
        )
        rows.append(row)
        if options.compile:
            forward = torch.compile(model.forward, dynamic=False)
            compiled = {"name": f"{name} compiled", "compiled": True, "forward": forward}
            fresh = {"prefill_s": [], "ttft_s": [], "decode_s": []}  # not the eager row's lists
            rows.append(dataclasses.replace(row, **compiled, **fresh))
        if options.lean:
            rows.extend(_lean_row(row))
    return rows


def _lean_row(row: Row) -> list[Row]:
    """The row decoding through :class:`LeanDecoder`, or none (logged) where its model has
    no lean step."""
    decoder = LeanDecoder(row.model)
    if decoder.unsupported:
        logger.warning("%s: no lean row (%s)", row.name, decoder.unsupported)
        return []
    fresh = {"prefill_s": [], "ttft_s": [], "decode_s": []}
    return [dataclasses.replace(row, name=f"{row.name} lean", lean=True, forward=decoder, **fresh)]


def _expands(export: str | Path) -> bool:
    """Whether ``export``'s expanded runtime differs from its packed one (a format with an
    ``expanded()`` of its own)."""
    formats = {entry["format"] for entry in read_manifest(export)["compressed_layers"].values()}
    return any(format_class(f).expanded is not CompressedLinear.expanded for f in formats)


def bench(
    checkpoint: str, exports: Sequence[str | Path] = (), options: SpeedOptions | None = None
) -> dict[str, Any]:
    """Time ``checkpoint`` (dense, each dtype) and its ``exports`` side by side; returns the
    record :func:`~lmcompress.compressor.io.speed_report.write_speed` renders: host, options,
    bandwidth, and per row medians, ratios to the best dense row and the decode limit."""
    options = options or SpeedOptions()
    device = torch.device(options.device)
    rows = load_rows(checkpoint, exports, options)
    compiled = sum(row.compiled for row in rows)
    try:
        with compile_limits(compiled):
            bandwidth = _time_rows(rows, options, device)
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        raise LmcompressError(
            "torch.compile hit dynamo's recompile limit: a compiled row would have been timed "
            "running eager"
        ) from err
    return _record(rows, options, bandwidth)


def compile_limits(compiled_rows: int):
    """Dynamo's settings for ``compiled_rows`` compiled rows: every one recompiles the same
    forward (its model class's) for its own weights, for prefill and decode shapes, and past
    dynamo's recompile limit (8) later rows would silently run eager. The limits are raised to
    what the rows need, and hitting them anyway is an error, not an eager row timed as a
    compiled one."""
    config = torch._dynamo.config
    return config.patch(
        recompile_limit=max(config.recompile_limit, 4 * compiled_rows),
        accumulated_recompile_limit=max(config.accumulated_recompile_limit, 8 * compiled_rows),
        fail_on_recompile_limit_hit=True,
    )


def _time_rows(rows: list[Row], options: SpeedOptions, device: torch.device) -> float | None:
    """Compile the compiled rows, then time every row in interleaved rounds (their lists
    filled in place); returns the measured memory bandwidth (CPU) or ``None``."""
    vocab = min(getattr(row.model.config, "vocab_size", 256) for row in rows)
    generator = torch.Generator().manual_seed(options.seed)
    batch, tokens = options.prefill
    prefill_ids = torch.randint(3, vocab, (batch, tokens), generator=generator).to(device)
    prompt = torch.randint(3, vocab, (1, options.prompt), generator=generator).to(device)
    bandwidth = measure_bandwidth() if device.type == "cpu" else None
    length = options.prompt + options.decode + 1
    caches = {
        id(row): StaticCache(config=row.model.config, max_cache_len=length)
        for row in rows
        if row.compiled
    }
    for row in rows:  # the compiling calls, apart from the timed rounds
        if row.compiled:
            start = time.perf_counter()
            time_prefill(row.forward, prefill_ids)
            time_decode(row, prompt, 2, caches[id(row)])
            row.compile_s = time.perf_counter() - start
    rounds = options.warmup + options.repeats
    bar = tqdm(total=rounds * len(rows), desc="bench", unit="row", disable=bar_disabled())
    for index in range(rounds):  # interleaved: every row in every round
        for row in rows:
            prefill = time_prefill(row.forward, prefill_ids)
            ttft, decode = time_decode(row, prompt, options.decode, caches.get(id(row)))
            if index >= options.warmup:
                row.prefill_s.append(prefill)
                row.ttft_s.append(ttft)
                row.decode_s.append(decode)
            bar.update()
    bar.close()
    return bandwidth


def _record(rows: list[Row], options: SpeedOptions, bandwidth: float | None) -> dict[str, Any]:
    batch, tokens = options.prefill
    out = []
    for row in rows:
        prefill = batch * tokens / statistics.median(row.prefill_s)
        decode = options.decode / statistics.median(row.decode_s)
        limit = bandwidth / row.bytes_per_token if bandwidth else None
        out.append(
            {
                "name": row.name,
                "dtype": row.dtype,
                "prefill_tokens_per_s": prefill,
                "decode_tokens_per_s": decode,
                "ttft_s": statistics.median(row.ttft_s),
                "weight_bytes": row.weight_bytes,
                "bytes_per_token": row.bytes_per_token,
                "decode_limit_tokens_per_s": limit,
                "decode_fraction_of_limit": decode / limit if limit else None,
                "load_rss_mib": row.load_rss_mib,
                "compiled": row.compiled,
                "lean": row.lean,
                "compile_s": row.compile_s,
                "rounds": {
                    "prefill_s": row.prefill_s,
                    "ttft_s": row.ttft_s,
                    "decode_s": row.decode_s,
                },
            }
        )
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):
        # a compiled row against the best compiled dense one, a lean row the best lean one
        for mode in ((False, False), (True, False), (False, True)):
            same = [r for r in out if (r["compiled"], r["lean"]) == mode]
            best = max((r[key] for r in same if r["name"].startswith("dense ")), default=None)
            for r in same:
                r[key.replace("tokens_per_s", "vs_best_dense")] = r[key] / best if best else None
    return {
        "host": machine(),
        "options": asdict(options),
        "bandwidth_bytes_per_s": bandwidth,
        "peak_rss_mib": peak_rss_mib(),
        "rows": out,
    }
