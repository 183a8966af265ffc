"""Probe collection across processes: under `torchrun` or `accelerate launch` (WORLD_SIZE > 1) each rank counts
every world-th batch of the cases and the counters are summed over ranks with torch.distributed."""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    """This process's place among the launched ones (the launcher's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def main(self) -> bool:
        """The one process that writes files and prints."""
        return self.rank == 0


def shard_from_env() -> Shard:
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    return Shard(int(env.get("RANK", "0")), world, int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", world)))


def rank_gpus(shard: Shard) -> list[int]:
    """The CUDA devices this rank uses: the local GPUs split evenly among the local ranks (one shared GPU
    each when there are more ranks than GPUs)."""
    gpus = torch.cuda.device_count()
    if gpus <= shard.local_world:
        return [shard.local_rank % gpus] if gpus else []
    per = gpus // shard.local_world
    return list(range(shard.local_rank * per, (shard.local_rank + 1) * per))


@contextmanager
def process_group(device: torch.device) -> Iterator[Shard]:
    """This process's shard while counting: alone, (0, 1); launched as several processes, its rank, with the
    default process group initialised (nccl on CUDA devices, one per rank; else gloo, which also sums CUDA
    tensors of ranks sharing a GPU) unless it already is; a group initialised here lives until the process exits."""
    import torch.distributed as dist

    shard = shard_from_env()
    if dist.is_available() and dist.is_initialized():
        yield Shard(dist.get_rank(), dist.get_world_size(), shard.local_rank, shard.local_world)
        return
    if shard.world <= 1:
        yield Shard()
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    nccl = device.type == "cuda" and torch.cuda.device_count() >= shard.local_world
    dist.init_process_group("nccl" if nccl else "gloo", device_id=device if nccl else None)
    # kept for the life of the process: a second init after a destroy can read the first group's stale
    # addresses from the launcher's store (seen as "connection refused" between gloo ranks)
    atexit.register(dist.destroy_process_group)
    yield shard


def all_reduce_sum(tensors: Iterable[torch.Tensor], shard: Shard) -> None:
    """Sum each tensor in place over the ranks (nothing to do alone)."""
    if shard.world > 1:
        import torch.distributed as dist

        for tensor in tensors:
            dist.all_reduce(tensor)


def all_reduce_min(value: int, device: torch.device, shard: Shard) -> int:
    """The smallest of the ranks' `value`s (`value` alone)."""
    if shard.world == 1:
        return value
    import torch.distributed as dist

    tensor = torch.tensor([value], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def all_gather(tensor: torch.Tensor, shard: Shard) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on each), in rank order ([tensor] alone)."""
    if shard.world <= 1:
        return [tensor]
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(shard.world)]
    dist.all_gather(parts, tensor)
    return parts
