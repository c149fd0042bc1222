"""The teacher's final hidden states of end-to-end distillation, kept per window.

When none of the trained parameters is a weight of the teacher (GPTQ's distilled scales: the
teacher is the dense weights the scale parametrizations hide), the teacher's output on a window
never changes, and a training that revisits its windows (more steps than windows) need not run
the teacher on a window twice. The hidden states (B, T, H) are small beside the logits; what a
step does with them (the teacher's head, its log-softmax) is unchanged, so the losses are the
very numbers a fresh teacher forward gives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# the most a cache holds; beyond it a window's states are computed and not kept (a window of
# 512 tokens of a 576-wide model is 1.2 MB: SmolLM2's 128 calibration windows take 151 MB)
MAX_BYTES = 1 << 30


class TeacherCache:
    """The teacher's output of each window seen, keyed by the window's token ids."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0
        self._stored: dict[tuple, torch.Tensor] = {}

    def get(self, ids: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The states ``compute()`` gave for these ``ids`` the first time; ``compute()`` for a
        window not seen before (kept while the cache holds under ``max_bytes``)."""
        key = (tuple(ids.shape), str(ids.device), ids.detach().cpu().numpy().tobytes())
        if key in self._stored:
            self.hits += 1
            return self._stored[key]
        hidden = compute().detach()
        size = hidden.numel() * hidden.element_size()
        if self.nbytes + size <= self.max_bytes:
            self._stored[key] = hidden
            self.nbytes += size
        return hidden
