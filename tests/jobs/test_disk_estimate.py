"""The free-space check's estimate of what a job writes is an upper bound of what it wrote, and
not a wild one: every method, with and without the dense copy, on a tiny checkpoint."""

from __future__ import annotations

import pytest

from lmcompress.jobs.options import RunOptions
from lmcompress.jobs.paths import EXPORT_EXTRAS_BYTES
from lmcompress.jobs.preflight import preflight
from lmcompress.jobs.run import run
from lmcompress.methods import get_method
from lmcompress.methods.int8 import Int8Config
from lmcompress.methods.magnitude import MagnitudeConfig
from lmcompress.methods.maskllm import MaskLLMConfig
from lmcompress.methods.subnet import SubnetConfig
from lmcompress.methods.svd import SVDConfig

TEXT = "\n\n".join(f"Document {i}. The quick brown fox jumps over the lazy dog." for i in range(60))

CONFIGS = {
    "magnitude 2:4": MagnitudeConfig(sparsity="2:4"),
    "svd 0.5": SVDConfig(ratio=0.5),
    "int8": Int8Config(),
    "maskllm": MaskLLMConfig(steps=2),
    "subnet": SubnetConfig(steps=2),
}


def _bytes(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("dense_copy", [True, False], ids=["dense copy", "compact"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_disk_estimate_bounds_the_export(name, dense_copy, tmp_path, tiny_checkpoint):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    options = RunOptions(
        checkpoint=str(tiny_checkpoint),
        calib=str(corpus),
        eval=(),
        nsamples=8,
        seq_len=32,
        output=str(tmp_path / "out"),
        dense_copy=dense_copy,
    )
    config = CONFIGS[name]
    (need,) = preflight(options, get_method(config.method)(config)).disk
    run(options, config)
    written = _bytes(tmp_path / "out")
    assert need.what == "output" and need.bytes >= written, (need.bytes, written)
    # the allowance for the model card and friends aside, within 2x of what was written
    assert need.bytes - EXPORT_EXTRAS_BYTES <= 2 * written, (need.bytes, written)
