"""Progress bars that ``-q`` silences.

tqdm reads ``TQDM_DISABLE`` only as a default, and only once, when it is imported; a bar created
with an explicit ``disable=False`` shows whatever the environment says. Every bar in lmcompress
passes ``disable=bar_disabled(...)`` instead, so that ``compress-model -q`` (which sets
``TQDM_DISABLE=1``) and a user's own ``TQDM_DISABLE`` hide them all.
"""

from __future__ import annotations

import os


def bar_disabled(enabled: bool = True) -> bool:
    """``disable=`` for a tqdm bar the caller would show when ``enabled``."""
    return not enabled or os.environ.get("TQDM_DISABLE", "").lower() not in ("", "0", "false")
