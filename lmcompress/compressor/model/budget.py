"""Will the job fit? The memory a job will hold at its peak, estimated from the model's shapes
before any weight is read, and checked against what the machine has.

The estimate is a sum of named parts (the model's weights, the calibration activations that
layer-wise methods keep for every window, a method's own state, the evaluation's logits), so
that a refusal can say what to lower. Methods add their parts through
:meth:`lmcompress.compressor.method.Method.memory_estimate`. The estimates aim to be within a
factor of :data:`ESTIMATE_FACTOR` (1.5) of the measured peak RSS, either way
(``benchmarks/results/memory_estimate.md`` compares them for every method, and
``tests/jobs/test_memory_estimate.py`` holds them to it on the tiny models); they exist to
refuse a job that cannot fit (``--nsamples 100000``: ~118 GB of activations for SmolLM2-135M)
in a second instead of after the kernel's OOM killer has starved the machine, not to squeeze
the last gigabyte.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

try:  # where /proc/meminfo is missing (macOS); accelerate depends on it
    import psutil
except ImportError:  # pragma: no cover
    psutil = None

import torch
from torch import nn

from lmcompress.errors import ConfigError

logger = logging.getLogger(__name__)

GiB = 2**30
ESTIMATE_FACTOR = 1.5  # the estimate aims to lie in [peak / 1.5, 1.5 × peak] (measured RSS)
# torch, transformers and the tokenizer, before any tensor: a tiny model's job peaks at 614-650
# MiB in CI (tests/jobs/test_memory_estimate.py), nearly all of it this share
RUNTIME_BYTES = 480 * 2**20


@dataclass
class MemoryEstimate:
    """Bytes by what holds them, and where (``cpu`` or a CUDA device)."""

    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def add(self, parts: dict[str, int]) -> MemoryEstimate:
        for name, nbytes in parts.items():
            self.parts[name] = self.parts.get(name, 0) + int(nbytes)
        return self

    def describe(self) -> str:
        """``"9.1 GiB (calibration activations 8.6 GiB, model weights 0.5 GiB, ...)"``."""
        parts = sorted(self.parts.items(), key=lambda item: -item[1])
        detail = ", ".join(f"{name} {_gib(n)}" for name, n in parts if n >= 2**20)
        return f"{_gib(self.total)} ({detail})"


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f} GiB"


def param_bytes(model: nn.Module, itemsize: int) -> int:
    """Bytes of the model's parameters at ``itemsize`` bytes each (a meta-device skeleton
    counts too: its tensors have shapes but no storage)."""
    return sum(p.numel() for p in model.parameters()) * itemsize


def eval_bytes(model: nn.Module, batch_size: int, seq_len: int, itemsize: int) -> int:
    """Peak of one perplexity batch: the logits and their log-softmax over the vocabulary,
    plus a few hidden-state-sized activations (no gradients)."""
    config = model.config
    vocab, hidden = config.vocab_size, config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    tokens = batch_size * seq_len
    return tokens * (2 * vocab + 4 * hidden + 2 * intermediate) * itemsize


def backward_bytes(
    model: nn.Module, batch_size: int, seq_len: int, itemsize: int, logit_copies: int = 3
) -> int:
    """Activations one forward keeps for backward through every block (hidden, MLP and the
    eager attention matrix per block), plus ``logit_copies`` logit-sized tensors (the logits,
    their log-softmax and its gradient)."""
    config = model.config
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    heads = getattr(config, "num_attention_heads", 1)
    tokens = batch_size * seq_len
    per_block = tokens * (12 * hidden + 4 * intermediate + 2 * heads * seq_len) * itemsize
    logits = tokens * config.vocab_size * itemsize * logit_copies
    return config.num_hidden_layers * per_block + logits


def available_bytes(device: torch.device | str = "cpu") -> tuple[int | None, str]:
    """Memory a new allocation can still get, and where the number comes from:
    ``MemAvailable`` of ``/proc/meminfo`` (or psutil) for the CPU, the free memory the driver
    reports for a CUDA device. ``(None, reason)`` where neither is known."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    if psutil is None:
        return None, "unknown (no /proc/meminfo and no psutil)"
    return int(psutil.virtual_memory().available), "psutil's available memory"


def check_fits(
    estimate: MemoryEstimate, device: torch.device | str = "cpu", force: bool = False
) -> str:
    """Raise a one-line :class:`ConfigError` when ``estimate`` exceeds the available memory
    (unless ``force``: then warn and go on). Returns the line the job logs once every check
    has passed (not before: a later check's error must be the only line)."""
    available, source = available_bytes(device)
    if available is None or estimate.total <= available:
        shown = "unknown" if available is None else _gib(available)
        return f"memory: the job needs about {estimate.describe()}; {shown} available"
    message = (
        f"the job needs about {estimate.describe()} but only {_gib(available)} is available "
        f"({source}); lower --nsamples or --seq-len, or pass --force to try anyway"
    )
    if force:
        logger.warning("%s: going on (--force)", message.split("; lower")[0])
        return f"memory: {message.split('; lower')[0]} (--force)"
    raise ConfigError(message)
