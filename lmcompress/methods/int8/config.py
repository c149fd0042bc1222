"""Options of the int8 method: W8A8 linears and an optional 8-bit softmax with its correction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from lmcompress.compressor.config import MethodConfig
from lmcompress.errors import ConfigError

SOFTMAX_SCALES = {"1/255": 1 / 255, "1/256": 1 / 256}


@dataclass(frozen=True)
class Int8Config(MethodConfig):
    """W8A8: int8 weights (symmetric, per output channel or per group of inputs) and int8
    activations (per token, dynamic; or per tensor, static from calibration), optionally with
    an 8-bit softmax whose rounding bias is corrected offline (Pandey et al. 2023,
    reconstructed: see ``softmax.py``)."""

    method: ClassVar[str] = "int8"

    bits: int = field(default=8, metadata={"help": "weight and activation bits (8 only)"})
    activations: Literal["dynamic", "static"] = field(
        default="dynamic",
        metadata={"help": "activation scales: per token at run time, or per tensor calibrated"},
    )
    group_size: int = field(
        default=0,
        metadata={
            "help": "input channels per weight scale",
            "default_text": "0, per output channel",
        },
    )
    softmax_bits: int = field(
        default=0,
        metadata={"help": "attention probabilities in 8 bits (8) or float (0)"},
    )
    softmax_scale: Literal["1/255", "1/256"] = field(
        default="1/255", metadata={"help": "step of the 8-bit probabilities"}
    )
    bias_correction: Literal["none", "layer", "head"] = field(
        default="none",
        metadata={"help": "offline softmax bias correction: per layer (the paper) or per head"},
    )
    smooth_alpha: float = field(
        default=0.0,
        metadata={
            "help": "SmoothQuant: move activation outliers into the weights with strength alpha "
            "before quantizing (0: off; the paper uses 0.5); llama, mistral, qwen2, qwen3"
        },
    )
    head: Literal["float", "int8"] = field(
        default="float",
        metadata={
            "help": "the output head (lm_head) in float, or W8A8 too: its own int8 codes, a "
            "tied input embedding stays float (faster decoding, a larger error)"
        },
    )
    path: Literal["int", "simulated"] = field(
        default="int",
        metadata={"help": "int8 matmuls (torch._int_mm) or quantize-dequantize in float"},
    )
    calib_batch_size: int = field(default=4, metadata={"help": "calibration windows per pass"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits != 8:
            raise ConfigError(f"bits must be 8 (int8 weights and activations), got {self.bits}")
        if self.softmax_bits not in (0, 8):
            raise ConfigError(
                f"softmax_bits must be 8 (an 8-bit softmax) or 0 (float), got {self.softmax_bits}"
            )
        if self.bias_correction != "none" and self.softmax_bits != 8:
            raise ConfigError("--bias-correction corrects the 8-bit softmax: add --softmax-bits 8")
        if self.group_size < 0:
            raise ConfigError(f"group_size must be >= 0 (0: per channel), got {self.group_size}")
        if not 0.0 <= self.smooth_alpha < 1.0:
            raise ConfigError(f"smooth_alpha must lie in [0, 1) (0: off), got {self.smooth_alpha}")
        if self.calib_batch_size < 1:
            raise ConfigError(f"calib_batch_size must be at least 1, got {self.calib_batch_size}")

    @property
    def softmax_step(self) -> float:
        return SOFTMAX_SCALES[self.softmax_scale]
