"""Re-fit the kept weights of a layer under a fixed mask with SparseGPT's OBS updates: what
learned-mask methods (MaskLLM, subnetwork extraction) offer after their masks are learned."""

from __future__ import annotations

import time

import torch
from torch import nn

from lmcompress.compressor.calibration.layerwise import compress_layerwise
from lmcompress.compressor.calibration.observers import HessianAccumulator
from lmcompress.compressor.formats.quant import weight_scale
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.report import LayerReport
from lmcompress.methods.common import prune_layer_
from lmcompress.methods.pruning import PruningConfig
from lmcompress.methods.sparsegpt.method import output_error
from lmcompress.methods.sparsegpt.solver import sparsegpt_prune


def hessian(_name: str, module: nn.Module) -> HessianAccumulator:
    W = weight_matrix(module)
    return HessianAccumulator(W.shape[1], device=W.device)


def int8_row_scales(W: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(out,) symmetric int8 scales of the kept weights of each row: ``absmax / 127`` (1 for a
    row with nothing kept), as the ``int8`` method computes them."""
    absmax = (W.detach().float() * keep.to(W.device)).abs().amax(dim=1)
    return weight_scale(absmax)


@torch.no_grad()
def refit_layer(
    config: PruningConfig,
    name: str,
    module: nn.Module,
    H: torch.Tensor,
    keep: torch.Tensor,
    quantize: bool = False,
) -> LayerReport:
    """SparseGPT's OBS updates with the mask fixed to ``keep``: re-fit the kept weights.
    ``quantize``: onto the int8 grid of each row as well, column by column (the error of each
    rounding re-fitted like a pruned weight's; ``sparsegpt_prune``'s ``quant_scale``). The
    scales come from a plain re-fit first, not from the weights before it as GPTQ takes them:
    the updates grow the kept weights (~1.2-1.3x the row's largest on random masks), and
    clipping them costs more than the rounding saves (measured in the tests)."""
    start = time.perf_counter()
    sparsity = config.sparsity_of(name)
    W = weight_matrix(module).detach()
    keep, scales = keep.to(W.device), None
    if quantize:
        scales = int8_row_scales(sparsegpt_prune(W, H, sparsity, mask=keep)[0], keep)
    W_new, keep = sparsegpt_prune(W, H, sparsity, mask=keep, quant_scale=scales)
    error = output_error(W, W_new, H)
    report = prune_layer_(name, module, keep, sparsity, start, new_weight=W_new)
    report.rel_error, report.error_kind = error, "output"
    return report


def refit(
    config: PruningConfig,
    model: nn.Module,
    data: torch.Tensor,
    layers: dict[str, nn.Module],
    keeps: dict[str, torch.Tensor],
    device: torch.device,
    quantize: bool = False,
) -> dict[str, float]:
    """Re-fit every layer to its mask through the layer-wise loop (each block sees the
    re-fitted blocks before it, as SparseGPT does), onto the int8 grid with ``quantize``.
    Returns relative output errors."""
    reports, _ = compress_layerwise(
        model,
        data,
        layers,
        make_accumulator=hessian,
        compress_layer=lambda n, m, acc: refit_layer(config, n, m, acc.H, keeps[n], quantize),
        device=device,
        batch_size=8,
    )
    return {r.name: r.rel_error for r in reports}
