"""The imports lmcompress makes inside functions, in one place: every other import is at the top
of its module (``tests/test_architecture.py`` holds the package to this list).

- :data:`OPTIONAL`: heavy dependencies that only one feature needs. They are imported where the
  feature starts, so that a CPU-only install, or a job that never draws a plot, neither needs
  nor pays for them. A module of ours that imports one at its top (the Triton kernels) is
  itself imported lazily, for the same reason.
- :data:`DEFERRED`: our modules imported later than their importer on purpose, each with why.
"""

from __future__ import annotations

OPTIONAL: dict[str, str] = {
    "triton": "the GPU kernels (kernels/*_triton.py), on the first CUDA call",
    "matplotlib": "report.png and the softmax-bias plot",
    "lm_eval": "lm-evaluation-harness tasks (the eval extra)",
    "datasets": "lm-eval's task data and the Hugging Face corpora (with lm_eval)",
    "compressed_tensors": "the interop extra (transformers reads int8 exports through it)",
    "gguf": "--export gguf's writer (0.8 s to import; transformers imports it to read a GGUF)",
}

DEFERRED: dict[str, str] = {
    "lmcompress.cli.main -> lmcompress.cli.*": (
        "`compress-model --help` is answered without importing torch (lmcompress.cli.help_spec): "
        "each command's module, which imports torch, is imported when the command runs"
    ),
    "lmcompress.cli.optimum -> lmcompress.cli.compress": (
        "`optimum-cli lmcompress --help` likewise: the job's parser and runner import torch, "
        "so only a job imports them"
    ),
    "lmcompress.compressor.io.hf_registration -> lmcompress.compressor.io.hf_quantizer": (
        "transformers' quantizer registry costs seconds to import, which `import lmcompress` "
        "must not: the quantizer is imported when transformers imports its registry"
    ),
    "lmcompress.compressor.io.hf_quantizer -> lmcompress.compressor.*": (
        "the quantizer is registered while transformers imports itself, possibly in the middle "
        "of importing one of our model modules: it imports them when from_pretrained calls it"
    ),
}
