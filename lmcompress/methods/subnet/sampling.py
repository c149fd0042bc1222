"""Stochastic subnetwork extraction (Dupont et al., arXiv 2202.12986; code N0ciple/ASLP): the
math of per-weight keep logits.

Every weight owns one logit ``m``, stacked against a fixed 0 logit, so its keep probability is
``sigmoid(m)``. Training samples a keep/drop decision with the Gumbel-softmax of the pair
``(m, 0)``: with ``g1, g2 ~ Gumbel(0, 1)`` and ``l = g1 − g2 ~ Logistic(0, 1)``::

    soft = softmax(((m + g1) / τ, g2 / τ))[0] = sigmoid((m + l) / τ)        (binary concrete)
    hard = 1[m + l > 0]                                    (exactly Bernoulli(sigmoid(m)))

and the forward pass uses ``hard`` with the soft sample's gradient (straight-through,
``hard + soft − soft.detach()``). Extraction keeps ``m ≥ 0`` (the paper: sparsity emerges), or,
for a target sparsity, the top logits of the layer (exactly that sparsity).

N:M targets go through MaskLLM's candidate machinery: conditioned on exactly ``n`` of a group's
``m`` independent Bernoulli(sigmoid(m_j)) being kept, pattern ``c`` has probability
``∝ exp(Σ_{j∈c} m_j)``; so the candidate logits are ``logits_group @ candidatesᵀ`` and one
pattern per group is drawn with a hard Gumbel-softmax over them. Extraction keeps the group's
``n`` largest logits (= the most probable pattern).
"""

from __future__ import annotations

import torch

from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.sparsity import nm_mask


def logistic_noise(
    shape: torch.Size | tuple[int, ...],
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Logistic(0, 1) noise, ``log u − log(1 − u)`` (the difference of two Gumbel samples)."""
    u = _open_uniform(shape, device, generator)
    return u.log() - torch.log1p(-u)


def gumbel_noise(
    shape: torch.Size | tuple[int, ...],
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Gumbel(0, 1) noise, ``−log(−log u)``."""
    return -torch.log(-torch.log(_open_uniform(shape, device, generator)))


def _open_uniform(shape, device, generator) -> torch.Tensor:
    """Uniform samples kept inside (0, 1), so that their logarithms stay finite."""
    u = torch.rand(shape, device=device, generator=generator)
    return u.clamp_(torch.finfo(u.dtype).tiny, 1 - torch.finfo(u.dtype).eps)


def topk_sample(logits: torch.Tensor, kept: int, tau: float, noise: torch.Tensor) -> torch.Tensor:
    """Exactly ``kept`` of the 1-D ``logits`` kept: the top ``kept`` of ``logits + noise``
    (Gumbel noise: a sample without replacement from ``softmax(logits)``, Kool et al. 2019, the
    Gumbel-top-k trick). Forward the exact 0/1 mask; backward the gradient of
    ``sigmoid((m + g − t) / τ)``, ``t`` midway between the last kept and the first dropped
    perturbed logit and held fixed (straight-through, as :func:`keep_sample`)."""
    if not 0 < kept <= logits.numel():
        raise ValueError(f"keep 1 to {logits.numel()} of the logits, not {kept}")
    if kept == logits.numel():
        return torch.ones_like(logits)
    perturbed = logits + noise
    top = perturbed.detach().topk(kept + 1)  # the kept ones and the first dropped
    threshold = (top.values[kept - 1] + top.values[kept]) / 2
    soft = torch.sigmoid((perturbed - threshold) / tau)
    sample = torch.zeros_like(soft)
    sample[top.indices[:kept]] = 1.0
    return sample + (soft - soft.detach())


def keep_sample(
    logits: torch.Tensor, tau: float, noise: torch.Tensor, hard: bool = True
) -> torch.Tensor:
    """One keep/drop sample per weight: the binary concrete ``sigmoid((m + l) / τ)``; with
    ``hard`` the exact 0/1 sample in forward, the soft sample's gradient in backward."""
    soft = torch.sigmoid((logits + noise) / tau)
    if not hard:
        return soft
    sample = (logits + noise > 0).to(soft.dtype)
    return sample + (soft - soft.detach())


def nm_sample(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    tau: float,
    noise: torch.Tensor,
    hard: bool = True,
    kappa: float = 1.0,
) -> torch.Tensor:
    """One N:M pattern per group of ``m`` weights: logits (..., in) with in % m == 0, candidates
    (C, m), Gumbel noise (G, C). ``kappa`` scales the patterns' log-probabilities (MaskLLM's κ:
    > 1 sharpens the distribution towards the most probable pattern). Returns the sampled mask
    shaped like ``logits``."""
    m = candidates.shape[1]
    groups = logits.reshape(-1, m) @ candidates.T  # (G, C): the patterns' log-probabilities
    if kappa != 1.0:
        groups = groups * kappa
    soft = torch.softmax((groups + noise) / tau, dim=-1)
    if hard:
        index = (groups + noise).argmax(-1, keepdim=True)
        one_hot = torch.zeros_like(soft).scatter_(-1, index, 1.0)
        soft = one_hot + (soft - soft.detach())
    return (soft @ candidates).reshape(logits.shape)


def keep_probability(logits: torch.Tensor) -> torch.Tensor:
    """Each weight's keep probability under the unstructured sampler."""
    return torch.sigmoid(logits)


def extract_keep(logits: torch.Tensor, target: Sparsity | None) -> torch.Tensor:
    """The deterministic keep-mask (bool, shaped like ``logits``): ``logits ≥ 0`` without a
    target (the paper); the top ``round((1 − s) · numel)`` logits of the layer for a fraction
    ``s`` (ties broken by position: exactly that many kept); the top ``n`` of every group of
    ``m`` for N:M."""
    if target is None:
        return logits >= 0
    if target.is_nm:
        return nm_mask(logits, target.n, target.m)
    flat = logits.flatten()
    kept = flat.numel() - round(target.ratio * flat.numel())
    keep = torch.zeros(flat.numel(), dtype=torch.bool, device=logits.device)
    keep[torch.topk(flat, kept, sorted=False).indices] = True
    return keep.reshape(logits.shape)
