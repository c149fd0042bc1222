"""The trainer every learned method shares (MaskLLM, subnetwork extraction).

AdamW on the method's own parameters only (mask logits, scales; the model's weights stay
frozen), cosine learning rate with optional warmup, gradient clipping and accumulation,
optional bf16 autocast, periodic evaluation, and checkpoints that make a killed run resume to
exactly the result of an uninterrupted one: the parameters, the optimiser moments, the step,
the data order and the RNG state are saved (as safetensors + JSON; nothing is pickled).

Data is any sequence of examples: token windows (an (N, L) tensor), or whatever the loss
understands (a decoder block's captured inputs, ...). Micro-batch ``k`` of step ``s`` takes
``batch_size`` examples from a seeded permutation, so the data order is a function of the step
alone (what makes resuming exact). While ``fit`` runs only the trained parameters require
gradients; every flag of the model is given back afterwards (``training.trainable_only``).

Runs under ``accelerate`` (``accelerate launch --cpu --num_processes 2 ...``): each process
takes every ``world_size``-th window of a batch; gradients are averaged by the trainer or by
FSDP (``compressor.distributed``); checkpoints hold whole tensors (any number of processes).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from lmcompress.compressor.training import checkpoint
from lmcompress.compressor.training.checkpoint import CHECKPOINT
from lmcompress.compressor.training.distributed import (
    average_gradients,
    barrier,
    full_tensor,
    shard_like,
)
from lmcompress.compressor.training.options import TrainingOptions, check_counts, trainable_only
from lmcompress.compressor.util import memory
from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError

logger = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "constant")


@dataclass(frozen=True)
class TrainConfig:
    """What determines the result of training (a checkpoint resumes only under the same), and
    the bookkeeping fields, :data:`BOOKKEEPING`, which do not (a resume may change them)."""

    steps: int = 100
    lr: float = 2e-4
    batch_size: int = 1  # windows per micro-batch (per process)
    grad_accum: int = 1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # 0: no clipping (the norm is still logged)
    optimizer: str = "adamw"  # or "sgd" (with ``momentum``; the betas are then unused)
    momentum: float = 0.9
    schedule: str = "cosine"  # or "constant" (after the warmup)
    warmup_steps: int = 0
    bf16: bool = False
    seed: int = 0
    # --- bookkeeping ---
    eval_every: int = 0  # 0: only at the end
    checkpoint_every: int = 0  # 0: no checkpoints
    # > 0: glibc serves allocations of at least this many bytes with mmap during training, so
    # freed step temporaries go back to the system (see compressor.memory); 0: malloc's default
    mmap_threshold: int = 0

    def __post_init__(self) -> None:
        check_counts(
            self, non_negative=("eval_every", "checkpoint_every", "mmap_threshold", "grad_clip")
        )
        if self.optimizer not in OPTIMIZERS or self.schedule not in SCHEDULES:
            raise ConfigError(
                f"optimizer must be one of {OPTIMIZERS} and schedule one of {SCHEDULES}, "
                f"got {self.optimizer!r}, {self.schedule!r}"
            )

    def fingerprint(self) -> dict[str, Any]:
        """The fields that decide the result (what a checkpoint must agree with), as JSON."""
        kept = {k: v for k, v in asdict(self).items() if k not in BOOKKEEPING}
        return json.loads(json.dumps(kept))

    @classmethod
    def from_options(cls, options: TrainingOptions, **overrides: Any) -> TrainConfig:
        """The fields ``options`` shares by name, ``seed`` from ``train_seed``, then
        ``overrides`` (e.g. a per-block seed, an mmap threshold)."""
        shared = {f.name: getattr(options, f.name) for f in fields(cls) if hasattr(options, f.name)}
        return cls(**{**shared, "seed": options.train_seed, **overrides})


BOOKKEEPING = ("eval_every", "checkpoint_every", "mmap_threshold")


def lr_factor(step: int, config: TrainConfig) -> float:
    """The learning rate at ``step`` as a fraction of the peak: linear warmup, then cosine
    decay to 0 at ``steps`` (or constant, ``schedule="constant"``)."""
    return cosine_lr(step, config) / config.lr


def cosine_lr(step: int, config: TrainConfig) -> float:
    """Learning rate at ``step``: linear warmup, then cosine decay to 0 at ``steps`` (or the
    peak, with ``schedule="constant"``)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return config.lr
    progress = (step - config.warmup_steps) / max(config.steps - config.warmup_steps, 1)
    return 0.5 * config.lr * (1 + math.cos(math.pi * min(progress, 1.0)))


@dataclass
class TrainState:
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # one entry per step
    evals: list[dict[str, Any]] = field(default_factory=list)


def make_optimizer(
    params: dict[str, nn.Parameter], config: TrainConfig, options: dict[str, dict[str, float]]
) -> torch.optim.Optimizer:
    """AdamW or SGD over ``params``; one parameter group per distinct ``options`` entry (in the
    order of ``params``, which checkpoints index the moments by), each remembering its peak lr.

    Fused where every tensor is on CPU/CUDA: one kernel per tensor, no whole-model temporaries
    (the default "foreach" path allocates copies of every moment: ~1 GB more peak for SmolLM2's
    mask logits)."""
    unknown = set(options) - set(params)
    if unknown:
        raise ValueError(f"param_options for unknown parameters: {sorted(unknown)}")
    groups: list[dict[str, Any]] = []
    for name, param in params.items():
        extra = options.get(name, {})
        group = {
            "lr": extra.get("lr", config.lr),
            "weight_decay": extra.get("weight_decay", config.weight_decay),
        }
        if groups and all(groups[-1][k] == v for k, v in group.items()):
            groups[-1]["params"].append(param)  # same options as the one before: same group
        else:
            groups.append({**group, "params": [param]})
    for group in groups:
        group["peak_lr"] = group["lr"]
    fused = all(p.device.type in ("cpu", "cuda") for p in params.values())
    kwargs: dict[str, Any] = {"fused": fused or None, "foreach": None if fused else False}
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, **kwargs)
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, **kwargs)


def batch_indices(step: int, micro: int, config: TrainConfig, n_windows: int) -> torch.Tensor:
    """Example indices of micro-batch ``micro`` of ``step`` (before sharding across processes):
    a seeded permutation per epoch, so the data position is a function of the step alone."""
    start = (step * config.grad_accum + micro) * config.batch_size
    epoch, offset = divmod(start, n_windows)
    order = torch.randperm(n_windows, generator=torch.Generator().manual_seed(config.seed + epoch))
    idx = order[offset : offset + config.batch_size]
    if len(idx) < config.batch_size:  # wrap into the next epoch
        nxt = torch.randperm(
            n_windows, generator=torch.Generator().manual_seed(config.seed + epoch + 1)
        )
        idx = torch.cat([idx, nxt[: config.batch_size - len(idx)]])
    return idx


def default_collate(examples: Sequence | torch.Tensor, idx: torch.Tensor) -> Any:
    """The examples at ``idx``: rows of a tensor as a tensor ((b, L) token ids), tensors
    stacked, anything else as a list."""
    if isinstance(examples, torch.Tensor):
        return examples[idx]
    items = [examples[i] for i in idx.tolist()]
    if items and all(isinstance(item, torch.Tensor) for item in items):
        return torch.stack(items)
    return items


class Trainer:
    """Optimise ``params`` of ``model`` on a sequence of examples.

    ``loss_fn(model, batch, step) -> (loss, logs)`` computes the loss of one micro-batch (by
    default (b, L) token ids: see :func:`default_collate`, or give ``collate(examples, idx)``);
    ``before_step(step)`` sets schedules (temperatures, ...) before it; ``evaluate(step) ->
    dict`` scores the model (e.g. the hard-mask perplexity). ``param_options`` gives a
    parameter its own ``lr`` (its peak: the schedule scales every one alike) or
    ``weight_decay`` (e.g. a learned scale beside mask logits, as ASLP trains them).
    ``fingerprint``: the method's options that decide the result, saved with every checkpoint
    and compared on resume beside ``config``'s, the parameters' shapes and the data (see
    :mod:`~lmcompress.compressor.training.checkpoint`); ``data_source``: what the examples
    are made from where it matters beyond them (block-wise: the token windows), saved with
    the examples' own fingerprint.
    """

    def __init__(
        self,
        model: nn.Module,
        params: dict[str, nn.Parameter],
        config: TrainConfig,
        loss_fn: Callable[[nn.Module, Any, int], tuple[torch.Tensor, dict[str, float]]],
        before_step: Callable[[int], dict[str, float]] | None = None,
        evaluate: Callable[[int], dict[str, float]] | None = None,
        checkpoint_dir: str | Path | None = None,
        accelerator: Any = None,
        desc: str = "train",
        leave: bool = True,
        collate: Callable[[Sequence | torch.Tensor, torch.Tensor], Any] = default_collate,
        param_options: dict[str, dict[str, float]] | None = None,
        fingerprint: dict[str, Any] | None = None,
        data_source: str | None = None,
    ) -> None:
        self.model, self.params, self.config = model, params, config
        self.fingerprint = fingerprint or {}
        self.data_source = data_source
        self.data: str | None = None  # checkpoint.data_fingerprint of what ``fit`` trains on
        self.saved_step: int | None = None  # the step of the checkpoint last saved or loaded
        self.collate = collate
        self.desc, self.leave = desc, leave  # progress bar label; keep it when done
        self.loss_fn, self.before_step, self.evaluate = loss_fn, before_step, evaluate
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.accelerator = accelerator
        self.optimizer = make_optimizer(params, config, param_options or {})
        self.state = TrainState()

    # --- checkpoints ----------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        """What a checkpoint must agree with to be resumed (``data`` once ``fit`` saw it)."""
        meta = {
            "config": self.config.fingerprint(),
            "options": self.fingerprint,
            "params": {name: list(param.shape) for name, param in self.params.items()},
        }
        return meta if self.data is None else {**meta, "data": self.data}

    def save_checkpoint(self) -> None:
        """Write the whole training state atomically into ``checkpoint_dir/trainer_state``.
        Every process must call it (sharded tensors are gathered); the main one writes. At the
        last step the optimiser moments are left out: no step follows a resume from there."""
        if self.checkpoint_dir is None:
            return
        tensors = {f"param.{k}": full_tensor(v.detach()) for k, v in self.params.items()}
        opt = self.optimizer.state_dict()
        names = list(self.params)
        if self.state.step < self.config.steps:
            for index, moments in opt["state"].items():
                for key, value in moments.items():
                    tensors[f"opt.{names[index]}.{key}"] = full_tensor(value.detach())
        if self._is_main():
            tensors = {k: v.cpu().contiguous() for k, v in tensors.items()}
            tensors["rng.torch"] = torch.get_rng_state()
            meta = {"state": asdict(self.state), "data": None, **self._meta()}
            checkpoint.write_checkpoint(self.checkpoint_dir / CHECKPOINT, tensors, meta)
        self.saved_step = self.state.step
        barrier()  # no process reads or rewrites the checkpoint before it is complete

    def load_checkpoint(self) -> bool:
        """Restore the state saved by :meth:`save_checkpoint`; False if there is none. A
        checkpoint of other options, parameters or data, or one that cannot be read, is a
        one-line error (before any parameter changes)."""
        source = self.checkpoint_dir / CHECKPOINT if self.checkpoint_dir else None
        if source is None or not source.is_dir():
            return False
        meta = checkpoint.read_meta(source)
        checkpoint.check_matches(source, meta, self._meta())
        checkpoint.check_tensors(source, meta)
        tensors = checkpoint.read_tensors(source)
        try:
            state = TrainState(**meta["state"])
        except TypeError as err:
            raise checkpoint.corrupt(source / checkpoint.STATE, f"state: {err}") from None
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(shard_like(tensors[f"param.{name}"].to(param.device), param))
        opt = self.optimizer.state_dict()
        for index, (name, param) in enumerate(self.params.items()):
            keys = [k for k in tensors if k.startswith(f"opt.{name}.")]
            if keys:  # moments shaped like the parameter are sharded like it ("step" is not)
                opt["state"][index] = {
                    k.rsplit(".", 1)[1]: shard_like(tensors[k].to(param.device), param)
                    if tensors[k].shape == param.shape
                    else tensors[k]
                    for k in keys
                }
        self.optimizer.load_state_dict(opt)
        torch.set_rng_state(tensors["rng.torch"])
        self.state, self.saved_step = state, state.step
        logger.info("resumed from %s at step %d", source, self.state.step)
        return True

    # --- the loop -------------------------------------------------------------------------

    def _is_main(self) -> bool:
        return self.accelerator is None or self.accelerator.is_main_process

    def fit(
        self,
        data: Sequence | torch.Tensor | Iterable,
        resume: bool = False,
        stop_after: int | None = None,
    ) -> TrainState:
        """Train on ``data`` until ``config.steps`` (or ``stop_after`` steps of this call: for
        tests of interrupted runs). With ``resume``, continue from the last checkpoint if there
        is one. ``data``: a sequence of examples (an iterable is read into a list first: the
        order must be a function of the step)."""
        config = self.config
        if not isinstance(data, (torch.Tensor, Sequence)):
            data = list(data)
        if len(data) == 0:
            raise ConfigError("nothing to train on: no examples")
        self.data = checkpoint.data_fingerprint(data)
        if self.data_source:
            self.data += f" from {self.data_source}"
        if resume:
            self.load_checkpoint()
        if config.mmap_threshold:  # and return what earlier work (a prior, loading) left free
            memory.set_mmap_threshold(config.mmap_threshold)
            memory.release_free_memory()
        done_here = 0
        bar = tqdm(
            total=config.steps,
            initial=self.state.step,
            desc=self.desc,
            unit="step",
            leave=self.leave,
            disable=bar_disabled(self._is_main()),
        )
        with trainable_only(self.model, self.params.values()):
            while self.state.step < config.steps and (stop_after is None or done_here < stop_after):
                logs = self._step(data)
                done_here += 1
                bar.update(1)
                bar.set_postfix(
                    {
                        k: f"{v:.3g}"
                        for k, v in logs.items()
                        if k in ("loss", "tau", "kappa", "flipped")
                    }
                )
                at_eval = config.eval_every and self.state.step % config.eval_every == 0
                if self.evaluate and (at_eval or self.state.step == config.steps):
                    evals = self.evaluate(self.state.step)
                    self.state.evals.append({"step": self.state.step, **evals})
                if config.checkpoint_every and self.state.step % config.checkpoint_every == 0:
                    self.save_checkpoint()
        bar.close()
        return self.state

    def _step(self, data: Sequence | torch.Tensor) -> dict[str, Any]:
        """One optimiser step (``grad_accum`` micro-batches); returns its log entry."""
        config, step = self.config, self.state.step
        world = self.accelerator.num_processes if self.accelerator else 1
        rank = self.accelerator.process_index if self.accelerator else 0
        device = next(self.model.parameters()).device
        logs = dict(self.before_step(step)) if self.before_step else {}
        lr = cosine_lr(step, config)
        for group in self.optimizer.param_groups:
            group["lr"] = group["peak_lr"] * lr_factor(step, config)
        start = time.perf_counter()
        total = 0.0
        for micro in range(config.grad_accum):
            idx = batch_indices(step, micro, config, len(data))
            batch = self.collate(data, idx[rank::world])  # this process's share
            if isinstance(batch, torch.Tensor):
                batch = batch.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
                loss, micro_logs = self.loss_fn(self.model, batch, step)
            scaled = loss / config.grad_accum
            if self.accelerator is not None:
                self.accelerator.backward(scaled)
            else:
                scaled.backward()
            total += float(loss.detach()) / config.grad_accum
            for key, value in micro_logs.items():
                logs[key] = logs.get(key, 0.0) + value / config.grad_accum
        if self.accelerator is not None:
            average_gradients(self.params.values())
        norm = torch.nn.utils.clip_grad_norm_(
            list(self.params.values()), config.grad_clip or math.inf
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        logs.update(
            step=self.state.step,
            loss=total,
            lr=lr,
            grad_norm=float(full_tensor(norm)),
            seconds=time.perf_counter() - start,
        )
        self.state.history.append(logs)
        return logs
