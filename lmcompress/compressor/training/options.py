"""What every learned method (MaskLLM, subnetwork extraction) shares about *how* and *where*
it trains.

``TrainingOptions`` is nested in a learned method's config as ``training``, ``LearningScope``
as ``scope`` (their fields stay flat flags and flat recipe keys: ``--steps``, ``--blockwise``,
``{"steps": 100}``); ``compressor.options.flat_option_groups`` lets the config be built with
the same flat keywords (``MaskLLMConfig(steps=8, blockwise=True)``). The trainer's
result-determining hyperparameters (``trainer.TrainConfig``) are derived from
``TrainingOptions`` by ``TrainConfig.from_options``, never copied by hand. :func:`trainable_only`
is how the trainer freezes everything but the trained parameters and gives every flag back
afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from lmcompress.compressor.options import check_choices, check_types
from lmcompress.errors import ConfigError, shown

# Options that change how a run is watched and saved, not what it learns: a resume may change
# them (``checkpoint.options_fingerprint`` leaves them out). ``fsdp`` only lays the same
# training out over processes, and checkpoints hold whole tensors (resumable with any number).
BOOKKEEPING = frozenset({"checkpoint_dir", "checkpoint_every", "resume", "eval_every", "fsdp"})


@dataclass(frozen=True)
class TrainingOptions:
    """Optimiser steps, batches, evaluation, checkpoints and processes of a learned method."""

    steps: int = field(default=100, metadata={"help": "optimiser steps"})
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate (see --schedule)"})
    batch_size: int = field(default=1, metadata={"help": "windows per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per step"})
    warmup_steps: int = field(default=0, metadata={"help": "linear lr warmup before the cosine"})
    optimizer: Literal["adamw", "sgd"] = field(
        default="adamw", metadata={"help": "optimiser of the trained parameters"}
    )
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum (--optimizer sgd)"})
    schedule: Literal["cosine", "constant"] = field(
        default="cosine", metadata={"help": "learning-rate schedule after the warmup"}
    )
    eval_windows: int = field(default=2, metadata={"help": "held-out windows for hard-mask ppl"})
    eval_every: int = field(default=0, metadata={"help": "evaluate every N steps (0: at the end)"})
    checkpoint_dir: str | None = field(
        default=None, metadata={"help": "directory of the training checkpoints"}
    )
    checkpoint_every: int = field(
        default=0, metadata={"help": "checkpoint every N steps (0: never)"}
    )
    resume: bool = field(
        default=False, metadata={"help": "continue from the checkpoint in --checkpoint-dir"}
    )
    train_seed: int = field(default=0, metadata={"help": "seed of data order, init and noise"})
    bf16: bool = field(
        default=False,
        metadata={"help": "bf16 autocast in forward/backward (trained parameters stay fp32)"},
    )
    fsdp: bool = field(
        default=False,
        metadata={
            "help": "under accelerate launch with several processes: shard the trained "
            "parameters, their gradients and AdamW moments over the processes (FSDP2) instead "
            "of replicating them (data parallel)"
        },
    )

    def __post_init__(self) -> None:
        check_types(self)  # before the comparisons below: recipes can hold any type
        check_counts(self, non_negative=("eval_windows", "eval_every", "checkpoint_every"))
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir")


Refit = Literal["none", "sparsegpt"]


@dataclass(frozen=True)
class LearningScope:
    """Where a learned method trains its masks (the whole model at once, or one decoder block
    at a time: ``drivers.learn_end_to_end`` / ``drivers.learn_blockwise``) and what becomes of
    the kept weights afterwards (re-fitted, then block-wise tuned: ``training.tuning``). All
    are beyond the papers; the defaults are the papers'."""

    blockwise: bool = field(
        default=False,
        metadata={
            "help": "learn each decoder block's masks in turn on a local loss (match the dense "
            "model's block outputs), --steps per block"
        },
    )
    refit: Refit = field(
        default="none",
        metadata={
            "help": "re-fit the kept weights under the learned mask (a learned rescaling is "
            "then not folded in)"
        },
    )
    tune_steps: int = field(
        default=0,
        metadata={
            "help": "block-wise: then train each block's kept weights (masks fixed) this many "
            "steps on the block error (0: off)"
        },
    )
    tune_lr: float = field(default=1e-3, metadata={"help": "learning rate of --tune-steps"})

    def __post_init__(self) -> None:
        check_types(self)
        check_choices(self)
        if self.tune_steps < 0 or self.tune_lr <= 0:
            raise ConfigError(
                f"tune_steps must be >= 0 and tune_lr positive, got {shown(self.tune_steps)}, "
                f"{shown(self.tune_lr)}"
            )
        if self.tune_steps and not self.blockwise:
            raise ConfigError("--tune-steps trains block by block: add --blockwise")


def check_counts(options: Any, non_negative: tuple[str, ...] = ()) -> None:
    """The checks every training config shares (``TrainingOptions``, the trainer's
    ``TrainConfig``): steps, batch size and accumulation at least 1, a positive learning rate,
    no negative warmup, plus the ``non_negative`` fields the config names."""
    for name in ("steps", "batch_size", "grad_accum"):
        if getattr(options, name) < 1:
            raise ConfigError(f"{name} must be at least 1, got {shown(getattr(options, name))}")
    if options.lr <= 0:
        raise ConfigError(f"lr must be positive, got {shown(options.lr)}")
    for name in ("warmup_steps", *non_negative):
        if getattr(options, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {shown(getattr(options, name))}")


@contextlib.contextmanager
def trainable_only(model: nn.Module, params: Iterable[torch.Tensor]) -> Iterator[None]:
    """``requires_grad`` on ``params`` only while the block runs (every other parameter of
    ``model`` frozen), then every parameter's flag as it was, also after an error: a model
    that came with frozen parameters leaves training with the same ones frozen."""
    params = list(params)
    before = {id(p): (p, p.requires_grad) for p in [*model.parameters(), *params]}
    try:
        for p, _ in before.values():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        yield
    finally:
        for p, flag in before.values():
            p.requires_grad_(flag)


def check_distill(steps: int, lr: float) -> None:
    """``--distill-steps`` / ``--distill-lr`` of a method that distils (structured, ``subnet
    --structure``, gptq): steps >= 0, a positive lr."""
    if steps < 0 or lr <= 0:
        raise ConfigError(f"distill_steps must be >= 0 and distill_lr positive, got {steps}, {lr}")
