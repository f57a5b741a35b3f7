"""Scaling across ranks (``--task scaling``): the engine's ``TrainStep`` under DDP at
world size 1 and 2, the share of a step spent in the gradient all-reduce, and a sweep
of ``train.ddp_bucket_cap_mb`` x ``train.ddp_gradient_as_bucket_view``.

How it measures:

- The task launches the ranks itself (``torch.multiprocessing`` spawn, a ``FileStore``
  in a temporary folder), one group per world size, one after the other. The backend is
  ``train.dist_backend`` (``auto``: gloo on the CPU, NCCL on CUDA, one GPU per rank).
- Every rank trains on the same cached batches (``solver.images_per_gpu`` images each),
  from the same initial weights. On the CPU the machine's threads are split fairly:
  1 rank x N threads against 2 ranks x N/2 threads.
- At world size 2 every sweep point is its own model and DDP wrapper in the same process
  group, and the points alternate iteration by iteration (``run_interleaved``), so the
  slow phases of a shared machine hit them alike. A barrier (untimed) starts each
  iteration on all ranks together; the time of an iteration is the slowest rank's.
- All-reduce share: the same step (the config's DDP settings) run under
  ``DistributedDataParallel.no_sync()`` alternates with the synchronised one;
  ``(t_sync - t_no_sync) / t_sync`` pair by pair, median. That is the time the gradient
  all-reduce adds to a step, i.e. the part not hidden behind the backward pass (the
  one small flags all-reduce of ``TrainStep`` runs in both).
- A sweep point "wins" only clearly beyond noise. The config's setting runs twice
  (``repeat``, an A/A pair) to measure that noise; a point wins when the 25th
  percentile of its per-iteration speed-ups over the config's setting is above both 1
  and the 75th percentile of the A/A speed-ups, and its median gain is at least
  ``WIN_MIN_GAIN`` and at least the A/A inter-quartile range.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from detector.config import Config
from detector.engine.amp import resolve_amp
from detector.distributed import all_gather_object, cuda_index_for_rank, resolve_backend, resolve_device
from detector.engine.optim import build_lr_scheduler, build_optimizer
from detector.engine.setup import configure_torch, prepare_model
from detector.engine.step import TrainStep
from detector.modeling import build_model

from .batches import Batch, cached_batches
from .memory import memory_kind
from .timing import Runner, run_interleaved, summarize_times

logger = logging.getLogger(__name__)

WIN_MIN_GAIN = 0.03  # a sweep point must be >= 3 % faster (pairwise median) to win
NO_SYNC = "no_sync"
REPEAT = "repeat"  # the config's DDP settings a second time: the A/A noise of the sweep


@dataclasses.dataclass(frozen=True)
class ScalingSweep:
    """What ``--task scaling`` measures: the world sizes, and the DDP settings swept at
    the largest one (bucket sizes in MiB x ``gradient_as_bucket_view``)."""

    world_sizes: Tuple[int, ...] = (1, 2)
    bucket_caps_mb: Tuple[float, ...] = (1.0, 25.0, 100.0)
    bucket_views: Tuple[bool, ...] = (False, True)

    def __post_init__(self) -> None:
        if not self.world_sizes or any(w < 1 for w in self.world_sizes):
            raise ValueError(f"--world-sizes must be integers >= 1, got {list(self.world_sizes)}")
        if not self.bucket_caps_mb or any(not c > 0 for c in self.bucket_caps_mb):
            raise ValueError(f"--bucket-caps must be numbers > 0 (MiB), got {list(self.bucket_caps_mb)}")
        if not self.bucket_views:
            raise ValueError("--bucket-views needs at least one of false, true")


def point_name(bucket_cap_mb: float, view: bool) -> str:
    return f"cap{bucket_cap_mb:g}_view{str(bool(view)).lower()}"


def _with_ddp(cfg: Config, bucket_cap_mb: float, view: bool) -> Config:
    train = dataclasses.replace(cfg.train, ddp_bucket_cap_mb=float(bucket_cap_mb), ddp_gradient_as_bucket_view=bool(view))
    return dataclasses.replace(cfg, train=train)


def _rank_device(cfg: Config, rank: int, world_size: int, backend: str) -> torch.device:
    device = resolve_device(cfg.train.device)
    if device.type == "cuda":
        device = torch.device("cuda", cuda_index_for_rank(rank, world_size, torch.cuda.device_count(), backend))
        torch.cuda.set_device(device)
    return device


def _build_step(cfg: Config, device: torch.device, world_size: int) -> Tuple[TrainStep, nn.Module]:
    """The Trainer's model preparation (DDP with the config's settings when
    ``world_size > 1``), optimizer, scheduler and ``TrainStep``; same weights on every rank."""
    torch.manual_seed(cfg.train.seed)
    model, _ = prepare_model(build_model(cfg), cfg, device, world_size)
    optimizer = build_optimizer(model, cfg, world_size, log=False)  # built once per setting swept
    step = TrainStep(model, optimizer, build_lr_scheduler(optimizer, cfg), resolve_amp(cfg.train.amp, device),
                     cfg.solver.clip_grad_norm, world_size=world_size)
    return step, model


def _runners(cfg: Config, device: torch.device, world_size: int, points: Sequence[Tuple[float, bool]],
             batches: List[Batch]) -> List[Runner]:
    """World size 1: one runner (no DDP). Larger: one per sweep point, ``repeat`` (the
    config's settings again) and ``no_sync`` (the config's settings, gradients not
    all-reduced)."""
    barrier = (lambda i: dist.barrier()) if world_size > 1 else None
    specs: List[Tuple[str, Config, bool]] = [("single", cfg, False)]
    if world_size > 1:
        specs = [(point_name(c, v), _with_ddp(cfg, c, v), False) for c, v in points]
        specs += [(REPEAT, cfg, False), (NO_SYNC, cfg, True)]
    runners = []
    for name, point_cfg, no_sync in specs:
        step, model = _build_step(point_cfg, device, world_size)

        def fn(i: int, step=step, model=model, no_sync=no_sync) -> int:
            images, targets = batches[i % len(batches)]
            if no_sync:
                with model.no_sync():
                    step(images, targets)
            else:
                step(images, targets)
            return len(images)

        runners.append(Runner(name, fn, device, prepare=barrier))
    return runners


def _rank_worker(rank: int, world_size: int, cfg: Config, batches: List[Batch], points: List[Tuple[float, bool]],
                 iters: int, warmup: int, threads: int, store_path: str, out_path: str) -> None:
    """One rank: join the group, time every runner, and (rank 0) write every rank's
    per-iteration times to ``out_path``."""
    torch.set_num_threads(threads)
    backend = resolve_backend(cfg.train.dist_backend, resolve_device(cfg.train.device).type)
    device = _rank_device(cfg, rank, world_size, backend)
    if world_size > 1:
        kwargs: Dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size, **kwargs)
    try:
        configure_torch(cfg)
        runners = _runners(cfg, device, world_size, points, batches)
        run_interleaved(runners, iters, warmup)
        mine = {r.name: {"times_s": r.times, "cpu_times_s": r.cpu_times, "images": r.images,
                         "peak_memory_bytes": r.peak_bytes, "memory_kind": memory_kind(device)}
                for r in runners}
        every = all_gather_object(mine)
        if rank == 0:
            Path(out_path).write_text(json.dumps({"ranks": every, "backend": backend if world_size > 1 else "",
                                                  "device": str(device)}))
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def _merge_ranks(ranks: List[Dict[str, Any]], name: str, world_size: int) -> Dict[str, Any]:
    """One run from every rank's times: an iteration takes as long as its slowest rank;
    the images are all ranks' (global throughput); CPU seconds summed over ranks."""
    times = np.max([r[name]["times_s"] for r in ranks], axis=0)
    cpu = np.sum([r[name]["cpu_times_s"] for r in ranks], axis=0)
    out: Dict[str, Any] = summarize_times(times.tolist(), float(np.mean(ranks[0][name]["images"])) * world_size)
    out["times_s"] = [round(float(t), 6) for t in times]
    out["cpu_median_s"] = float(np.median(cpu))
    out["cpu_times_s"] = [round(float(t), 6) for t in cpu]
    out["peak_memory_bytes"] = int(max(r[name]["peak_memory_bytes"] for r in ranks))
    out["peak_memory_mib"] = round(out["peak_memory_bytes"] / 2**20, 1)
    out["memory_kind"] = ranks[0][name]["memory_kind"] + (" (largest rank)" if world_size > 1 else "")
    out["world_size"] = world_size
    return out


def _run_group(cfg: Config, world_size: int, threads: int, points: List[Tuple[float, bool]], batches: List[Batch],
               iters: int, warmup: int) -> Dict[str, Any]:
    """Spawn ``world_size`` ranks with ``threads`` threads each; returns their merged runs."""
    logger.info("world size %d: %d rank(s) x %d thread(s), %d runner(s) interleaved", world_size, world_size, threads,
                1 if world_size == 1 else len(points) + 2)
    with tempfile.TemporaryDirectory(prefix="scaling_") as tmp:
        out_path = os.path.join(tmp, "result.json")
        mp.start_processes(_rank_worker, nprocs=world_size, join=True, start_method="spawn",
                           args=(world_size, cfg, batches, points, iters, warmup, threads,
                                 os.path.join(tmp, "store"), out_path))
        raw = json.loads(Path(out_path).read_text())
    runs = {name: _merge_ranks(raw["ranks"], name, world_size) for name in raw["ranks"][0]}
    return {"runs": runs, "backend": raw["backend"], "device": raw["device"]}


def _pairwise(a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    """Per-iteration ratios a_i / b_i (iterations interleaved, so pair by pair)."""
    return np.asarray(a, dtype=np.float64) / np.asarray(b, dtype=np.float64)


def allreduce_share(sync: Dict[str, Any], no_sync: Dict[str, Any]) -> Dict[str, float]:
    """The time the gradient all-reduce adds to a step: ``1 - t_no_sync / t_sync`` pair
    by pair (median and quartiles), from the two medians (seconds and share), and the
    same share of the CPU seconds (all ranks summed)."""
    share = 1.0 - _pairwise(no_sync["times_s"], sync["times_s"])
    q25, med, q75 = np.percentile(share, [25, 50, 75])
    return {
        "share_pairwise_median": float(med),
        "share_pairwise_q25": float(q25),
        "share_pairwise_q75": float(q75),
        "share_of_medians": 1.0 - no_sync["median_s"] / sync["median_s"],
        "allreduce_median_s": sync["median_s"] - no_sync["median_s"],
        # CPU seconds of all ranks (gloo's threads included): steadier on a shared machine.
        "cpu_share_of_medians": 1.0 - no_sync["cpu_median_s"] / sync["cpu_median_s"],
        "method": "step time with DDP gradient sync minus the same step under DDP.no_sync(), "
                  "interleaved iteration by iteration; the all-reduce time not hidden behind backward",
    }


def _quartiles(x: np.ndarray) -> Tuple[float, float, float]:
    q25, med, q75 = np.percentile(x, [25, 50, 75])
    return float(q25), float(med), float(q75)


def sweep_verdict(runs: Dict[str, Dict[str, Any]], baseline: str, repeat: Dict[str, Any]) -> Dict[str, Any]:
    """Each sweep point (``runs``: point name -> run) against ``baseline`` (the config's
    setting): per-iteration speed-ups ``t_baseline / t_point`` (median, quartiles).
    ``repeat``: the baseline's setting run a second time; its speed-ups are the noise.
    A point wins beyond noise when its q25 exceeds 1 and the noise's q75, and its median
    gain is >= ``WIN_MIN_GAIN`` and >= the noise's inter-quartile range; the winner is
    the winning point with the largest median (``None`` if none wins)."""
    n25, nmed, n75 = _quartiles(_pairwise(runs[baseline]["times_s"], repeat["times_s"]))
    points: Dict[str, Dict[str, Any]] = {}
    for name, run in runs.items():
        q25, med, q75 = _quartiles(_pairwise(runs[baseline]["times_s"], run["times_s"]))
        points[name] = {"images_per_s": run["images_per_s"], "median_s": run["median_s"],
                        "speedup_median": med, "speedup_q25": q25, "speedup_q75": q75,
                        "beyond_noise": bool(name != baseline and q25 > max(1.0, n75)
                                             and med - 1.0 >= max(WIN_MIN_GAIN, n75 - n25))}
    winners = [n for n, p in points.items() if p["beyond_noise"]]
    winner = max(winners, key=lambda n: points[n]["speedup_median"]) if winners else None
    return {"baseline": baseline, "points": points, "winner": winner,
            "noise": {"speedup_median": nmed, "speedup_q25": n25, "speedup_q75": n75,
                      "what": "the baseline against its own repeat (A/A), per-iteration speed-ups"},
            "rule": f"wins if its per-iteration speed-up over the baseline has q25 > max(1, the A/A q75) "
                    f"and median - 1 >= max({WIN_MIN_GAIN:g}, the A/A IQR)"}


def benchmark_scaling(cfg: Config, iters: int, warmup: int, sweep: ScalingSweep = ScalingSweep(),
                      num_batches: int = 4, synthetic: bool = False, threads: int = 0) -> Dict[str, Any]:
    """Run every world size of ``sweep`` (the DDP sweep at the largest, when > 1) and
    return ``runs`` (``ws{N}``: the config's settings; ``ws{N}_{point}``, ``ws{N}_no_sync``)
    and ``scaling`` (threads per rank, images/s per world size, efficiency, all-reduce
    share, the sweep's verdict, skipped world sizes)."""
    device = resolve_device(cfg.train.device)
    total = threads or torch.get_num_threads()
    batches = cached_batches(cfg, True, num_batches, synthetic, pin=False)
    base = (float(cfg.train.ddp_bucket_cap_mb), bool(cfg.train.ddp_gradient_as_bucket_view))
    points = [(float(c), bool(v)) for c in sweep.bucket_caps_mb for v in sweep.bucket_views]
    if point_name(*base) not in [point_name(*p) for p in points]:
        points.append(base)
    largest = max(sweep.world_sizes)
    runs: Dict[str, Dict[str, Any]] = {}
    scaling: Dict[str, Any] = {"threads_total": total, "threads_per_rank": {}, "images_per_s": {}, "skipped": {}}
    for ws in sorted(set(sweep.world_sizes)):
        reason = _cannot_run(cfg, device, ws)
        if reason:
            scaling["skipped"][str(ws)] = reason
            continue
        per_rank = max(1, total // ws) if device.type == "cpu" else total
        group = _run_group(cfg, ws, per_rank, points if ws == largest else [base], batches, iters, warmup)
        scaling["threads_per_rank"][str(ws)] = per_rank
        scaling["backend"] = group["backend"] or scaling.get("backend", "")
        for name, run in group["runs"].items():
            runs[f"ws{ws}" if name in ("single", point_name(*base)) else f"ws{ws}_{name}"] = run
        scaling["images_per_s"][str(ws)] = runs[f"ws{ws}"]["images_per_s"]
    if largest > 1 and "ws1" in runs and f"ws{largest}" in runs:
        scaling["efficiency"] = runs[f"ws{largest}"]["images_per_s"] / (largest * runs["ws1"]["images_per_s"])
    if largest > 1 and f"ws{largest}" in runs:
        scaling["allreduce"] = allreduce_share(runs[f"ws{largest}"], runs[f"ws{largest}_{NO_SYNC}"])
        by_point = {point_name(*p): runs[f"ws{largest}" if p == base else f"ws{largest}_{point_name(*p)}"] for p in points}
        scaling["sweep"] = sweep_verdict(by_point, point_name(*base), runs[f"ws{largest}_{REPEAT}"])
        scaling["sweep"]["world_size"] = largest
    return {"runs": runs, "scaling": scaling, "images_per_iter": cfg.solver.images_per_gpu}


def _cannot_run(cfg: Config, device: torch.device, world_size: int) -> Optional[str]:
    """Why a world size cannot run here (NCCL with fewer GPUs than ranks), else None."""
    if device.type != "cuda" or world_size == 1:
        return None
    backend = resolve_backend(cfg.train.dist_backend, "cuda")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        return f"NCCL needs one GPU per rank: {torch.cuda.device_count()} GPU(s) for world size {world_size}"
    return None


def format_scaling(result: Dict[str, Any]) -> str:
    """The scaling table of a ``benchmark_scaling`` result."""
    s = result["scaling"]
    lines = [f"  scaling: backend {s.get('backend') or '-'}, {s['threads_total']} threads in all; threads per rank "
             + ", ".join(f"{ws} rank(s) x {t}" for ws, t in s["threads_per_rank"].items())]
    for ws, ips in s["images_per_s"].items():
        lines.append(f"    world size {ws}: {ips:8.2f} images/s")
    if "efficiency" in s:
        lines.append(f"    scaling efficiency: {s['efficiency']:.3f}")
    if "allreduce" in s:
        a = s["allreduce"]
        lines.append(f"    all-reduce share of a step: {a['share_pairwise_median'] * 100:.1f} % (pairwise median; "
                     f"IQR {a['share_pairwise_q25'] * 100:.1f}..{a['share_pairwise_q75'] * 100:.1f} %), "
                     f"{a['allreduce_median_s'] * 1000:.1f} ms; of CPU time {a['cpu_share_of_medians'] * 100:.1f} %; "
                     "sync vs no_sync()")
    if "sweep" in s:
        v = s["sweep"]
        lines.append(f"    {'bucket_cap_mb x gradient_as_bucket_view':<28s} {'images/s':>9s}  speed-up vs {v['baseline']} (q25..q75)")
        for name, p in v["points"].items():
            mark = "  wins" if p["beyond_noise"] else ""
            lines.append(f"    {name:<40s} {p['images_per_s']:9.2f}  {p['speedup_median']:.3f} "
                         f"({p['speedup_q25']:.3f}..{p['speedup_q75']:.3f}){mark}")
        n = v["noise"]
        lines.append(f"    {'A/A noise (baseline vs its repeat)':<40s} {'':9s}  {n['speedup_median']:.3f} "
                     f"({n['speedup_q25']:.3f}..{n['speedup_q75']:.3f})")
        lines.append(f"    winner beyond noise: {v['winner'] or 'none (keep the defaults)'}")
    for ws, why in s["skipped"].items():
        lines.append(f"    world size {ws} skipped: {why}")
    return "\n".join(lines)
