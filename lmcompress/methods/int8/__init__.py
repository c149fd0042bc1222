"""int8: W8A8 linears and an 8-bit softmax with offline bias correction."""

from lmcompress.methods.int8.config import Int8Config
from lmcompress.methods.int8.method import Int8

__all__ = ["Int8", "Int8Config"]
