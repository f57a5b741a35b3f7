"""``torch.profiler`` summary of one training step."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from detector.config import Config
from detector.distributed import resolve_device

from .batches import cached_batches
from .steps import build_ours, build_train_optimizer, make_train_step, make_ours_train_step
from .timing import synchronize
from .torchvision_ref import build_torchvision_model


# Device-to-host read-backs the profiler shows: every scalar read (``.item()``,
# ``float(t)``, ``bool(t)``, ``if t:``) dispatches ``aten::_local_scalar_dense``; on CUDA
# a stream synchronisation (``.cpu()``, ``.tolist()``, ``nonzero`` sizing) appears as
# ``cudaStreamSynchronize``. The benchmark's own ``torch.cuda.synchronize`` after the
# step is a ``cudaDeviceSynchronize`` and is not counted.
SYNC_EVENTS = ("aten::_local_scalar_dense", "cudaStreamSynchronize")


def count_ops(events: Any) -> Dict[str, int]:
    """Counts over the profiler's ``key_averages()`` of one step: ``aten_ops`` (every
    ``aten::`` operator dispatched, nested calls included), ``host_syncs`` (the
    ``SYNC_EVENTS``) and ``nonzero`` (``aten::nonzero`` calls: a sync on CUDA)."""
    aten = sum(int(e.count) for e in events if e.key.startswith("aten::"))
    syncs = sum(int(e.count) for e in events if e.key in SYNC_EVENTS)
    nonzero = sum(int(e.count) for e in events if e.key == "aten::nonzero")
    return {"aten_ops": aten, "host_syncs": syncs, "nonzero": nonzero}


def profile_train_step(
    cfg: Config,
    warmup: int = 2,
    row_limit: int = 10,
    synthetic: bool = False,
    torchvision_model: bool = False,
    trace_path: Optional[str] = None,
) -> Dict[str, Any]:
    """``torch.profiler`` over one training step after ``warmup`` steps.

    Returns ``top_ops``: the ``row_limit`` operators with the largest self time (CPU,
    or CUDA on a GPU) as dicts (name, self/total time in ms, calls, share of the step),
    ``counts`` (:func:`count_ops`) and ``table``: the profiler's own text table.
    On the CPU the step runs on one intra-op thread (see the body), so its times are
    one core's.
    """

    device = resolve_device(cfg.train.device)
    if device.type != "cpu":
        return _profile_train_step(cfg, device, warmup, row_limit, synthetic, torchvision_model, trace_path)
    # The profiler records the calling thread only; on the CPU the model runs some
    # per-image work on helper threads (detector.modeling.cpu_threads), which one
    # intra-op thread keeps in the caller: the same operators, all of them counted.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _profile_train_step(cfg, device, warmup, row_limit, synthetic, torchvision_model, trace_path)
    finally:
        torch.set_num_threads(threads)


def _profile_train_step(cfg: Config, device: torch.device, warmup: int, row_limit: int, synthetic: bool,
                        torchvision_model: bool, trace_path: Optional[str]) -> Dict[str, Any]:
    torch.manual_seed(cfg.train.seed)
    batches = cached_batches(cfg, True, 2, synthetic, pin=device.type == "cuda")
    if torchvision_model:
        model = build_torchvision_model(cfg).to(device)
        model.train()
        step = make_train_step(model, build_train_optimizer(model, cfg), cfg, device, True)
    else:
        step, _ = make_ours_train_step(build_ours(cfg, device), cfg, device)
    for i in range(warmup):
        step(batches[i % len(batches)])
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step(batches[0])
        synchronize(device)
    if trace_path:
        prof.export_chrome_trace(trace_path)
    sort_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events) or 1.0
    rows = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:row_limit]
    top = [
        {
            "name": e.key,
            "self_ms": round(getattr(e, attr) / 1000.0, 3),
            "total_ms": round(e.cpu_time_total / 1000.0, 3),
            "calls": int(e.count),
            "self_share": round(getattr(e, attr) / total, 4),
        }
        for e in rows
    ]
    return {
        "model": "torchvision" if torchvision_model else "ours",
        "step_self_ms": round(total / 1000.0, 3),
        "top_ops": top,
        "counts": count_ops(events),
        "table": events.table(sort_by=sort_key, row_limit=row_limit),
    }
