"""What each Triton kernel costs a GPU, found on a machine without one: every kernel and launch
configuration lmcompress can run is compiled for ``sm_80`` (A100) and ``sm_90`` (H100/H200) by
Triton's own compiler, and the PTX is assembled by the ``ptxas`` that Triton ships
(``ptxas -v``): registers per thread, spill stores and loads (bytes), and the shared memory
Triton allocates. A spill (local-memory traffic in the inner loop) or a config over the
architecture's shared memory is a bug a CPU-only test can catch
(``tests/kernels/test_ptx_report.py``); ``python -m benchmarks.ptx_report`` writes the table.

The configurations: the 2:4 matmul's autotuning candidates (decode with one K slice and with
several, whose partial sums are float32; prefill), for fp16 and bf16, plus a general N:M
pattern (4:8, the slower expansion) at the interpreter's tiles; the int8 softmax with and
without a mask and an offset. Compiling needs Triton's compiler running normally: under
``TRITON_INTERPRET=1`` the kernels are interpreted functions, so :func:`report` runs in a
child process without it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from lmcompress.kernels.softmax_constants import BLOCK

ARCHS = (80, 90)
# The most shared memory one block may use (bytes, opt-in): 163 KiB on sm_80, 227 KiB on sm_90.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
MAX_REGISTERS = 255

_USED = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclasses.dataclass
class Variant:
    """One kernel compiled one way: ``constexprs`` and the launch ``options`` (warps,
    stages), and the pointer dtypes of its ``signature``."""

    kernel: str
    name: str
    signature: dict[str, str]
    constexprs: dict[str, object]
    options: dict[str, object]


@dataclasses.dataclass
class Entry:
    """A :class:`Variant`'s resources on one architecture."""

    kernel: str
    name: str
    arch: int
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int

    @property
    def problems(self) -> list[str]:
        """What is wrong with it: spills, too many registers, too much shared memory."""
        found = []
        if self.spill_stores or self.spill_loads:
            found.append(f"spills {self.spill_stores} / {self.spill_loads} bytes")
        if self.registers > MAX_REGISTERS:
            found.append(f"{self.registers} registers")
        if self.shared_bytes > SHARED_LIMIT[self.arch]:
            found.append(f"{self.shared_bytes} bytes of shared memory")
        return found


def parse_ptxas(text: str) -> tuple[int, int, int]:
    """``(registers, spill store bytes, spill load bytes)`` from ``ptxas -v`` output for one
    kernel; a ``ValueError`` where either line is missing."""
    used, spills = _USED.search(text), _SPILLS.search(text)
    if used is None or spills is None:
        raise ValueError(f"ptxas -v output without registers or spills: {text[:200]!r}")
    return int(used.group(1)), int(spills.group(1)), int(spills.group(2))


def ptxas(arch: int) -> str | None:
    """The ptxas that Triton ships for ``arch`` (``None`` where it has none)."""
    from triton.backends.nvidia.compiler import get_ptxas  # imports triton's CUDA backend

    try:
        path = get_ptxas(arch).path
    except (RuntimeError, AttributeError, FileNotFoundError):
        return None
    return path if path and os.path.exists(path) else None


def _nm_signature(dtype: str, y: str) -> dict[str, str]:
    signature = {"x_ptr": dtype, "v_ptr": dtype, "i_ptr": "*u8", "b_ptr": dtype, "y_ptr": y}
    for name in ("tokens", "out_features", "in_features", "tokens_bucket"):
        signature[name] = "i32"
    for name in ("s_xm", "s_xk", "s_vn", "s_vk", "s_in", "s_ik", "s_ys", "s_ym", "s_yn"):
        signature[name] = "i32"
    return signature


def variants(arch: int) -> Iterator[Variant]:
    """Every configuration the report compiles for ``arch`` (module doc)."""
    from lmcompress.kernels import nm_linear_triton as nm  # imports triton

    for dtype in ("fp16", "bf16"):
        for decode, splits in ((True, (1, 4)), (False, (1,))):
            for config in nm._configs(decode, arch):
                for split in splits:
                    blocks = {k: config.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
                    name = (
                        f"{dtype} {'decode' if decode else 'prefill'} 2:4 "
                        f"{blocks['BLOCK_M']}x{blocks['BLOCK_N']}x{blocks['BLOCK_K']} "
                        f"w{config.num_warps} s{config.num_stages} split {split}"
                    )
                    y = f"*{dtype}" if split == 1 else "*fp32"
                    yield _nm_variant(name, dtype, y, 2, 4, split, config.kwargs, config)
        general = nm.INTERPRETER_CONFIG
        yield _nm_variant(f"{dtype} 4:8 16x32x64 w4 s3 split 1", dtype, f"*{dtype}", 4, 8, 1,
                          general, None)  # fmt: skip
    yield from _softmax_variants()


def _nm_variant(name, dtype, y, n, m, split, blocks, config) -> Variant:
    from lmcompress.kernels import nm_linear_triton as nm

    constexprs = {
        "N": n, "M": m, "BITS": nm.index_bits(m), "FAST": nm.fast_path(n, m), "HAS_BIAS": True,
        "SPLIT_K": split, "UPCAST": False, "PRECISION": "tf32", **blocks,
    }  # fmt: skip
    warps, stages = (config.num_warps, config.num_stages) if config else (4, 3)
    signature = _nm_signature(f"*{dtype}", y) | dict.fromkeys(constexprs, "constexpr")
    return Variant(
        "nm_matmul_kernel", name, signature, constexprs, {"num_warps": warps, "num_stages": stages}
    )


def _softmax_variants() -> Iterator[Variant]:
    signature = {"scores_ptr": "*fp32", "mask_ptr": "*fp32", "offset_ptr": "*fp32"}
    signature |= {"q_ptr": "*u8", "out_ptr": "*fp32"}
    for name in ("n_rows", "n_cols", "heads", "queries", "s_sb", "s_sh", "s_sq", "s_sk"):
        signature[name] = "i32"
    for name in ("m_sb", "m_sh", "m_sq", "m_sk", "o_sb", "o_sh"):
        signature[name] = "i32"
    signature |= {"scale": "fp32", "v_ptr": "*fp32"}
    for mask in (False, True):
        for offset in (False, True):
            constexprs = {"HAS_MASK": mask, "HAS_OFFSET": offset, "ROWS": 16}
            constexprs |= {"BLOCK_COLS": BLOCK, "STORE_V": False}
            yield Variant(
                "int8_softmax_kernel",
                f"rows 16 mask {mask} offset {offset}",
                signature | dict.fromkeys(constexprs, "constexpr"),
                constexprs,
                {"num_warps": 4, "num_stages": 3, "enable_fp_fusion": False},
            )


def compile_variant(variant: Variant, arch: int) -> Entry:
    """Compile ``variant`` for ``sm_<arch>`` and read its resources (module doc)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lmcompress.kernels import nm_linear_triton, triton_softmax

    module = nm_linear_triton if variant.kernel == "nm_matmul_kernel" else triton_softmax
    source = ASTSource(getattr(module, variant.kernel), variant.signature, variant.constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=variant.options)
    with tempfile.TemporaryDirectory() as scratch:
        ptx = os.path.join(scratch, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        suffix = "a" if arch >= 90 else ""
        command = [ptxas(arch), f"-arch=sm_{arch}{suffix}", "-v", ptx, "-o", ptx + ".o"]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    registers, stores, loads = parse_ptxas(done.stdout + done.stderr)
    return Entry(
        variant.kernel, variant.name, arch, registers, stores, loads, compiled.metadata.shared
    )


def report() -> list[Entry]:
    """Every variant on every architecture (in this process: Triton must not be
    interpreting; :func:`report_in_child` otherwise)."""
    return [compile_variant(v, arch) for arch in ARCHS for v in variants(arch)]


def report_in_child(timeout: float = 900) -> list[Entry]:
    """:func:`report` in a fresh Python without ``TRITON_INTERPRET`` (module doc)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import dataclasses, json; from lmcompress.kernels import ptx_report; "
        "print(json.dumps([dataclasses.asdict(e) for e in ptx_report.report()]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout,
        check=False,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"ptx report failed: {done.stderr.strip().splitlines()[-1:]}")
    return [Entry(**row) for row in json.loads(done.stdout.strip().splitlines()[-1])]
