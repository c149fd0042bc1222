"""The learnable subnetwork of one linear layer, as a ``torch.nn.utils.parametrize``
parametrization of its frozen weight: ``W -> scale · W ⊙ mask``.

``mask`` is a fresh straight-through sample of the keep logits every forward (unstructured: one
Bernoulli per weight; N:M: one pattern per group, see ``sampling``), or, with ``hard`` on, the
deterministic extracted mask (``sampling.extract_keep``), so the parametrized model in hard mode
computes exactly what the extracted one does. ``scale`` is ASLP's learned rescaling: one scalar
per layer (the paper), one per output row, or none.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn

from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.training.gumbel import candidate_patterns, gumbel_noise
from lmcompress.methods.subnet.sampling import extract_keep, keep_sample, logistic_noise, nm_sample

Scale = Literal["layer", "row", "none"]
SCALES: tuple[str, ...] = get_args(Scale)


class KeepLogitMask(nn.Module):
    """Keep logits (out, in) for an ``(out, in)`` weight (``transposed``: stored ``(in, out)``,
    as GPT-2's Conv1D does); ``target`` is the sparsity extraction aims at (``None``: the
    paper's ``logit ≥ 0``); N:M targets are also sampled as N:M patterns."""

    def __init__(
        self,
        logits: torch.Tensor,
        target: Sparsity | None,
        scale: Scale = "layer",
        tau: float = 1.0,
        transposed: bool = False,
    ) -> None:
        super().__init__()
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
        self.logits = nn.Parameter(logits)
        self.target, self.tau, self.transposed = target, tau, transposed
        self.kappa = 1.0  # N:M: the scale of the pattern logits (a schedule sets it per step)
        self.hard = False  # True: the extracted mask instead of a sample
        shape = {"layer": (), "row": (logits.shape[0], 1), "none": None}[scale]
        self.scale = (
            nn.Parameter(torch.ones(shape, dtype=logits.dtype, device=logits.device))
            if shape is not None
            else None
        )
        nm = target is not None and target.is_nm
        candidates = candidate_patterns(target.n, target.m, logits.dtype) if nm else None
        self.register_buffer("candidates", candidates, persistent=False)

    def trainable(self, prefix: str) -> dict[str, nn.Parameter]:
        """The parameters to train, named ``prefix.logits`` / ``prefix.scale``."""
        params = {f"{prefix}.logits": self.logits}
        if self.scale is not None:
            params[f"{prefix}.scale"] = self.scale
        return params

    def keep(self) -> torch.Tensor:
        """The extracted keep-mask, bool (out, in)."""
        return extract_keep(self.logits.detach(), self.target)

    def mask(self) -> torch.Tensor:
        """The mask times the scale, (out, in): a straight-through sample, or the extracted
        mask in ``hard`` mode."""
        if self.hard:
            mask = self.keep().to(self.logits.dtype)
        elif self.candidates is not None:
            groups = self.logits.numel() // self.candidates.shape[1]
            noise = gumbel_noise((groups, self.candidates.shape[0]), device=self.logits.device)
            mask = nm_sample(self.logits, self.candidates, self.tau, noise, kappa=self.kappa)
        else:
            noise = logistic_noise(self.logits.shape, device=self.logits.device)
            mask = keep_sample(self.logits, self.tau, noise)
        return mask if self.scale is None else mask * self.scale

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        mask = self.mask().to(weight.dtype)
        return weight * (mask.T if self.transposed else mask)
