"""MaskLLM's soft N:M mask on CPU in one pass per direction (``lmc_soft_mask_forward`` /
``lmc_soft_mask_backward`` of :file:`cpu_kernels.cpp`): the Gumbel noise, the softmax over the
candidate patterns, the mask and its product with the weight, without the (G, C) and (G, m)
temporaries of the torch path; the backward regenerates the noise and the softmax. Used by
:class:`lmcompress.methods.maskllm.parametrization.LearnableNMMask` where
:func:`soft_mask_supported` (``masks.soft_mask_replayed`` is the torch path).
"""

from __future__ import annotations

import torch

from lmcompress.kernels.cpu_kernels import library


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


# the largest pattern count and group size the fused soft-mask kernels take (8:16 has 12,870
# candidates: such layers use the torch path)
SOFT_MASK_MAX_CANDIDATES, SOFT_MASK_MAX_M = 256, 64


def soft_mask_supported(candidates: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether :func:`soft_mask_forward` / :func:`soft_mask_backward` take these: the library
    built, fp32 CPU tensors, at most ``SOFT_MASK_MAX_CANDIDATES`` patterns of at most
    ``SOFT_MASK_MAX_M`` weights."""
    c, m = candidates.shape
    return (
        c <= SOFT_MASK_MAX_CANDIDATES
        and m <= SOFT_MASK_MAX_M
        and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and library() is not None
    )


def soft_mask_forward(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    kappa: float,
    tau: float,
    noise: tuple[torch.Tensor | None, int, int],
    hard: bool,
    floor: float,
    weight: torch.Tensor | None,
) -> torch.Tensor:
    """``weight ⊙ mask`` (G, m) (``mask`` if ``weight`` is None) for logits (G, C); ``noise`` is
    ``(doubled pool, offset, 0)`` or ``(None, 0, seed)`` (see the C++ source)."""
    logits, candidates = logits.contiguous(), candidates.contiguous()
    pool, offset, seed = noise
    groups, count = logits.shape
    m = candidates.shape[1]
    out = torch.empty((groups, m), dtype=torch.float32)
    w = None if weight is None else weight.contiguous()
    library().lmc_soft_mask_forward(
        logits.data_ptr(), candidates.data_ptr(), groups, count, m, kappa, tau, _ptr(pool),
        0 if pool is None else pool.numel() // 2, offset, seed, int(hard), floor, _ptr(w),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def soft_mask_backward(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    kappa: float,
    tau: float,
    noise: tuple[torch.Tensor | None, int, int],
    grad: torch.Tensor,
    weight: torch.Tensor | None,
) -> torch.Tensor:
    """The logits' gradient (G, C) given the output's ``grad`` (G, m) (see the C++ source)."""
    logits, candidates, grad = logits.contiguous(), candidates.contiguous(), grad.contiguous()
    pool, offset, seed = noise
    groups, count = logits.shape
    out = torch.empty_like(logits)
    w = None if weight is None else weight.contiguous()
    library().lmc_soft_mask_backward(
        logits.data_ptr(), candidates.data_ptr(), groups, count, candidates.shape[1], kappa,
        tau, _ptr(pool), 0 if pool is None else pool.numel() // 2, offset, seed,
        grad.data_ptr(), _ptr(w), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def group_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1).to(torch.uint8)`` for fp32 CPU logits (G, C ≤ 256) in one pass:
    torch's reduction over a dimension of 6 takes ~1.5 s for SmolLM2's 159M logits at one
    thread, ~10x this."""
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.uint8)
    library().lmc_group_argmax(
        logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out
