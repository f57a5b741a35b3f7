"""Memory figures: the peak memory of this process (CUDA allocator or CPU resident set)."""

from __future__ import annotations

import resource
from typing import Optional

import torch


def _read_proc_status_bytes(field: str) -> Optional[int]:
    """A memory field of /proc/self/status (``VmHWM``: peak resident set since the
    last reset; ``VmRSS``: current resident set), in bytes; None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_memory(device: torch.device) -> bool:
    """Reset the peak-memory counter. Returns False where it cannot be reset (then the
    CPU figure is the lifetime peak of the process)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak RSS (VmHWM) to the current RSS
        return True
    except OSError:
        return False


def current_memory_bytes(device: torch.device) -> int:
    """Memory in use now: CUDA allocated bytes, or the resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    rss = _read_proc_status_bytes("VmRSS")
    return int(rss) if rss is not None else 0


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory since the last :func:`reset_peak_memory`: CUDA max allocated bytes,
    or the CPU peak RSS in bytes (``VmHWM``; ``ru_maxrss`` where /proc is absent)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _read_proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def reserved_bytes(device: torch.device) -> Optional[int]:
    """Bytes the CUDA caching allocator holds from the driver (``memory_reserved``: free
    blocks and CUDA graphs' private pools included); None off CUDA."""
    return int(torch.cuda.memory_reserved(device)) if device.type == "cuda" else None


def memory_kind(device: torch.device) -> str:
    return "cuda_max_memory_allocated" if device.type == "cuda" else "cpu_peak_rss"
