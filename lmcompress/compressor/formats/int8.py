"""``int8``: a W8A8 linear layer (int8 weights and activations, symmetric, zero-point 0).

Weights are quantized once (:func:`~lmcompress.compressor.formats.quant.int8_weight`), per output
channel or per group of input channels. Activations are quantized in ``forward``: per token
from each row's absmax (``dynamic``), or with one per-tensor scale from calibration
(``static``). Two forward paths compute the same function:

- ``path="int"``: :func:`lmcompress.kernels.int8_ops.linear` (the body of
  ``torch.ops.lmcompress.int8_linear``) — int8 × int8 → int32 with ``torch._int_mm`` (exact),
  then the float32 rescale. The fast path on CPUs with VNNI/AMX.
- ``path="simulated"``: dequantize, matmul in float64, cast
  (:func:`~lmcompress.compressor.formats.quant.simulated_int8_linear`): the reference, runs anywhere
  float64 does.

With per-channel scales they agree to the rounding of the final float32 rescale (a few ulps).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from lmcompress.compressor.formats import quant
from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.formats.registry import register_format
from lmcompress.compressor.formats.schema import (
    EXACT,
    FLOAT_NAMES,
    LINEAR_META,
    Meta,
    MetaField,
    Schema,
    StoredTensor,
    bias_tensor,
)
from lmcompress.compressor.model.surgery import weight_matrix
from lmcompress.errors import ConfigError
from lmcompress.kernels import cpu_kernels, int8_ops, lean_ops, ops

ACTIVATIONS = ("dynamic", "static")
PATHS = ("int", "simulated")


def groups(meta: Meta) -> int:
    """Scales per row: 1 per channel, ``in / group_size`` per group."""
    size = meta.get("group_size")
    return 1 if size is None else meta["in_features"] // size


def group_rule(meta: Meta) -> str | None:
    size = meta.get("group_size")
    if size is not None and meta["in_features"] % size:
        return f"group_size {size} does not divide in_features={meta['in_features']}"
    return None


def static(meta: Meta) -> bool:
    return meta.get("activations", "dynamic") == "static"


# The int8 fields, scales and bias every int8-coded format stores beside its codes:
# weight_scale float32 (out, groups) > 0, input_scale float32 (1,) > 0 for static activations.
INT8_META = {
    **LINEAR_META,
    "bits": MetaField((int,), required=False, choices=(8,)),
    "group_size": MetaField((int, type(None)), required=False, minimum=1),
    "activations": MetaField((str,), required=False, choices=ACTIVATIONS),
    "dtype": MetaField((str,), required=False, choices=FLOAT_NAMES),
}
INT8_SCALES = {
    "weight_scale": StoredTensor(
        EXACT, lambda meta: (meta["out_features"], groups(meta)), positive=True
    ),
    "input_scale": StoredTensor(EXACT, lambda _meta: (1,), present=static, positive=True),
    "bias": bias_tensor(),
}
INT8 = Schema(
    meta=INT8_META,
    tensors={
        "weight_q": StoredTensor(
            torch.int8, lambda meta: (meta["out_features"], meta["in_features"])
        ),
        **INT8_SCALES,
    },
    rules=(group_rule,),
)


def int8_forward(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    path: str = "int",
) -> torch.Tensor:
    """``Q(x) weight_qᵀ`` rescaled, plus ``bias``: the computation of every int8-coded layer
    (:class:`QuantLinear`, and the composed formats that unpack their codes first).
    ``input_scale`` ``None``: per-token dynamic activation scales. While ``torch.compile``
    traces on CPU (no gradient), the ``int`` path is one op (``lean_ops.int8_layer``) that
    runs the same kernels as eager."""
    out_features, in_features = weight_q.shape
    if path == "int" and lean_ops.traced_cpu(x, in_features):  # compiled: eager's computation
        return lean_ops.int8_layer(x, weight_q, weight_scale, input_scale, bias)
    if (
        path == "int"
        and weight_scale.shape[1] == 1
        and ops.few_tokens_cpu(x, in_features, cpu_kernels.MAX_TOKENS)
    ):  # one fused pass, bit-identical to the torch computation below
        y = cpu_kernels.int8_linear(
            x.reshape(-1, in_features), weight_scale, input_scale, bias, weight_q
        )
        return y.reshape(*x.shape[:-1], out_features)
    x_q, x_scale = quantize_activations(x.reshape(-1, in_features), input_scale)
    args = (x_q, x_scale, weight_q, weight_scale, bias, x.dtype)
    if path == "int":
        y = int8_ops.linear(*args)
    else:
        y = quant.simulated_int8_linear(*args)
    return y.reshape(*x.shape[:-1], out_features)


def quantize_activations(
    x_2d: torch.Tensor, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q, x_scale)`` of ``x_2d`` (tokens, in): int8 codes with per-token absmax scales
    (tokens, 1) when ``input_scale`` is ``None``, else with the static scale (1,)."""
    if (
        x_2d.device.type == "cpu"
        and not torch.compiler.is_compiling()  # compiled, inductor fuses the torch ops below
        and x_2d.dtype in (torch.float32, torch.bfloat16)
        and not (x_2d.requires_grad and torch.is_grad_enabled())  # the scales' gradient
        and (input_scale is None or input_scale.dtype == torch.float32)
        and cpu_kernels.library() is not None
    ):  # one pass instead of six; bit-identical
        return cpu_kernels.int8_quantize(x_2d, input_scale)
    x_scale = quant.per_token_scale(x_2d) if input_scale is None else input_scale
    return quant.quantize(x_2d, x_scale), x_scale


class Int8CodedLinear(CompressedLinear):
    """What every layer that computes with int8 codes shares (:class:`QuantLinear`, and
    :class:`~lmcompress.compressor.formats.nm_packed_int8.PackedNMInt8Linear`, which stores the
    same codes packed): the scales, the activation mode, the forward path, their metadata,
    their checks on load, the float32 scales under casts, and the computation itself.

    Buffers registered by :meth:`init_scales`: ``weight_scale`` fp32 (out, 1) or (out, groups);
    ``input_scale`` fp32 (1,) for static activations, ``None`` for dynamic per-token ones;
    ``bias`` (out,) in the original dtype, or ``None``. ``dtype`` is the original weight's dtype
    (that of :meth:`dense_weight`); ``path`` chooses the forward (``int`` or ``simulated``) and
    may be changed at any time. A subclass stores the codes its own way: it registers them,
    then calls :meth:`init_scales` (so the buffers keep the order codes, scales, bias), and
    implements :meth:`weight_codes`, :meth:`code_tensors` and :meth:`code_meta`.
    """

    exact_tensors = frozenset({"weight_scale", "input_scale"})  # float32 at any save dtype

    def init_scales(
        self,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
        path: str,
        dtype: torch.dtype,
    ) -> None:
        """Check ``path``, derive ``group_size`` from ``weight_scale``'s shape, register the
        scales (as float32) and the bias."""
        if path not in PATHS:
            raise ConfigError(f"unknown int8 path {path!r}; choose from {', '.join(PATHS)}")
        groups = weight_scale.shape[-1]
        self.group_size = None if groups == 1 else self.in_features // groups
        self.path, self.dtype = path, dtype
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer(
            "input_scale", None if input_scale is None else input_scale.float().reshape(1)
        )
        self.register_buffer("bias", bias)

    # --- what a subclass provides -----------------------------------------------------------

    def weight_codes(self) -> torch.Tensor:
        """The int8 codes (out, in)."""
        raise NotImplementedError

    def code_tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors that hold the codes (they come first in :meth:`state_tensors`)."""
        raise NotImplementedError

    def code_meta(self) -> dict[str, Any]:
        """The metadata of the codes' layout (it comes before the int8 fields in :meth:`meta`)."""
        return {}

    # --- shared -----------------------------------------------------------------------------

    @property
    def activations(self) -> str:
        return "dynamic" if self.input_scale is None else "static"

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {**self.code_tensors(), "weight_scale": self.weight_scale}
        if self.input_scale is not None:
            tensors["input_scale"] = self.input_scale
        if self.bias is not None:
            tensors["bias"] = self.bias
        return tensors

    def meta(self) -> dict[str, Any]:
        return {
            **super().meta(),
            **self.code_meta(),
            "bits": 8,
            "group_size": self.group_size,
            "activations": self.activations,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    @classmethod
    def checked_state(
        cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
    ) -> dict[str, Any]:
        """The arguments of :class:`QuantLinear` (``weight_q``, scales, bias, ``conv1d``,
        ``dtype``) from stored ``tensors`` and ``meta``, checked against the format's schema
        (:data:`INT8`: fields, dtypes, shapes, positive finite scales; a mismatched file is a
        :class:`ModelLoadError`). A format that stores its codes otherwise checks them in its
        schema and passes none here: ``weight_q`` is then ``None``."""
        cls.schema.check(cls.format, tensors, meta)
        return {
            "weight_q": tensors.get("weight_q"),
            "weight_scale": tensors["weight_scale"],
            "input_scale": tensors.get("input_scale"),
            "bias": tensors.get("bias"),
            "conv1d": bool(meta.get("conv1d", False)),
            "dtype": getattr(torch, meta.get("dtype", "float32")),
        }

    def _apply(self, fn, recurse=True):
        """Scales stay float32 whatever the model is cast to (``model.to(torch.bfloat16)`` would
        otherwise round them to 8 bits of mantissa); they follow device moves."""
        scales = {"weight_scale": self.weight_scale, "input_scale": self.input_scale}
        super()._apply(fn, recurse)
        for name, scale in scales.items():
            if scale is not None:
                setattr(self, name, scale.to(fn(scale).device))
        return self

    def dense_weight(self) -> torch.Tensor:
        """The dequantized weight ``codes · weight_scale`` (out, in), in :attr:`dtype`."""
        return quant.dequantize(self.weight_codes(), self.weight_scale).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_forward(
            x, self.weight_codes(), self.weight_scale, self.input_scale, self.bias, self.path
        )


@register_format
class QuantLinear(Int8CodedLinear):
    """``y = Q(x) Q(W)ᵀ + b`` for an ``nn.Linear`` or GPT-2 ``Conv1D``.

    Buffers: ``weight_q`` int8 (out, in), then those of :class:`Int8CodedLinear` (scales,
    bias); ``dtype`` and ``path`` as there.
    """

    format = "int8"
    schema = INT8
    interop = "compressed-tensors"  # the dense copy: int-quantized, as llm-compressor writes

    def __init__(
        self,
        weight_q: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        conv1d: bool = False,
        path: str = "int",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        out_features, in_features = weight_q.shape
        super().__init__(in_features, out_features, conv1d=conv1d)
        self.register_buffer("weight_q", weight_q)
        self.init_scales(weight_scale, input_scale, bias, path, dtype)

    @classmethod
    @torch.no_grad()
    def from_linear(
        cls,
        linear: nn.Module,
        activations: str = "dynamic",
        input_scale: torch.Tensor | float | None = None,
        group_size: int | None = None,
        path: str = "int",
        bits: int = 8,
    ) -> QuantLinear:
        """Quantize ``linear``'s weight; ``input_scale`` is the static activation *scale*
        (``quant.absmax_scale(observed_absmax)``), required for ``activations="static"`` and
        refused for ``"dynamic"``. Bad options are one-line :class:`ConfigError` s."""
        if bits != 8:
            raise ConfigError(f"int8 format: bits must be 8, got {bits}")
        if activations not in ACTIVATIONS:
            raise ConfigError(
                f"unknown activation quantization {activations!r}; choose from "
                f"{', '.join(ACTIVATIONS)}"
            )
        if activations == "static" and input_scale is None:
            raise ConfigError("static activations need an input_scale from calibration")
        if activations == "dynamic" and input_scale is not None:
            raise ConfigError("input_scale is for static activations; dynamic ones have none")
        W = weight_matrix(linear).detach()  # (out, in)
        if input_scale is not None:
            input_scale = torch.as_tensor(input_scale, dtype=torch.float32, device=W.device)
            if input_scale.numel() != 1:
                raise ConfigError(
                    f"static input_scale is per tensor (one value), got shape "
                    f"{list(input_scale.shape)}"
                )
            quant.check_scale(input_scale, "input_scale")
        weight_q, weight_scale = quant.int8_weight(W, group_size)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(
            weight_q,
            weight_scale,
            input_scale,
            bias,
            conv1d=isinstance(linear, Conv1D),
            path=path,
            dtype=W.dtype,
        )

    def weight_codes(self) -> torch.Tensor:
        return self.weight_q

    def code_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight_q": self.weight_q}

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> QuantLinear:
        """Rebuild from :meth:`state_tensors` and :meth:`meta`, checked
        (:meth:`~Int8CodedLinear.checked_state`)."""
        return cls(**cls.checked_state(tensors, meta))

    def extra_repr(self) -> str:
        groups = "channel" if self.group_size is None else f"group of {self.group_size}"
        return (
            f"{super().extra_repr()}, weights per {groups}, activations={self.activations}, "
            f"path={self.path}"
        )
