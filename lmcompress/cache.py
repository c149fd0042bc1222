"""Where lmcompress caches what it derives once (the dequantized SmolLM2, the clean wiki text,
the compiled CPU kernels): a leaf, so that the kernels below the core and the core share it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$LMCOMPRESS_CACHE``, else ``$XDG_CACHE_HOME/lmcompress``, else ``~/.cache/lmcompress``."""
    if os.environ.get("LMCOMPRESS_CACHE"):
        return Path(os.environ["LMCOMPRESS_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "lmcompress"
    return Path.home() / ".cache" / "lmcompress"
