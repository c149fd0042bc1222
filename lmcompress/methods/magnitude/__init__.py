from lmcompress.methods.magnitude.config import MagnitudeConfig
from lmcompress.methods.magnitude.method import Magnitude

__all__ = ["Magnitude", "MagnitudeConfig"]
