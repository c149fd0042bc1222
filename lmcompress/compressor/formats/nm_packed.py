"""``nm_packed``: an N:M-sparse linear layer that holds only its packed form.

The layer keeps the ``n`` kept weights of every group of ``m`` inputs and their 2-bit (for
2:4) positions (layout in :mod:`lmcompress.kernels.reference`): at fp16, 56.25 % of the dense
bytes for 2:4. It never materialises the dense weight as a buffer; its forward calls
``torch.ops.lmcompress.nm_linear`` (in eager mode on CPU its computation directly,
:func:`~lmcompress.kernels.ops.nm_linear_cpu`), whose CPU implementation reads the packed form
with a compiled kernel for a few tokens and unpacks once per call for more, and whose CUDA
implementation is a Triton kernel reading the packed form directly
(:mod:`lmcompress.kernels.nm_linear_triton`).

Loaded for inference on CPU (:func:`~lmcompress.compressor.formats.int4_shared.prepare_decode`),
a 2:4 float layer holds its values and positions as the tiles of
:mod:`~lmcompress.kernels.nm24_tiles` instead (:meth:`PackedNMLinear.tile`: the same bytes,
permuted): its few-token forward then runs the tiled kernel, 1.5-2x the row kernel's speed on an
AVX2 EPYC; ``values`` and ``indices`` still read (and write) the stored layout.
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
    NM_META,
    Meta,
    Schema,
    StoredTensor,
    bias_tensor,
    nm_rule,
)
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.errors import ModelLoadError
from lmcompress.kernels import (
    cpu_kernels,
    lean_ops,
    nm24_tiles,
    ops,  # registers torch.ops.lmcompress.nm_linear
)
from lmcompress.kernels.reference import index_bits, pack_nm


def kept(meta: Meta) -> int:
    """Weights kept per row of an N:M layer: ``in · n / m``."""
    return meta["in_features"] // meta["m"] * meta["n"]


def index_bytes(meta: Meta) -> int:
    """Bytes of packed positions per row (``index_bits(m)`` bits per kept weight)."""
    return -(-kept(meta) * index_bits(meta["m"]) // 8)


# values (out, in·n/m) in the export's dtype, positions uint8 (out, index bytes), bias (out,)
NM_PACKED = Schema(
    meta={**LINEAR_META, **NM_META},
    tensors={
        "values": StoredTensor(FLOAT, lambda meta: (meta["out_features"], kept(meta))),
        "indices": StoredTensor(
            torch.uint8, lambda meta: (meta["out_features"], index_bytes(meta))
        ),
        "bias": bias_tensor(),
    },
    rules=(nm_rule,),
)


@register_format
class PackedNMLinear(CompressedLinear):
    """A linear layer stored as packed N:M ``values`` ``(out, in·n/m)`` and uint8 ``indices``.

    Buffers (not parameters: the layer is an inference form): ``values``, ``indices`` and
    ``bias`` (``None`` when the original had none). ``n`` and ``m`` are plain ints so that
    ``torch.compile`` sees them as constants.
    """

    format = "nm_packed"
    schema = NM_PACKED
    tiled = False  # values and positions held as nm24_tiles' tiles (tiled_values, tiled_indices)
    _STORED = ("values", "indices")

    def __init__(
        self,
        values: torch.Tensor,
        indices: torch.Tensor,
        n: int,
        m: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        conv1d: bool = False,
    ) -> None:
        super().__init__(in_features, values.shape[0], conv1d=conv1d)
        self.n, self.m = n, m
        self.register_buffer("values", values)
        self.register_buffer("indices", indices)
        self.register_buffer("bias", bias)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Module, n: int, m: int) -> PackedNMLinear:
        """Pack an ``nn.Linear`` or GPT-2 ``Conv1D`` whose weight is already N:M sparse (a
        :class:`~lmcompress.errors.ConfigError` otherwise: packing drops nothing silently)."""
        W = weight_matrix(linear).detach()  # (out, in)
        values, indices = pack_nm(W, n, m)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(values, indices, n, m, W.shape[1], bias=bias, conv1d=isinstance(linear, Conv1D))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {"values": self.values, "indices": self.indices}
        if self.bias is not None:
            tensors["bias"] = self.bias
        return tensors

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "n": self.n, "m": self.m}

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> PackedNMLinear:
        """Rebuild from :meth:`state_tensors` and :meth:`meta`, checked against
        :data:`NM_PACKED` (a truncated, retyped or mismatched file is a
        :class:`ModelLoadError`, not a crash or a wrong number in the first forward)."""
        cls.schema.check("nm_packed", tensors, meta)
        n, m, in_features = meta["n"], meta["m"], meta["in_features"]
        values, indices, bias = tensors["values"], tensors["indices"], tensors.get("bias")
        if not indices.is_meta and (why := ops.bad_positions(indices, n, m, values.shape[1])):
            raise ModelLoadError(f"nm_packed indices: {why}")
        return cls(
            values, indices, n, m, in_features, bias=bias, conv1d=bool(meta.get("conv1d", False))
        )

    def tile(self) -> None:
        """Hold the values and positions as :mod:`~lmcompress.kernels.nm24_tiles`' tiles where
        they fit (2:4, float, CPU, shapes); otherwise nothing changes."""
        held = self._buffers
        if self.tiled or not nm24_tiles.tileable(held["values"], self.n, self.m, self.in_features):
            return
        tiled_values, tiled_indices = nm24_tiles.tile(held.pop("values"), held.pop("indices"))
        self.register_buffer("tiled_values", tiled_values)
        self.register_buffer("tiled_indices", tiled_indices)
        self.tiled = True

    def untile(self) -> None:
        """Back to the stored layout (a no-op for a layer that is not tiled)."""
        if self.tiled:
            held = self._buffers
            values, indices = nm24_tiles.untile(held.pop("tiled_values"), held.pop("tiled_indices"))
            self.tiled = False
            self.register_buffer("values", values)
            self.register_buffer("indices", indices)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, indices)`` in the stored layout (a tiled layer's untiled: one pass)."""
        held = self._buffers
        if self.tiled:
            return nm24_tiles.untile(held["tiled_values"], held["tiled_indices"])
        return held["values"], held["indices"]

    def __getattr__(self, name: str) -> Any:
        """A tiled layer's ``values`` and ``indices``: the stored layout, untiled on reading."""
        if name in self._STORED and self.__dict__.get("tiled"):
            return self.stored()[self._STORED.index(name)]
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        """Setting a tiled layer's ``values`` or ``indices`` untiles it first."""
        if name in self._STORED and self.__dict__.get("tiled"):
            self.untile()
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        """Moves and casts run on the stored layout; a tiled layer is tiled again after (where
        it still fits: not on a GPU)."""
        tiled = self.tiled
        self.untile()
        result = super()._apply(fn, recurse)
        if tiled:
            self.tile()
        return result

    def dense_weight(self) -> torch.Tensor:
        return ops.unpack_nm(*self.stored(), self.n, self.m, self.in_features)

    def expanded(self) -> nn.Module:
        """Unpacked once: a dense linear in the values' dtype (2:4: 1/0.5625 the bytes)."""
        return self.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiled:
            held = self._buffers
            if nm24_tiles.applies(x, self.in_features):
                return nm24_tiles.linear(x, held["tiled_values"], held["tiled_indices"], self.bias)
            if lean_ops.traced_cpu(x, self.in_features, cpu_kernels.MAX_TOKENS):
                return lean_ops.nm24_decode(
                    x, held["tiled_values"], held["tiled_indices"], self.bias
                )
        values, indices = self.stored()
        if ops.eager_cpu(x):  # the op's CPU computation, without the dispatch
            return ops.nm_linear_cpu(
                x, values, indices, self.n, self.m, self.in_features, self.bias
            )
        return torch.ops.lmcompress.nm_linear(
            x, values, indices, self.n, self.m, self.in_features, self.bias
        )

    def extra_repr(self) -> str:
        dtype = self._buffers["tiled_values" if self.tiled else "values"].dtype
        return f"{super().extra_repr()}, n={self.n}, m={self.m}, dtype={dtype}"
