"""The method registry: an explicit map from name to method class (no import-time discovery).

Adding a method = one subpackage with ``config.py`` and ``method.py`` plus one line here.
"""

from __future__ import annotations

from lmcompress.compressor.method import Method
from lmcompress.errors import ConfigError, shown
from lmcompress.methods.gptq import GPTQ, RTN
from lmcompress.methods.int8 import Int8
from lmcompress.methods.magnitude import Magnitude
from lmcompress.methods.maskllm import MaskLLM
from lmcompress.methods.sparsegpt import SparseGPT
from lmcompress.methods.structured import Structured
from lmcompress.methods.subnet import Subnet
from lmcompress.methods.svd import ASVD, FWSVD, GFWSVD, SVD, SVDLLM
from lmcompress.methods.wanda import Wanda

METHODS: dict[str, type[Method]] = {
    "magnitude": Magnitude,
    "wanda": Wanda,
    "sparsegpt": SparseGPT,
    "maskllm": MaskLLM,
    "subnet": Subnet,
    "structured": Structured,
    "svd": SVD,
    "asvd": ASVD,
    "svd-llm": SVDLLM,
    "fwsvd": FWSVD,
    "gfwsvd": GFWSVD,
    "int8": Int8,
    "rtn": RTN,
    "gptq": GPTQ,
}


def get_method(name: str) -> type[Method]:
    if not isinstance(name, str) or name not in METHODS:  # a recipe's method can be a list
        raise ConfigError(f"unknown method {shown(name)}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]
