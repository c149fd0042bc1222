"""Several processes started by ``accelerate launch``: the accelerator, and FSDP sharding of a
learned method's parameters.

Data parallel (the default): every process holds all the trainable parameters and the trainer
averages their gradients (``average_gradients``).

FSDP (``shard_modules``): PyTorch's FSDP2 ``fully_shard`` is applied to each module that owns
trainable parameters (MaskLLM: each layer's mask parametrization, which owns its logits), so
every process keeps 1/world of the parameters, their gradients and their AdamW moments; a
module's full parameters exist only while its forward or backward runs (all-gathered, then
freed), and its gradients are reduce-scattered (averaged) as the backward leaves it. The frozen
model weights are not sharded: in a learned mask method the trainable state (6 logits per group
of 4 weights for 2:4, plus two AdamW moments and a gradient) is ~6x the weights.

Why not accelerate's own FSDP plugin: accelerate 1.15 turns it on only for GPU-like distributed
types (``AcceleratorState``: the FSDP branch is never taken for ``MULTI_CPU``), and it wraps whole
transformer blocks, which would shard the frozen weights too. accelerate still starts and joins
the processes (``Accelerator``); the sharding is torch's FSDP2, not a layer of ours.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import get_cpu_distributed_information
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

logger = logging.getLogger(__name__)


def is_initialized() -> bool:
    """Whether this process belongs to a process group (several processes joined)."""
    return dist.is_available() and dist.is_initialized()


def _rank_and_world() -> tuple[int, int]:
    """From torchrun's ``RANK``/``WORLD_SIZE`` (``accelerate launch --multi_gpu``) or, before
    accelerate has copied them there, from MPI's (``accelerate launch --cpu --num_processes N
    --mpirun_hostfile FILE`` runs ``mpirun``): accelerate's own reading of the environment."""
    info = get_cpu_distributed_information()
    return info.rank, info.world_size


def world_size() -> int:
    """Processes in this run (1 unless started by ``accelerate launch`` on several)."""
    return _rank_and_world()[1]


def is_main_process() -> bool:
    """Rank 0, or the only process (the one that evaluates, prints and writes the outputs)."""
    return _rank_and_world()[0] == 0


def accelerator(device: torch.device):
    """An ``accelerate.Accelerator`` (joins the processes) when launched on several, else None."""
    if world_size() <= 1:
        return None
    return Accelerator(cpu=device.type == "cpu")


def shard_modules(modules: Iterable[nn.Module], device: torch.device) -> int:
    """``fully_shard`` each module over all processes (one FSDP unit per module, resharded after
    its forward). Call after the process group exists and before the optimizer is built on the
    (now sharded, ``DTensor``) parameters. Returns the number of modules sharded."""
    if not is_initialized():
        raise RuntimeError("FSDP needs several processes: start the run with accelerate launch")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    count = 0
    for module in modules:
        fully_shard(module, mesh=mesh, reshard_after_forward=True)
        count += 1
    logger.info("fsdp: %d modules sharded over %d processes", count, dist.get_world_size())
    return count


def join_processes(device: torch.device, fsdp: bool = False, modules: Iterable[nn.Module] = ()):
    """The accelerator (:func:`accelerator`: None in a single process) and, with ``fsdp`` and
    several processes, ``modules`` sharded over them (:func:`shard_modules`). Call before
    anything holds the modules' parameters (an optimiser, a dict of them): sharding replaces
    them by ``DTensor`` parameters."""
    joined = accelerator(device)
    if fsdp and joined is not None:  # each process keeps 1/world of the parameters
        shard_modules(modules, device)
    elif fsdp:
        logger.info("fsdp: a single process, nothing to shard")
    return joined


def is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every process (a collective for a sharded one: call it on all)."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor; the tensor itself otherwise."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor, the same on every process) laid out as ``like`` is."""
    if not is_sharded(like):
        return value
    return distribute_tensor(value.to(like.dtype), like.device_mesh, like.placements)


def average_gradients(params: Iterable[nn.Parameter]) -> None:
    """Average the gradients of replicated parameters over processes (data parallel: they live
    outside any DDP wrapper). Sharded ones are skipped: FSDP has reduce-scattered theirs."""
    if not is_initialized():
        return
    for param in params:
        if param.grad is not None and not is_sharded(param):
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum floats over processes (identity in a single process)."""
    if not is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()


def barrier() -> None:
    if is_initialized():
        dist.barrier()
