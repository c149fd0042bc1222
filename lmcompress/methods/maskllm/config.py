from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

from lmcompress.compressor.options import flat_option_groups
from lmcompress.compressor.training.gumbel import Noise
from lmcompress.compressor.training.options import LearningScope, TrainingOptions
from lmcompress.errors import ConfigError
from lmcompress.methods.pruning import PruningConfig

Prior = Literal["sparsegpt", "wanda", "magnitude", "none"]
PRIORS: tuple[str, ...] = get_args(Prior)


@flat_option_groups
@dataclass(frozen=True)
class MaskLLMConfig(PruningConfig):
    """MaskLLM: learn N:M masks end to end with Gumbel-softmax over the candidate patterns.

    ``training`` holds the generic options (steps, lr, batch size, checkpoints, ...), ``scope``
    the block-wise and re-fit options; they are also accepted flat, ``MaskLLMConfig(steps=8,
    blockwise=True)``, as in recipes and on the command line."""

    method: ClassVar[str] = "maskllm"

    training: TrainingOptions = field(default_factory=TrainingOptions)
    tau: tuple[float, float] = field(
        default=(4.0, 0.05),
        metadata={
            "help": "Gumbel-softmax temperature, linear from START to END",
            "metavar": ("START", "END"),
        },
    )
    kappa: tuple[float, float] = field(
        default=(100.0, 500.0),
        metadata={
            "help": "scale of the logits, linear from START to END",
            "metavar": ("START", "END"),
        },
    )
    prior: Prior = field(
        default="sparsegpt", metadata={"help": "one-shot prior of the mask logits"}
    )
    prior_strength: float = field(default=3.0, metadata={"help": "alpha of the prior"})
    prior_from: str | None = field(
        default=None,
        metadata={"help": "prior: the learned masks of this maskllm output dir (mask transfer)"},
    )
    weight_reg: float = field(default=1e-5, metadata={"help": "lambda of the sparse-weight term"})
    weight_reg_norm: bool = field(
        default=False,
        metadata={"help": "divide the sparse-weight term by the layers' total |W|^2 (scale-free)"},
    )
    distill: bool = field(default=False, metadata={"help": "add KL to the dense model's logits"})
    init_std: float = field(default=0.01, metadata={"help": "std of the initial logits"})
    # --- beyond the paper (off by default: the defaults above are the paper's method) ---
    scope: LearningScope = field(default_factory=LearningScope)  # --blockwise, --refit, --tune-*
    noise: Noise = field(
        default="exact",
        metadata={
            "help": "Gumbel noise: exact; pool (windows of a pre-drawn pool); counter (fresh, "
            "hashed); pool and counter run the fused CPU kernel"
        },
    )
    quant_aware: Literal["none", "int8"] = field(
        default="none",
        metadata={
            "help": "int8: learn the masks for an int8 stage after this one (W8A8 fake "
            "quantization in training, straight-through) and re-fit onto the int8 grid"
        },
    )
    straight_through_from: float = field(
        default=1.0,
        metadata={
            "help": "fraction of training after which samples are hard (straight-through); "
            "1 = never"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # types first (tau, kappa: two floats), Literal choices
        if not self.sparsity.is_nm or any(not s.is_nm for _, s in self.layer_rules):
            raise ConfigError("maskllm learns N:M masks: give --sparsity N:M (e.g. 2:4)")
        if min(self.tau) <= 0 or min(self.kappa) <= 0:
            raise ConfigError("tau and kappa must be positive")
        if not 0.0 <= self.straight_through_from <= 1.0:
            raise ConfigError(
                f"straight_through_from must lie in [0, 1], got {self.straight_through_from}"
            )
        training, blockwise = self.training, self.scope.blockwise
        if blockwise and training.fsdp:
            raise ConfigError("--fsdp is for end-to-end training; --blockwise runs one process")
        if self.scope.tune_steps and self.quant_aware != "none":
            raise ConfigError(
                "--tune-steps would move the weights off the int8 grid of --quant-aware"
            )
        if blockwise and self.distill:
            raise ConfigError(
                "--distill is for end-to-end training; --blockwise already matches the dense "
                "model's block outputs"
            )
