"""Register lmcompress's quantizer with transformers without importing transformers.

transformers dispatches ``from_pretrained`` on ``quantization_config.quant_method`` through the
registry in ``transformers.quantizers.auto``, and importing that module costs seconds (it
imports every quantizer), which ``import lmcompress`` must not. :func:`install` registers at
once if the module is already imported, and otherwise puts a finder on ``sys.meta_path`` that
registers right after the module's first import: by the time ``from_pretrained`` reads a
``config.json``, the quantizer is known. The finder finds nothing itself and removes itself once
it has seen the module.
"""

from __future__ import annotations

import logging
import sys

_REGISTRY = "transformers.quantizers.auto"


def install() -> None:
    """Register now, or right after transformers' quantizer registry is first imported."""
    if _REGISTRY in sys.modules:
        _register()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def _register() -> None:
    """A failure is logged, never raised: it would break every ``from_pretrained``."""
    try:
        from lmcompress.compressor.io.hf_quantizer import register

        register()
    except (ImportError, AttributeError, TypeError, ValueError) as err:
        logging.getLogger(__name__).warning(
            "lmcompress could not register its transformers quantizer: %s", err
        )


class _RegisterAfterImport:
    """A ``sys.meta_path`` finder (duck-typed: ``importlib.abc`` costs milliseconds to import)
    that wraps the loader of :data:`_REGISTRY`, found by the other finders, so that
    :func:`_register` runs after the module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _REGISTRY:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _register()

        loader.exec_module = exec_module  # this spec's loader instance only
        return spec
