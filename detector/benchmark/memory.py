"""Memory figures: the peak memory of this process (CUDA allocator or CPU resident set),
and the memory of a command's whole process tree (``--task memory``)."""

from __future__ import annotations

import os
import resource
import subprocess
import time
from typing import Any, Dict, List, Optional

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


def memory_kind(device: torch.device) -> str:
    return "cuda_max_memory_allocated" if device.type == "cuda" else "cpu_peak_rss"


def _process_tree(root_pid: int) -> List[int]:
    """``root_pid`` and all its descendants (from /proc/*/stat)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _proc_kib(path: str, field: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure_command_memory(cmd: List[str], interval_s: float = 0.2) -> Dict[str, Any]:
    """Run ``cmd`` and sample the memory of its whole process tree (the trainer and its
    data-loader workers) every ``interval_s``.

    Returns ``returncode``, ``wall_s``, ``peak_tree_rss_bytes`` (sum of the processes'
    resident sets: counts pages shared between them once per process, an upper bound),
    ``peak_tree_pss_bytes`` (proportional set size: shared pages split between the
    sharers, the tree's real footprint) and ``peak_largest_process_rss_bytes``
    (``ru_maxrss`` of the largest child, what ``/usr/bin/time -v`` reports).
    """

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    peak_rss = peak_pss = 0
    samples = 0
    while proc.poll() is None:
        pids = _process_tree(proc.pid)
        rss = sum(_proc_kib(f"/proc/{p}/status", "VmRSS:") for p in pids)
        pss = sum(_proc_kib(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        samples += 1
        time.sleep(interval_s)
    wall = time.perf_counter() - t0
    largest = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {
        "command": cmd,
        "returncode": proc.returncode,
        "wall_s": round(wall, 2),
        "samples": samples,
        "peak_tree_rss_bytes": peak_rss * 1024,
        "peak_tree_pss_bytes": peak_pss * 1024,
        "peak_largest_process_rss_bytes": largest * 1024,
    }
