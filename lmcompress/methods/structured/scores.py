"""The one-shot scores of structured pruning and the budget they are cut to.

- :func:`allocate`: how many channels and KV groups each block loses, and how many blocks go,
  for a fraction of the decoder's parameters kept (uniform widths): the budget met as closely
  as whole structures allow, in given proportions of each kind (equal for the one-shot rows).
- :func:`calibration_pass`: one pass of the dense model over the calibration windows that sums
  each structured linear's squared inputs per feature (for the activation-aware score) and the
  angular distance between the hidden states entering block ``l`` and block ``l + n``, at the
  last token of every window, as Gromov et al. (2024, "The Unreasonable Ineffectiveness of the
  Deeper Layers") measure it: ``arccos(cos(h_l, h_{l+n})) / π``.
- :func:`width_scores`: per block, a score for each channel and each KV group: the sum over
  the structure's weights of ``|W_ij|`` times the norm of input ``j`` (Wanda's score summed
  over the structure: "Wanda-sp"), or of ``|W_ij|`` alone (``magnitude``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from tqdm.auto import tqdm

from lmcompress.compressor.model.families import Structures, decoder_blocks
from lmcompress.compressor.model.structure import BlockShape, attention_layout
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError

Removal = dict[str, int]  # kind -> channels / groups removed per block, or blocks removed


def kept_params(shape: BlockShape, blocks: int, removal: Removal) -> int:
    """The decoder's parameters once ``removal`` is applied to ``blocks`` blocks of ``shape``."""
    per_block = (
        shape.params
        - removal.get("channels", 0) * shape.channel_params
        - removal.get("heads", 0) * shape.group_params
    )
    return (blocks - removal.get("layers", 0)) * per_block  # (ints, or tensors of candidates)


SLACK = 0.005  # removals within this fraction of the decoder of the closest all count as met
TOLERANCE = 0.02  # a budget missed by more than this fraction of the decoder is refused


def allocate(
    shapes: list[BlockShape],
    kinds: tuple[str, ...],
    ratio: float,
    shares: dict[str, float] | None = None,
    channel_multiple: int = 1,
) -> Removal:
    """How many channels and KV groups each block loses and how many blocks go (never all of
    a kind), so that the kept parameters meet ``ratio`` of the decoder's: among the removals
    within ``SLACK`` of the closest, the one whose fractions of each kind's count are most
    nearly proportional to ``shares`` (default 1 each: the same fraction of every kind; a
    learned run passes the fractions it learned); the kept channels a multiple of
    ``channel_multiple`` (or all of them). A :class:`ConfigError` where the closest misses the
    budget by more than ``TOLERANCE`` of the decoder (too few structures)."""
    shape, blocks = shapes[0], len(shapes)
    if any(s != shape for s in shapes):
        raise ConfigError("structured pruning needs blocks of one shape")
    counts = {"channels": shape.channels, "heads": shape.groups, "layers": blocks}
    choices = {k: torch.arange(counts[k], dtype=torch.float64) for k in kinds}
    if "channels" in kinds:  # removals that leave a multiple (0 removed: the width as it is)
        removals = choices["channels"]
        fits = ((counts["channels"] - removals) % channel_multiple == 0) | (removals == 0)
        choices["channels"] = removals[fits]
        if len(choices["channels"]) == 1 and channel_multiple > 1:
            raise ConfigError(
                f"--channel-multiple {channel_multiple}: no narrower MLP width of the "
                f"{counts['channels']} channels is a multiple of it"
            )
    grids = torch.meshgrid(*(choices[k] for k in kinds), indexing="ij")
    removed = dict(zip(kinds, (g.flatten() for g in grids), strict=True))
    total = blocks * shape.params
    kept = kept_params(shape, blocks, removed)  # every candidate at once
    gap = (kept - ratio * total).abs()
    best = float(gap.min())
    if best > TOLERANCE * total:
        closest = float(kept[gap.argmin()]) / total
        multiple = f" (widths multiples of {channel_multiple})" if channel_multiple > 1 else ""
        raise ConfigError(
            f"ratio {ratio}: removing whole {', '.join(kinds)}{multiple} keeps {closest:.3f} of "
            "the decoder at the closest; keep more or add another --structure"
        )
    fractions = torch.stack([removed[k] / counts[k] for k in kinds], dim=1)  # (candidates, kinds)
    want = torch.tensor(
        [1.0 if shares is None else float(shares[k]) for k in kinds], dtype=torch.float64
    )
    cosine = torch.nn.functional.cosine_similarity(fractions, want[None], dim=1)
    cosine = torch.where(
        gap <= best + SLACK * total, cosine, torch.tensor(-2.0, dtype=torch.float64)
    )
    choice = int(torch.argmax(cosine))  # ties: the first (fewest removals of the first kinds)
    return {k: int(removed[k][choice]) for k in kinds}


def _structured_linears(structures: Structures, kinds: tuple[str, ...]) -> list[str]:
    paths = [path for path, _ in structures.mlp] if "channels" in kinds else []
    return paths + (list(structures.kv_groups) if "heads" in kinds else [])


@torch.no_grad()
def calibration_pass(
    model: nn.Module,
    data: torch.Tensor,
    structures: Structures,
    kinds: tuple[str, ...],
    span: int,
    batch_size: int,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """``(norms, distances)``: ``norms["<block>.<path>"]`` the L2 norm of each input feature of
    the structured linears over every calibration token (float32, (in,)); ``distances`` (blocks
    − span + 1,) the mean angular distance between the states entering blocks ``l`` and
    ``l + span`` (``None`` for ``span`` 0)."""
    blocks = decoder_blocks(model)
    sums: dict[str, torch.Tensor] = {}
    states: list[torch.Tensor | None] = [None] * (len(blocks) + 1)
    handles = []

    def square_sum(key: str):
        def hook(_module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            sums[key] = sums.get(key, 0) + x.square().sum(0)

        return hook

    def boundary(index: int):
        def hook(_module, args, kwargs, output=None):
            h = output if output is not None else (args[0] if args else kwargs["hidden_states"])
            h = h[0] if isinstance(h, (tuple, list)) else h
            states[index] = h[:, -1].detach().float()  # (batch, hidden): the last token

        return hook

    for b, block in enumerate(blocks):
        for path in _structured_linears(structures, kinds):
            module = block.get_submodule(path)
            handles.append(module.register_forward_pre_hook(square_sum(f"{b}.{path}")))
        if span:
            handles.append(block.register_forward_pre_hook(boundary(b), with_kwargs=True))
    if span:
        last = blocks[-1].register_forward_hook(boundary(len(blocks)), with_kwargs=True)
        handles.append(last)
    distance = torch.zeros(len(blocks) - span + 1) if span else None
    try:
        batches = range(0, data.shape[0], batch_size)
        device = next(model.parameters()).device
        for start in tqdm(batches, desc="structure scores", disable=bar_disabled()):
            model(input_ids=data[start : start + batch_size].to(device), use_cache=False)
            if span:
                h = torch.stack(states)  # (blocks + 1, batch, hidden)
                cos = torch.nn.functional.cosine_similarity(h[:-span], h[span:], dim=-1)
                distance += (cos.clamp(-1, 1).arccos() / math.pi).sum(1).cpu()
    finally:
        for handle in handles:
            handle.remove()
    norms = {key: value.sqrt().cpu() for key, value in sums.items()}
    return norms, None if distance is None else distance / data.shape[0]


def width_scores(
    model: nn.Module,
    structures: Structures,
    kinds: tuple[str, ...],
    norms: dict[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """``{"channels": (blocks, channels), "heads": (blocks, groups)}`` for the width kinds in
    ``kinds`` (module doc; ``norms`` ``None``: magnitude)."""
    out: dict[str, list[torch.Tensor]] = {k: [] for k in kinds if k != "layers"}
    kv = attention_layout(model.config)[0] if "heads" in kinds else 0
    for b, block in enumerate(decoder_blocks(model)):

        def weighted(path: str, axis: str, _b: int = b, _block: nn.Module = block) -> torch.Tensor:
            """Per row (``out``) or column (``in``): Σ |W| · the norm of its input feature."""
            W = weight_matrix(_block.get_submodule(path)).detach().abs().float()
            norm = None if norms is None else norms[f"{_b}.{path}"].to(W.device)
            if axis == "out":
                return (W if norm is None else W * norm).sum(1).cpu()
            return (W.sum(0) if norm is None else W.sum(0) * norm).cpu()

        if "channels" in out:
            out["channels"].append(sum(weighted(p, axis) for p, axis in structures.mlp))
        if "heads" in out:
            q, k, v, o = structures.kv_groups
            parts = [weighted(q, "out"), weighted(k, "out"), weighted(v, "out"), weighted(o, "in")]
            out["heads"].append(sum(part.reshape(kv, -1).sum(1) for part in parts))
    return {kind: torch.stack(rows) for kind, rows in out.items()}
