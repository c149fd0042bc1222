"""Options of the weight-only low-bit methods: round to nearest (``rtn``) and GPTQ (``gptq``),
on one grid (:mod:`~lmcompress.compressor.formats.grid`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from lmcompress.compressor.config import MethodConfig, Sparsity, parse_sparsity
from lmcompress.compressor.training.options import check_distill
from lmcompress.errors import ConfigError
from lmcompress.kernels.int4_reference import BITS
from lmcompress.methods.gptq.solver import check_options

NO_SPARSITY = ("", "none", "0")


@dataclass(frozen=True)
class RTNConfig(MethodConfig):
    """Round to nearest: every weight to the closest point of its group's grid (the baseline
    GPTQ is measured against)."""

    method: ClassVar[str] = "rtn"

    bits: int = field(default=4, metadata={"help": "bits per weight code: 3, 4 or 8"})
    group_size: int = field(
        default=128,
        metadata={"help": "input columns per scale and zero point (-1: one per output row)"},
    )
    sym: bool = field(
        default=True,
        metadata={
            "help": "symmetric grid, every zero point 2^(bits-1) (--no-sym: asymmetric, a zero "
            "point per group)"
        },
    )

    scale_dtype: Literal["float32", "float16"] = field(
        default="float32",
        metadata={
            "help": "float16: every scale a float16 number (stored as float32), fitted before "
            "the codes, as GGUF's Q4_0 / Q8_0 blocks hold them: --export gguf then writes the "
            "runtime's weights exactly"
        },
    )

    observer: Literal["minmax", "mse"] = field(
        default="minmax",
        metadata={
            "help": "each group's range: its min and max (minmax), or the range shrunk to the "
            "least |error|^2.4 of its rounded weights (mse: GPTQ's reference quantizer with "
            "mse=True, llm-compressor's mse observer; outliers clip)"
        },
    )

    head: Literal["float", "quantized"] = field(
        default="float",
        metadata={
            "help": "the output head (lm_head) in float, or on the same grid by round to "
            "nearest: its own codes, a tied input embedding stays float (decoding reads a "
            "quarter of the bytes for it; a larger error)"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits not in BITS:
            raise ConfigError(f"bits must be one of {', '.join(map(str, BITS))}, got {self.bits}")
        if self.group_size != -1 and self.group_size < 1:
            raise ConfigError(
                f"group_size must be a positive number of columns or -1 (per output row), got "
                f"{self.group_size}"
            )


@dataclass(frozen=True)
class GPTQConfig(RTNConfig):
    """GPTQ: column by column onto the grid, each rounding error spread over the columns not
    yet quantized by the OBS update with the layer Hessian; optionally pruning jointly
    (SparseGPT's joint mode) or keeping an earlier stage's zeros."""

    method: ClassVar[str] = "gptq"

    act_order: bool | None = field(
        default=None,
        metadata={
            "help": "visit columns by decreasing Hessian diagonal (desc_act), with static groups; "
            "--no-act-order: in column order, each group fitted when reached",
            "default_text": "on, off where --sparsity N:M chooses the mask",
        },
    )
    blocksize: int = field(default=128, metadata={"help": "columns per lazy-update block"})
    percdamp: float = field(default=0.01, metadata={"help": "dampening, fraction of mean diag H"})
    sparsity: str = field(
        default="none",
        metadata={
            "help": "prune jointly while quantizing: the fraction of weights removed (0.5) or an "
            "N:M pattern, keep N of every M input weights (2:4, stored nm_packed_int4); compare "
            "--ratio of the low-rank methods, the fraction kept"
        },
    )
    keep_mask: bool = field(
        default=False,
        metadata={
            "help": "keep the weights' zeros zero (an earlier pruning stage's mask; with "
            "--sparsity N:M they must form that pattern)"
        },
    )
    hessian_dtype: Literal["float32", "float64"] = field(
        default="float32", metadata={"help": "dtype the Hessian is accumulated and solved in"}
    )
    calib_batch_size: int = field(default=8, metadata={"help": "calibration windows per pass"})
    distill_steps: int = field(
        default=0,
        metadata={"help": "then train every group's scale end to end this many steps (one "
                  "calibration window each) on the KL divergence from the dense model's logits, "
                  "codes and zero points fixed (EfficientQAT's E2E-QP; 0: off; cannot stream)"},
    )  # fmt: skip
    distill_lr: float = field(default=1e-4, metadata={"help": "learning rate of --distill-steps"})

    def __post_init__(self) -> None:
        super().__post_init__()
        text = str(self.sparsity).strip()
        pattern = None if text.lower() in NO_SPARSITY else parse_sparsity(text)
        object.__setattr__(self, "sparsity", "none" if pattern is None else str(pattern))
        object.__setattr__(self, "_pattern", pattern)  # derived: not a field
        if self.act_order is None:  # act-order (llm-compressor's default, "static"), except
            # where the solver chooses an N:M mask: that needs each group of M visited together
            chooses_nm = pattern is not None and pattern.is_nm and not self.keep_mask
            object.__setattr__(self, "act_order", not chooses_nm)
        if self.blocksize < 1:
            raise ConfigError(f"blocksize must be at least 1, got {self.blocksize}")
        if not 0 <= self.percdamp < 1:
            raise ConfigError(f"percdamp must lie in [0, 1), got {self.percdamp}")
        if self.calib_batch_size < 1:
            raise ConfigError(f"calib_batch_size must be at least 1, got {self.calib_batch_size}")
        check_distill(self.distill_steps, self.distill_lr)
        if self.keep_mask and pattern is not None and not pattern.is_nm:
            raise ConfigError(
                f"--keep-mask keeps the existing zeros; --sparsity {pattern} would choose more: "
                "give one or an N:M pattern the zeros form"
            )
        m = pattern.m if pattern is not None and pattern.is_nm else 1
        # the options alone, on a width every pattern and group fits (layers: validate)
        width = m * (self.group_size if self.group_size > 0 else 1)
        check_options(
            (1, width), self.bits, self.group_size, self.act_order, pattern, self.keep_mask
        )

    @property
    def pattern(self) -> Sparsity | None:
        """The parsed ``sparsity`` (``None``: no pruning)."""
        return self._pattern
