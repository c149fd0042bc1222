"""What the ``int4`` and ``nm_packed_int4`` formats store, as their :class:`Schema`: meta fields
(bits, group size, symmetry, dtype; n and m), the packed codes' and the grid's dtypes and shapes,
and the codes' and zero points' range (:func:`bad_codes`), checked at load."""

from __future__ import annotations

import torch

from lmcompress.compressor.formats import grid
from lmcompress.compressor.formats.nm_packed import NM_PACKED, kept
from lmcompress.compressor.formats.schema import (
    EXACT,
    FLOAT_NAMES,
    LINEAR_META,
    NM_META,
    Meta,
    MetaField,
    Schema,
    StoredTensor,
    bias_tensor,
    nm_rule,
)
from lmcompress.kernels.int4_reference import BITS, groups_of, packed_columns


def n_groups(meta: Meta) -> int:
    return groups_of(meta["group_size"], meta["in_features"])


def group_rule(meta: Meta) -> str | None:
    size, in_features = meta["group_size"], meta["in_features"]
    if size != -1 and (size < 1 or in_features % size):
        return f"group_size {size} does not divide in_features={in_features} (nor is it -1)"
    return None


INT4_META = {
    **LINEAR_META,
    "bits": MetaField((int,), choices=BITS),
    "group_size": MetaField((int,)),
    "symmetric": MetaField((bool,)),
    "dtype": MetaField((str,), required=False, choices=FLOAT_NAMES),
}
# scales float32 (out, groups) > 0, zeros uint8 (out, groups), bias (out,)
INT4_GRID = {
    "scales": StoredTensor(
        EXACT, lambda meta: (meta["out_features"], n_groups(meta)), positive=True
    ),
    "zeros": StoredTensor(torch.uint8, lambda meta: (meta["out_features"], n_groups(meta))),
    "bias": bias_tensor(),
}
INT4 = Schema(
    meta=INT4_META,
    tensors={
        "qweight": StoredTensor(
            torch.uint8,
            lambda meta: (meta["out_features"], packed_columns(meta["bits"], meta["in_features"])),
        ),
        **INT4_GRID,
    },
    rules=(group_rule,),
)
NM_PACKED_INT4 = Schema(
    meta={**INT4_META, **NM_META},
    tensors={
        "qweight": StoredTensor(
            torch.uint8,
            lambda meta: (meta["out_features"], packed_columns(meta["bits"], kept(meta))),
        ),
        "indices": NM_PACKED.tensors["indices"],
        **INT4_GRID,
    },
    rules=(nm_rule, group_rule),
)


def bad_codes(qweight: torch.Tensor, zeros: torch.Tensor, meta: Meta, columns: int) -> str | None:
    """Why stored codes and zero points are not a valid grid of ``meta``'s bits (``columns``
    codes a row), or ``None``: every code and zero point in ``[0, 2^bits - 1]`` (3 bits: no
    nibble above 7; an odd row's unused high nibble 0), symmetric zero points ``2^(bits-1)``."""
    bits, maxq = meta["bits"], grid.max_code(meta["bits"])
    if bits == 3 and bool((qweight & 0x88).any()):
        return "a code is above 7, out of range for 3 bits"
    if bits <= 4 and columns % 2 and bool((qweight[:, -1] >> 4).any()):
        return "the unused high nibble of an odd row is not 0"
    if bool((zeros > maxq).any()):
        return f"a zero point is above {maxq}, out of range for {bits} bits"
    if meta["symmetric"] and bool((zeros != 1 << (bits - 1)).any()):
        return f"symmetric, but a zero point is not {1 << (bits - 1)}"
    return None
