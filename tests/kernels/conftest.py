"""Kernel tests run the Triton kernels on CPU tensors in Triton's interpreter, which is chosen
when ``@triton.jit`` runs: set it before any test module imports a kernel module. A GPU run
opts out with ``TRITON_INTERPRET=0``."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
