"""Distillation of a structurally pruned model before its extraction, on the core's end-to-end
driver (``drivers.learn_end_to_end`` with ``distill``: KL(dense ‖ pruned) on the logits, the
LM loss only logged), as the low-rank methods' ``--distill-steps`` do.

The pruned model is the dense one with its :class:`StructureGates` on; every weight of its
decoder linears trains as ``W + Δ`` (:class:`DeltaWeight`, ``Δ`` starting at 0), so that the
teacher is the same model with the gates and the deltas off: no second copy of the model.
A removed structure's weights get no gradient (its gate is 0), so the extraction afterwards
removes exactly what was gated. Norms and embeddings stay as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from lmcompress.compressor.model.structure import StructureGates
from lmcompress.compressor.model.surgery import add_parametrization, bake
from lmcompress.compressor.training.drivers import Learnable, learn_end_to_end
from lmcompress.compressor.training.tuning import distill_config


class DeltaWeight(nn.Module):
    """Parametrization ``W -> W + Δ`` with a trainable float32 ``Δ`` (zero at the start);
    ``enabled`` off: ``W`` as stored (the teacher's weight)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.delta = nn.Parameter(
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        )
        self.enabled = True

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.delta.to(weight.dtype) if self.enabled else weight


def distill_kept(
    model: nn.Module,
    data: torch.Tensor,
    layers: dict[str, nn.Module],
    keep: dict[str, torch.Tensor],
    scales: dict[str, torch.Tensor],
    steps: int,
    lr: float,
) -> list[dict]:
    """Train ``layers``' weights of ``model`` gated at ``keep`` (bool, ``extract_``'s shapes;
    times ``scales`` where a kind has them) for ``steps`` steps (one window each, AdamW at peak
    ``lr``, cosine) on the KL from the ungated dense model; the weights are then baked and the
    gates removed. Returns the loss curve."""
    gates = StructureGates(model, keep)
    for kind, kept in keep.items():
        value = kept.to(torch.float32)
        value = value[:, None].expand(-1, 2) if kind == "layers" else value
        gates.values[kind] = value * scales[kind] if kind in scales else value
    deltas = {}
    for name, module in layers.items():
        deltas[name] = DeltaWeight(module.weight)
        add_parametrization(module, deltas[name])
    learnable = Learnable(
        params={f"{name}.delta": d.delta for name, d in deltas.items()},
        param_options={f"{name}.delta": {"weight_decay": 0.0} for name in deltas},
        masks=[gates, *deltas.values()],
    )
    config = distill_config(steps, lr)
    try:
        with torch.enable_grad():
            result = learn_end_to_end(model, data, learnable, config, distill=True, lm_loss=False)
    finally:
        for module in layers.values():
            bake(module)
        gates.remove()
    return result.state.history
