"""lmcompress: compression and sparsity for pretrained Hugging Face language models.

The public API::

    from lmcompress import load_model, compress, save_compressed, MagnitudeConfig

    model, tokenizer = load_model("smollm2-135m")
    report = compress(model, MagnitudeConfig(sparsity="2:4"))
    save_compressed(model, "out/", report, tokenizer=tokenizer)

A whole job (what ``compress-model`` runs: checks, calibration, evaluation, export) is
``run(RunOptions(checkpoint=..., output=...), SparseGPTConfig(sparsity="2:4"))``.

Names are imported on first use, so ``import lmcompress`` stays fast and importing
``lmcompress.errors`` does not pull in transformers.

``import lmcompress`` also registers the ``lmcompress`` quantizer with transformers (as soon as
transformers' quantizer registry is imported, never importing it itself): afterwards
``AutoModelForCausalLM.from_pretrained(out)`` on an export written with ``dense_copy=False``
builds the compressed runtime modules (:mod:`lmcompress.compressor.io.hf_quantizer`).

The names (``__all__``; ``dir(lmcompress)`` lists them too):

- load, compress, save, reload: ``load_model``, ``compress``, ``save_compressed``,
  ``load_compressed`` (``runtime="dense"`` by default; ``compress-model eval`` loads
  ``packed``), ``CompressionReport`` and ``Stats`` (what ``compress`` returns);
- decoding: ``LeanDecoder`` (``model.forward = LeanDecoder(model)``: one-token CPU steps of a
  Llama, Mistral or Qwen2 model through the lean step, for ``generate`` and ``bench --lean``);
- text and scores: ``tokenize``, ``calibration_windows``, ``perplexity``, ``run_lm_eval``;
- whole jobs: ``run``, ``RunOptions``;
- methods: ``METHODS`` (the registry: name -> method class, each with its ``config_class``),
  ``MethodConfig``, ``parse_sparsity`` and every method's config (``MagnitudeConfig``, ...);
- errors a caller can catch: ``LmcompressError`` and its ``ConfigError`` (with
  ``ArgumentError``: an API argument of the wrong kind), ``ModelLoadError``, ``DataError``.
"""

from __future__ import annotations

import importlib
from typing import Any

from lmcompress.compressor.io import hf_registration as _hf_registration
from lmcompress.version import __version__ as __version__

_EXPORTS = {
    "compress": "lmcompress.api",
    "CompressionReport": "lmcompress.compressor.report",
    "Stats": "lmcompress.compressor.method",
    "MethodConfig": "lmcompress.compressor.config",
    "parse_sparsity": "lmcompress.compressor.config",
    "load_compressed": "lmcompress.compressor.io.load",
    "LeanDecoder": "lmcompress.compressor.lean_decode",
    "save_compressed": "lmcompress.compressor.io.save",
    "load_model": "lmcompress.compressor.model.loading",
    "perplexity": "lmcompress.evaluation.perplexity",
    "tokenize": "lmcompress.evaluation.corpora",
    "calibration_windows": "lmcompress.compressor.calibration.windows",
    "run_lm_eval": "lmcompress.evaluation.lm_eval_adapter",
    "LmcompressError": "lmcompress.errors",
    "ConfigError": "lmcompress.errors",
    "ModelLoadError": "lmcompress.errors",
    "DataError": "lmcompress.errors",
    "ArgumentError": "lmcompress.errors",
    "METHODS": "lmcompress.methods",
    "MagnitudeConfig": "lmcompress.methods.magnitude",
    "WandaConfig": "lmcompress.methods.wanda",
    "SparseGPTConfig": "lmcompress.methods.sparsegpt",
    "MaskLLMConfig": "lmcompress.methods.maskllm",
    "SVDConfig": "lmcompress.methods.svd",
    "ASVDConfig": "lmcompress.methods.svd",
    "SVDLLMConfig": "lmcompress.methods.svd",
    "FWSVDConfig": "lmcompress.methods.svd",
    "GFWSVDConfig": "lmcompress.methods.svd",
    "SubnetConfig": "lmcompress.methods.subnet",
    "StructuredConfig": "lmcompress.methods.structured",
    "Int8Config": "lmcompress.methods.int8",
    "GPTQConfig": "lmcompress.methods.gptq",
    "RTNConfig": "lmcompress.methods.gptq",
    "run": "lmcompress.jobs.run",
    "RunOptions": "lmcompress.jobs.options",
}

__all__ = sorted(_EXPORTS)

_hf_registration.install()


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lmcompress' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
