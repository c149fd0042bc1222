from lmcompress.methods.sparsegpt.config import SparseGPTConfig
from lmcompress.methods.sparsegpt.method import SparseGPT

__all__ = ["SparseGPT", "SparseGPTConfig"]
