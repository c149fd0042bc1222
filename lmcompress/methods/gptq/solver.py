"""GPTQ (Frantar, Ashkboos, Hoefler & Alistarh 2023, arXiv 2210.17323): weight-only quantization
by OBS updates. Pure tensor math, no model wiring.

For one linear layer the layer-wise problem is ``min_Q ‖W X − Q X‖²_F`` over weights ``Q`` on the
grid (:mod:`~lmcompress.compressor.formats.grid`), with Hessian ``H = 2 X Xᵀ`` (normalised by the
token count). With ``U`` the upper Cholesky factor of ``(H + λI)⁻¹`` (``λ = percdamp · mean diag
H``, dead inputs ``H_jj = 0`` set to ``H_jj = 1`` and ``W[:, j] = 0``) and ``d_j = U_jj``, the
columns are visited in order (Alg. 1 of the paper):

    q_j = quant(w_j),   e_j = (w_j − q_j) / d_j,   W[:, j:] −= e_j · U[j, j:]

with the lazy batch scheme: the update reaches the columns of the current block at once and the
rest of the matrix once per block (``W[:, i2:] −= E · U[i1:i2, i2:]``), here also per sub-block
of :data:`~lmcompress.methods.obs.SUB_BLOCK` columns inside a block, as SparseGPT's solver does.
Both only regroup the same arithmetic.

Grid parameters, as the reference (``IST-DASLab/gptq``, ``GPTQ.fasterquant``):

- per row (``group_size=-1``): from the whole weight before any update;
- per group, in order: from the group's columns as updated so far, when its first column is
  reached (the block and sub-block boundaries are cut at group starts so that the group's
  columns are current there; the reference reads a stale copy when a group starts inside a
  block, which makes no difference at its default group 128 = block 128);
- act-order (``desc_act``): columns visited by decreasing ``diag H``, with *static* groups
  (``static_groups=True``): every group's parameters from the weight before the permutation and
  any update, so the stored groups stay contiguous in the original column order (no g_idx).

Joint pruning (SparseGPT, arXiv 2301.00774, §3.4, "joint sparsification and quantization"): a
pruned weight's target is 0 (code ``z``) instead of its grid value; the mask is chosen as
SparseGPT chooses it (OBS saliency ``w² / d²``: for N:M the ``M − N`` lowest of each row's group
of ``M`` when its first column is reached; unstructured, the lowest ``ratio`` of each block), or
fixed (``mask``: a learned mask, or an earlier stage's zeros). Act-order cannot choose an N:M
mask (the M columns of a group are no longer visited together): refused, a fixed mask is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.formats import grid
from lmcompress.compressor.sparsity import nm_mask, unstructured_mask
from lmcompress.errors import ConfigError
from lmcompress.kernels.int4_reference import BITS, dequantize_codes
from lmcompress.methods.obs import SUB_BLOCK, inverse_hessian_factor


@dataclass
class Quantized:
    """A layer's grid: ``codes`` uint8 (out, in), ``scales`` float32 and ``zeros`` uint8
    (out, groups) over the original column order, ``keep`` bool (out, in) where weights were
    pruned (``None``: none were), and the ``group_size`` (-1: one group per row)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    keep: torch.Tensor | None
    group_size: int

    def weight(self) -> torch.Tensor:
        """``(q − z) · s`` (out, in), float32."""
        return dequantize_codes(self.codes, self.scales, self.zeros, self.group_size)


def check_options(
    shape: tuple[int, int],
    bits: int,
    group_size: int,
    act_order: bool,
    sparsity: Sparsity | None,
    fixed_mask: bool,
    where: str = "the weight",
) -> None:
    """A one-line :class:`ConfigError` for options that cannot quantize a weight of ``shape``."""
    columns = shape[1]
    if bits not in BITS:
        raise ConfigError(f"bits must be one of {', '.join(map(str, BITS))}, got {bits}")
    if group_size != -1 and (group_size < 1 or columns % group_size):
        raise ConfigError(
            f"group_size {group_size} does not divide {where}'s {columns} input columns "
            "(-1: one group per output row)"
        )
    if sparsity is not None and sparsity.is_nm:
        if columns % sparsity.m:
            raise ConfigError(
                f"{where}'s {columns} input columns are not a multiple of M={sparsity.m}"
            )
        if act_order and not fixed_mask:
            raise ConfigError(
                "act-order visits the columns out of order, so it cannot choose an N:M mask "
                "(every group of M together); drop --act-order, or keep an existing mask"
            )
        if group_size != -1 and group_size % sparsity.m and not fixed_mask:
            raise ConfigError(f"group_size {group_size} is not a multiple of M={sparsity.m}")


def block_step(blocksize: int, group_size: int, dynamic: bool, m: int) -> int:
    """Columns per lazy block: ``blocksize``, cut to a multiple of the N:M ``m`` and of a
    dynamic group (or the group itself where it is larger and not a multiple), so that every
    group starts where the columns it reads are current."""
    step = max(m, blocksize - blocksize % m) if m else blocksize
    if dynamic:
        if group_size <= step:
            step -= step % group_size
        elif group_size % step:
            step = group_size
    return step


@torch.no_grad()
def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    symmetric: bool = True,
    act_order: bool = False,
    blocksize: int = 128,
    percdamp: float = 0.01,
    sparsity: Sparsity | None = None,
    mask: torch.Tensor | None = None,
    half_scales: bool = False,
    mse: bool = False,
) -> Quantized:
    """Quantize ``W`` (out, in) given the layer Hessian ``H`` (in, in) (see the module doc);
    ``sparsity`` prunes jointly, ``mask`` (bool, out × in) fixes what is kept; ``half_scales``:
    every group's scale a float16 number, fitted before its codes (``grid.half_scales``);
    ``mse``: each group's range by the reference quantizer's clipping search
    (``grid.grid_params``).
    Computes in float64 for a float64 ``W`` (the Cholesky in float64 for a float64 ``H``), else
    float32, on ``W``'s device; ``W`` and ``H`` are not modified."""
    rows, cols = W.shape
    check_options((rows, cols), bits, group_size, act_order, sparsity, mask is not None)
    if tuple(H.shape) != (cols, cols):
        raise ConfigError(f"Hessian shape {tuple(H.shape)} does not match in_features={cols}")
    compute = torch.float64 if W.dtype == torch.float64 else torch.float32
    H = H.detach().to(W.device, torch.float64 if H.dtype == torch.float64 else torch.float32)
    H = H.clone()
    W = W.detach().to(compute).clone()  # (out, in)
    dead = H.diagonal() == 0
    H.diagonal()[dead] = 1
    W[:, dead] = 0
    size = cols if group_size == -1 else group_size
    dynamic = group_size != -1 and not act_order
    if dynamic:  # filled as each group is reached
        scales = torch.ones(rows, cols // size, device=W.device)
        zeros = torch.zeros(rows, cols // size, device=W.device)
    else:  # static: before any update or permutation
        scales, zeros = grid.group_params(W, bits, group_size, symmetric, half_scales, mse)
    perm = torch.arange(cols, device=W.device)
    if act_order:
        perm = torch.argsort(H.diagonal(), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]
    U = inverse_hessian_factor(H, percdamp, who="GPTQ").to(compute).contiguous()  # (in, in)
    del H
    solver = _Columns(
        Wt=W.T.contiguous(),  # (in, out): a column's update touches contiguous memory
        U=U,
        codes=torch.empty(cols, rows, dtype=torch.uint8, device=W.device),
        keep=_initial_keep(mask, sparsity, perm, cols, rows, W.device),
        scales=scales,
        zeros=zeros,
        group_of=perm // size,  # (in,) each visited column's group
        bits=bits,
        symmetric=symmetric,
        half=half_scales,
        mse=mse,
        size=size if dynamic else 0,
        sparsity=None if mask is not None else sparsity,
    )
    m = sparsity.m if solver.sparsity is not None and sparsity.is_nm else 0
    step = block_step(blocksize, size, dynamic, m)
    for i1 in range(0, cols, step):
        solver.block(i1, min(i1 + step, cols))
    order = torch.argsort(perm)  # visited order -> original order
    codes = solver.codes.T[:, order].contiguous()
    keep = None if solver.keep is None else solver.keep.T[:, order].contiguous()
    return Quantized(codes, scales.float(), zeros.to(torch.uint8), keep, group_size)


def _initial_keep(mask, sparsity, perm, cols, rows, device) -> torch.Tensor | None:
    """(in, out) keep-mask in visited order: the fixed ``mask``, all kept where the solver
    chooses one, ``None`` without pruning."""
    if mask is not None:
        if tuple(mask.shape) != (rows, cols):
            raise ConfigError(f"mask shape {tuple(mask.shape)} does not match W {(rows, cols)}")
        return mask.to(device, torch.bool)[:, perm].T.contiguous()
    if sparsity is not None:
        return torch.ones(cols, rows, dtype=torch.bool, device=device)
    return None


@dataclass
class _Columns:
    """The solver's state (transposed: row ``j`` of ``Wt`` is column ``j`` of W, in visited
    order) and its pass over one block."""

    Wt: torch.Tensor  # (in, out), updated in place
    U: torch.Tensor  # (in, in) upper factor
    codes: torch.Tensor  # (in, out) uint8
    keep: torch.Tensor | None  # (in, out) bool
    scales: torch.Tensor  # (out, groups)
    zeros: torch.Tensor  # (out, groups)
    group_of: torch.Tensor  # (in,)
    bits: int
    symmetric: bool
    half: bool  # float16 scales
    mse: bool  # the clipping search
    size: int  # a dynamic group's width (0: static groups)
    sparsity: Sparsity | None  # chosen by the solver (None: fixed or no pruning)

    def block(self, i1: int, i2: int) -> None:
        """Columns ``i1:i2``: each quantized with the OBS updates inside the block (per
        sub-block, cut at group starts), then the lazy update of the columns after it."""
        W1, U1, d1 = self.Wt[i1:i2], self.U[i1:i2, i1:i2], self.U.diagonal()[i1:i2]
        E1 = torch.empty_like(W1)  # (B, out) scaled errors
        nm = self.sparsity is not None and self.sparsity.is_nm
        if self.sparsity is not None and not nm:  # unstructured: over the whole block
            self.keep[i1:i2] = unstructured_mask(
                W1.square() / d1[:, None].square(), self.sparsity.ratio
            )
        sub = self.sparsity.m * max(1, SUB_BLOCK // self.sparsity.m) if nm else SUB_BLOCK
        s1 = 0
        while s1 < i2 - i1:
            s2 = min(s1 + sub, i2 - i1)
            if self.size:  # the next group start
                s2 = min(s2, ((i1 + s1) // self.size + 1) * self.size - i1)
            for j in range(s1, s2):
                self.column(i1, j, s2, W1, U1, d1, E1)
            W1[s2:].addmm_(U1[s1:s2, s2:].T, E1[s1:s2], alpha=-1)  # lazy, rest of block
            s1 = s2
        self.Wt[i2:].addmm_(self.U[i1:i2, i2:].T, E1, alpha=-1)  # lazy batch update

    def column(self, i1, j, s2, W1, U1, d1, E1) -> None:
        """Quantize visited column ``i1 + j`` (its group's grid first, its N:M mask at the
        first column of a group of M), then update the sub-block's columns after it."""
        c = i1 + j
        if self.size and c % self.size == 0:  # the group's columns are current here
            group = self.Wt[c : c + self.size].T
            scale, zero = grid.grid_params(group, self.bits, self.symmetric, self.half, self.mse)
            self.scales[:, c // self.size], self.zeros[:, c // self.size] = scale, zero
        if self.sparsity is not None and self.sparsity.is_nm and c % self.sparsity.m == 0:
            g = slice(j, j + self.sparsity.m)
            scores = W1[g].square() / d1[g, None].square()  # (M, out)
            self.keep[i1 + j : i1 + j + self.sparsity.m] = nm_mask(
                scores.T, self.sparsity.n, self.sparsity.m
            ).T
        group = self.group_of[c]
        scale = self.scales[:, group].to(W1.dtype)
        zero = self.zeros[:, group].to(W1.dtype)
        q = grid.codes(W1[j], scale, zero, self.bits)  # (out,)
        if self.keep is not None:  # pruned: code z, weight 0
            q = torch.where(self.keep[c], q, zero)
        self.codes[c] = q.to(torch.uint8)
        torch.sub(W1[j], (q - zero).mul_(scale), out=E1[j]).div_(d1[j])  # e = (w − q̂) / d
        W1[j:s2].addr_(U1[j, j:s2], E1[j], alpha=-1)  # OBS update within the sub-block
