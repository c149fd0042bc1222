"""One-shot structured pruning into a smaller dense model: MLP channels, KV groups and decoder
blocks removed by magnitude, an activation-aware score or the blocks' angular distance."""

from lmcompress.methods.structured.config import StructuredConfig
from lmcompress.methods.structured.method import Structured

__all__ = ["Structured", "StructuredConfig"]
