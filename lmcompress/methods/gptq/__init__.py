from lmcompress.methods.gptq.config import GPTQConfig, RTNConfig
from lmcompress.methods.gptq.method import GPTQ, RTN

__all__ = ["GPTQ", "RTN", "GPTQConfig", "RTNConfig"]
