"""The compressed formats lmcompress ships; importing this package registers them all in
``compressor.runtime.FORMATS``."""

from lmcompress.compressor.formats.int8 import QuantLinear
from lmcompress.compressor.formats.low_rank import LowRankLinear
from lmcompress.compressor.formats.nm_packed import PackedNMLinear
from lmcompress.compressor.formats.nm_packed_int8 import PackedNMInt8Linear

__all__ = ["LowRankLinear", "PackedNMInt8Linear", "PackedNMLinear", "QuantLinear"]
