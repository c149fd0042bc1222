from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from lmcompress.compressor.config import MethodConfig
from lmcompress.compressor.model.structure import KINDS
from lmcompress.compressor.training.options import check_distill
from lmcompress.errors import ConfigError

CHANNEL_MULTIPLE_HELP = (  # structured's and subnet --structure's --channel-multiple
    "the kept MLP width a multiple of this (32: GGUF's Q4_0 / Q8_0 blocks and a 4-bit "
    "--group-size 32 then fit it; 64 or 128: what GPU kernels tile by); 1: any"
)


@dataclass(frozen=True)
class StructuredConfig(MethodConfig):
    """One-shot structured pruning: remove whole MLP channels, KV groups (with their query
    heads) and decoder blocks, the same widths in every block, so that the result is a
    standard checkpoint of the same architecture, smaller (``compressor.model.structure``).

    ``ratio`` is the fraction of the decoder blocks' parameters KEPT (the low-rank methods'
    convention). Widths are ranked by ``score``: ``magnitude`` (the sum of ``|W|`` over a
    structure's weights) or ``activation`` (Wanda's ``|W| · ‖x‖`` summed over them, the
    structured form of Wanda, "Wanda-sp" in An et al. 2024, FLAP); blocks by the angular
    distance between the hidden states before and after them (Gromov et al. 2024)."""

    method: ClassVar[str] = "structured"

    structure: tuple[str, ...] = field(
        default=("channels",),
        metadata={"help": f"what to remove, any of: {', '.join(KINDS)}", "metavar": "KIND"},
    )
    ratio: float = field(
        default=0.8,
        metadata={
            "help": "fraction of the decoder blocks' parameters kept; compare --sparsity of "
            "the pruning methods (and of subnet --structure), the fraction removed"
        },
    )
    score: Literal["activation", "magnitude"] = field(
        default="activation",
        metadata={"help": "rank channels and KV groups by |W| times the input norm, or by |W|"},
    )
    channel_multiple: int = field(default=1, metadata={"help": CHANNEL_MULTIPLE_HELP})
    calib_batch_size: int = field(
        default=4, metadata={"help": "calibration windows per forward pass"}
    )
    distill_steps: int = field(
        default=0,
        metadata={"help": "then train the pruned model's decoder weights this many steps (one "
                  "calibration window each) on the KL divergence from the dense model's "
                  "logits (0: off)"},
    )  # fmt: skip
    distill_lr: float = field(default=1e-4, metadata={"help": "learning rate of --distill-steps"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.structure or len(set(self.structure)) != len(self.structure):
            raise ConfigError(f"structure: one or more of {', '.join(KINDS)}, each once")
        unknown = [k for k in self.structure if k not in KINDS]
        if unknown:
            raise ConfigError(f"unknown structure {unknown[0]!r}; choose from {', '.join(KINDS)}")
        if not 0.0 < self.ratio < 1.0:
            raise ConfigError(f"ratio {self.ratio!r} must lie in (0, 1): the fraction kept")
        if self.include or self.exclude:
            raise ConfigError("structured pruning removes whole structures: no --include/--exclude")
        if self.calib_batch_size < 1:
            raise ConfigError(f"calib_batch_size must be >= 1, got {self.calib_batch_size}")
        check_distill(self.distill_steps, self.distill_lr)
        check_channel_multiple(self.channel_multiple, self.structure)


def check_channel_multiple(multiple: int, structure: tuple[str, ...]) -> None:
    """``--channel-multiple``: a positive number, and only where MLP channels are removed."""
    if multiple < 1:
        raise ConfigError(f"channel_multiple must be >= 1, got {multiple}")
    if multiple > 1 and "channels" not in structure:
        raise ConfigError("--channel-multiple rounds the MLP width: it needs --structure channels")
