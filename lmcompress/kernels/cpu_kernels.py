"""CPU kernels for the compressed runtimes at few tokens (:file:`cpu_kernels.cpp`).

At batch-1 decoding every layer multiplies one token: torch's matmuls there cost a fixed
~100 µs a layer (bf16) or run several float passes around the integer product (int8), and a
packed N:M layer without a kernel unpacks its whole weight on every call. These kernels read
each compressed weight once per call for up to four tokens at a time:

- packed N:M (float values, or int8 codes): the packed values and positions directly (2:4 in
  bf16: 56 % of the dense bytes; float 2:4 also on :mod:`~lmcompress.kernels.nm24_tiles`'
  tiles, one row a vector lane); and the unpacking itself, for more tokens;
- int8 W8A8: activation quantization, the integer products and the rescale in one pass,
  bit-identical to the torch computation;
- low rank: both factors' products in one call;
- weight-only int4 (``lmc_int4_*``, called by :mod:`lmcompress.kernels.int4_ops` and
  :mod:`lmcompress.kernels.int4_tiles`): the packed 4-bit codes for a few tokens (16 rows a
  vector on the tiled layout), their dequantization by blocks for more.

On SmolLM2's 210 decoder linears at one token they run 2–4× faster than torch's
(``benchmarks/results/speed.md``). Vector loops: AVX-512's, else AVX2's (half as wide; 1 or 2
from ``lmc_nm_simd()`` / ``lmc_int4_vector()``), else plain loops (6-13× slower than torch's
dense bf16 on an AVX2-only AMD EPYC: ``benchmarks/results/layer_speed_avx2``).

The C++ source is compiled once per machine with the system compiler (``$CXX``, else ``c++``,
``g++`` or ``clang++``; ``-O3 -march=native -fopenmp``), the same toolchain ``torch.compile``
uses on CPU, into ``<cache>/kernels`` under a name that hashes the source, the compiler, the
flags and the CPU (a cache shared by different machines never loads code built for another),
and loaded with :mod:`ctypes`. It needs no ninja and no torch headers (~1 s to build). Where
there is no compiler, the build fails, or ``LMCOMPRESS_CPU_KERNELS=0``, :func:`library` is
``None`` (logged once) and callers use the pure-torch reference.

The functions here trust their arguments' layout (:mod:`lmcompress.kernels.ops` checks them)
and make tensors contiguous; results are new tensors.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from lmcompress.cache import cache_dir
from lmcompress.kernels import reference

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAG_SETS = (  # tried in order: clang without libomp builds single-threaded
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3"],
)
# Above these token counts torch's matmul is faster (measured crossovers on SmolLM2's shapes,
# `python -m benchmarks.layer_speed`):
MAX_TOKENS = 12  # packed N:M (then unpack once per call) and int8
LOW_RANK_MAX_TOKENS = 8
FLOAT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_VOID, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_F32, _U64 = ctypes.c_float, ctypes.c_uint64
SIGNATURES = {
    "lmc_nm_simd": [],
    "lmc_nm_matmul_float": [_VOID, _INT, _I64, _I64, _VOID, _INT, _VOID, _I64, _I64]
    + [_INT, _INT, _INT, _VOID, _INT, _VOID, _INT, _INT],
    "lmc_nm_matmul_int8": [_VOID, _I64, _I64, _VOID, _VOID, _I64, _I64, _INT, _INT, _INT]
    + [_VOID, _INT],
    "lmc_nm_unpack": [_VOID, _INT, _VOID, _I64, _I64, _I64, _INT, _INT, _INT, _VOID, _INT],
    "lmc_int8_linear": [_VOID, _INT, _I64, _I64, _VOID, _VOID, _VOID, _I64, _INT, _INT, _INT]
    + [_I64, _VOID, _VOID, _INT, _VOID, _INT, _INT],
    "lmc_int8_quantize": [_VOID, _INT, _I64, _I64, _VOID, _VOID, _VOID, _INT],
    "lmc_int8_rescale": [_VOID, _I64, _I64, _VOID, _INT, _VOID, _VOID, _INT, _VOID, _I64, _INT]
    + [_INT],
    "lmc_nm_first_bad_byte": [_VOID, _I64, _I64, _I64, _VOID, _VOID],
    "lmc_all_finite": [_VOID, _INT, _I64, _INT],
    "lmc_lowrank_float": [_VOID, _INT, _I64, _I64, _VOID, _VOID, _INT, _I64, _I64, _VOID, _INT]
    + [_VOID, _INT, _INT],
    "lmc_soft_mask_forward": [_VOID, _VOID, _I64, _INT, _INT, _F32, _F32, _VOID, _I64, _I64]
    + [_U64, _INT, _F32, _VOID, _VOID, _INT],
    "lmc_soft_mask_backward": [_VOID, _VOID, _I64, _INT, _INT, _F32, _F32, _VOID, _I64, _I64]
    + [_U64, _VOID, _VOID, _VOID, _INT],
    "lmc_group_argmax": [_VOID, _I64, _INT, _VOID, _INT],
    "lmc_int4_vector": [],
    "lmc_int4_linear": [_VOID, _INT, _I64, _I64, _VOID, _I64, _VOID, _VOID, _I64, _I64, _VOID]
    + [_I64, _INT, _INT, _INT, _I64, _VOID, _INT, _VOID, _INT, _INT, _INT],
    "lmc_int4_dequant": [_VOID, _I64, _VOID, _VOID, _I64, _I64, _VOID, _I64, _INT, _INT, _INT]
    + [_I64, _I64, _I64, _VOID, _INT, _INT],
    "lmc_int4_linear_tiled": [_VOID, _INT, _I64, _I64, _VOID, _VOID, _VOID, _I64, _I64, _I64]
    + [_VOID, _INT, _VOID, _INT, _INT, _INT],
    "lmc_int4_untile_rows": [_VOID, _I64, _I64, _I64, _VOID, _INT],
    "lmc_int4_dequant_tiled": [_VOID, _VOID, _VOID, _I64, _I64, _I64, _I64, _I64, _VOID, _INT]
    + [_INT],
    "lmc_int4_linear_tiled24": [_VOID, _INT, _I64, _I64, _VOID, _VOID, _VOID, _VOID, _I64, _I64]
    + [_I64, _VOID, _INT, _VOID, _INT, _INT, _INT],
    "lmc_int4_dequant_tiled24": [_VOID, _VOID, _VOID, _VOID, _I64, _I64, _I64, _I64, _I64, _VOID]
    + [_INT, _INT],
    "lmc_nm24_tiled_float": [_VOID, _INT, _I64, _I64, _VOID, _INT, _VOID, _I64, _VOID, _INT]
    + [_VOID, _INT, _INT, _INT],
}
_RETURNS_INT = ("lmc_nm_simd", "lmc_nm_first_bad_byte", "lmc_all_finite", "lmc_int4_vector")


def enabled() -> bool:
    """``False`` where ``LMCOMPRESS_CPU_KERNELS=0`` asks for the pure-torch reference."""
    return os.environ.get("LMCOMPRESS_CPU_KERNELS", "1") != "0"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; ``None`` where they cannot be (logged once)."""
    if not enabled():
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        logger.warning(
            "compiled CPU kernels unavailable (%s): the compressed layers run torch's ops "
            "(packed N:M layers unpack on every call)",
            err,
        )
        return None
    for name, args in SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = _INT if name in _RETURNS_INT else None
    logger.debug("compiled CPU kernels loaded (AVX-512 2:4 loops: %s)", bool(lib.lmc_nm_simd()))
    return lib


@torch.compiler.assume_constant_result  # called while torch.compile traces, not traced
def built() -> bool:
    """Whether :func:`library` is there (a traced layer's check before it adds a kernel op)."""
    return library() is not None


def has_compiler() -> bool:
    """Whether :func:`_compiler` finds one: the kernel tests skip only where it does not."""
    return _compiler(required=False) is not None


def _compiler(required: bool = True) -> str | None:
    names = (os.environ.get("CXX"), "c++", "g++", "clang++")
    found = next((shutil.which(c) for c in names if c and shutil.which(c)), None)
    if found is None and required:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    return found


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = ("model name", "flags", "Features", "CPU part")
    lines = {line.split(":")[0].strip(): line for line in text.splitlines() if ":" in line}
    return "\n".join(lines.get(key, "") for key in keep) + platform.machine()


def _build() -> Path:
    """The shared library for this source, compiler and CPU: cached, else compiled into a
    temporary file and renamed into place (two processes building at once both succeed)."""
    compiler = _compiler()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + version.encode() + _cpu_identity().encode()).hexdigest()
    target = cache_dir() / "kernels" / f"cpu_kernels-{digest[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the CPU kernels (once per machine) into %s", target.parent)
    errors = []
    for flags in FLAG_SETS:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        command = [compiler, *flags, "-shared", "-fPIC", "-std=c++17", str(SOURCE), "-o", tmp]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode == 0:
            os.replace(tmp, target)
            return target
        os.unlink(tmp)
        errors.append(done.stderr.strip().splitlines()[-1:] or ["?"])
    raise RuntimeError(f"{Path(compiler).name} failed: {errors[0][0]}")


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _bias(bias: torch.Tensor | None) -> tuple[int | None, int]:
    """A (contiguous) bias's pointer and float kind arguments: (NULL, 0) for none."""
    return (None, 0) if bias is None else (bias.data_ptr(), FLOAT_KINDS[bias.dtype])


def matmul(
    x: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    n: int,
    m: int,
    bits: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` for packed ``W`` with float values, ``x`` (tokens, in) fp32 or bf16
    (fp16 runs in fp32): (tokens, out) in ``x``'s dtype, accumulated in fp32."""
    lib = library()
    dtype = x.dtype
    x = x if dtype in (torch.float32, torch.bfloat16) else x.float()
    x, values, indices = x.contiguous(), values.contiguous(), indices.contiguous()
    bias = None if bias is None else bias.contiguous()
    tokens, in_features = x.shape
    y = x.new_empty((tokens, values.shape[0]))
    lib.lmc_nm_matmul_float(
        x.data_ptr(), FLOAT_KINDS[x.dtype], tokens, in_features,
        values.data_ptr(), FLOAT_KINDS[values.dtype], indices.data_ptr(), indices.shape[1],
        values.shape[0], n, m, bits,
        *_bias(bias),
        y.data_ptr(), FLOAT_KINDS[y.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return y if y.dtype == dtype else y.to(dtype)


def int8_matmul(
    x_q: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, n: int, m: int, bits: int
) -> torch.Tensor:
    """``x_q @ W.T`` as exact int32 for int8 ``x_q`` (tokens, in) and packed int8 codes: equal
    to ``torch._int_mm(x_q, unpack(W).t())``."""
    lib = library()
    x_q, values, indices = x_q.contiguous(), values.contiguous(), indices.contiguous()
    tokens, in_features = x_q.shape
    acc = torch.empty((tokens, values.shape[0]), dtype=torch.int32)
    lib.lmc_nm_matmul_int8(
        x_q.data_ptr(), tokens, in_features, values.data_ptr(), indices.data_ptr(),
        indices.shape[1], values.shape[0], n, m, bits, acc.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return acc


def int8_matmul_dense(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """``x_q @ w_q.T`` as exact int32 for int8 ``x_q`` (tokens, in) and dense int8 codes
    ``w_q`` (out, in): equal to ``torch._int_mm(x_q, w_q.t())``, any number of tokens."""
    x_q, w_q = x_q.contiguous(), w_q.contiguous()
    acc = torch.empty((x_q.shape[0], w_q.shape[0]), dtype=torch.int32)
    library().lmc_nm_matmul_int8(
        x_q.data_ptr(), *x_q.shape, w_q.data_ptr(), None, 0, w_q.shape[0], 1, 1, 0,
        acc.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return acc


def products_beat_int_mm() -> bool:
    """Whether the kernels' int8 products beat ``torch._int_mm`` at any token count: with AVX2
    but not AVX-512 (``lmc_nm_simd() == 2``; Zen 3, 256 x 1536 x 576: ~147 ms against ~8)."""
    lib = library()
    return lib is not None and lib.lmc_nm_simd() == 2


def unpack(
    values: torch.Tensor, indices: torch.Tensor, n: int, m: int, bits: int, in_features: int
) -> torch.Tensor:
    """The dense (out, in) weight in ``values``' dtype (1, 2 or 4-byte elements)."""
    lib = library()
    values, indices = values.contiguous(), indices.contiguous()
    dense = values.new_empty((values.shape[0], in_features))
    lib.lmc_nm_unpack(
        values.data_ptr(), values.element_size(), indices.data_ptr(), indices.shape[1],
        values.shape[0], in_features, n, m, bits, dense.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return dense


def int8_linear(
    x: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    codes: torch.Tensor,
    indices: torch.Tensor | None = None,
    n: int = 1,
    m: int = 1,
) -> torch.Tensor:
    """The whole int8 linear of ``x`` (tokens, in), fp32 or bf16, in one pass: per-token (or
    the static ``input_scale``) activation codes, their int32 products with the int8 weight
    ``codes`` (dense (out, in), or packed N:M with ``indices``), the rescale by ``weight_scale``
    (out, 1) and the bias. Bit-identical to
    :func:`lmcompress.compressor.formats.int8.int8_forward` on the ``int`` path; (tokens, out)
    in ``x``'s dtype."""
    lib = library()
    x, codes = x.contiguous(), codes.contiguous()
    tokens, in_features = x.shape
    packed = indices is not None
    indices = indices.contiguous() if packed else None
    bias = None if bias is None else bias.contiguous()
    y = x.new_empty((tokens, codes.shape[0]))
    lib.lmc_int8_linear(
        x.data_ptr(), FLOAT_KINDS[x.dtype], tokens, in_features,
        _ptr(input_scale), codes.data_ptr(),
        indices.data_ptr() if packed else None, indices.shape[1] if packed else 0,
        n, m, reference.index_bits(m) if packed else 0,
        codes.shape[0], weight_scale.contiguous().data_ptr(),
        *_bias(bias),
        y.data_ptr(), FLOAT_KINDS[y.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return y


def int8_quantize(
    x: torch.Tensor, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``formats.int8.quantize_activations`` in one pass: int8 codes of ``x`` (tokens, in),
    fp32 or bf16, and their scales, per token (tokens, 1) or ``input_scale``. Bit-identical."""
    lib = library()
    x = x.contiguous()
    tokens, in_features = x.shape
    codes = torch.empty((tokens, in_features), dtype=torch.int8)
    scales = torch.empty((tokens, 1), dtype=torch.float32)
    lib.lmc_int8_quantize(
        x.data_ptr(), FLOAT_KINDS[x.dtype], tokens, in_features, _ptr(input_scale),
        codes.data_ptr(), scales.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return codes, (scales if input_scale is None else input_scale)


def int8_rescale(
    acc: torch.Tensor,
    x_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kernels.int8_ops.rescale`` in one pass: ``acc`` int32 (tokens, out), ``x_scale`` fp32
    (tokens, 1) or (1,), ``weight_scale`` fp32 (out, 1); (tokens, out) in ``out_dtype`` (fp32
    or bf16), written into ``out`` where given (a block of columns of a larger output: rows
    may be strided, columns contiguous). Bit-identical."""
    lib = library()
    acc, x_scale = acc.contiguous(), x_scale.contiguous()
    bias = None if bias is None else bias.contiguous()
    tokens, out_features = acc.shape
    y = torch.empty((tokens, out_features), dtype=out_dtype) if out is None else out
    lib.lmc_int8_rescale(
        acc.data_ptr(), tokens, out_features, x_scale.data_ptr(), int(x_scale.numel() != 1),
        weight_scale.contiguous().data_ptr(),
        *_bias(bias),
        y.data_ptr(), y.stride(0), FLOAT_KINDS[out_dtype], torch.get_num_threads(),
    )  # fmt: skip
    return y


def lowrank(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``(x Aᵀ) Bᵀ + bias`` for ``x`` (tokens, in) and factors ``A`` (rank, in), ``B`` (out,
    rank) of one dtype, ``x`` fp32 or bf16: each factor's rows are read once for up to four
    tokens, accumulated in fp32, the intermediate rounded to ``x``'s dtype as two torch linears
    round it. (tokens, out) in ``x``'s dtype."""
    lib = library()
    x, A, B = x.contiguous(), A.contiguous(), B.contiguous()
    bias = None if bias is None else bias.contiguous()
    tokens, in_features = x.shape
    y = x.new_empty((tokens, B.shape[0]))
    lib.lmc_lowrank_float(
        x.data_ptr(), FLOAT_KINDS[x.dtype], tokens, in_features,
        A.data_ptr(), B.data_ptr(), FLOAT_KINDS[A.dtype], A.shape[0], B.shape[0],
        *_bias(bias),
        y.data_ptr(), FLOAT_KINDS[y.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return y


def first_bad_byte(
    indices: torch.Tensor, bytes_: int, valid: torch.Tensor
) -> tuple[int, int] | None:
    """(row, byte) of the first of the first ``bytes_`` index bytes of each row that the
    256-entry bool table ``valid`` rejects, or ``None``: one pass (a load-time check)."""
    lib = library()
    indices = indices.contiguous()
    table = valid.to(torch.uint8).contiguous()
    where = torch.zeros(2, dtype=torch.int64)
    found = lib.lmc_nm_first_bad_byte(
        indices.data_ptr(), indices.shape[0], indices.stride(0), bytes_, table.data_ptr(),
        where.data_ptr(),
    )  # fmt: skip
    return (int(where[0]), int(where[1])) if found else None


def all_finite(values: torch.Tensor) -> bool:
    """Whether no value of ``values`` (fp32, bf16 or fp16, on CPU) is a NaN or an infinity: one
    parallel pass of integer tests (a load-time check)."""
    lib, values, threads = library(), values.contiguous(), torch.get_num_threads()
    return bool(
        lib.lmc_all_finite(values.data_ptr(), FLOAT_KINDS[values.dtype], values.numel(), threads)
    )
