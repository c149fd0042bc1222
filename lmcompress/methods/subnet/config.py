from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

from lmcompress.compressor.model.structure import KINDS
from lmcompress.compressor.options import flat_option_groups
from lmcompress.compressor.training.options import LearningScope, TrainingOptions, check_distill
from lmcompress.errors import ConfigError
from lmcompress.methods.pruning import PruningConfig
from lmcompress.methods.structured.config import CHANNEL_MULTIPLE_HELP, check_channel_multiple
from lmcompress.methods.subnet.parametrization import Scale

Prior = Literal["sparsegpt", "wanda", "magnitude", "none"]
Constraint = Literal["lagrangian", "penalty", "none"]
ConstraintScale = Literal["relative", "size"]
Extract = Literal["topk", "threshold"]
Widths = Literal["uniform", "per-layer"]
LayerSample = Literal["bernoulli", "topk"]
CONSTRAINTS: tuple[str, ...] = get_args(Constraint)


def paper_training() -> TrainingOptions:
    """ASLP's optimiser: SGD, lr 50, momentum 0.9, constant, on the mask logits."""
    return TrainingOptions(optimizer="sgd", lr=50.0, momentum=0.9, schedule="constant")


@flat_option_groups
@dataclass(frozen=True)
class SubnetConfig(PruningConfig):
    """Stochastic subnetwork extraction (ASLP): per-weight keep logits sampled with a hard
    Gumbel-softmax, frozen weights, a learned rescaling of the surviving weights.

    The defaults are the paper's (SGD lr 50 on the logits, scale lr 1e-3, τ = 1, one scale per
    layer), plus what a pretrained LM needs: a one-shot prior as the initial logits, a sparsity
    target held by a constraint on the expected keep rate and met exactly at extraction."""

    method: ClassVar[str] = "subnet"

    training: TrainingOptions = field(default_factory=paper_training)
    tau: float = field(default=1.0, metadata={"help": "Gumbel-softmax temperature"})
    tau_end: float | None = field(
        default=None,
        metadata={
            "help": "anneal the temperature linearly from --tau to this over the steps "
            "(MaskLLM's schedule; none: constant --tau)"
        },
    )
    kappa: tuple[float, float] = field(
        default=(1.0, 1.0),
        metadata={
            "help": "N:M layers: scale of the logits in the pattern sampler, linear from START "
            "to END (MaskLLM's κ; 1 1: the conditional Bernoulli as it is)",
            "metavar": ("START", "END"),
        },
    )
    scale: Scale = field(
        default="layer",
        metadata={"help": "learned rescaling of the kept weights: per layer, per row, or none"},
    )
    scale_lr: float = field(default=1e-3, metadata={"help": "learning rate of the scales"})
    prior: Prior = field(
        default="sparsegpt",
        metadata={"help": "one-shot mask the logits start from (none: all 0, the paper)"},
    )
    prior_strength: float = field(
        default=3.0, metadata={"help": "initial logit: +A where the prior keeps, -A elsewhere"}
    )
    constraint: Constraint = field(
        default="lagrangian",
        metadata={
            "help": "hold each layer's expected keep rate at the target (unstructured): "
            "learned Lagrange multipliers, a fixed quadratic penalty, or nothing (top-k "
            "extraction alone)"
        },
    )
    constraint_weight: float = field(
        default=1.0,
        metadata={"help": "penalty: its weight; lagrangian: the multipliers' learning rate"},
    )
    constraint_scale: ConstraintScale = field(
        default="relative",
        metadata={
            "help": "each layer's deviation: relative, (r - k) / k, whose pull on one logit "
            "scales as 1 / (k x layer size); size: that times the layer's size over the mean "
            "size of the constrained layers, the same pull on a logit in every layer"
        },
    )
    extract: Extract = field(
        default="topk",
        metadata={
            "help": "topk: exactly the target sparsity; threshold: keep logits >= 0 (the "
            "paper; the sparsity emerges and is reported)"
        },
    )
    scope: LearningScope = field(default_factory=LearningScope)  # --blockwise, --refit, --tune-*
    structure: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": f"learn whole structures instead of single weights, any of: "
            f"{', '.join(KINDS)}; --sparsity is then the fraction of the decoder's parameters "
            "removed, extracted into a smaller model of the same architecture",
            "metavar": "KIND",
        },
    )
    widths: Widths = field(
        default="uniform",
        metadata={"help": "--structure: the same widths in every block (a standard config: "
                  "plain transformers loads it) or each block its own, the learned keep "
                  "logits ranked across blocks (only lmcompress loads it)"},
    )  # fmt: skip
    channel_multiple: int = field(
        default=1, metadata={"help": f"--structure: {CHANNEL_MULTIPLE_HELP}"}
    )
    layer_sample: LayerSample = field(
        default="bernoulli",
        metadata={"help": "--structure layers: each training forward drops blocks by one "
                  "Bernoulli draw a block (bernoulli), or drops exactly the blocks the budget "
                  "removes, drawn by Gumbel top-k (topk: every sample the extraction's depth)"},
    )  # fmt: skip
    distill_steps: int = field(
        default=0,
        metadata={"help": "--structure: then train the kept weights this many steps (one "
                  "calibration window each) on the KL divergence from the dense model's "
                  "logits (0: off)"},
    )  # fmt: skip
    distill_lr: float = field(default=1e-4, metadata={"help": "learning rate of --distill-steps"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tau <= 0 or self.scale_lr <= 0 or self.constraint_weight < 0:
            raise ConfigError("tau and scale_lr must be positive, constraint_weight >= 0")
        if (self.tau_end is not None and self.tau_end <= 0) or min(self.kappa) <= 0:
            raise ConfigError(
                f"tau_end and kappa must be positive, got {self.tau_end}, {self.kappa}"
            )
        if self.prior_strength < 0:
            raise ConfigError(f"prior_strength must be >= 0, got {self.prior_strength}")
        nm = self.sparsity.is_nm or any(s.is_nm for _, s in self.layer_rules)
        if self.extract == "threshold" and nm:
            raise ConfigError("--extract threshold is for unstructured masks, not N:M")
        if self.kappa != (1.0, 1.0) and not nm:
            raise ConfigError("--kappa scales the N:M pattern sampler: it needs an N:M sparsity")
        if self.scope.blockwise and self.training.fsdp:
            raise ConfigError("--fsdp is for end-to-end training; --blockwise runs one process")
        check_distill(self.distill_steps, self.distill_lr)
        if self.structure:
            self._check_structure()
        elif (
            self.distill_steps
            or self.widths != "uniform"
            or self.channel_multiple != 1
            or self.layer_sample != "bernoulli"
        ):
            raise ConfigError(
                "--distill-steps, --widths, --channel-multiple and --layer-sample are for a "
                "structured extraction: add --structure"
            )

    def _check_structure(self) -> None:
        """``--structure``: known kinds, each once; a fraction to remove; end to end only."""
        unknown = [k for k in self.structure if k not in KINDS]
        if unknown or len(set(self.structure)) != len(self.structure):
            raise ConfigError(f"structure: one or more of {', '.join(KINDS)}, each once")
        if self.sparsity.is_nm or self.layer_sparsity or self.include or self.exclude:
            raise ConfigError(
                "--structure removes whole structures at one --sparsity fraction: no N:M, "
                "--layer-sparsity, --include or --exclude"
            )
        scope = self.scope
        if scope.blockwise or scope.refit != "none" or scope.tune_steps or self.training.fsdp:
            raise ConfigError(
                "--structure learns end to end in one process: no --blockwise, "
                "--refit, --tune-steps or --fsdp"
            )
        check_channel_multiple(self.channel_multiple, self.structure)
        if self.layer_sample != "bernoulli" and "layers" not in self.structure:
            raise ConfigError("--layer-sample draws whole blocks: add --structure layers")
        if self.channel_multiple > 1 and self.widths == "per-layer":
            raise ConfigError(
                "--channel-multiple rounds the one MLP width: not with --widths per-layer"
            )
