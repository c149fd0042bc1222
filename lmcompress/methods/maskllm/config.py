from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from lmcompress.errors import ConfigError
from lmcompress.methods.pruning import PruningConfig

PRIORS = ("sparsegpt", "wanda", "magnitude", "none")
REFITS = ("none", "sparsegpt")
NOISES = ("exact", "pool")


@dataclass(frozen=True)
class MaskLLMConfig(PruningConfig):
    """MaskLLM: learn N:M masks end to end with Gumbel-softmax over the candidate patterns."""

    method: ClassVar[str] = "maskllm"

    steps: int = field(default=100, metadata={"help": "optimiser steps"})
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate (cosine schedule)"})
    batch_size: int = field(default=1, metadata={"help": "windows per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per step"})
    tau: tuple[float, float] = field(
        default=(4.0, 0.05), metadata={"help": "temperature START END"}
    )
    kappa: tuple[float, float] = field(
        default=(100.0, 500.0), metadata={"help": "logit scale START END"}
    )
    prior: str = field(
        default="sparsegpt", metadata={"help": "one-shot prior: " + "|".join(PRIORS)}
    )
    prior_strength: float = field(default=3.0, metadata={"help": "alpha of the prior"})
    prior_from: str | None = field(default=None, metadata={"help": "output dir of a learned mask"})
    weight_reg: float = field(default=1e-5, metadata={"help": "lambda of the sparse-weight term"})
    weight_reg_norm: bool = field(
        default=False,
        metadata={"help": "divide the sparse-weight term by the layers' total |W|^2 (scale-free)"},
    )
    distill: bool = field(default=False, metadata={"help": "add KL to the dense model's logits"})
    init_std: float = field(default=0.01, metadata={"help": "std of the initial logits"})
    eval_windows: int = field(default=2, metadata={"help": "held-out windows for hard-mask ppl"})
    eval_every: int = field(default=0, metadata={"help": "evaluate every N steps (0: at the end)"})
    checkpoint_dir: str | None = field(default=None, metadata={"help": "where to checkpoint"})
    checkpoint_every: int = field(default=0, metadata={"help": "checkpoint every N steps"})
    resume: bool = field(default=False, metadata={"help": "continue from checkpoint_dir"})
    train_seed: int = field(default=0, metadata={"help": "seed of data order, init and noise"})
    warmup_steps: int = field(default=0, metadata={"help": "linear lr warmup before the cosine"})
    bf16: bool = field(
        default=False,
        metadata={"help": "bf16 autocast in forward/backward (logits and AdamW stay fp32)"},
    )
    fsdp: bool = field(
        default=False,
        metadata={
            "help": "under accelerate launch with several processes: shard the mask logits, "
            "their gradients and AdamW moments over the processes (FSDP2) instead of "
            "replicating them (data parallel)"
        },
    )
    # --- beyond the paper (off by default: the defaults above are the paper's method) ---
    blockwise: bool = field(
        default=False,
        metadata={
            "help": "learn each decoder block's masks in turn on a local loss (match the dense "
            "model's block outputs), --steps per block"
        },
    )
    refit: str = field(
        default="none",
        metadata={"help": "re-fit the kept weights under the learned mask: " + "|".join(REFITS)},
    )
    noise: str = field(
        default="exact",
        metadata={"help": "Gumbel noise: exact | pool (windows of a pre-drawn pool, cheaper)"},
    )
    straight_through_from: float = field(
        default=1.0,
        metadata={
            "help": "fraction of training after which samples are hard (straight-through); "
            "1 = never"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "tau", tuple(float(v) for v in self.tau))
        object.__setattr__(self, "kappa", tuple(float(v) for v in self.kappa))
        if not self.pattern.is_nm or any(":" not in e for e in self.layer_sparsity):
            raise ConfigError("maskllm learns N:M masks: give --sparsity N:M (e.g. 2:4)")
        if self.prior not in PRIORS:
            raise ConfigError(f"prior must be one of {', '.join(PRIORS)}, got {self.prior!r}")
        if min(self.tau) <= 0 or min(self.kappa) <= 0:
            raise ConfigError("tau and kappa must be positive")
        if self.eval_windows < 0:
            raise ConfigError(f"eval_windows must be >= 0, got {self.eval_windows}")
        if self.refit not in REFITS:
            raise ConfigError(f"refit must be one of {', '.join(REFITS)}, got {self.refit!r}")
        if self.noise not in NOISES:
            raise ConfigError(f"noise must be one of {', '.join(NOISES)}, got {self.noise!r}")
        if not 0.0 <= self.straight_through_from <= 1.0:
            raise ConfigError(
                f"straight_through_from must lie in [0, 1], got {self.straight_through_from}"
            )
        if self.blockwise and (self.checkpoint_dir or self.resume):
            raise ConfigError("--blockwise runs do not checkpoint: drop --checkpoint-dir/--resume")
        if self.blockwise and self.fsdp:
            raise ConfigError("--fsdp is for end-to-end training; --blockwise runs one process")
        if self.blockwise and self.distill:
            raise ConfigError(
                "--distill is for end-to-end training; --blockwise already matches the dense "
                "model's block outputs"
            )
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir")
