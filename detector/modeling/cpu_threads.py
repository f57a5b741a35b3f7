"""Running independent pieces of CPU work on several threads.

Some of torchvision's CPU kernels (``roi_align``'s forward, ``nms``) run on one thread
while the step has ``torch.get_num_threads()`` cores. Their calls release the GIL, so
independent calls (per image, or per chunk of RoIs) can run side by side on plain
Python threads. Each call computes exactly what it computes alone: the results are
bit-identical to running the pieces one after the other.

Grad mode and autocast are per thread: worker threads run with gradients off (use this
only for work whose result needs no gradient) and under the caller's CPU autocast
settings (torchvision's CPU ``roi_align`` has no bfloat16 kernel; its autocast wrapper
runs it in float32).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Sequence, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


def worker_count(device: torch.device, pieces: int) -> int:
    """Threads worth using for ``pieces`` independent pieces on ``device``: 1 (run in
    the caller) off the CPU, while tracing or scripting, or with one intra-op thread."""
    if device.type != "cpu" or torch.jit.is_tracing() or torch.jit.is_scripting():
        return 1
    return max(1, min(torch.get_num_threads(), pieces))


def map_no_grad(fn: Callable[[T], R], items: Sequence[T], device: torch.device) -> List[R]:
    """``[fn(item) for item in items]`` with gradients off and the caller's CPU autocast,
    on ``worker_count`` threads."""
    threads = worker_count(device, len(items))
    autocast = torch.is_autocast_enabled("cpu")
    autocast_dtype = torch.get_autocast_dtype("cpu")

    def run(item: T) -> R:
        with torch.no_grad(), torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast):
            return fn(item)

    if threads < 2:
        return [run(item) for item in items]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(run, items))
