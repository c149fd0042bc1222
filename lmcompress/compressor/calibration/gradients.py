"""Gradient statistics of the LM loss per linear layer: the diagonal (empirical) Fisher and the
Kronecker factors, for the Fisher-weighted SVD family (FWSVD, GFWSVD).

For a linear layer ``y = W x`` (``W``: (out, in)) and a loss ``L``, the weight gradient over the
tokens ``t`` of one backward pass is ``G = Σ_t δ_t x_tᵀ`` with ``δ_t = ∂L/∂y_t``. The pass
accumulates, per selected layer:

- ``fisher`` = Σ_samples G ⊙ G, (out, in): the empirical diagonal Fisher (FWSVD).
- ``xx`` = Σ_tokens x xᵀ, (in, in), and ``dd`` = Σ_tokens δ δᵀ, (out, out): the input-side and
  output-side Kronecker factors (``F ≈ xx ⊗ dd`` up to scale, the K-FAC form).

What one *sample* is: one backward pass, i.e. one batch of ``batch_size`` consecutive windows of
``data`` (the last batch may be smaller). ``samples`` counts them. The loss of a batch is the
**mean** next-token NLL over its ``B·(T−1)`` predicted tokens (``model(ids, labels=ids).loss``),
so with equal-length windows ``G_batch = (1/B) Σ_windows G_window``: ``batch_size=1`` gives the
per-window empirical Fisher Σ_w G_w²; ``batch_size=B`` gives Σ_batches (mean of B window
gradients)², a cheaper and smaller-scaled estimate (FWSVD's reference accumulates per batch).
``δ`` carries the same ``1/(B·(T−1))`` factor, so ``dd`` scales with the batch size too; the
consumers (a per-column importance, Cholesky factors of regularised Kronecker factors) are
invariant to one overall scale, but divide by ``samples`` / ``tokens`` for means.
``tokens`` counts the input rows seen, ``B·T`` per batch (the last position of a window feeds
no prediction: its δ is zero, it still adds to ``xx``).

Memory is bounded by the accumulators: forward hooks add ``xᵀx`` of the layer inputs and drop
them, a hook on each layer output adds ``δᵀδ`` when its gradient arrives, and a post-accumulate
hook on each selected weight adds ``G²`` and frees ``.grad`` as soon as it is complete (one
layer's gradient alive at a time). Nothing per-sample is stored.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.model.families import decoder_blocks
from lmcompress.compressor.model.surgery import forward_hooks, is_linear, weight_matrix
from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]
SampleHook = Callable[[str, torch.Tensor], None]  # (layer name, that sample's G (out, in))
_FIELDS = ("fisher", "xx", "dd")


@dataclass
class GradientStats:
    """Accumulated gradient statistics of one linear layer (see the module docstring).

    ``fisher`` (out, in), ``xx`` (in, in), ``dd`` (out, out) are ``None`` when not requested;
    ``samples``: backward passes (batches) seen; ``tokens``: input rows seen.
    """

    name: str
    fisher: torch.Tensor | None = None
    xx: torch.Tensor | None = None
    dd: torch.Tensor | None = None
    samples: int = 0
    tokens: int = 0

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat tensors for :class:`~lmcompress.compressor.method.Stats`: ``"{name}.fisher"``,
        ``.xx``, ``.dd`` (those present) and the counts as 0-d int64 ``.samples``, ``.tokens``."""
        tensors = {
            f"{self.name}.{key}": value
            for key in _FIELDS
            if (value := getattr(self, key)) is not None
        }
        tensors[f"{self.name}.samples"] = torch.tensor(self.samples, dtype=torch.int64)
        tensors[f"{self.name}.tokens"] = torch.tensor(self.tokens, dtype=torch.int64)
        return tensors

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], name: str) -> GradientStats:
        """Inverse of :meth:`to_tensors` for layer ``name``."""
        if f"{name}.samples" not in tensors:
            raise ConfigError(f"no gradient statistics for layer {name!r} in these tensors")
        return cls(
            name=name,
            **{key: tensors.get(f"{name}.{key}") for key in _FIELDS},
            samples=int(tensors[f"{name}.samples"]),
            tokens=int(tensors[f"{name}.tokens"]),
        )


def gradient_stats_tensors(stats: dict[str, GradientStats]) -> dict[str, torch.Tensor]:
    """All layers' :meth:`GradientStats.to_tensors` in one flat dict."""
    return {key: value for layer in stats.values() for key, value in layer.to_tensors().items()}


def causal_lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL of the batch ``ids`` (B, T): Hugging Face's shifted-label loss.

    ``use_cache=False``: no KV cache is wanted, and under checkpointing the recomputed blocks
    would write to it a second time.
    """
    return model(input_ids=ids, labels=ids, use_cache=False).loss


class _Collector:
    """The hooks of one pass and the accumulators they write to."""

    def __init__(
        self,
        layers: dict[str, nn.Module],
        *,
        fisher: bool,
        kronecker: bool,
        device: torch.device,
        dtype: torch.dtype,
        on_sample: SampleHook | None = None,
    ) -> None:
        self.dtype = dtype
        self.on_sample = on_sample
        self.recomputing = False  # True during backward: forwards then are checkpoint replays
        self.stats: dict[str, GradientStats] = {}

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, device=device, dtype=dtype)

        for name, module in layers.items():
            out_features, in_features = weight_matrix(module).shape
            self.stats[name] = GradientStats(
                name=name,
                fisher=zeros(out_features, in_features) if fisher else None,
                xx=zeros(in_features, in_features) if kronecker else None,
                dd=zeros(out_features, out_features) if kronecker else None,
            )

    def on_forward(
        self, name: str, _module: nn.Module, inputs: tuple, output: torch.Tensor
    ) -> None:
        # A forward inside backward is a non-reentrant checkpoint replaying a block: its inputs
        # were counted, and the gradient reaches the first forward's output hook. (A model's own
        # *reentrant* checkpointing would lose δ here; HF's is off in eval mode.)
        if self.recomputing:
            return
        stats = self.stats[name]
        x = inputs[0].detach()
        x = x.reshape(-1, x.shape[-1]).to(self.dtype)  # (B·T, in)
        stats.tokens += x.shape[0]
        if stats.xx is not None:
            stats.xx.addmm_(x.T, x)
            if output.requires_grad:
                output.register_hook(functools.partial(self._on_output_grad, stats))

    def _on_output_grad(self, stats: GradientStats, grad: torch.Tensor) -> None:
        d = grad.detach().reshape(-1, grad.shape[-1]).to(self.dtype)  # (B·T, out)
        stats.dd.addmm_(d.T, d)

    def on_weight_grad(self, name: str, transpose: bool, weight: nn.Parameter) -> None:
        """Post-accumulate hook: the weight's gradient of this backward is complete."""
        fisher = self.stats[name].fisher
        if fisher is not None or self.on_sample is not None:
            g = weight.grad.detach()
            g = (g.T if transpose else g).to(self.dtype)  # (out, in)
            if fisher is not None:
                fisher.addcmul_(g, g)
            if self.on_sample is not None:
                self.on_sample(name, g)
        weight.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        self.recomputing = True
        try:
            loss.backward()
        finally:
            self.recomputing = False
        for stats in self.stats.values():
            stats.samples += 1


@contextlib.contextmanager
def checkpointed_blocks(model: nn.Module) -> Iterator[None]:
    """Run every decoder block under ``torch.utils.checkpoint`` (non-reentrant) inside the
    ``with`` block: activations inside a block are recomputed in backward, not stored.

    Not ``model.gradient_checkpointing_enable()``: Hugging Face checkpoints a block only when
    it is in training mode (``GradientCheckpointingLayer``), which turns dropout on (GPT-2 and
    OPT default to 0.1) and changes the statistics. Wrapping the blocks' ``forward`` works in
    eval mode; the original ``forward`` is put back even when the block raises.
    """
    blocks = list(decoder_blocks(model))
    saved = [vars(block).get("forward") for block in blocks]  # an instance override, if any
    try:
        for block in blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        yield
    finally:
        for block, previous in zip(blocks, saved, strict=True):
            if previous is None:
                vars(block).pop("forward", None)
            else:
                block.forward = previous


def _check_inputs(
    model: nn.Module,
    data: torch.Tensor,
    layers: dict[str, nn.Module],
    fisher: bool,
    kronecker: bool,
    batch_size: int,
    min_tokens: int,
) -> None:
    if not (fisher or kronecker):
        raise ConfigError("gradient statistics: ask for fisher, kronecker or both")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if not isinstance(data, torch.Tensor) or data.dim() != 2 or data.dtype != torch.long:
        raise ConfigError("calibration data must be a LongTensor of token ids (N, T)")
    if data.shape[0] == 0 or data.shape[1] < min_tokens:
        raise ConfigError(
            f"need at least one window of >= {min_tokens} tokens, got {tuple(data.shape)}"
        )
    if not layers:
        raise ConfigError("gradient statistics: no layer selected")
    for name, module in layers.items():
        if not is_linear(module):
            raise ConfigError(f"{name} is a {type(module).__name__}, not a linear layer")
        if parametrize.is_parametrized(module, "weight"):
            raise ConfigError(f"{name} has a parametrized weight; bake it first")
        try:
            found = model.get_submodule(name)
        except AttributeError:
            found = None
        if found is not module:
            raise ConfigError(f"{name} is not that module of this model")


@contextlib.contextmanager
def _gradient_pass(
    model: nn.Module, layers: dict[str, nn.Module], collector: _Collector, checkpointing: bool
) -> Iterator[None]:
    """Eval mode, gradients on, only the selected weights requiring grad, the collector's hooks
    on them (and each block recomputed in backward with ``checkpointing``); afterwards every
    mode and ``requires_grad`` as before and no ``.grad`` left, also on error."""
    requires_grad = [(p, p.requires_grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    model.zero_grad(set_to_none=True)
    try:
        with contextlib.ExitStack() as stack:
            model.eval()
            for param, _ in requires_grad:
                param.requires_grad_(False)
            for name, module in layers.items():
                module.weight.requires_grad_(True)
                hook = functools.partial(collector.on_weight_grad, name, isinstance(module, Conv1D))
                stack.callback(module.weight.register_post_accumulate_grad_hook(hook).remove)
            stack.enter_context(forward_hooks(layers, collector.on_forward))
            stack.enter_context(torch.enable_grad())
            if checkpointing:
                stack.enter_context(checkpointed_blocks(model))
            yield
    finally:
        for param, flag in requires_grad:
            param.requires_grad_(flag)
        for module, training in modes:
            module.training = training
        model.zero_grad(set_to_none=True)


def gradient_statistics(
    model: nn.Module,
    data: torch.Tensor,
    layers: dict[str, nn.Module],
    *,
    fisher: bool = True,
    kronecker: bool = True,
    batch_size: int = 1,
    checkpointing: bool = False,
    progress: bool = True,
    loss_fn: LossFn | None = None,
    dtype: torch.dtype = torch.float32,
    on_sample: SampleHook | None = None,
) -> dict[str, GradientStats]:
    """Back-propagate the LM loss over the windows ``data`` (N, T) and accumulate, for every
    layer in ``layers`` (``{qualified name: linear}``, as ``LayerSelection.select`` returns):
    the diagonal Fisher Σ G² (``fisher``) and the Kronecker factors ``xx``, ``dd``
    (``kronecker``). See the module docstring for what a sample is and the loss's scale.

    ``batch_size`` windows per backward pass; ``checkpointing`` recomputes each decoder block in
    backward (:func:`checkpointed_blocks`: same numbers, less activation memory);
    ``loss_fn(model, ids) -> scalar loss`` replaces :func:`causal_lm_loss` (it should keep the
    mean reduction, and pass ``use_cache=False`` under checkpointing); ``dtype``: of the
    accumulators (float32, or float64); ``on_sample(name, G)`` is called with every
    layer's weight gradient of every backward pass, (out, in) in ``dtype`` (a view freed after
    the call: copy what you keep), for estimators that need per-sample gradients.

    The pass runs in eval mode (no dropout: the statistics of the network being compressed),
    with gradients enabled and only the selected weights requiring grad (the graph must reach
    them; with ``fisher=False`` their gradients are dropped unread). Afterwards every module's
    train/eval mode and every parameter's ``requires_grad`` are as before, also on error, and
    no ``.grad`` is left (``model.zero_grad(set_to_none=True)``: earlier gradients are gone).
    Accumulators live on the device of the model's first parameter.
    """
    # The default loss predicts token t+1 from t: a window needs two tokens.
    _check_inputs(model, data, layers, fisher, kronecker, batch_size, 1 if loss_fn else 2)
    if dtype not in (torch.float32, torch.float64):
        raise ConfigError(f"accumulator dtype must be float32 or float64, got {dtype}")
    loss_fn = loss_fn or causal_lm_loss
    device = next(model.parameters()).device
    collector = _Collector(
        layers, fisher=fisher, kronecker=kronecker, device=device, dtype=dtype, on_sample=on_sample
    )
    n_windows = data.shape[0]
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_gradient_pass(model, layers, collector, checkpointing))
        bar = tqdm(total=n_windows, desc="gradients", unit="window", disable=bar_disabled(progress))
        stack.callback(bar.close)
        for first in range(0, n_windows, batch_size):
            ids = data[first : first + batch_size].to(device)  # (B, T)
            loss = loss_fn(model, ids)
            if loss.dim() != 0 or not loss.requires_grad:
                raise ConfigError("the loss must be a scalar that depends on the selected layers")
            collector.backward(loss)
            bar.update(ids.shape[0])
            del ids, loss  # the next batch's forward runs without this one's graph
    logger.info(
        "gradient statistics: %d layers, %d windows in %d backward passes, %.1f s",
        len(layers),
        n_windows,
        -(-n_windows // batch_size),
        time.perf_counter() - start,
    )
    return collector.stats
