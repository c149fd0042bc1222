"""MaskLLM on two CPU processes under ``accelerate launch`` on a tiny model: data parallel
(logits replicated, gradients averaged by the trainer) and FSDP (logits, gradients and AdamW
moments sharded by FSDP2).

accelerate 1.15's ``launch --cpu --num_processes 2`` starts ONE process unless an MPI hostfile
is given (then it runs ``mpirun``); on a machine without GPUs, ``--multi_gpu --num_processes 2``
starts two through torchrun and ``Accelerator(cpu=True)`` joins them with the gloo backend. The
tests use torchrun, and ``mpirun`` where MPI is installed (e.g. Debian's ``openmpi-bin``).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    import torch
    from accelerate import PartialState
    sys.path[:0] = [{tests!r}, {root!r}]  # conftest, and the benchmarks package it imports
    from conftest import make_tiny_model
    from lmcompress import MaskLLMConfig, compress
    from lmcompress.methods.maskllm import method as maskllm_method
    from safetensors.torch import save_file

    logging.basicConfig(level=logging.INFO)  # "resumed from ... at step N" goes to stderr
    options = json.loads(sys.argv[1])
    out = sys.argv[2]
    local = {{}}
    shard = maskllm_method.distributed.shard_modules

    def spy(modules, device):  # record each process's share of the logits once sharded
        modules = list(modules)
        count = shard(modules, device)
        local["numel"] = sum(m.logits.to_local().numel() for m in modules)
        local["total"] = sum(m.logits.numel() for m in modules)
        return count

    maskllm_method.distributed.shard_modules = spy
    model = make_tiny_model("llama")
    data = torch.randint(3, 256, (12, 32), generator=torch.Generator().manual_seed(0))
    config = MaskLLMConfig(
        sparsity="2:4", steps=4, lr=0.05, batch_size=2, prior="magnitude", **options
    )
    report, stats = compress(model, config, data, return_stats=True)
    rank = PartialState().process_index
    save_file(stats.tensors, f"{{out}}/rank{{rank}}.safetensors")
    history = report.extra["loss_curve"]
    with open(f"{{out}}/rank{{rank}}.json", "w") as f:
        json.dump({{"local": local, "history": history}}, f)
    """
)


def _launch(
    tmp_path: Path, name: str, mpi: bool = False, **options
) -> tuple[list[dict], list[dict], str]:
    """Run the script on two processes (torchrun, or ``mpirun``: ``mpi``); per rank: its logits
    and its json record; stderr."""
    out = tmp_path / name
    out.mkdir()
    script = tmp_path / "train.py"
    tests = Path(__file__).resolve().parent.parent
    script.write_text(SCRIPT.format(tests=str(tests), root=str(tests.parent)))
    accelerate = Path(sys.executable).parent / "accelerate"
    env = dict(os.environ)
    if mpi:
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("localhost slots=2\n")
        mode = ["--cpu", "--mpirun_hostfile", str(hostfile)]
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # containers
    else:
        mode = ["--multi_gpu"]
    command = [
        str(accelerate), "launch", *mode, "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        str(script), json.dumps(options), str(out),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tensors = [load_file(out / f"rank{r}.safetensors") for r in (0, 1)]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return tensors, records, proc.stderr


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("ddp"), "ddp")


def test_two_process_accelerate_run_trains_and_keeps_invariants(data_parallel):
    ranks, records, _ = data_parallel
    assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) == 14
    for key, logits in ranks[0].items():
        # gradients are averaged, so both processes hold the same logits after every step
        torch.testing.assert_close(ranks[1][key], logits, rtol=0, atol=1e-6)
        assert logits.shape[1] == 6
    assert records[0]["local"] == {}  # nothing sharded
    assert [h["step"] for h in records[0]["history"]] == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """The FSDP run, which also writes its one checkpoint, at step 3 of 4, for the resume test
    (a checkpoint changes nothing in the training): ``(checkpoint dir, _launch's result)``."""
    root = tmp_path_factory.mktemp("fsdp")
    checkpoints = root / "ckpt"
    options = {"checkpoint_dir": str(checkpoints), "checkpoint_every": 3}
    return checkpoints, _launch(root, "fsdp", fsdp=True, **options)


def test_fsdp_shards_the_logits_and_matches_data_parallel(fsdp_run, data_parallel):
    reference, reference_records, _ = data_parallel
    ranks, records, _ = fsdp_run[1]
    for record in records:  # each process held half the logits (and so half the moments)
        assert record["local"]["numel"] * 2 == record["local"]["total"] > 0
    for r in (0, 1):
        assert ranks[r].keys() == reference[0].keys()
        for key, logits in reference[0].items():
            # the same data split, noise and averaged gradients: the same training
            torch.testing.assert_close(ranks[r][key], logits, rtol=1e-4, atol=1e-5)
    for ours, theirs in zip(records[0]["history"], reference_records[0]["history"], strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4)
        assert ours["lm_loss"] == pytest.approx(theirs["lm_loss"], rel=1e-4)
        assert ours["flipped"] == pytest.approx(theirs["flipped"], abs=1e-6)


def test_fsdp_checkpoint_resumes_to_the_uninterrupted_result(tmp_path, fsdp_run, data_parallel):
    reference, _, _ = data_parallel
    # the only checkpoint is written at step 3 (of 4); the resumed run trains step 4 from it
    checkpoints = fsdp_run[0]
    state = json.loads((checkpoints / "trainer_state" / "state.json").read_text())
    assert state["state"]["step"] == 3
    saved = load_file(checkpoints / "trainer_state" / "state.safetensors")
    name = next(iter(reference[0]))[: -len(".logits")]
    assert saved[f"param.{name}"].shape == reference[0][f"{name}.logits"].shape  # gathered
    ranks, records, log = _launch(
        tmp_path,
        "resumed",
        fsdp=True,
        checkpoint_dir=str(checkpoints),
        checkpoint_every=3,
        resume=True,
    )
    assert log.count("resumed from") == 2 and "at step 3" in log  # both processes
    assert [h["step"] for h in records[0]["history"]] == [1, 2, 3, 4]
    for key, logits in reference[0].items():
        torch.testing.assert_close(ranks[0][key], logits, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs MPI (mpirun)")
def test_cpu_launch_through_mpirun_trains_the_same_fsdp_run(tmp_path, data_parallel):
    """``accelerate launch --cpu --num_processes 2 --mpirun_hostfile H``: the ranks come from
    MPI's environment (OMPI_COMM_WORLD_*), not torchrun's."""
    reference, _, _ = data_parallel
    ranks, records, _ = _launch(tmp_path, "mpi", mpi=True, fsdp=True)
    assert all(r["local"]["numel"] * 2 == r["local"]["total"] for r in records)
    for r in (0, 1):
        for key, logits in reference[0].items():
            torch.testing.assert_close(ranks[r][key], logits, rtol=1e-4, atol=1e-5)
