"""``torch.profiler`` summary of one training step or inference batch."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Dict, Iterable, Optional

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from detector.config import Config
from detector.distributed import resolve_device
from detector.evaluation.inference import inference_run

from .batches import cached_batches
from .steps import build_ours, make_step
from .timing import synchronize
from .torchvision_ref import build_torchvision_model


# Device-to-host read-backs the profiler shows: every scalar read (``.item()``,
# ``float(t)``, ``bool(t)``, ``if t:``) dispatches ``aten::_local_scalar_dense``; on CUDA
# a stream synchronisation (``.cpu()``, ``.tolist()``, ``nonzero`` sizing) appears as
# ``cudaStreamSynchronize``. The benchmark's own ``torch.cuda.synchronize`` after the
# step is a ``cudaDeviceSynchronize`` and is not counted.
SYNC_EVENTS = ("aten::_local_scalar_dense", "cudaStreamSynchronize")

# The dense kernels of convolutions and linear layers, forward and backward. Both models
# run the same ones (same layers, same shapes), so their share of torchvision's step
# bounds any speed-up from everything else: ours / torchvision <= 1 / dense_share.
DENSE_OPS = ("aten::mkldnn_convolution", "aten::cudnn_convolution", "aten::convolution_backward",
             "aten::_slow_conv2d_forward", "aten::_slow_conv2d_backward", "aten::thnn_conv2d",
             "aten::cudnn_convolution_transpose", "aten::mm", "aten::addmm", "aten::bmm")


def count_ops(events: Any) -> Dict[str, int]:
    """Counts over the profiler's ``key_averages()`` of one step: ``aten_ops`` (every
    ``aten::`` operator dispatched, nested calls included), ``host_syncs`` (the
    ``SYNC_EVENTS``) and ``nonzero`` (``aten::nonzero`` calls: a sync on CUDA)."""
    aten = sum(int(e.count) for e in events if e.key.startswith("aten::"))
    syncs = sum(int(e.count) for e in events if e.key in SYNC_EVENTS)
    nonzero = sum(int(e.count) for e in events if e.key == "aten::nonzero")
    return {"aten_ops": aten, "host_syncs": syncs, "nonzero": nonzero}


def kernel_summary(events: Iterable[Any], row_limit: int = 15) -> Dict[str, Any]:
    """The device's own records in a profile (``prof.events()``): kernels, copies and
    memsets, those replayed from a CUDA graph included. ``gpu_busy_ms``: their summed
    durations (the device's busy time when they do not overlap, which one stream's do
    not); ``top_kernels``: the ``row_limit`` longest by name (ms, count, share)."""
    per_name: Dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.device_type == DeviceType.CUDA:
            per_name[e.name][0] += e.time_range.elapsed_us()
            per_name[e.name][1] += 1
    busy = sum(t for t, _ in per_name.values())
    rows = sorted(per_name.items(), key=lambda kv: kv[1][0], reverse=True)[:row_limit]
    return {"gpu_busy_ms": round(busy / 1000.0, 3),
            "top_kernels": [{"name": name[:120], "ms": round(t / 1000.0, 3), "calls": n,
                             "share": round(t / (busy or 1.0), 4)} for name, (t, n) in rows]}


def host_summary(events: Any, row_limit: int = 15) -> Dict[str, Any]:
    """The host's side of a profile (``key_averages()``) on a GPU, where a step bound by
    dispatch spends its time: ``host_ms``, the summed self CPU time of every operator and
    runtime call; ``top_host_ops``: the ``row_limit`` largest by self CPU time (ms,
    calls, share), and ``most_called``: the ``row_limit`` operators called most often."""
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    by_time = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:row_limit]
    by_calls = sorted(events, key=lambda e: int(e.count), reverse=True)[:row_limit]
    return {"host_ms": round(total / 1000.0, 3),
            "top_host_ops": [{"name": e.key[:120], "ms": round(e.self_cpu_time_total / 1000.0, 3),
                              "calls": int(e.count), "share": round(e.self_cpu_time_total / total, 4)}
                             for e in by_time],
            "most_called": [{"name": e.key[:120], "calls": int(e.count)} for e in by_calls]}


def profile_train_step(
    cfg: Config,
    warmup: int = 2,
    row_limit: int = 10,
    synthetic: bool = False,
    torchvision_model: bool = False,
    trace_path: Optional[str] = None,
    task: str = "train",
) -> Dict[str, Any]:
    """``torch.profiler`` over one training step (``task="train"``) or one inference
    batch (``"infer"``, as ``--task infer`` runs it) after ``warmup`` of them.

    Returns ``top_ops``: the ``row_limit`` operators with the largest self time (CPU,
    or CUDA on a GPU) as dicts (name, self/total time in ms, calls, share of the step),
    ``counts`` (:func:`count_ops`), ``dense_share``: the share of the step's self time in
    ``DENSE_OPS``, and ``table``: the profiler's own text table; on a GPU also
    :func:`kernel_summary`'s and :func:`host_summary`'s fields.

    On the CPU both models' steps run on one intra-op thread (see the body), so the
    times are one core's. (Even torchvision's operator count depends on the thread
    count, so both are counted at the same setting.)
    """

    device = resolve_device(cfg.train.device)
    if device.type != "cpu":
        return _profile_step(cfg, device, warmup, row_limit, synthetic, torchvision_model, trace_path, task)
    # One intra-op thread for both models: operator counts (torchvision's too) depend on
    # the thread count, and the times are then one core's.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _profile_step(cfg, device, warmup, row_limit, synthetic, torchvision_model, trace_path, task)
    finally:
        torch.set_num_threads(threads)


def _profile_step(cfg: Config, device: torch.device, warmup: int, row_limit: int, synthetic: bool,
                        torchvision_model: bool, trace_path: Optional[str], task: str) -> Dict[str, Any]:
    torch.manual_seed(cfg.train.seed)
    batches = cached_batches(cfg, task == "train", 2, synthetic, pin=device.type == "cuda")
    model = build_torchvision_model(cfg).to(device) if torchvision_model else build_ours(cfg, device)
    step, _ = make_step(model, cfg, device, task, torchvision_model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # Inference batches run as run_inference runs them (autocast's weight casts kept).
    with inference_run(device, cfg.eval.amp) if task == "infer" else contextlib.nullcontext():
        for i in range(warmup):
            step(batches[i % len(batches)])
        synchronize(device)
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
    kernels = {**kernel_summary(prof.events()), **host_summary(events)} if device.type == "cuda" else {}
    return {
        **kernels,
        "model": "torchvision" if torchvision_model else "ours",
        "step_self_ms": round(total / 1000.0, 3),
        "top_ops": top,
        "counts": count_ops(events),
        "dense_share": round(sum(getattr(e, attr) for e in events if e.key in DENSE_OPS) / total, 4),
        "table": events.table(sort_by=sort_key, row_limit=row_limit),
    }
