"""Compressed formats: how a compressed layer computes and is stored.

``base`` (the ``CompressedLinear`` and ``ModelTransform`` protocols), ``registry`` (the name
tables, a leaf), one module per format (``nm_packed``, ``low_rank``, ``int8``,
``nm_packed_int8``, the ``int8_softmax`` transform), ``quant`` (int8 math), ``compose`` (formats
of layers two stages compressed) and ``catalog`` (every built-in format, by name).
"""
