"""Learned structured extraction (``subnet --structure heads|channels|layers``): ASLP's keep
logits and learned rescaling, one per structure instead of one per weight.

Every MLP channel, KV group (with its query heads) and decoder block owns a keep logit ``m``
and (unless ``--scale none``) a scale; each forward of the model draws one hard binary-concrete
sample per structure (``sampling.keep_sample``: exactly Bernoulli(sigmoid(m)) forward, the soft
sample's gradient backward) and multiplies the structure by ``sample · scale``
(``compressor.model.structure.StructureGates``); ``--layer-sample topk`` draws the blocks
instead as exactly the number the budget removes (``sampling.topk_sample``: Gumbel top-k), so
that training sees only models of the extracted depth. The weights stay frozen. The constraint holds
the *expected* kept parameters of the decoder at the target,

    E = Σ_b P(block b) · (params_b − Σ_c (1 − p_c) · channel_params − Σ_g (1 − p_g) · group_params)

through ``d = (E / total − k) / k`` and learned multipliers ``λ1 d + λ2 d²`` trained by ascent
(as the unstructured constraint, ``subnet.learning``; Sheared LLaMA's form). The initial logits
are ``±prior_strength`` where the one-shot structured score keeps (``--prior``: sparsegpt or
wanda → the activation-aware score, magnitude → magnitude, none → 0).

Extraction keeps the same widths in every block (a standard config): each kind loses the share
of its structures closest in proportion to what the learned keep probabilities say
(``1 − mean sigmoid``) that meets the budget (``structured.scores.allocate``); each block
keeps its top logits, the model its top blocks; the scales are folded in. ``--widths
per-layer``: the same number of each kind removed, but the logits of the kept blocks ranked
together (``structured.method.global_keep``), so each block has its own widths. ``hard``
mode (the hard perplexity during training) gates with exactly that extraction.
"""

from __future__ import annotations

import torch
from torch import nn

from lmcompress.compressor.model.structure import StructureGates, block_shapes
from lmcompress.compressor.training.drivers import Learnable, learn_end_to_end
from lmcompress.compressor.training.gumbel import linear_schedule
from lmcompress.compressor.training.trainer import TrainConfig
from lmcompress.methods.structured.distill import distill_kept
from lmcompress.methods.structured.method import global_keep, one_shot_keep, top_keep
from lmcompress.methods.structured.scores import allocate
from lmcompress.methods.subnet.learning import GradientReversal
from lmcompress.methods.subnet.sampling import (
    gumbel_noise,
    keep_sample,
    logistic_noise,
    topk_sample,
)


class StructureSampler:
    """Keep logits and scales of ``model``'s structures of ``kinds``, and the gates they drive
    (module doc); ``hard``: the extracted keeps, ``enabled`` off: no gate (the dense model)."""

    def __init__(
        self,
        model: nn.Module,
        kinds: tuple[str, ...],
        logits: dict[str, torch.Tensor],
        ratio: float,
        tau: float = 1.0,
        scaled: bool = True,
        per_layer: bool = False,
        channel_multiple: int = 1,
        layer_sample: str = "bernoulli",
    ) -> None:
        self.kinds, self.ratio, self.tau, self.per_layer = kinds, ratio, tau, per_layer
        self.channel_multiple, self.layer_sample = channel_multiple, layer_sample
        self.shapes = block_shapes(model)
        self.gates = StructureGates(model, kinds)
        self.logits = {k: nn.Parameter(logits[k].float().clone()) for k in kinds}
        blocks = len(self.shapes)
        shape = {k: tuple(v.shape) for k, v in logits.items()} | {"layers": (blocks, 2)}
        self.scales = {k: nn.Parameter(torch.ones(shape[k])) for k in kinds} if scaled else {}
        self.hard = False
        self._handle = model.register_forward_pre_hook(lambda *_: self.sample())

    @property
    def enabled(self) -> bool:
        return self.gates.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.gates.enabled = value

    def trainable(self) -> dict[str, nn.Parameter]:
        return {f"{k}.logits": v for k, v in self.logits.items()} | {
            f"{k}.scale": v for k, v in self.scales.items()
        }

    def removal(self) -> dict[str, int]:
        """Structures removed per kind (per block; blocks for ``layers``) at the budget, in
        the proportions the keep probabilities have learned."""
        learned = {k: float(1 - torch.sigmoid(v.detach()).mean()) for k, v in self.logits.items()}
        return allocate(self.shapes, self.kinds, self.ratio, learned, self.channel_multiple)

    def keeps(self, removal: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
        """The extracted keeps at ``removal`` (default: :meth:`removal`), bool: (blocks,
        channels), (blocks, groups), (blocks,)."""
        removal = self.removal() if removal is None else removal
        keep = {}
        if "layers" in self.logits:
            keep["layers"] = top_keep(self.logits["layers"].detach()[None], removal["layers"])[0]
        for kind, logits in self.logits.items():
            if kind != "layers" and self.per_layer:  # ranked across the blocks kept
                keep[kind] = global_keep(logits.detach(), removal[kind], keep.get("layers"))
            elif kind != "layers":
                keep[kind] = top_keep(logits.detach(), removal[kind])
        return keep

    def sample(self) -> None:
        """Set the gates: a fresh straight-through sample (or the hard keeps) times the scales."""
        keeps = self.keeps() if self.hard else {}
        for kind, logits in self.logits.items():
            if self.hard:
                mask = keeps[kind].to(logits.dtype)
            elif kind == "layers" and self.layer_sample == "topk":
                kept = len(self.shapes) - self.removal()["layers"]
                noise = gumbel_noise(logits.shape, logits.device)
                mask = topk_sample(logits, kept, self.tau, noise)
            else:
                mask = keep_sample(logits, self.tau, logistic_noise(logits.shape, logits.device))
            if kind == "layers":
                mask = mask[:, None].expand(-1, 2)
            self.gates.values[kind] = mask * self.scales[kind] if kind in self.scales else mask

    def expected_params(self) -> torch.Tensor:
        """The decoder's expected kept parameters under the keep probabilities (module doc)."""
        shape, blocks = self.shapes[0], len(self.shapes)
        p = {k: torch.sigmoid(v) for k, v in self.logits.items()}
        per_block = torch.full((blocks,), float(shape.params))
        if "channels" in p:
            per_block = per_block - (1 - p["channels"]).sum(1) * shape.channel_params
        if "heads" in p:
            per_block = per_block - (1 - p["heads"]).sum(1) * shape.group_params
        return (per_block * p["layers"]).sum() if "layers" in p else per_block.sum()

    def remove(self) -> None:
        self._handle.remove()
        self.gates.remove()


class ParamsConstraint(nn.Module):
    """The expected-parameters constraint (module doc): ``penalty`` ``w · d²``, ``lagrangian``
    multipliers by ascent (learning rate ``w``), or ``none``."""

    def __init__(self, sampler: StructureSampler, kind: str, weight: float) -> None:
        super().__init__()
        self.sampler, self.kind, self.weight = sampler, kind, weight
        shape = sampler.shapes[0]
        self.total = float(len(sampler.shapes) * shape.params)
        self.multipliers = nn.Parameter(torch.zeros(2))

    def trainable(self) -> tuple[dict[str, nn.Parameter], dict[str, dict]]:
        if self.kind != "lagrangian":
            return {}, {}
        name = "constraint.multipliers"
        return {name: self.multipliers}, {name: {"lr": self.weight, "weight_decay": 0.0}}

    def forward(self, _step: int) -> tuple[torch.Tensor, dict[str, float]]:
        ratio = self.sampler.ratio
        d = (self.sampler.expected_params() / self.total - ratio) / ratio
        logs = {"keep_dev": float(d.detach().abs())}
        if self.kind == "none":
            return torch.zeros(()), logs
        if self.kind == "penalty":
            return self.weight * d.square(), logs
        lam = GradientReversal.apply(self.multipliers)
        logs["lambda"] = float(self.multipliers.detach().abs().max())
        return lam[0] * d + lam[1] * d.square(), logs


def prior_logits(
    model: nn.Module,
    data: torch.Tensor,
    kinds: tuple[str, ...],
    ratio: float,
    prior: str,
    strength: float,
    channel_multiple: int = 1,
) -> dict[str, torch.Tensor]:
    """``±strength`` where the one-shot structured pruning at ``ratio`` keeps (module doc;
    widths multiples of ``channel_multiple``); zeros for ``prior`` none."""
    shapes = block_shapes(model)
    counts = {"channels": shapes[0].channels, "heads": shapes[0].groups}
    if prior == "none":
        zeros = {k: torch.zeros(len(shapes), counts[k]) for k in kinds if k != "layers"}
        return zeros | ({"layers": torch.zeros(len(shapes))} if "layers" in kinds else {})
    score = "magnitude" if prior == "magnitude" else "activation"
    keep, _, _ = one_shot_keep(model, data, kinds, ratio, score, 4, channel_multiple)
    return {k: torch.where(v, strength, -strength).float() for k, v in keep.items()}


def learn(config, model: nn.Module, layers, train_data, score) -> tuple[dict, dict]:
    """Learn the structures of ``model`` end to end (module doc) on ``train_data``, then, with
    ``distill_steps``, distil the weights of ``layers`` in the gated model; ``(tensors, meta)``
    of the stats: every kind's ``keep``, ``scale`` and ``logits``, the training history."""
    kinds, ratio = config.structure, 1.0 - config.sparsity.ratio
    logits = prior_logits(model, train_data, kinds, ratio, config.prior, config.prior_strength,
                          config.channel_multiple)  # fmt: skip
    sampler = StructureSampler(
        model, kinds, logits, ratio, config.tau, config.scale != "none",
        config.widths == "per-layer", config.channel_multiple, config.layer_sample,
    )  # fmt: skip
    constraint = ParamsConstraint(sampler, config.constraint, config.constraint_weight)
    extra, extra_options = constraint.trainable()
    scales = {f"{k}.scale": {"lr": config.scale_lr, "weight_decay": 0.0} for k in sampler.scales}
    learnable = Learnable(
        params=sampler.trainable() | extra,
        extra_loss=constraint,
        param_options=scales | extra_options,
        before_step=_tau_schedule(config, sampler),
        masks=[sampler],
    )
    train = TrainConfig.from_options(config.training, weight_decay=0.0, grad_clip=0.0)
    try:
        result = learn_end_to_end(model, train_data, learnable, train, score=score)
        removal = sampler.removal()
        keep = sampler.keeps(removal)
        scale = {k: v.detach().clone() for k, v in sampler.scales.items()}
    finally:
        sampler.remove()
    tensors = {f"{k}.keep": v for k, v in keep.items()}
    tensors |= {f"{k}.scale": v for k, v in scale.items()}
    tensors |= {f"{k}.logits": v.detach().clone() for k, v in sampler.logits.items()}
    state = result.state
    meta = {"history": state.history, "evals": state.evals, "step0": result.step0}
    meta["removal"] = removal
    if config.distill_steps:
        meta["distill_history"] = distill_kept(
            model, train_data, layers, keep, scale, config.distill_steps, config.distill_lr
        )
    return tensors, meta


def _tau_schedule(config, sampler: StructureSampler):
    if config.tau_end is None:
        return None

    def before_step(step: int) -> dict[str, float]:
        sampler.tau = linear_schedule(config.tau, config.tau_end, step, config.training.steps)
        return {"tau": sampler.tau}

    return before_step
