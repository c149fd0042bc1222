"""``nm_packed_int8``: int8 codes that are N:M sparse, stored packed (a 2:4 layer, then int8).

Quantizing an N:M-sparse weight rounds its zeros to zero codes, so an int8 layer made from a
pruned one is N:M sparse too. Stored the ``nm_packed`` way — the kept int8 codes ``values``
(out, in·n/m) and their positions ``indices`` (2 bits each for 2:4) — with the int8 layer's
scales. For 2:4 a group of 4 weights takes 2 codes × 8 bits + 2 positions × 2 bits = 20 bits
instead of 32: 62.5 % of the int8 codes' bytes (the fp32 scales, one per row, are the same in
both).

The computation is the int8 layer's: the int32 products of the activation codes with the
packed codes (read directly by a compiled CPU kernel for a few tokens, unpacked for more), then
the same rescale, so the module's outputs are those of the
:class:`~lmcompress.compressor.formats.int8.QuantLinear` it was packed from, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmcompress.compressor.formats.int8 import (
    INT8_META,
    INT8_SCALES,
    Int8CodedLinear,
    QuantLinear,
    group_rule,
    quantize_activations,
)
from lmcompress.compressor.formats.nm_packed import NM_PACKED, kept
from lmcompress.compressor.formats.registry import register_format
from lmcompress.compressor.formats.schema import NM_META, Schema, StoredTensor, nm_rule
from lmcompress.errors import ModelLoadError
from lmcompress.kernels import cpu_kernels, int8_ops, lean_ops, ops
from lmcompress.kernels.reference import pack_nm

# The nm_packed codes, int8 (out, in·n/m) and their uint8 positions, then the int8 scales
NM_PACKED_INT8 = Schema(
    meta={**INT8_META, **NM_META},
    tensors={
        "values": StoredTensor(torch.int8, lambda meta: (meta["out_features"], kept(meta))),
        "indices": NM_PACKED.tensors["indices"],
        **INT8_SCALES,
    },
    rules=(nm_rule, group_rule),
)


@register_format
class PackedNMInt8Linear(Int8CodedLinear):
    """An N:M-sparse :class:`QuantLinear`, its codes packed.

    Buffers: ``values`` int8 (out, in·n/m), ``indices`` uint8 (packed positions), then those
    of :class:`~lmcompress.compressor.formats.int8.Int8CodedLinear` (scales, bias); ``dtype``
    and ``path`` as there.
    """

    format = "nm_packed_int8"
    schema = NM_PACKED_INT8

    def __init__(
        self,
        values: torch.Tensor,
        indices: torch.Tensor,
        n: int,
        m: int,
        in_features: int,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        conv1d: bool = False,
        path: str = "int",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(in_features, values.shape[0], conv1d=conv1d)
        self.n, self.m = n, m
        self.register_buffer("values", values)
        self.register_buffer("indices", indices)
        self.init_scales(weight_scale, input_scale, bias, path, dtype)

    @classmethod
    @torch.no_grad()
    def from_quant(cls, layer: QuantLinear, n: int, m: int) -> PackedNMInt8Linear:
        """Pack ``layer``'s codes, which must be N:M sparse (a :class:`ConfigError` otherwise:
        packing drops nothing silently)."""
        values, indices = pack_nm(layer.weight_q, n, m)
        return cls(
            values,
            indices,
            n,
            m,
            layer.in_features,
            layer.weight_scale,
            layer.input_scale,
            layer.bias,
            conv1d=layer.conv1d,
            path=layer.path,
            dtype=layer.dtype,
        )

    @classmethod
    def compose(cls, later: QuantLinear, n: int, m: int) -> PackedNMInt8Linear:
        """The composed form of an N:M stage followed by int8 (``stages.compose_``)."""
        return cls.from_quant(later, n, m)

    @classmethod
    def from_linear(cls, linear: nn.Module, n: int, m: int, **int8_options: Any):
        """Quantize an N:M-sparse ``linear`` (:meth:`QuantLinear.from_linear`'s options), then
        pack the codes."""
        return cls.from_quant(QuantLinear.from_linear(linear, **int8_options), n, m)

    def weight_codes(self) -> torch.Tensor:
        """The int8 codes (out, in), zeros where pruned."""
        return ops.unpack_nm(self.values, self.indices, self.n, self.m, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel scales on the integer path: the int32 products from the packed codes
        (``torch.ops.lmcompress.nm_int8_matmul``; a compiled kernel reads them for a few tokens
        on CPU), then the int8 layer's rescale: the same integers, so the same output as
        :class:`QuantLinear`'s, bit for bit. Other paths unpack and run the int8 layer's."""
        if self.path != "int" or self.weight_scale.shape[1] != 1:
            return super().forward(x)
        if lean_ops.traced_cpu(x, self.in_features):  # compiled: eager's computation, one op
            return lean_ops.int8_layer(
                x, self.values, self.weight_scale, self.input_scale, self.bias,
                nm=(self.indices, self.n, self.m), in_features=self.in_features,
            )  # fmt: skip
        if ops.few_tokens_cpu(x, self.in_features, cpu_kernels.MAX_TOKENS):  # one fused pass
            y = cpu_kernels.int8_linear(
                x.reshape(-1, self.in_features), self.weight_scale, self.input_scale, self.bias,
                self.values, self.indices, self.n, self.m,
            )  # fmt: skip
            return y.reshape(*x.shape[:-1], self.out_features)
        x_q, x_scale = quantize_activations(x.reshape(-1, self.in_features), self.input_scale)
        args = (x_q, self.values, self.indices, self.n, self.m, self.in_features)
        if ops.eager_cpu(x):
            acc = ops.nm_int8_matmul_cpu(*args)
        else:
            acc = torch.ops.lmcompress.nm_int8_matmul(*args)
        y = int8_ops.rescale(acc, x_scale, self.weight_scale, self.bias, x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def expanded(self) -> QuantLinear:
        """Unpacked once: the :class:`QuantLinear` of the same codes and scales (the same
        computation; 1 byte per weight instead of 2:4's 0.625)."""
        return QuantLinear(
            self.weight_codes(),
            self.weight_scale,
            self.input_scale,
            self.bias,
            conv1d=self.conv1d,
            path=self.path,
            dtype=self.dtype,
        )

    def code_tensors(self) -> dict[str, torch.Tensor]:
        return {"values": self.values, "indices": self.indices}

    def code_meta(self) -> dict[str, Any]:
        return {"n": self.n, "m": self.m}

    @classmethod
    def from_state(
        cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
    ) -> PackedNMInt8Linear:
        """Rebuild from :meth:`state_tensors` and :meth:`meta`, checked against
        :data:`NM_PACKED_INT8` (the packed codes, then the int8 scales and fields), then the
        positions (a mismatched file is a :class:`ModelLoadError`)."""
        checked = cls.checked_state(tensors, meta)
        values, indices = tensors["values"], tensors["indices"]
        n, m = meta["n"], meta["m"]
        if not indices.is_meta and (why := ops.bad_positions(indices, n, m, values.shape[1])):
            raise ModelLoadError(f"nm_packed_int8 indices: {why}")
        return cls(
            values,
            indices,
            n,
            m,
            meta["in_features"],
            checked["weight_scale"],
            checked["input_scale"],
            checked["bias"],
            conv1d=checked["conv1d"],
            dtype=checked["dtype"],
        )

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, n={self.n}, m={self.m}, int8 codes, "
            f"activations={self.activations}, path={self.path}"
        )
