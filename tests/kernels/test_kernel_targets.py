"""The CPU kernels' source compiles for every kind of x86 CPU it has a branch for, on whatever
CPU the tests run: ``-march=native`` builds only this machine's branch, so a mistake in another
one (an AVX2-only helper called from code every build compiles) went unseen on the AVX2 hosts
that ran CI and left an AVX-512 Xeon, and any CPU without AVX2, with no kernels at all (every
int4 decode about 15x slower, the lean step off). Each target is compiled to an object file
(``-c``, so that intrinsics a target lacks fail too), as ``cpu_kernels._build`` compiles it."""

from __future__ import annotations

import platform
import subprocess

import pytest
from conftest import requires_kernels

from lmcompress.kernels import cpu_kernels

pytestmark = [
    requires_kernels,
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets"),
]

# one CPU for each set of the source's #if branches
TARGETS = {
    "x86-64": "no AVX2: the scalar loops (also what the fallback flags without -march build)",
    "haswell": "AVX2 + FMA + F16C without AVX-512 (LMC_NM_AVX2, LMC_INT4_AVX2)",
    "znver3": "an AMD EPYC with AVX2 only",
    "skylake-avx512": "AVX-512 F/BW/VL without VNNI or VBMI",
    "icelake-server": "AVX-512 with VNNI and VBMI/VBMI2",
    "sapphirerapids": "AVX-512 BF16 and AMX (the Xeons these benchmarks ran on)",
}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_source_compiles_for(target, tmp_path):
    compiler = cpu_kernels._compiler()
    command = [compiler, "-O0", f"-march={target}", "-fopenmp", "-std=c++17", "-fPIC", "-c"]
    command += [str(cpu_kernels.SOURCE), "-o", str(tmp_path / "k.o")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode and f"'{target}'" in done.stderr.replace("‘", "'").replace("’", "'"):
        pytest.skip(f"this compiler does not know -march={target}")
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 0, f"{target} ({TARGETS[target]}): {errors[:3]}"


def test_the_kernels_build_wherever_a_compiler_is():
    """Where a compiler is, the library builds (a failed build logs one warning and every
    compressed layer falls back to torch's ops: the tests must not take that for 'no
    compiler' and skip)."""
    assert cpu_kernels.library() is not None
