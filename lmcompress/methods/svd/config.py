"""Configs of the low-rank family: plain SVD and its weighted variants (ASVD, SVD-LLM, FWSVD,
GFWSVD). All share the parameter budget convention and the rank allocation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from lmcompress.compressor.config import MethodConfig
from lmcompress.errors import ConfigError


def _check_damp(damp: float) -> None:
    if not 0.0 <= damp < 1.0:
        raise ConfigError(f"damp {damp!r} must lie in [0, 1)")


@dataclass(frozen=True)
class LowRankConfig(MethodConfig):
    """Options every low-rank method has (not a method of its own).

    ``ratio`` is the fraction of the selected layers' parameters KEPT (the ASVD convention):
    0.8 keeps about 80 % of them, i.e. removes about 20 %. ``allocation="uniform"``: each layer
    (out m, in n) gets rank ``floor(ratio·m·n/(m+n))`` rounded down to a multiple of 8, so the
    kept count is at most ``ratio`` of the layer's. ``allocation="greedy"``: the same total
    budget shared out by the weighted truncation error each parameter removes
    (``ranks.allocate_ranks``); layers may then stay dense or drop lower. ``ratio = 1`` keeps
    every layer dense.
    """

    method: ClassVar[str] = "low-rank"
    # Fisher weightings compare truncation errors across layers as they are (both estimate
    # the loss increase); the others relative to each layer's total (ranks.allocate_ranks).
    absolute_errors: ClassVar[bool] = False

    ratio: float = field(
        default=0.8,
        metadata={
            "help": "fraction of the selected layers' parameters kept; compare --sparsity "
            "of the pruning methods, the fraction removed"
        },
    )
    allocation: Literal["uniform", "greedy"] = field(
        default="uniform",
        metadata={
            "help": "ranks: the same ratio in every layer, or greedy by the weighted error per "
            "parameter under the same total budget"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # types are checked from here on
        if not 0.0 < self.ratio <= 1.0:
            raise ConfigError(
                f"ratio {self.ratio!r} must lie in (0, 1]: the fraction of parameters kept"
            )


@dataclass(frozen=True)
class SVDConfig(LowRankConfig):
    """Plain truncated SVD: replace each selected linear by a rank-r factor pair."""

    method: ClassVar[str] = "svd"


@dataclass(frozen=True)
class _CalibratedConfig(LowRankConfig):
    calib_batch_size: int = field(
        default=4, metadata={"help": "calibration windows per forward or backward pass"}
    )
    sequential: bool = field(
        default=False,
        metadata={"help": "factorise block by block, each layer weighted by the Gram of its "
                  "inputs in the compressed model (svd-llm; gfwsvd's K-FAC input factor); "
                  "ranks from the dense statistics"},
    )  # fmt: skip
    refit: Literal["none", "output"] = field(
        default="none",
        metadata={"help": "output: re-fit each layer's output factor in closed form to its "
                  "dense output on its inputs in the compressed model, block by block"},
    )  # fmt: skip
    tune_steps: int = field(
        default=0,
        metadata={"help": "block by block: then train each block's factor pairs this many "
                  "steps (one batch of --calib-batch-size windows each) on the block-output "
                  "error against the dense model (0: off)"},
    )  # fmt: skip
    tune_lr: float = field(default=1e-4, metadata={"help": "learning rate of --tune-steps"})
    distill_steps: int = field(
        default=0,
        metadata={"help": "then train every factor pair end to end this many steps (one "
                  "calibration window each) on the KL divergence from the dense model's "
                  "logits (0: off)"},
    )  # fmt: skip
    distill_lr: float = field(default=1e-4, metadata={"help": "learning rate of --distill-steps"})
    stats_nsamples: int = field(
        default=0,
        metadata={"help": "the statistics (and so the ranks) from the first N calibration "
                  "windows only; the block-by-block pass and --distill-steps still use all "
                  "--nsamples of them (0: all)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stats_nsamples < 0:
            raise ConfigError(
                f"stats_nsamples must be >= 0 (0: every window), got {self.stats_nsamples}"
            )
        if self.calib_batch_size < 1:
            raise ConfigError(f"calib_batch_size must be at least 1, got {self.calib_batch_size}")
        for steps, lr in (("tune_steps", "tune_lr"), ("distill_steps", "distill_lr")):
            if getattr(self, steps) < 0 or getattr(self, lr) <= 0:
                raise ConfigError(
                    f"{steps} must be >= 0 and {lr} positive, got {getattr(self, steps)}, "
                    f"{getattr(self, lr)}"
                )


@dataclass(frozen=True)
class ASVDConfig(_CalibratedConfig):
    """ASVD: truncated SVD of W·S, S = diag(mean|x_j|^alpha) of the calibration inputs.

    The factors are mapped back with S⁻¹ (Yuan et al. 2023)."""

    method: ClassVar[str] = "asvd"

    alpha: float = field(
        default=0.5, metadata={"help": "exponent of the mean absolute input per channel"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.alpha <= 4.0:
            raise ConfigError(f"alpha {self.alpha!r} must lie in [0, 4] (ASVD uses 0.5)")


@dataclass(frozen=True)
class SVDLLMConfig(_CalibratedConfig):
    """SVD-LLM: truncated SVD in the space whitened by the Cholesky factor of Σ x xᵀ.

    The dropped singular values are then exactly the layer's output error on the calibration
    inputs (Wang et al. 2024)."""

    method: ClassVar[str] = "svd-llm"

    damp: float = field(
        default=0.0,
        metadata={"help": "first shrinkage of Σxxᵀ towards its mean diagonal; raised ×10 "
                  "until the Cholesky factorisation succeeds"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_damp(self.damp)


@dataclass(frozen=True)
class FWSVDConfig(_CalibratedConfig):
    """FWSVD: truncated SVD of W·D, D = diag(√I_j) from the diagonal empirical Fisher.

    I_j sums the squared LM-loss gradients of input feature j over the output rows; the factors
    are mapped back with D⁻¹ (Hsu et al. 2022)."""

    method: ClassVar[str] = "fwsvd"
    absolute_errors: ClassVar[bool] = True

    calib_batch_size: int = field(
        default=8, metadata={"help": "windows per backward pass (one Fisher sample)"}
    )
    checkpointing: bool = field(
        default=True,
        metadata={"help": "recompute each block in backward: ~30 % more time, and the "
                  "activations of one block instead of all (8 × 512 tokens on SmolLM2: ~11 GB)"},
    )  # fmt: skip


@dataclass(frozen=True)
class GFWSVDConfig(FWSVDConfig):
    """GFWSVD: truncated SVD weighted by a Kronecker-factored Fisher X ⊗ Y, both sides.

    The truncation runs in the space of the factors' Cholesky factors, W̃ = L_Yᵀ W L_X
    (Chekalina et al. 2025)."""

    method: ClassVar[str] = "gfwsvd"

    calib_batch_size: int = field(
        default=8,
        metadata={"help": "windows per backward pass; with --kronecker nearest, one gradient "
                  "sample each (nsamples / calib-batch-size of them are kept)"},
    )  # fmt: skip
    kronecker: Literal["kfac", "nearest"] = field(
        default="kfac",
        metadata={"help": "the factors: K-FAC (Σxxᵀ and Σδδᵀ of the gradient pass) or the "
                  "nearest Kronecker product to the per-sample Fisher (power iteration)"},
    )  # fmt: skip
    damp: float = field(
        default=0.01,
        metadata={"help": "regularisation (1-a)F + a·mean(diag F)·I of each factor, a "
                  "starting here and raised ×10 until the Cholesky factorisation succeeds"},
    )  # fmt: skip
    power_iters: int = field(
        default=4, metadata={"help": "power iterations of --kronecker nearest (at most)"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_damp(self.damp)
        if self.power_iters < 1:
            raise ConfigError(f"power_iters must be at least 1, got {self.power_iters}")
