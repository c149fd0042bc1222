"""Model surgery: find linear layers by name, view their weights as (out, in), replace
modules, parametrize weights, and hooks that always remove themselves."""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.model.families import family_of
from lmcompress.errors import ConfigError

# GPT-2 stores its projections as Conv1D: a linear layer whose weight is (in, out).
LINEAR_TYPES = (nn.Linear, Conv1D)


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, LINEAR_TYPES)


def weight_matrix(module: nn.Module) -> torch.Tensor:
    """The layer's weight as an ``(out_features, in_features)`` view (shares storage)."""
    if isinstance(module, Conv1D):
        return module.weight.t()
    return module.weight


def in_out_features(module: nn.Module) -> tuple[int, int]:
    out_features, in_features = weight_matrix(module).shape
    return in_features, out_features


@dataclass(frozen=True)
class LayerSelection:
    """Which linear layers a method compresses, by glob patterns on module names.

    With no ``include`` patterns, every linear inside the decoder blocks is selected.
    """

    include: Sequence[str] = ()
    exclude: Sequence[str] = ()

    def select(self, model: nn.Module) -> dict[str, nn.Module]:
        """``{qualified_name: module}`` of the selected linear layers, in model order."""
        family = family_of(model)
        include = tuple(self.include) or (f"{family.blocks}.*",)
        chosen = {
            name: module
            for name, module in model.named_modules()
            if is_linear(module)
            and any(fnmatch.fnmatchcase(name, p) for p in include)
            and not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)
        }
        if not chosen:
            raise ConfigError(
                f"no linear layer matches include={list(include)} exclude={list(self.exclude)}"
            )
        _refuse_tied_head(model, chosen, family.head)
        return chosen


def _refuse_tied_head(model: nn.Module, chosen: dict[str, nn.Module], head: str) -> None:
    if head not in chosen:
        return
    embeddings = model.get_input_embeddings()
    if embeddings is not None and chosen[head].weight is embeddings.weight:
        raise ConfigError(
            f"{head} shares its weight with the input embeddings (tied): compressing it would "
            "compress the embeddings too; exclude it"
        )


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` where ``name`` is; return the module it replaced."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


def replace_modules(
    model: nn.Module,
    names: Iterable[str],
    factory: Callable[[str, nn.Module], nn.Module | None],
) -> dict[str, nn.Module]:
    """The one module-replacement walker: ``factory(name, module)`` gives each named module's
    replacement (``None``: leave it). Returns ``{name: new module}`` of what was replaced."""
    replaced = {}
    for name in list(names):
        new = factory(name, model.get_submodule(name))
        if new is not None:
            replace_module(model, name, new)
            replaced[name] = new
    return replaced


class WeightMask(nn.Module):
    """Parametrization ``W -> W * mask`` for a fixed mask (shape of the stored weight)."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.mask


def add_parametrization(module: nn.Module, parametrization: nn.Module) -> None:
    """Parametrize ``module.weight`` (masks while learning; see :func:`bake`)."""
    parametrize.register_parametrization(module, "weight", parametrization)


def bake(module: nn.Module) -> None:
    """Replace the parametrized weight by its current value and drop the parametrizations."""
    if parametrize.is_parametrized(module, "weight"):
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


@contextlib.contextmanager
def forward_hooks(
    modules: dict[str, nn.Module],
    hook: Callable[[str, nn.Module, tuple, torch.Tensor], None],
) -> Iterator[None]:
    """Call ``hook(name, module, inputs, output)`` after each module's forward, inside the
    ``with`` block only; the hooks are removed even when the block raises."""
    handles = [
        module.register_forward_hook(
            lambda mod, inputs, output, _name=name: hook(_name, mod, inputs, output)
        )
        for name, module in modules.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
