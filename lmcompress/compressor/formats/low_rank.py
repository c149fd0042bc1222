"""The ``low_rank`` format: a linear layer stored as two thin factors, ``W ≈ B @ A``.

``A`` (r, in) projects the input down to rank r, ``B`` (out, r) projects back up, so a layer of
``out · in`` weights stores ``r · (out + in)``: smaller whenever ``r < out · in / (out + in)``.
The forward pass is two matmuls, ``x Aᵀ`` then ``(x Aᵀ) Bᵀ + b``, and never builds ``W``.

:func:`truncated_svd` is the plain (unweighted) factorisation; weighted variants (Fisher SVD)
compute their own factors and build the module with :meth:`LowRankLinear.from_factors`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.formats.registry import register_format
from lmcompress.compressor.formats.schema import (
    FLOAT,
    LINEAR_META,
    MetaField,
    Schema,
    StoredTensor,
    bias_tensor,
    positive_int,
)
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.errors import ConfigError
from lmcompress.kernels import cpu_kernels, lean_ops, ops


@torch.no_grad()
def truncated_svd(W: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best rank-``rank`` approximation of ``W`` (out, in) in Frobenius norm, as factors
    ``A`` (rank, in) and ``B`` (out, rank) with ``B @ A = U_r S_r V_rᵀ`` (Eckart–Young).

    √S goes to both sides (``A = √S_r V_rᵀ``, ``B = U_r √S_r``) so that the two factors have
    the same scale: neither over- nor underflows when stored in fp16/bf16. The SVD runs in
    float32 (float64 for a float64 ``W``) on ``W``'s device; the factors come back in ``W``'s
    dtype.
    """
    out_features, in_features = W.shape
    if not 1 <= rank <= min(out_features, in_features):
        raise ConfigError(
            f"rank {rank} is impossible for a {out_features}x{in_features} weight "
            f"(need 1 <= rank <= {min(out_features, in_features)})"
        )
    compute = torch.float64 if W.dtype == torch.float64 else torch.float32
    U, S, Vh = torch.linalg.svd(W.to(compute), full_matrices=False)  # (out, k), (k,), (k, in)
    root = S[:rank].sqrt()  # (r,)
    A = root[:, None] * Vh[:rank]  # (r, in)
    B = U[:, :rank] * root[None, :]  # (out, r)
    return A.to(W.dtype).contiguous(), B.to(W.dtype).contiguous()


# A (r, in) and B (out, r) in the export's dtype; bias (out,) exactly when meta says so
LOW_RANK = Schema(
    meta={**LINEAR_META, "rank": positive_int(), "bias": MetaField((bool,), required=False)},
    tensors={
        "A": StoredTensor(FLOAT, lambda meta: (meta["rank"], meta["in_features"])),
        "B": StoredTensor(FLOAT, lambda meta: (meta["out_features"], meta["rank"])),
        "bias": bias_tensor(present=lambda meta: bool(meta.get("bias"))),
    },
)


@register_format
class LowRankLinear(CompressedLinear):
    """``y = (x Aᵀ) Bᵀ + b``: a rank-r stand-in for an ``nn.Linear`` or GPT-2 ``Conv1D``.

    ``A`` and ``B`` are parameters (a later method may fine-tune them); ``bias`` is the
    original layer's bias, or ``None``.
    """

    format = "low_rank"
    schema = LOW_RANK

    def __init__(
        self,
        A: torch.Tensor,
        B: torch.Tensor,
        bias: torch.Tensor | None = None,
        conv1d: bool = False,
    ) -> None:
        rank, in_features = A.shape
        out_features, rank_b = B.shape
        if rank_b != rank:
            raise ValueError(f"factor shapes disagree: A {tuple(A.shape)}, B {tuple(B.shape)}")
        super().__init__(in_features, out_features, conv1d=conv1d)
        self.rank = rank
        self.A = nn.Parameter(A, requires_grad=False)  # (r, in)
        self.B = nn.Parameter(B, requires_grad=False)  # (out, r)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # (out,)

    @classmethod
    def from_factors(
        cls,
        A: torch.Tensor,
        B: torch.Tensor,
        bias: torch.Tensor | None = None,
        conv1d: bool = False,
    ) -> LowRankLinear:
        """Build from factors computed elsewhere (weighted SVD variants)."""
        return cls(A.detach(), B.detach(), None if bias is None else bias.detach(), conv1d)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Module, rank: int) -> LowRankLinear:
        """Factor ``linear`` (``nn.Linear`` or ``Conv1D``) by truncated SVD at ``rank``."""
        A, B = truncated_svd(weight_matrix(linear).detach(), rank)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(A, B, bias, conv1d=isinstance(linear, Conv1D))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {"A": self.A.detach(), "B": self.B.detach()}
        if self.bias is not None:
            tensors["bias"] = self.bias.detach()
        return tensors

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "rank": self.rank, "bias": self.bias is not None}

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> LowRankLinear:
        """Rebuild from :meth:`state_tensors` and :meth:`meta`, checked against
        :data:`LOW_RANK`."""
        cls.schema.check("low_rank", tensors, meta)
        return cls(tensors["A"], tensors["B"], tensors.get("bias"), conv1d=bool(meta.get("conv1d")))

    @torch.no_grad()
    def dense_weight(self) -> torch.Tensor:
        """``B @ A`` (out, in), accumulated in float32 for half-precision factors."""
        compute = torch.promote_types(self.A.dtype, torch.float32)
        return (self.B.to(compute) @ self.A.to(compute)).to(self.A.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        """``(x Aᵀ) Bᵀ + b``: the low-rank kernel for a few tokens on CPU, else two linears
        (:func:`ops.low_rank_linear`); while ``torch.compile`` traces a few tokens without
        gradients, the same computation as one op (``lean_ops.low_rank_layer``)."""
        if (
            lean_ops.traced_cpu(x, self.in_features, cpu_kernels.LOW_RANK_MAX_TOKENS)  # eager: no
            and self.A.dtype == self.B.dtype == x.dtype
            and not (torch.is_grad_enabled() and (self.A.requires_grad or self.B.requires_grad))
        ):
            return lean_ops.low_rank_layer(x, self.A, self.B, self.bias)
        return ops.low_rank_linear(x, self.A, self.B, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, bias={self.bias is not None}"
