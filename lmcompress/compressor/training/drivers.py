"""The drivers every learned-mask method shares (MaskLLM, subnetwork extraction): a method
supplies the parametrizations and the terms of its loss, the driver trains them with the shared
trainer and gives back the history.

- :func:`learn_end_to_end`: the whole model on the LM loss (plus the method's extra terms and,
  optionally, the KL divergence from the dense model's logits: the same model, masks off).
- :func:`learn_blockwise`: inside the layer-wise loop, block i's parameters are trained so that
  its output matches the dense model's hidden states after block i, from the compressed model's
  hidden states entering it. A dense stream runs alongside (earlier blocks' errors are
  compensated, not accumulated); ``steps`` are per block. With a checkpoint directory, each
  block keeps its own checkpoint (``checkpoint.block_dir``): every ``checkpoint_every`` steps
  and once the block is trained; a resumed run replays the finished blocks from theirs (their
  forward passes, not their training) and continues the interrupted one from its last.

Both save with every checkpoint the method's ``fingerprint`` (``checkpoint.options_fingerprint``
of its config): a resume under other options is refused naming them.

A method's per-block (or whole-model) state is a :class:`Learnable`: the trained parameters,
their per-parameter optimiser options, the extra loss terms (evaluated inside the same
``parametrize.cached()`` context as the forward, so they see the same sample), a hook run before
every step, the mask modules, and ``finish`` (blockwise: extract and report the block's layers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from lmcompress.compressor.calibration.layerwise import (
    Accumulator,
    LayerwiseStats,
    compress_layerwise,
    layerwise_estimate,
)
from lmcompress.compressor.model.loss import distillation_losses, final_hidden, nll_from_hidden
from lmcompress.compressor.report import LayerReport
from lmcompress.compressor.training.checkpoint import Checkpoints, block_dir, data_fingerprint
from lmcompress.compressor.training.teacher import TeacherCache
from lmcompress.compressor.training.trainer import TrainConfig, Trainer, TrainState
from lmcompress.compressor.util import memory
from lmcompress.errors import LmcompressError

ExtraLoss = Callable[[int], tuple[torch.Tensor, dict[str, float]]]
# Held-out metrics of the model as it is now (``{"hard_ppl": ...}``): the method passes the
# scoring in (:func:`lmcompress.methods.common.held_out_perplexity`), so the core, below the
# evaluation layer, runs it without importing it.
Score = Callable[[], dict[str, float]]

# End to end, every soft mask, gradient and optimiser moment of the whole model is live at
# once, and the heap would otherwise keep ~1 GB of freed step temporaries (compressor.memory):
# glibc serves allocations of 1 MiB and more with mmap while training end to end.
MMAP_THRESHOLD = 1 << 20


def no_extra_loss(_step: int) -> tuple[torch.Tensor, dict[str, float]]:
    return torch.zeros(()), {}


@dataclass
class Learnable:
    """What a method trains in one run of a driver (one block, or the whole model)."""

    params: dict[str, nn.Parameter]
    extra_loss: ExtraLoss = no_extra_loss
    param_options: dict[str, dict[str, float]] = field(default_factory=dict)
    before_step: Callable[[int], dict[str, float]] | None = None
    # blockwise: extract the block's layers (the parametrizations removed) and report them
    finish: Callable[[], list[LayerReport]] | None = None
    # the mask parametrizations: their ``hard`` flag (the deterministic mask) is switched on to
    # measure the hard perplexity or block error; ``enabled`` (False: the dense weight) off for
    # the teacher of end-to-end distillation
    masks: list[nn.Module] = field(default_factory=list)
    # blockwise: after ``finish``, a second training of the block on the same examples (e.g.
    # its kept weights under the fixed masks; not checkpointed), whose ``finish`` bakes it
    tune: Callable[[], Learnable] | None = None
    # the TrainConfig fields this learnable trains under instead of the run's (steps, lr)
    overrides: dict[str, Any] = field(default_factory=dict)
    # no trained parameter changes the teacher (``teacher.TeacherCache``: one forward a window)
    fixed_teacher: bool = False


@contextlib.contextmanager
def masks_set(masks: Iterable[nn.Module], **flags: bool) -> Iterator[None]:
    """Every module of ``masks`` with the attributes ``flags`` (``hard=True``,
    ``enabled=False``) while the block runs, then as they were, also after an error."""
    masks = list(masks)
    before = [{name: getattr(mask, name) for name in flags} for mask in masks]
    try:
        for mask in masks:
            for name, value in flags.items():
                setattr(mask, name, value)
        yield
    finally:
        for mask, flags_before in zip(masks, before, strict=True):
            for name, value in flags_before.items():
                setattr(mask, name, value)


def hard_score(masks: Iterable[nn.Module], score: Score | None) -> dict[str, float]:
    """``score()`` with every mask in ``masks`` switched to its deterministic (``hard``) form;
    ``{}`` without a score (no held-out windows)."""
    if score is None:
        return {}
    with masks_set(masks, hard=True):
        return score()


def training_extra(meta: dict[str, Any], curve_keys: tuple[str, ...]) -> dict[str, Any]:
    """The report's ``extra`` of a learned-mask run from its stats ``meta``: the loss curve
    (``curve_keys`` of each step), the hard-mask perplexities (step 0 = the prior), the steps
    and, block-wise, each block's curve and hard block error before/after training."""

    def curve(history: list[dict]) -> list[dict]:
        return [{k: h[k] for k in curve_keys if k in h} for h in history]

    history, blocks = meta.get("history", []), meta.get("block_history", [])
    step0 = meta.get("step0")
    extra: dict[str, Any] = {
        "loss_curve": curve(history),
        "hard_ppl": ([{"step": 0, **step0}] if step0 else []) + meta.get("evals", []),
        "steps": len(history) or max((len(b["history"]) for b in blocks), default=0),
    }
    if blocks:
        extra["block_curves"] = [
            {
                "block": b["block"],
                "curve": curve(b["history"]),
                "hard_before": b.get("hard_before"),
                "hard_after": b.get("hard_after"),
                **{k: b[k] for k in ("tune_before", "tune_after") if k in b},
            }
            for b in blocks
        ]
    return extra


@dataclass
class EndToEndResult:
    state: TrainState
    step0: dict[str, float]  # the hard masks' perplexity before training ({}: no eval windows)


def learn_end_to_end(
    model: nn.Module,
    train_data: torch.Tensor,
    learnable: Learnable,
    config: TrainConfig,
    score: Score | None = None,
    checkpoints: Checkpoints | None = None,
    accelerator: Any = None,
    distill: bool = False,
    lm_loss: bool = True,
) -> EndToEndResult:
    """Train ``learnable`` on the LM loss of ``model`` over (N, L) token windows, plus its
    extra terms and, with ``distill``, KL(dense || masked) on the logits (the dense model is
    ``model`` with ``learnable.masks`` disabled; ``lm_loss`` False: the KL alone, the LM loss
    only logged). With ``score`` (the held-out perplexity), the
    hard masks' score is measured before training and at every evaluation. ``accelerator``
    (``distributed.join_processes``): several processes, the parameters sharded or not.
    ``checkpoints``: where to checkpoint, whether to resume. Raises if training ends before
    ``config.steps`` (a run stopped early)."""
    checkpoints = checkpoints or Checkpoints()
    step0 = hard_score(learnable.masks, score)
    trainer = Trainer(
        model,
        learnable.params,
        config,
        _lm_loss(learnable, distill, lm_loss),
        before_step=learnable.before_step,
        evaluate=(lambda _step: hard_score(learnable.masks, score)) if score is not None else None,
        checkpoint_dir=checkpoints.directory,
        accelerator=accelerator,
        param_options=learnable.param_options,
        fingerprint=checkpoints.fingerprint,
    )
    model.train(False)  # no dropout: the masks are what is learned
    state = trainer.fit(train_data, resume=checkpoints.resume)
    if state.step < config.steps:
        raise LmcompressError(f"training stopped at step {state.step} of {config.steps}")
    del trainer  # the optimiser moments (AdamW: 2x the parameters) are no longer needed
    memory.release_free_memory()
    return EndToEndResult(state, step0)


def _lm_loss(learnable: Learnable, distill: bool, with_lm: bool = True) -> Callable:
    """``loss_fn(model, ids, step)`` for the trainer: LM loss (+ KL with ``distill``) + extra
    terms. The losses over the vocabulary are computed from the final hidden states a chunk of
    positions at a time: the (B, T, V) logits never exist whole (``compressor.model.loss``)."""

    cache = TeacherCache() if distill and learnable.fixed_teacher else None

    def loss_fn(model: nn.Module, ids: torch.Tensor, step: int):
        def dense_hidden() -> torch.Tensor:  # (B, T, H) of the dense model
            with torch.no_grad(), masks_set(learnable.masks, enabled=False):
                return final_hidden(model, ids)

        teacher = None
        if distill:
            teacher = cache.get(ids, dense_hidden) if cache is not None else dense_hidden()
        with parametrize.cached():  # one sample per layer for the forward and the extra terms
            hidden = final_hidden(model, ids)  # (B, T, H)
            if teacher is None:
                lm_loss, kl = nll_from_hidden(model, hidden, ids, reduction="mean"), None
            else:  # both from one pass over the vocabulary
                lm_loss, kl = distillation_losses(model, hidden, ids, teacher, nll_grad=with_lm)
            extra, logs = learnable.extra_loss(step)
        logs = {"lm_loss": float(lm_loss.detach()), **logs}
        loss = (lm_loss if with_lm else 0.0) + extra
        if kl is not None:
            loss = loss + kl
            logs["kl"] = float(kl.detach())
        return loss, logs

    return loss_fn


def _run(block: nn.Module, index: int, x: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    out = block(x, *batch["args"][index], **batch["kwargs"][index])
    return out[0] if isinstance(out, (tuple, list)) else out


def _hard_error(learnable: Learnable, block, index, examples, count: int) -> float | None:
    """The mean relative block-output error of the hard masks on the first ``count`` batches
    (no masks: of the block as it is)."""
    with masks_set(learnable.masks, hard=True):
        return _block_error(block, index, examples, count)


def _block_error(block, index, examples, count: int) -> float | None:
    """The mean relative block-output error of ``block`` as it is on the first ``count``
    batches."""
    if count == 0:
        return None
    with torch.no_grad():
        errors = [
            float((_run(block, index, b["hidden"], b).float() - y.float()).square().mean() / s)
            for b, y, s in examples[:count]
        ]
    return sum(errors) / len(errors)


def _block_examples(block, index, dense, batches) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
    """``(batch, target, scale)`` per captured batch: the dense block's output on the dense
    inputs (what to reproduce) and its mean squared change of the hidden states (the scale of
    the relative error). Call before the block is parametrized."""
    with torch.no_grad():
        targets = [_run(block, index, x, b) for x, b in zip(dense, batches, strict=True)]
    scales = [(y - x).square().mean().clamp_min(1e-12) for x, y in zip(dense, targets, strict=True)]
    return list(zip(batches, targets, scales, strict=True))


def _train_block(
    block,
    index,
    learnable: Learnable,
    examples,
    config: TrainConfig,
    checkpoints: Checkpoints,
    source: str,
) -> TrainState:
    """Train ``learnable`` on the relative block-output error of ``examples``, one captured
    batch per step (``config.batch_size`` 1); checkpointed in the block's own directory, the
    trained state too (a resume replays the block from it)."""

    def loss_fn(_block: nn.Module, example: tuple, step: int):
        batch, target, scale = example
        with parametrize.cached():
            out = _run(block, index, batch["hidden"], batch)
            extra, logs = learnable.extra_loss(step)
        err = (out.float() - target.float()).square().mean() / scale
        return err + extra, {"rel_err": float(err.detach()), **logs}

    trainer = Trainer(
        block,
        learnable.params,
        config,
        loss_fn,
        before_step=learnable.before_step,
        desc=f"block {index}",
        leave=False,
        collate=lambda items, idx: items[int(idx[0])],
        param_options=learnable.param_options,
        checkpoint_dir=checkpoints.directory and block_dir(checkpoints.directory, index),
        fingerprint=checkpoints.fingerprint,
        data_source=source,
    )
    with torch.enable_grad():
        state = trainer.fit(examples, resume=checkpoints.resume)
    if state.step == config.steps and trainer.saved_step != state.step:
        trainer.save_checkpoint()
    return state


@dataclass
class BlockwiseResult:
    reports: list[LayerReport]
    loop: LayerwiseStats
    histories: list[dict[str, Any]]  # {"block": i, "history": [...]} per block
    seconds: float


def learn_blockwise(
    model: nn.Module,
    data: torch.Tensor,
    layers: dict[str, nn.Module],
    start_block: Callable[[int, list[str], dict[str, Accumulator]], Learnable],
    config: TrainConfig,
    make_accumulator: Callable[[str, nn.Module], Accumulator],
    device: torch.device,
    hard_batches: int = 2,
    checkpoints: Checkpoints | None = None,
) -> BlockwiseResult:
    """Train each decoder block's ``Learnable`` in turn on the relative block-output error.

    ``start_block(index, names, accumulators)`` parametrizes the block's layers (the
    accumulators hold their statistics on the compressed inputs, e.g. a prior's Hessian) and
    returns what to train; after training, the learnable's ``finish`` extracts the layers and
    reports them, then the compressed block's outputs feed the next. The loop captures batches
    of ``config.batch_size`` windows; block i trains on one captured batch per step, with seed
    ``config.seed + i``. The history of each block also holds the hard masks' block error on
    the first ``hard_batches`` batches before and after training (``hard_before``,
    ``hard_after``). ``checkpoints``: see the module's doc.
    """
    start = time.perf_counter()
    checkpoints = checkpoints or Checkpoints()
    source = data_fingerprint(data)  # of the token windows every block's examples come from
    dense: list[torch.Tensor] = []  # the dense model's hidden states entering the block
    histories: list[dict[str, Any]] = []

    def compress_block(index, block, names, accumulators, batches) -> list[LayerReport]:
        if not dense:
            dense.extend(b["hidden"] for b in batches)
        examples = _block_examples(block, index, dense, batches)
        learnable = start_block(index, names, accumulators)
        block_config = dataclasses.replace(config, batch_size=1, seed=config.seed + index)
        before = _hard_error(learnable, block, index, examples, hard_batches)
        state = _train_block(block, index, learnable, examples, block_config, checkpoints, source)
        after = _hard_error(learnable, block, index, examples, hard_batches)
        histories.append(
            {"block": index, "history": state.history, "hard_before": before, "hard_after": after}
        )
        reports = learnable.finish() if learnable.finish else []
        if learnable.tune is not None:  # a second training on the same examples
            tuned = learnable.tune()
            tune_config = dataclasses.replace(block_config, **tuned.overrides)
            histories[-1]["tune_before"] = _block_error(block, index, examples, hard_batches)
            tuned_state = _train_block(block, index, tuned, examples, tune_config, Checkpoints(),
                                       source)  # fmt: skip
            if tuned.finish:
                tuned.finish()
            histories[-1]["tune_history"] = tuned_state.history
            histories[-1]["tune_after"] = _block_error(block, index, examples, hard_batches)
        dense[:] = [target for _, target, _ in examples]
        return reports

    reports, loop = compress_layerwise(
        model,
        data,
        layers,
        make_accumulator=make_accumulator,
        device=device,
        batch_size=config.batch_size,
        compress_block=compress_block,
    )
    model.train(False)
    return BlockwiseResult(reports, loop, histories, time.perf_counter() - start)


def blockwise_estimate(
    model: nn.Module,
    layers: dict[str, nn.Module],
    nsamples: int,
    seq_len: int,
    batch_size: int,
    itemsize: int,
    state: dict[str, Callable[[nn.Module], int]],
) -> dict[str, int]:
    """Peak bytes of :func:`learn_blockwise`: the layer-wise loop's (``layerwise_estimate``,
    with the method's ``state`` per layer) plus the dense stream's block outputs, as many as
    the loop's windows."""
    parts = layerwise_estimate(model, layers, nsamples, seq_len, batch_size, itemsize, state=state)
    parts["dense block outputs"] = parts["calibration activations"]
    return parts
