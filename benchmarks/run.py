"""The entry point of ``tools/benchmark.py``: run one task, describe the machine and the
options, and format a short summary."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Dict, List, Optional

import torch

from detector.config import Config, config_to_dict
from detector.engine.amp import resolve_amp
from detector.data import DataError, build_dataset, resolve_num_classes
from detector.distributed import resolve_device

from .profiling import SYNC_EVENTS, profile_train_step
from .records_memory import benchmark_records, format_records
from .records_sharing import format_sharing, node_sharing
from .scaling import ScalingSweep, benchmark_scaling, format_scaling
from .tasks import benchmark_data, benchmark_eval, benchmark_model, benchmark_train_loader
from .timing import machine_info
from .time_to_accuracy import benchmark_time_to_accuracy, format_time_to_accuracy

logger = logging.getLogger(__name__)

TASKS = ("train", "infer", "data", "eval", "time-to-accuracy", "scaling")


def _resolve_num_classes(cfg: Config, synthetic: bool) -> Config:
    """``model.num_classes: auto`` from the data; for synthetic batches without the data
    at hand, COCO's 80 (the class count barely changes the timings)."""
    try:
        return resolve_num_classes(cfg)
    except (DataError, FileNotFoundError):
        if not synthetic or cfg.model.num_classes is not None:
            raise
    logger.info("model.num_classes=auto: no data at hand for synthetic batches; timing with 80 classes")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_classes=80))


def run_benchmark(
    cfg: Config,
    task: str,
    iters: int = 10,
    warmup: int = 3,
    compare_torchvision: bool = False,
    loader: bool = True,
    synthetic: bool = False,
    num_batches: int = 4,
    profile: bool = False,
    gt_file: Optional[str] = None,
    results_file: Optional[str] = None,
    config_path: Optional[str] = None,
    overrides: Optional[List[str]] = None,
    torchvision_options: bool = False,
    threads: int = 0,
    eval_images: int = 500,
    eval_boxes: int = 30,
    count_ops: bool = False,
    budget_s: float = 300.0,
    scaling: Optional[ScalingSweep] = None,
    records_file: Optional[str] = None,
    node_ranks: int = 0,
) -> Dict[str, Any]:
    """Run one benchmark task and return its JSON-ready result.

    Args:
        task: ``train`` (cached batches, then the real loader unless ``loader=False``),
            ``infer``, ``data`` (loader throughput), ``eval`` (COCO scoring),
            ``time-to-accuracy`` or ``scaling``.
        iters: timed iterations (>= 1); warmup: untimed ones before.
        compare_torchvision: also time torchvision's FasterRCNN (train/infer).
        synthetic: random batches at the input size instead of the configured data.
        num_batches: distinct batches cached in memory and cycled through.
        profile: add a ``torch.profiler`` summary of one training step or inference batch
            (train or infer), ours and, with ``compare_torchvision``, torchvision's.
        torchvision_options: give torchvision's model our ``train.*`` speed options too
            (default: torchvision as it comes).
        threads: ``torch.set_num_threads`` (0: leave PyTorch's default).
        eval_images, eval_boxes: size of the generated case of ``task="eval"``.
        count_ops: train or infer: add ``ops_per_step`` and ``host_syncs_per_step`` (ours
            and torchvision's) from ``torch.profiler`` over one step or inference batch
            after warm-up.
        budget_s: ``task="time-to-accuracy"``: training seconds of each run
            (``benchmarks.time_to_accuracy``).
        scaling: ``task="scaling"``: world sizes and DDP settings to sweep
            (``benchmarks.scaling``; default ``ScalingSweep()``).
        records_file: ``task="data"``: the ``records`` case (``records_memory``) reads
            this COCO file (images need not exist) instead of the config's training set,
            and adds its parse cost and 2 ranks x ``data.num_workers`` workers reading it.
        node_ranks: with ``records_file``, also ``node_ranks`` ranks on this machine each
            parsing it, against one parse shared through a record file
            (``records_sharing``; 0: not run).

    Returns a dict with ``task``, ``config``, ``machine``, ``iters``, ``warmup``,
    ``runs`` (name -> :func:`summarize_times` fields plus ``peak_memory_bytes``,
    ``memory_kind``, ``times_s``) and, when compared, ``ratio`` (ours / torchvision,
    images per second).
    """
    _check_arguments(task, iters, warmup, profile, count_ops, compare_torchvision, threads)
    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(cfg.train.device) if task in ("train", "infer", "time-to-accuracy", "scaling") else torch.device("cpu")
    if task in ("train", "infer", "scaling"):
        cfg = _resolve_num_classes(cfg, synthetic)
    result: Dict[str, Any] = {
        "task": task,
        "config": config_path,
        "overrides": list(overrides or []),
        "machine": machine_info(device),
        "device": str(device),
        "iters": iters,
        "warmup": warmup,
        "synthetic": synthetic,
        "options": _speed_options(cfg, device),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    t0 = time.perf_counter()
    if task in ("train", "infer"):
        result.update(
            benchmark_model(cfg, task, iters, warmup, compare_torchvision, num_batches, synthetic,
                            torchvision_options=torchvision_options)
        )
        if task == "train" and loader and not synthetic:
            result["runs"].update(benchmark_train_loader(cfg, iters, warmup)["runs"])
        if profile or count_ops:
            result.update(_profiles(cfg, task, synthetic, profile, count_ops, compare_torchvision))
    elif task == "data":
        result.update(benchmark_data(cfg, iters, warmup))
        dataset = None if records_file else build_dataset(cfg, "train", is_train=True)
        result["records"] = benchmark_records(dataset, records_file, ranks=2, workers=cfg.data.num_workers)
        if records_file and node_ranks > 0 and "skipped" not in result["records"]:
            result["records"]["sharing"] = node_sharing(records_file, "", node_ranks, cfg.data.num_workers)
    elif task == "time-to-accuracy":
        result.update(benchmark_time_to_accuracy(cfg, budget_s))
    elif task == "scaling":
        result.update(benchmark_scaling(cfg, iters, warmup, scaling or ScalingSweep(), num_batches, synthetic, threads))
    else:
        result.update(benchmark_eval(cfg, iters, warmup, gt_file, results_file, eval_images, eval_boxes))
    result["wall_s"] = round(time.perf_counter() - t0, 3)
    try:
        result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        pass
    result["config_resolved"] = config_to_dict(cfg)
    return result


def _check_arguments(task: str, iters: int, warmup: int, profile: bool, count_ops: bool, compare_torchvision: bool,
                     threads: int) -> None:
    """``ValueError`` naming the option for arguments that do not fit together."""
    if task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}; got {task!r}")
    if iters < 1:
        raise ValueError(f"--iters must be >= 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    if profile and task not in ("train", "infer"):
        raise ValueError(f"--profile applies to --task train or infer, not {task!r}")
    if count_ops and task not in ("train", "infer"):
        raise ValueError(f"--count-ops applies to --task train or infer, not {task!r}")
    if compare_torchvision and task not in ("train", "infer"):
        raise ValueError(f"--compare-torchvision applies to --task train or infer, not {task!r}")
    if threads < 0:
        raise ValueError(f"--threads must be >= 0, got {threads}")


def _speed_options(cfg: Config, device: torch.device) -> Dict[str, Any]:
    """The ``train.*`` speed settings in force on ``device``, for the result's ``options``."""
    amp = resolve_amp(cfg.train.amp, device)
    return {
        "channels_last": cfg.train.channels_last,
        "cudnn_benchmark": cfg.train.cudnn_benchmark,
        "compile_backbone": cfg.train.compile_backbone,
        "amp": amp.enabled,
        "amp_dtype": str(amp.dtype).replace("torch.", ""),
    }


def _profiles(cfg: Config, task: str, synthetic: bool, profile: bool, count_ops: bool,
              compare_torchvision: bool) -> Dict[str, Any]:
    """``profile`` (per model: :func:`profile_train_step`) and/or the ``--count-ops``
    fields (``ops_per_step``, ``host_syncs_per_step``, ``nonzero_per_step``)."""
    profiles = {"ours": profile_train_step(cfg, synthetic=synthetic, task=task)}
    if compare_torchvision or count_ops:
        profiles["torchvision"] = profile_train_step(cfg, synthetic=synthetic, torchvision_model=True, task=task)
    out: Dict[str, Any] = {}
    if profile:
        out["profile"] = profiles
    if count_ops:
        out["ops_per_step"] = {k: p["counts"]["aten_ops"] for k, p in profiles.items()}
        out["host_syncs_per_step"] = {k: p["counts"]["host_syncs"] for k, p in profiles.items()}
        out["nonzero_per_step"] = {k: p["counts"]["nonzero"] for k, p in profiles.items()}
        what = "training step" if task == "train" else "inference batch"
        out["ops_counted"] = ("aten:: operators dispatched (nested included) and host syncs ("
                              + ", ".join(SYNC_EVENTS) + f") in one {what} after warm-up, by torch.profiler")
    return out


def format_summary(result: Dict[str, Any]) -> str:
    """A short human-readable table of a :func:`run_benchmark` result."""
    if result["task"] == "time-to-accuracy":
        return format_time_to_accuracy(result)
    lines = [f"task={result['task']} device={result['device']} iters={result['iters']} warmup={result['warmup']}"]
    mem_unit = "MiB"
    for name, r in result["runs"].items():
        if r.get("stopped"):
            lines.append(f"  {name:<20s} stopped after {r['iters']} timed iterations: {r['stopped']}")
        if not r["iters"]:
            continue
        lines.append(
            f"  {name:<20s} median {r['median_s'] * 1000:9.1f} ms/iter (cpu {r['cpu_median_s'] * 1000:9.1f})  (IQR {r['iqr_s'] * 1000:7.1f}, "
            f"min {r['min_s'] * 1000:8.1f}, max {r['max_s'] * 1000:8.1f})  {r['images_per_s']:8.2f} images/s  "
            f"peak {r['peak_memory_mib']:8.1f} {mem_unit} ({r['memory_kind']})"
            + (f", reserve grew {r['reserved_growth_mib']:.0f} MiB" if "reserved_growth_mib" in r else "")
        )
    if "ratio" in result:
        lines.append(
            f"  ours / torchvision speed: {result['ratio_pairwise_median']:.3f} (median of per-iteration "
            f"pairs, the figure to read; ratio of medians {result['ratio']:.3f}, by CPU time "
            f"{result['ratio_cpu_time']:.3f}; torchvision with {result['torchvision_options']})"
        )
    if "ratio_vs_pycocotools" in result:
        for k, v in result["ratio_vs_pycocotools"].items():
            lines.append(f"  {k} / pycocotools_direct speed: {v:.3f} (max |stat diff| {result['max_abs_diff_vs_pycocotools'][k]:.2e})")
    if "ops_per_step" in result:
        lines.append(f"  aten ops per step: {result['ops_per_step']}; host syncs per step: "
                     f"{result['host_syncs_per_step']}; nonzero per step: {result['nonzero_per_step']}")
    if "scaling" in result:
        lines.append(format_scaling(result))
    if "records" in result:
        lines.append(format_records(result["records"]))
        if "sharing" in result["records"]:
            lines.append(format_sharing(result["records"]["sharing"]))
    for name, prof in (result.get("profile") or {}).items():
        lines.append(f"  profile ({name}), one {'training step' if result['task'] == 'train' else 'inference batch'}, "
                     "top operators by self time:")
        for op in prof["top_ops"]:
            lines.append(f"    {op['name']:<45s} {op['self_ms']:9.2f} ms  {op['self_share'] * 100:5.1f}%  x{op['calls']}")
        lines.append(f"    convolution and linear kernels: {prof['dense_share'] * 100:.1f}% of the step"
                     + (f" (bounds ours / torchvision at {1 / prof['dense_share']:.2f}x)"
                        if name == "torchvision" and prof["dense_share"] > 0 else ""))
        if "gpu_busy_ms" in prof:
            lines.append(f"    device busy {prof['gpu_busy_ms']:.2f} ms in the step; longest kernels:")
            lines += [f"      {k['ms']:8.2f} ms {k['share'] * 100:5.1f}% x{k['calls']:<4d} {k['name'][:90]}"
                      for k in prof["top_kernels"]]
    return "\n".join(lines)
