"""A check before work starts: does one training batch fit in the device's memory?

An input size far beyond what the memory holds (``input.min_size_train=[8000]`` with a
matching ``input.max_size_train``) otherwise ends in the kernel's OOM killer, with no
message, minutes into the run. ``check_batch_memory`` estimates a lower bound of what one
training batch needs and refuses, in one line naming the keys, a batch that cannot fit.

The estimate: ``images_per_gpu`` x the largest resized image (shorter side
``min(max(input.min_size_train), input.max_size_train)``, longer side
``input.max_size_train``, in pixels) x the bytes per input pixel that a training step
keeps (activations and their gradients in float32). The bytes per pixel are lower
bounds for each backbone (the measured peak of a training step is higher), so the check
only refuses what certainly cannot fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from detector.config import Config, ConfigError

# Lower bounds of the bytes a training step holds per input pixel (float32 activations
# of backbone + FPN + RPN and their gradients), by model.backbone.
BYTES_PER_PIXEL = {"resnet18": 250, "resnet34": 300, "resnet50": 600, "resnet101": 800}
GIB = 2.0**30


def batch_bytes(cfg: Config) -> float:
    """The lower bound (bytes) of the memory one training batch needs (module docstring)."""
    long_side = cfg.input.max_size_train
    short_side = min(max(cfg.input.min_size_train), long_side)
    return float(cfg.solver.images_per_gpu) * short_side * long_side * BYTES_PER_PIXEL[cfg.model.backbone]


def _cgroup_free_bytes() -> Optional[float]:
    """Memory left under this process's cgroup v2 limit, or None without one."""
    base = Path("/sys/fs/cgroup")
    try:
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return float(int(limit) - int((base / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def available_bytes(device: torch.device) -> Optional[float]:
    """Free memory of ``device``: a GPU's free memory, or the host's ``MemAvailable``
    (and the cgroup limit, whichever is lower) for the CPU; None where unknown."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    free: Optional[float] = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = float(line.split()[1]) * 1024
    except OSError:
        pass
    limit = _cgroup_free_bytes()
    return limit if free is None else (free if limit is None else min(free, limit))


def check_batch_memory(cfg: Config, device: torch.device, ranks_on_device: int = 1,
                       free: Optional[float] = None) -> None:
    """Raise ``ConfigError`` when ``ranks_on_device`` training batches (ranks sharing
    the device or the host's memory) need more than the ``free`` bytes of ``device``
    (default: ``available_bytes(device)``; unknown: no check)."""
    free = available_bytes(device) if free is None else free
    if free is None:
        return
    need = batch_bytes(cfg) * max(1, ranks_on_device)
    if need <= free:
        return
    long_side = cfg.input.max_size_train
    short_side = min(max(cfg.input.min_size_train), long_side)
    shared = f" x {ranks_on_device} ranks" if ranks_on_device > 1 else ""
    raise ConfigError(
        f"one training batch needs at least {need / GIB:.1f} GiB (solver.images_per_gpu={cfg.solver.images_per_gpu} "
        f"images of up to {short_side}x{long_side} px from input.min_size_train={cfg.input.min_size_train} and "
        f"input.max_size_train={long_side}, model.backbone={cfg.model.backbone}{shared}) but {device} has "
        f"{free / GIB:.1f} GiB free; lower input.min_size_train, input.max_size_train or solver.images_per_gpu"
    )
