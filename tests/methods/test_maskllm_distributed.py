"""MaskLLM on two CPU processes under ``accelerate launch`` on a tiny model.

accelerate 1.15's ``launch --cpu --num_processes 2`` starts ONE process unless an MPI hostfile
is given; on a machine without GPUs, ``--multi_gpu --num_processes 2`` starts two through
torchrun and ``Accelerator(cpu=True)`` joins them with the gloo backend. The test uses that.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import load_file

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from accelerate import PartialState
    sys.path.insert(0, {tests!r})
    from conftest import make_tiny_model
    from lmcompress import MaskLLMConfig, compress
    from safetensors.torch import save_file

    model = make_tiny_model("llama")
    data = torch.randint(3, 256, (12, 32), generator=torch.Generator().manual_seed(0))
    config = MaskLLMConfig(sparsity="2:4", steps=4, lr=0.05, batch_size=2, prior="magnitude")
    report, stats = compress(model, config, data, return_stats=True)
    rank = PartialState().process_index
    save_file(stats.tensors, f"{out}/rank{{rank}}.safetensors")
    """
)


def test_two_process_accelerate_run_trains_and_keeps_invariants(tmp_path):
    tests = str(Path(__file__).resolve().parent.parent)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=tests, out=str(tmp_path)))
    accelerate = Path(sys.executable).parent / "accelerate"
    proc = subprocess.run(
        [
            str(accelerate),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) == 14
    for key, logits in ranks[0].items():
        # gradients are averaged, so both processes hold the same logits after every step
        torch.testing.assert_close(ranks[1][key], logits, rtol=0, atol=1e-6)
        assert logits.shape[1] == 6
