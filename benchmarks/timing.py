"""Timing: per-iteration wall and CPU time with device synchronisation, summary
statistics, interleaved runners, and a description of the machine."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import numpy as np
import torch
import torchvision

from .memory import current_memory_bytes, memory_kind, peak_memory_bytes, reserved_bytes, reset_peak_memory


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize_times(times: Sequence[float], images_per_iter: float) -> Dict[str, float]:
    """Median and spread of per-iteration times (seconds) and images per second.

    Returns a dict with ``iters``, ``median_s``, ``mean_s``, ``std_s``, ``min_s``,
    ``max_s``, ``iqr_s`` (75th minus 25th percentile), ``images_per_iter`` and
    ``images_per_s`` (``images_per_iter / median_s``).
    """
    if not times:
        raise ValueError("summarize_times: no timed iterations (iters must be >= 1)")
    arr = np.asarray(times, dtype=np.float64)
    median = float(np.median(arr))
    q25, q75 = np.percentile(arr, [25, 75])
    return {
        "iters": int(arr.size),
        "median_s": median,
        "mean_s": float(arr.mean()),
        "std_s": float(arr.std(ddof=1)) if arr.size > 1 else 0.0,
        "min_s": float(arr.min()),
        "max_s": float(arr.max()),
        "iqr_s": float(q75 - q25),
        "images_per_iter": float(images_per_iter),
        "images_per_s": float(images_per_iter / median) if median > 0 else float("inf"),
    }


class Runner:
    """Times one callable per iteration and tracks its peak memory, and on CUDA the
    growth of the allocator's reserve during its calls (warm-up included: a CUDA graph's
    private pool is reserved at capture, and a replay allocates nothing, so the peak
    counter never sees a graph step's activations; their reserve is that growth).

    ``fn(i)`` runs iteration ``i`` and returns the number of images it processed;
    ``prepare(i)``, if given, runs first, outside the timed region (e.g. fresh copies
    of inputs that the timed code mutates).
    """

    def __init__(self, name: str, fn: Callable[[int], int], device: torch.device,
                 prepare: Optional[Callable[[int], None]] = None):
        self.name = name
        self.stopped: Optional[str] = None  # why run_interleaved took it out of the rotation
        self.fn = fn
        self.prepare = prepare
        self.device = device
        self.times: List[float] = []
        self.cpu_times: List[float] = []
        self.images: List[int] = []
        self.peak_bytes = 0
        self.peak_delta_bytes = 0
        self.reserved_growth_bytes = 0

    def run(self, i: int, timed: bool = True) -> None:
        if self.prepare is not None:
            self.prepare(i)
        synchronize(self.device)
        reset_peak_memory(self.device)
        before = current_memory_bytes(self.device)
        reserved = reserved_bytes(self.device)
        c0 = time.process_time()
        t0 = time.perf_counter()
        n = self.fn(i)
        synchronize(self.device)
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0
        peak = peak_memory_bytes(self.device)
        if reserved is not None:
            self.reserved_growth_bytes += max(0, reserved_bytes(self.device) - reserved)
        if timed:
            self.times.append(dt)
            self.cpu_times.append(cpu)
            self.images.append(n)
            self.peak_bytes = max(self.peak_bytes, peak)
            self.peak_delta_bytes = max(self.peak_delta_bytes, peak - before)

    def summary(self) -> Dict[str, Any]:
        if not self.times:  # stopped before its first timed iteration
            return {"iters": 0, "stopped": self.stopped}
        out: Dict[str, Any] = summarize_times(self.times, statistics.mean(self.images) if self.images else 0)
        out["times_s"] = [round(t, 6) for t in self.times]
        # CPU seconds of this process (all its threads) per iteration: on a shared
        # machine a steadier measure of the work done than the wall-clock time.
        out["cpu_median_s"] = float(np.median(self.cpu_times))
        out["cpu_times_s"] = [round(t, 6) for t in self.cpu_times]
        out["peak_memory_bytes"] = int(self.peak_bytes)
        out["peak_memory_delta_bytes"] = int(self.peak_delta_bytes)
        out["peak_memory_mib"] = round(self.peak_bytes / 2**20, 1)
        out["memory_kind"] = memory_kind(self.device)
        if self.device.type == "cuda":
            out["reserved_growth_mib"] = round(self.reserved_growth_bytes / 2**20, 1)
        if self.stopped:
            out["stopped"] = self.stopped
        return out


def run_interleaved(runners: Sequence[Runner], iters: int, warmup: int,
                    stop_on: Tuple[Type[BaseException], ...] = ()) -> None:
    """Warm each runner up, then alternate them iteration by iteration (the order
    flips every iteration) so slow phases of a shared machine hit all of them alike.
    A runner whose iteration raises one of ``stop_on`` leaves the rotation (its
    ``stopped`` says why); the others go on."""
    active = list(runners)

    def run(r: Runner, i: int, timed: bool) -> None:
        try:
            r.run(i, timed=timed)
        except stop_on as exc:
            r.stopped = f"{type(exc).__name__} at {'timed' if timed else 'warm-up'} iteration {i}: {exc}"
            active.remove(r)

    for r in list(active):
        for i in range(warmup):
            if r in active:
                run(r, i, timed=False)
    for i in range(iters):
        for r in (list(active) if i % 2 == 0 else list(reversed(active))):
            run(r, warmup + i, timed=True)


def machine_info(device: torch.device) -> Dict[str, Any]:
    """What the figures were measured on."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: Dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "torch": torch.__version__,
        "device": str(device),
    }
    info["torchvision"] = torchvision.__version__
    try:
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info
