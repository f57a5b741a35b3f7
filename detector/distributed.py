"""Process-group set-up and small collective helpers.

Launch modes understood by ``init_distributed``:

- one plain process (``python tools/train.py``): world size 1, no process group;
- ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
- SLURM (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, with the
  master address taken from ``MASTER_ADDR`` or the first host of ``SLURM_NODELIST``.

The backend is NCCL when the device is CUDA and gloo otherwise. Every helper works
(as the identity, or a no-op) when no process group is initialised.
"""

from __future__ import annotations

import os
import random
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _env_int(*names: str, default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def _slurm_master_addr() -> str:
    nodelist = os.environ.get("SLURM_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return nodelist.split(",")[0].split("[")[0]


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` when CUDA is available, else ``cpu``.

    ``cuda`` (no index) also becomes ``cuda:<local_rank>``. Asking for CUDA on a
    machine without it is an error, not a silent fallback.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"train.device={name!r} but CUDA is not available on this machine; use 'cpu' or 'auto'")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def init_distributed(device_name: str = "auto", timeout_minutes: int = 30) -> DistInfo:
    """Initialise the default process group from the environment, if launched so.

    Returns rank, world size, local rank and the device this process should use.
    """
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        os.environ.setdefault("MASTER_ADDR", _slurm_master_addr())
        os.environ.setdefault("MASTER_PORT", "29500")
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world_size = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    device = resolve_device(device_name, local_rank)
    if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: Dict[str, Any] = {}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=timeout_minutes),
            **kwargs,
        )
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_dist() and get_world_size() > 1:
        dist.barrier()


def all_gather_object(obj: Any) -> List[Any]:
    """Gather any picklable object from every rank; returns a list indexed by rank."""
    if not is_dist() or get_world_size() == 1:
        return [obj]
    out: List[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_gather_padded(tensor: torch.Tensor) -> List[torch.Tensor]:
    """``all_gather`` for tensors whose first dimension differs between ranks.

    Each rank's tensor ``[N_r, ...]`` is padded to the largest ``N`` before the
    collective and cut back afterwards; returns ``[tensor_r for r in ranks]``.
    """
    if not is_dist() or get_world_size() == 1:
        return [tensor]
    size = torch.tensor([tensor.shape[0]], device=tensor.device, dtype=torch.long)
    sizes = [torch.zeros_like(size) for _ in range(get_world_size())]
    dist.all_gather(sizes, size)
    n_max = int(max(s.item() for s in sizes))
    padded = tensor.new_zeros((n_max, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded)
    return [g[: int(s.item())] for g, s in zip(gathered, sizes)]


def reduce_dict(values: Dict[str, torch.Tensor], average: bool = True) -> Dict[str, torch.Tensor]:
    """All-reduce a dict of scalar tensors (same keys on every rank); mean by default."""
    if not is_dist() or get_world_size() == 1:
        return values
    names = sorted(values)
    stacked = torch.stack([values[k].detach().float() for k in names])
    dist.all_reduce(stacked)
    if average:
        stacked /= get_world_size()
    return dict(zip(names, stacked))


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed python, numpy and torch (CPU and CUDA) with ``seed + rank``; returns it."""
    s = int(seed) + int(rank)
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)
    return s


def cleanup() -> None:
    if is_dist():
        dist.destroy_process_group()
