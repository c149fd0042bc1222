"""The offline GPU resource report (``lmcompress/kernels/ptx_report.py``): ``ptxas -v`` read
right, a spill / too many registers / too much shared memory flagged, and every Triton kernel
and autotuning candidate compiled for sm_80 and sm_90 (no GPU needed: Triton's compiler and
the ptxas its wheel ships) with none of them."""

from __future__ import annotations

import pytest

from lmcompress.kernels import ptx_report
from lmcompress.kernels.ptx_report import Entry

SPILLING = """ptxas info    : Compiling entry function 'nm_matmul_kernel' for 'sm_80'
ptxas info    : Function properties for nm_matmul_kernel
    328 bytes stack frame, 324 bytes spill stores, 316 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 328 bytes cumulative stack size
"""
CLEAN = """ptxas-blackwell info    : Function properties for int8_softmax_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas-blackwell info    : Used 146 registers, used 1 barriers
"""


def test_ptxas_output_is_read():
    assert ptx_report.parse_ptxas(SPILLING) == (255, 324, 316)
    assert ptx_report.parse_ptxas(CLEAN) == (146, 0, 0)
    with pytest.raises(ValueError, match="without registers"):
        ptx_report.parse_ptxas("ptxas info    : 0 bytes gmem")


def _entry(**changes):
    fields = {"kernel": "k", "name": "n", "arch": 80, "registers": 200, "spill_stores": 0,
              "spill_loads": 0, "shared_bytes": 1024} | changes  # fmt: skip
    return Entry(**fields)


@pytest.mark.parametrize("arch", ptx_report.ARCHS)
def test_problems_are_flagged_at_their_limits(arch):
    limit = ptx_report.SHARED_LIMIT[arch]
    assert _entry(arch=arch).problems == []
    assert _entry(arch=arch, registers=255, shared_bytes=limit).problems == []
    assert _entry(arch=arch, shared_bytes=limit + 1).problems == [
        f"{limit + 1} bytes of shared memory"
    ]
    assert _entry(arch=arch, registers=256).problems == ["256 registers"]
    assert _entry(arch=arch, spill_loads=4).problems == ["spills 0 / 4 bytes"]
    assert _entry(arch=arch, spill_stores=8).problems == ["spills 8 / 0 bytes"]
    assert ptx_report.SHARED_LIMIT[90] > ptx_report.SHARED_LIMIT[80]


def test_every_kernel_and_config_compiles_without_spills_on_sm80_and_sm90():
    if any(ptx_report.ptxas(arch) is None for arch in ptx_report.ARCHS):
        pytest.skip("Triton ships no ptxas here")
    from lmcompress.kernels import nm_linear_triton as nm

    entries = ptx_report.report_in_child()
    problems = [f"{e.kernel} {e.name} sm_{e.arch}: {e.problems}" for e in entries if e.problems]
    assert problems == []
    for arch in ptx_report.ARCHS:
        names = {e.name for e in entries if e.arch == arch}
        for decode in (True, False):
            for config in nm._configs(decode, arch):  # every candidate the autotuner may pick
                blocks = "x".join(str(config.kwargs[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
                assert any(f"2:4 {blocks} w{config.num_warps} s{config.num_stages}" in n
                           for n in names), (arch, decode, blocks)  # fmt: skip
        assert sum(e.kernel == "int8_softmax_kernel" for e in entries if e.arch == arch) == 4
    assert len(entries) == sum(len(list(ptx_report.variants(arch))) for arch in ptx_report.ARCHS)
