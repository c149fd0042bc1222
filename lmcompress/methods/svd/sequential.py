"""Low rank block by block (``--sequential``, ``--refit output``; beyond the reference
implementations, which take every statistic from the dense model before any layer changes).

SparseGPT's strength is that each layer is compressed for the inputs it will see: those of the
already-compressed layers below it. Here the same layer-wise loop (the core's
``compress_layerwise``) runs over the model after the dense statistics are collected and the
ranks allocated from them; in each block, every selected layer's input Gram ``Σ = Σ x xᵀ`` is
accumulated on the compressed model's hidden states, then

- ``sequential``: the method's input-side statistic is that Σ instead of the dense one
  (SVD-LLM's Gram; GFWSVD's K-FAC input factor, its output factor staying the dense
  gradients'), so the truncation minimises the error on the inputs the layer will get;
- ``refit="output"``: after the truncation, the output factor B of ``W ≈ B A`` is re-fitted in
  closed form to the layer's dense output on those inputs, A fixed:
  ``B' = argmin ‖(W − B' A) X‖² + λ ‖B' − B‖² = (W Σ Aᵀ + λ B)(A Σ Aᵀ + λ I)⁻¹``,
  λ = ``REFIT_DAMP`` × the mean diagonal of ``A Σ Aᵀ``. Any output-side weighting (GFWSVD's
  gradient factor) leaves this minimiser unchanged: B' is the least-squares fit of every
  output row alike.

- ``tune_steps``: after a block's layers are factorised (with or without the two above), its
  factor pairs are trained on the block-output error against the dense model, the dense and
  the compressed streams side by side (the core's ``drivers.learn_blockwise``, as MaskLLM's
  and subnet's ``--tune-steps``; optimiser ``training.tuning.TUNE_OPTIMIZER``): the factors
  of one layer compensate the truncation error of the others, and of the blocks below.

The compressed layer's product ``B A`` replaces the weight inside the loop, so the next block
sees the compressed outputs; the modules are swapped for their factor pairs at the end.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.calibration.layerwise import compress_layerwise
from lmcompress.compressor.calibration.observers import HessianAccumulator
from lmcompress.compressor.formats.low_rank import LowRankLinear
from lmcompress.compressor.method import Method, Stats
from lmcompress.compressor.model.surgery import replace_modules, weight_matrix
from lmcompress.compressor.report import CompressionReport
from lmcompress.compressor.training.drivers import Learnable, learn_blockwise, training_extra
from lmcompress.compressor.training.trainer import TrainConfig
from lmcompress.compressor.training.tuning import TUNE_OPTIMIZER, distill_config
from lmcompress.methods.common import count_params
from lmcompress.methods.svd.tuning import block_learnable, distill_factors

CURVE_KEYS = ("step", "rel_err", "loss", "lm_loss", "kl")
REFIT_DAMP = 1e-2  # of the mean diagonal of A Σ Aᵀ, as SparseGPT's percdamp


@torch.no_grad()
def output_refit(
    W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, gram: torch.Tensor, damp: float = REFIT_DAMP
) -> torch.Tensor:
    """The output factor (out, r) minimising ``‖(W − B' A) X‖² + λ‖B' − B‖²`` for the inputs
    whose Gram is ``gram`` (in, in); ``A`` (r, in), ``B`` (out, r). Float64, in B's dtype."""
    G, A64 = gram.to(W.device, torch.float64), A.to(torch.float64)
    AG = A64 @ G  # (r, in)
    lhs = AG @ A64.T  # (r, r), symmetric
    lam = damp * float(lhs.diagonal().mean().clamp_min(1e-300))
    rhs = W.to(torch.float64) @ AG.T + lam * B.to(torch.float64)  # (out, r)
    lhs.diagonal().add_(lam)
    return torch.linalg.solve(lhs, rhs.T).T.to(B.dtype).contiguous()


def _layer_stats(stats: Stats, name: str, key: str | None, gram: torch.Tensor) -> Stats:
    """``name``'s statistics, its input-side one (``key``) replaced by ``gram``."""
    prefix = f"{name}."
    tensors = {k: v for k, v in stats.tensors.items() if k.startswith(prefix)}
    if key is not None:
        tensors[prefix + key] = gram
    return Stats(tensors=tensors, meta=stats.meta)


def compress_sequential(
    method: Method, model: nn.Module, data: torch.Tensor, stats: Stats
) -> CompressionReport:
    """Factorise ``method``'s layers (a ``LowRankMethod``: ``ranks``, ``factorize``,
    ``input_gram``, ``finish_report``) block by block on the compressed model's inputs (see the
    module doc); ``stats``: the dense statistics, which allocate the ranks."""
    start = time.perf_counter()
    config = method.config
    layers = method.validate(model)
    report = CompressionReport(method.name, config.to_dict(), model_params=count_params(model))
    ranks = method.ranks(layers, stats)
    key = method.input_gram() if config.sequential else None
    built: dict[str, LowRankLinear | None] = {}

    dense: dict[str, torch.Tensor] = {}  # --distill-steps: the teacher's weights

    def compress_layer(name: str, module: nn.Module, accumulator: HessianAccumulator):
        if config.distill_steps:
            dense[name] = module.weight.detach().clone()
        gram = accumulator.H.detach().clone()
        refit = None
        if config.refit == "output":
            refit = lambda W, A, B: output_refit(W, A, B, gram)  # noqa: E731
        layer_stats = _layer_stats(stats, name, key, gram)
        new, layer = method.factorize(name, module, ranks[name], layer_stats, refit)
        if new is not None:  # the next blocks see the compressed layer
            weight = new.dense_weight().to(module.weight.dtype)  # (out, in)
            module.weight.data.copy_(weight.T if isinstance(module, Conv1D) else weight)
        built[name] = new
        return layer

    make_accumulator = lambda _n, m: HessianAccumulator(weight_matrix(m).shape[1])  # noqa: E731
    device = method.device or next(model.parameters()).device
    histories = []
    if config.tune_steps:

        def start_block(_index: int, names: list[str], accumulators: dict) -> Learnable:
            reports = [compress_layer(n, layers[n], accumulators[n]) for n in names]
            return block_learnable({n: layers[n] for n in names}, built, reports)

        tune = TrainConfig(steps=config.tune_steps, lr=config.tune_lr,
                           batch_size=config.calib_batch_size, **TUNE_OPTIMIZER)  # fmt: skip
        result = learn_blockwise(model, data, layers, start_block, tune, make_accumulator, device)
        report.layers, histories = result.reports, result.histories
    else:
        report.layers, _ = compress_layerwise(
            model, data, layers, make_accumulator=make_accumulator,
            compress_layer=compress_layer, device=device, batch_size=config.calib_batch_size,
        )  # fmt: skip
    curve = []
    if config.distill_steps:
        train = distill_config(config.distill_steps, config.distill_lr)
        curve = distill_factors(model, data, layers, built, dense, train)
    replace_modules(model, layers, lambda name, _module: built[name])
    method.finish_report(report, start)
    extra = training_extra({"block_history": histories, "history": curve}, CURVE_KEYS)
    if histories:  # each block's error before / after tuning, and its curve
        report.extra["block_curves"] = extra["block_curves"]
    if curve:
        report.extra["loss_curve"] = extra["loss_curve"]
    return report
