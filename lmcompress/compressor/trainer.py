"""The trainer every learned method shares (MaskLLM, subnetwork extraction).

AdamW on the method's own parameters only (mask logits, scales; the model's weights stay
frozen), cosine learning rate with optional warmup, gradient clipping and accumulation,
optional bf16 autocast, periodic evaluation, and checkpoints that make a killed run resume to
exactly the result of an uninterrupted one: the parameters, the optimiser moments, the step,
the data order and the RNG state are saved (as safetensors + JSON; nothing is pickled).

Runs under ``accelerate`` (``accelerate launch --cpu --num_processes 2 ...``): each process
takes every ``world_size``-th window of a batch and gradients are averaged across processes,
by the trainer (data parallel) or by FSDP when the parameters are sharded ``DTensor`` s (see
``compressor.distributed``); checkpoints then hold the whole tensors, gathered from all
processes, so a run resumes with any number of processes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from lmcompress.compressor import memory
from lmcompress.compressor.distributed import (
    average_gradients,
    barrier,
    full_tensor,
    shard_like,
)
from lmcompress.errors import ConfigError, LmcompressError

logger = logging.getLogger(__name__)

CHECKPOINT = "trainer_state"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    lr: float = 2e-4
    batch_size: int = 1  # windows per micro-batch (per process)
    grad_accum: int = 1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    warmup_steps: int = 0
    eval_every: int = 0  # 0: only at the end
    bf16: bool = False
    seed: int = 0
    checkpoint_every: int = 0  # 0: no checkpoints
    # > 0: glibc serves allocations of at least this many bytes with mmap during training, so
    # freed step temporaries go back to the system (see compressor.memory); 0: malloc's default
    mmap_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "mmap_threshold"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")


def cosine_lr(step: int, config: TrainConfig) -> float:
    """Learning rate at ``step``: linear warmup, then cosine decay to 0 at ``steps``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(config.steps - config.warmup_steps, 1)
    return 0.5 * config.lr * (1 + math.cos(math.pi * min(progress, 1.0)))


@dataclass
class TrainState:
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # one entry per step
    evals: list[dict[str, Any]] = field(default_factory=list)


def batch_indices(step: int, micro: int, config: TrainConfig, n_windows: int) -> torch.Tensor:
    """Window indices of micro-batch ``micro`` of ``step`` (before sharding across processes):
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


class Trainer:
    """Optimise ``params`` of ``model`` on token windows ``data`` (N, L).

    ``loss_fn(model, input_ids, step) -> (loss, logs)`` computes the loss of one micro-batch;
    ``before_step(step)`` sets schedules (temperatures, ...) before it; ``evaluate(step) ->
    dict`` scores the model (e.g. the hard-mask perplexity).
    """

    def __init__(
        self,
        model: nn.Module,
        params: dict[str, nn.Parameter],
        config: TrainConfig,
        loss_fn: Callable[[nn.Module, torch.Tensor, int], tuple[torch.Tensor, dict[str, float]]],
        before_step: Callable[[int], dict[str, float]] | None = None,
        evaluate: Callable[[int], dict[str, float]] | None = None,
        checkpoint_dir: str | Path | None = None,
        accelerator: Any = None,
        desc: str = "train",
        leave: bool = True,
    ) -> None:
        self.model, self.params, self.config = model, params, config
        self.desc, self.leave = desc, leave  # progress bar label; keep it when done
        self.loss_fn, self.before_step, self.evaluate = loss_fn, before_step, evaluate
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.accelerator = accelerator
        # Fused: one kernel per tensor, no whole-model temporaries (the default "foreach"
        # path allocates copies of every moment: ~1 GB more peak for SmolLM2's mask logits).
        fused = all(p.device.type in ("cpu", "cuda") for p in params.values())
        self.optimizer = torch.optim.AdamW(
            list(params.values()),
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
            fused=fused or None,
            foreach=None if fused else False,
        )
        self.state = TrainState()

    # --- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        """Write the whole training state atomically into ``checkpoint_dir/trainer_state``.
        Every process must call it (sharded tensors are gathered); the main one writes."""
        if self.checkpoint_dir is None:
            return
        tensors = {f"param.{k}": full_tensor(v.detach()) for k, v in self.params.items()}
        opt = self.optimizer.state_dict()
        names = list(self.params)
        for index, moments in opt["state"].items():
            for key, value in moments.items():
                tensors[f"opt.{names[index]}.{key}"] = full_tensor(value.detach())
        if self._is_main():
            tensors = {k: v.cpu().contiguous() for k, v in tensors.items()}
            tensors["rng.torch"] = torch.get_rng_state()
            target = self.checkpoint_dir / CHECKPOINT
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".trainer-", dir=target.parent))
            save_file(tensors, str(tmp / "state.safetensors"))
            meta = {"state": asdict(self.state), "config": asdict(self.config)}
            (tmp / "state.json").write_text(json.dumps(meta))
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        barrier()  # no process reads or rewrites the checkpoint before it is complete

    def load_checkpoint(self) -> bool:
        """Restore the state saved by :meth:`save_checkpoint`; False if there is none."""
        source = self.checkpoint_dir / CHECKPOINT if self.checkpoint_dir else None
        if source is None or not (source / "state.json").is_file():
            return False
        meta = json.loads((source / "state.json").read_text())
        saved = {k: v for k, v in meta["config"].items()}
        saved["betas"] = tuple(saved["betas"])
        if TrainConfig(**saved) != self.config:
            raise LmcompressError(
                f"{source} was written with other training options; cannot resume"
            )
        tensors = load_file(str(source / "state.safetensors"))
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
        self.state = TrainState(**meta["state"])
        logger.info("resumed from %s at step %d", source, self.state.step)
        return True

    # --- the loop -------------------------------------------------------------------------

    def _is_main(self) -> bool:
        return self.accelerator is None or self.accelerator.is_main_process

    def fit(
        self, data: torch.Tensor, resume: bool = False, stop_after: int | None = None
    ) -> TrainState:
        """Train until ``config.steps`` (or ``stop_after`` steps of this call: for tests of
        interrupted runs). With ``resume``, continue from the last checkpoint if there is one."""
        config = self.config
        if resume:
            self.load_checkpoint()
        if config.mmap_threshold:  # and return what earlier work (a prior, loading) left free
            memory.set_mmap_threshold(config.mmap_threshold)
            memory.release_free_memory()
        world = self.accelerator.num_processes if self.accelerator else 1
        rank = self.accelerator.process_index if self.accelerator else 0
        device = next(self.model.parameters()).device
        done_here = 0
        bar = tqdm(
            total=config.steps,
            initial=self.state.step,
            desc=self.desc,
            unit="step",
            leave=self.leave,
            disable=not self._is_main(),
        )
        while self.state.step < config.steps and (stop_after is None or done_here < stop_after):
            step = self.state.step
            logs = dict(self.before_step(step)) if self.before_step else {}
            lr = cosine_lr(step, config)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            start = time.perf_counter()
            total = 0.0
            for micro in range(config.grad_accum):
                idx = batch_indices(step, micro, config, data.shape[0])
                ids = data[idx[rank::world]].to(device)  # this process's share
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
                    loss, micro_logs = self.loss_fn(self.model, ids, step)
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
            norm = torch.nn.utils.clip_grad_norm_(list(self.params.values()), config.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.state.step += 1
            done_here += 1
            logs.update(
                step=self.state.step,
                loss=total,
                lr=lr,
                grad_norm=float(full_tensor(norm)),
                seconds=time.perf_counter() - start,
            )
            self.state.history.append(logs)
            bar.update(1)
            bar.set_postfix(
                {k: f"{v:.3g}" for k, v in logs.items() if k in ("loss", "tau", "kappa", "flipped")}
            )
            at_eval = config.eval_every and self.state.step % config.eval_every == 0
            if self.evaluate and (at_eval or self.state.step == config.steps):
                self.state.evals.append({"step": self.state.step, **self.evaluate(self.state.step)})
            if config.checkpoint_every and self.state.step % config.checkpoint_every == 0:
                self.save_checkpoint()
        bar.close()
        return self.state
