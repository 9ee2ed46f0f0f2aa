"""torchrun / DDP helpers: NCCL on CUDA, gloo on CPU; single-process runs need none of it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from train.errors import UserError


@dataclass(frozen=True)
class DistInfo:
    rank: int  # global rank (0 when not distributed)
    world_size: int  # number of processes
    local_rank: int  # rank on this node (picks the GPU)
    device: torch.device  # this process's device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def device_type(choice: str) -> str:
    """"cuda" or "cpu": where ``run.device=choice`` trains on this machine (auto: CUDA when there is one). The one
    rule: the command's checks before any side effect and the Trainer both ask it."""
    return "cuda" if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else "cpu"


def resolve_device(choice: str, local_rank: int = 0) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("run.device='cuda' but no CUDA device is visible (torch.cuda.is_available() is False): use "
                        "--run.device cpu, or auto (CUDA when there is one)")
    return torch.device("cuda", local_rank) if device_type(choice) == "cuda" else torch.device("cpu")


def init_distributed(device_choice: str = "auto") -> DistInfo:
    """Initialise the process group when launched by torchrun (``WORLD_SIZE`` > 1), else a no-op."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_choice, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (picklable objects); the identity when not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
