from lmcompress.methods.maskllm.config import MaskLLMConfig
from lmcompress.methods.maskllm.method import MaskLLM

__all__ = ["MaskLLM", "MaskLLMConfig"]
