"""``int4`` and ``nm_packed_int4``: weight-only low-bit linears (3, 4 or 8 bits; GPTQ, RTN).

Storage (layout in :mod:`lmcompress.kernels.int4_reference`): unsigned codes ``q`` packed two
a byte (``qweight``), per group of ``group_size`` consecutive input columns (``-1``: one group
per row) a float32 scale and a uint8 zero point; the weight is ``(q - z) · s``. A symmetric grid
has every zero point ``2^(bits-1)``. ``nm_packed_int4`` keeps only the codes of an N:M-sparse
weight's kept positions (packed the same way over the kept axis) and their positions
``indices`` as ``nm_packed`` stores them; a position not stored has code ``z`` and so weight
exactly 0. Scales and zeros are per group of the original input columns in both.

The computation is the int4 runtime's (:mod:`lmcompress.kernels.int4_ops`): for a few tokens on
CPU a compiled kernel reads the packed codes directly; otherwise blocks of output rows are
dequantized into the input's dtype for ``F.linear``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.formats import grid
from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.formats.int4_forward import hold_tiles24, stored_nm, tiled_forward
from lmcompress.compressor.formats.int4_schema import INT4, NM_PACKED_INT4, bad_codes
from lmcompress.compressor.formats.nm_packed import kept
from lmcompress.compressor.formats.quant import check_scale
from lmcompress.compressor.formats.registry import register_format
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.errors import ModelLoadError
from lmcompress.kernels import int4_ops, int4_tiles, ops
from lmcompress.kernels.int4_reference import check_bits, dequantize_codes, pack_codes, unpack_codes
from lmcompress.kernels.reference import gather_nm, pack_nm

_GRID = {"scales": "scales16", "zeros": "zeros16"}  # a tiled layer's grid buffers


class Int4CodedLinear(CompressedLinear):
    """What :class:`Int4Linear` and :class:`PackedNMInt4Linear` share: the grid (``scales``
    float32 (out, groups), ``zeros`` uint8 (out, groups)), ``bits``, ``group_size`` (-1: per
    row), ``symmetric``, ``dtype`` (that of :meth:`dense_weight`), the bias, their metadata,
    checks on load and the computation. A subclass registers its codes, then calls
    :meth:`init_grid`, and implements :meth:`weight_codes`, :meth:`code_tensors`."""

    exact_tensors = frozenset({"scales"})  # float32 at any save dtype
    tiled = False  # codes in int4_tiles' (int4_tiles24's) layout, where the kernels read them
    # the dense copy: pack-quantized (W4A16 / W8A16), as llm-compressor writes GPTQ and vLLM
    # reads; 3 bits, asymmetric grids and Conv1D fall back to dequantized weights (save.py)
    interop = "compressed-tensors"

    def init_grid(
        self,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bits: int,
        group_size: int,
        symmetric: bool,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        check_bits(bits)
        self.bits, self.group_size, self.symmetric, self.dtype = bits, group_size, symmetric, dtype
        self.register_buffer("scales", scales.float())
        self.register_buffer("zeros", zeros.to(torch.uint8))
        self.register_buffer("bias", bias)

    def hold_grid_tiled(self) -> None:
        """The grid held as :func:`int4_tiles.tile_grid` (``scales16``, ``zeros16``) only, as
        the tiled decode kernels read it, and the layer marked tiled."""
        scales16, zeros16 = int4_tiles.tile_grid(self.scales, self.zeros)
        del self._buffers["scales"], self._buffers["zeros"]  # held tiled only (__getattr__)
        self.register_buffer("scales16", scales16)
        self.register_buffer("zeros16", zeros16)
        if self.bias is not None:
            self.bias = self.bias.contiguous()
        self.tiled = True

    def __getattr__(self, name: str) -> Any:
        """A tiled layer's ``scales`` and ``zeros``: its tiled grid (``scales16``,
        ``zeros16``), untiled to (out, groups) on reading."""
        if name in _GRID and self.__dict__.get("tiled"):
            return int4_tiles.untile_rows_of_grid(self._buffers[_GRID[name]], self.out_features)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        """Setting a tiled layer's ``scales`` or ``zeros`` (out, groups) tiles them."""
        if name in _GRID and self.__dict__.get("tiled"):
            value = value.float() if name == "scales" else value.to(torch.uint8)
            name, value = _GRID[name], int4_tiles.tile_rows(value)
        super().__setattr__(name, value)

    def weight_codes(self) -> torch.Tensor:
        """The uint8 codes (out, in); ``zeros`` where a packed format stores nothing."""
        raise NotImplementedError

    def code_tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def code_meta(self) -> dict[str, Any]:
        return {}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {**self.code_tensors(), "scales": self.scales, "zeros": self.zeros}
        if self.bias is not None:
            tensors["bias"] = self.bias
        return tensors

    def meta(self) -> dict[str, Any]:
        return {
            **super().meta(),
            **self.code_meta(),
            "bits": self.bits,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    @classmethod
    def checked_state(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict:
        """The grid arguments (scales, zeros, bits, ...) from stored ``tensors`` and ``meta``,
        checked against the format's schema, then the codes' and zero points' range (a
        tampered file is a :class:`ModelLoadError`)."""
        cls.schema.check(cls.format, tensors, meta)
        qweight, zeros = tensors["qweight"], tensors["zeros"]
        columns = kept(meta) if "n" in meta else meta["in_features"]
        if not qweight.is_meta and (why := bad_codes(qweight, zeros, meta, columns)):
            raise ModelLoadError(f"{cls.format} layer: {why}")
        return {
            "scales": tensors["scales"],
            "zeros": zeros,
            "bits": meta["bits"],
            "group_size": meta["group_size"],
            "symmetric": meta["symmetric"],
            "bias": tensors.get("bias"),
            "conv1d": bool(meta.get("conv1d", False)),
            "dtype": getattr(torch, meta.get("dtype", "float32")),
        }

    def _apply(self, fn, recurse=True):
        """Scales stay float32 whatever the model is cast to; they follow device moves."""
        key = "scales16" if "scales16" in self._buffers else "scales"
        scales = self._buffers[key]
        super()._apply(fn, recurse)
        self._buffers[key] = scales.to(fn(scales).device)
        return self

    def dequantized(self) -> torch.Tensor:
        """``(q - z) · s`` (out, in), float32."""
        return dequantize_codes(self.weight_codes(), self.scales, self.zeros, self.group_size)

    def dense_weight(self) -> torch.Tensor:
        return self.dequantized().to(self.dtype)

    def nm(self) -> tuple[torch.Tensor, int, int] | None:
        """``(indices, n, m)`` of packed N:M kept codes, ``None`` for every column's."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The int4 runtime (:func:`lmcompress.kernels.int4_ops.linear`): a kernel reads the
        codes for a few tokens on CPU; else rows are dequantized by blocks for ``F.linear``.
        Traced by ``torch.compile`` (no gradient needed): one opaque op (``int4_forward``)."""
        if self.tiled:  # the decode kernel's short path (None where it does not apply)
            y = tiled_forward(self, x)
            if y is not None:
                return y
        held = self._buffers  # a tiled layer's grid: tiled only (no "scales", "zeros": None)
        grid = held.get("scales"), held.get("zeros")
        grid16 = held.get("scales16"), held.get("zeros16")
        if torch.compiler.is_compiling() and not (x.requires_grad and torch.is_grad_enabled()):
            indices, n, m = self.nm() or (None, 1, 1)
            return ops.int4_linear(
                x, self.qweight, *grid, self.bits, self.group_size, self.in_features, self.bias,
                indices, n, m, self.tiled, *grid16, self.out_features,
            )  # fmt: skip
        return int4_ops.linear(
            x, self.qweight, *grid, bits=self.bits, group_size=self.group_size,
            in_features=self.in_features, bias=self.bias, nm=self.nm(), tiled=self.tiled,
            grid16=grid16 if self.tiled else None, out_features=self.out_features,
        )  # fmt: skip

    def expanded(self) -> nn.Module:
        """Dequantized once: a dense linear of :attr:`dtype`."""
        return self.to_dense()

    def extra_repr(self) -> str:
        groups = "row" if self.group_size == -1 else f"group of {self.group_size}"
        kind = "symmetric" if self.symmetric else "asymmetric"
        return f"{super().extra_repr()}, bits={self.bits}, per {groups}, {kind}"


@register_format
class Int4Linear(Int4CodedLinear):
    """Packed low-bit codes ``qweight`` uint8 (out, ceil(in/2)) (8 bits: (out, in)), then the
    buffers of :class:`Int4CodedLinear` (scales, zeros, bias)."""

    format = "int4"
    schema = INT4

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bits: int,
        group_size: int,
        symmetric: bool,
        in_features: int,
        bias: torch.Tensor | None = None,
        conv1d: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(in_features, qweight.shape[0], conv1d=conv1d)
        self.register_buffer("qweight", qweight)
        self.init_grid(scales, zeros, bits, group_size, symmetric, bias, dtype)
        self.tile_codes()

    def tile_codes(self) -> None:
        """Hold the codes in :mod:`lmcompress.kernels.int4_tiles`' layout where its decode
        kernel reads them (``qweight`` then has that layout; :meth:`stored_codes` gives the
        stored one). Called at construction, and by the Hugging Face quantizer once
        transformers has filled a module built on the meta device."""
        if not self.tiled and int4_tiles.tileable(
            self.qweight, self.bits, self.group_size, self.in_features
        ):
            self.qweight = int4_tiles.tile(self.qweight)
            self.hold_grid_tiled()

    def stored_codes(self) -> torch.Tensor:
        """The packed codes in the stored layout (out, ceil(in/2)) (8 bits: (out, in))."""
        if self.tiled:
            return int4_tiles.untile(self.qweight, self.out_features)
        return self.qweight

    @classmethod
    def from_codes(
        cls,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        linear: nn.Module,
        **grid_options: Any,
    ) -> Int4Linear:
        """From uint8 codes ``q`` (out, in) on the grid ``scales``/``zeros`` (out, groups) of
        ``grid_options`` (``bits``, ``group_size``, ``symmetric``), for the layer ``linear``
        (its bias, kind and dtype)."""
        check_scale(scales, "int4 scales")
        W = weight_matrix(linear)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(
            pack_codes(q, grid_options["bits"]),
            scales.float(),
            zeros.to(torch.uint8),
            in_features=W.shape[1],
            bias=bias,
            conv1d=isinstance(linear, Conv1D),
            dtype=W.dtype,
            **grid_options,
        )

    @classmethod
    @torch.no_grad()
    def from_linear(
        cls,
        linear: nn.Module,
        bits: int = 4,
        group_size: int = 128,
        symmetric: bool = True,
        half_scales: bool = False,
        mse: bool = False,
    ) -> Int4Linear:
        """Round to nearest on the grid of each group of ``linear``'s weight (RTN);
        ``half_scales``: every scale a float16 number (``grid.half_scales``); ``mse``: each
        group's range by the clipping search (``grid.grid_params``)."""
        check_bits(bits)
        W = weight_matrix(linear).detach()  # (out, in)
        scales, zeros = grid.group_params(W, bits, group_size, symmetric, half_scales, mse)
        q = grid.quantize_groups(W, scales, zeros, bits)
        return cls.from_codes(
            q, scales, zeros, linear, bits=bits, group_size=group_size, symmetric=symmetric
        )

    def weight_codes(self) -> torch.Tensor:
        return unpack_codes(self.stored_codes(), self.bits, self.in_features)

    def code_tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.stored_codes()}

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Int4Linear:
        checked = cls.checked_state(tensors, meta)
        return cls(tensors["qweight"], in_features=meta["in_features"], **checked)


@register_format
class PackedNMInt4Linear(Int4CodedLinear):
    """An N:M-sparse :class:`Int4Linear`: the kept codes ``qweight`` uint8 packed over the kept
    axis (out, ceil(in·n/m / 2)), their positions ``indices`` (as ``nm_packed``), then the
    buffers of :class:`Int4CodedLinear` over the original columns."""

    format = "nm_packed_int4"
    schema = NM_PACKED_INT4

    def __init__(
        self,
        qweight: torch.Tensor,
        indices: torch.Tensor,
        n: int,
        m: int,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bits: int,
        group_size: int,
        symmetric: bool,
        in_features: int,
        bias: torch.Tensor | None = None,
        conv1d: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(in_features, qweight.shape[0], conv1d=conv1d)
        self.n, self.m = n, m
        self.register_buffer("qweight", qweight)
        self.register_buffer("indices", indices)
        self.init_grid(scales, zeros, bits, group_size, symmetric, bias, dtype)
        self.tile_codes()

    def tile_codes(self) -> None:
        """Hold 2:4 codes in :mod:`lmcompress.kernels.int4_tiles24`' layout where its decode
        kernel reads them (at construction; by the Hugging Face quantizer once filled)."""
        hold_tiles24(self)

    @classmethod
    @torch.no_grad()
    def from_int4(cls, layer: Int4Linear, n: int, m: int) -> PackedNMInt4Linear:
        """Pack ``layer``'s codes, whose weights must be N:M sparse (every code other than its
        group's zero point is kept; a :class:`ConfigError` if a group of M holds more than N)."""
        q = layer.weight_codes()  # (out, in)
        nonzero = q != grid.expand(layer.zeros, layer.in_features)
        _, indices = pack_nm(nonzero.to(torch.uint8), n, m)
        values = gather_nm(q, indices, n, m)  # (out, in·n/m): z where a group keeps fewer
        return cls(
            pack_codes(values, layer.bits),
            indices,
            n,
            m,
            layer.scales,
            layer.zeros,
            layer.bits,
            layer.group_size,
            layer.symmetric,
            layer.in_features,
            bias=layer.bias,
            conv1d=layer.conv1d,
            dtype=layer.dtype,
        )

    @classmethod
    def compose(cls, later: Int4Linear, n: int, m: int) -> PackedNMInt4Linear:
        """The composed form of an N:M stage followed by a low-bit one (``compose_``)."""
        return cls.from_int4(later, n, m)

    @classmethod
    def from_linear(
        cls, linear: nn.Module, n: int, m: int, **int4_options: Any
    ) -> PackedNMInt4Linear:
        """Round an N:M-sparse ``linear`` to nearest (:meth:`Int4Linear.from_linear`), then
        pack its codes (its zeros stay zeros: 0 is on every grid)."""
        return cls.from_int4(Int4Linear.from_linear(linear, **int4_options), n, m)

    def nm(self) -> tuple[torch.Tensor, int, int]:
        return self.indices, self.n, self.m

    def weight_codes(self) -> torch.Tensor:
        qweight, idx = stored_nm(self)
        values = unpack_codes(qweight, self.bits, self.n * self.in_features // self.m)
        marked = ops.unpack_nm(values.to(torch.int16) + 1, idx, self.n, self.m, self.in_features)
        zeros = grid.expand(self.zeros, self.in_features)  # (out, in)
        return torch.where(marked == 0, zeros, (marked - 1).to(torch.uint8))

    def code_tensors(self) -> dict[str, torch.Tensor]:
        qweight, indices = stored_nm(self)
        return {"qweight": qweight, "indices": indices}

    def code_meta(self) -> dict[str, Any]:
        return {"n": self.n, "m": self.m}

    @classmethod
    def from_state(
        cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
    ) -> PackedNMInt4Linear:
        checked = cls.checked_state(tensors, meta)
        qweight, indices, n, m = tensors["qweight"], tensors["indices"], meta["n"], meta["m"]
        if not indices.is_meta and (why := ops.bad_positions(indices, n, m, kept(meta))):
            raise ModelLoadError(f"nm_packed_int4 indices: {why}")
        return cls(qweight, indices, n, m, in_features=meta["in_features"], **checked)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, n={self.n}, m={self.m}"
