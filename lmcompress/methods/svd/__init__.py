"""The low-rank family: plain SVD and the activation- and Fisher-weighted variants."""

from lmcompress.methods.svd.activation import ASVD, SVDLLM
from lmcompress.methods.svd.config import (
    ASVDConfig,
    FWSVDConfig,
    GFWSVDConfig,
    SVDConfig,
    SVDLLMConfig,
)
from lmcompress.methods.svd.fisher import FWSVD, GFWSVD
from lmcompress.methods.svd.method import SVD

__all__ = [
    "ASVD",
    "FWSVD",
    "GFWSVD",
    "SVD",
    "SVDLLM",
    "ASVDConfig",
    "FWSVDConfig",
    "GFWSVDConfig",
    "SVDConfig",
    "SVDLLMConfig",
]
