"""Memory of the annotation records at scale (``--task data``'s ``records`` case).

- ``parse_cost``: time and peak resident memory of parsing a COCO file into a data set,
  in a fresh interpreter (so the peak is the parse's, not this process's);
- ``worker_walk``: the private memory (USS = Private_Clean + Private_Dirty, and PSS, from
  ``/proc/<pid>/smaps_rollup``) of a forked child, as a data loader worker is, before and
  after it reads every record (``get_annotation``), then after a full ``gc.collect()``;
  for the ``RecordStore`` and, as the control, the former layout of one ``ImageRecord``
  per image in a list;
- ``worker_gc_growth``: what a loader worker's full ``gc.collect()`` makes private of
  what it inherited, ``DetectionDataLoader`` (which freezes the parent's objects while
  it forks) against torch's ``DataLoader``;
- ``rank_tree_memory``: ``ranks`` processes, as the ranks of a DDP run on one machine,
  each parsing the file and reading every record of its shard through a ``DataLoader``
  of ``workers`` workers; the PSS of every rank and worker, summed (the machine's share).

Linux only (``/proc``); elsewhere the case reports that it was skipped.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from detector.data.coco import CocoDetection
from detector.data.dataset import DetectionDataset
from detector.data.loader import DetectionDataLoader

ROLLUP = "/proc/{pid}/smaps_rollup"


def memory_kib(pid: int | str = "self") -> Dict[str, int]:
    """``uss``, ``pss``, ``rss`` of process ``pid`` in KiB (from ``smaps_rollup``)."""
    fields: Dict[str, int] = {}
    for line in Path(ROLLUP.format(pid=pid)).read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    return {"uss": fields["Private_Clean"] + fields["Private_Dirty"], "pss": fields["Pss"], "rss": fields["Rss"]}


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _parse_in_this_process(ann_file: str, image_dir: str) -> Dict[str, Any]:
    """Build the data set of ``ann_file`` (images need not exist) and report its cost."""
    t0, c0 = time.perf_counter(), time.process_time()
    dataset = CocoDetection(image_dir, ann_file)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    gc.collect()
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_after_mib": _rss_mib(), "images": len(dataset), "boxes": dataset.records.num_boxes,
            "store_mib": dataset.records.nbytes / 2**20}


def parse_cost(ann_file: str, image_dir: str) -> Dict[str, Any]:
    """Seconds (wall and CPU), peak and final resident MiB, images, boxes and the store's MiB of parsing
    ``ann_file`` into a ``CocoDetection`` in a fresh interpreter (imports included in
    the memory figures: ``baseline_rss_mib`` is the interpreter after the imports)."""
    code = ("import json, sys, os; os.environ.setdefault('NO_ALBUMENTATIONS_UPDATE', '1'); "
            "from benchmarks import records_memory as m; "
            "base = m._rss_mib(); r = m._parse_in_this_process(sys.argv[1], sys.argv[2]); "
            "r['baseline_rss_mib'] = base; print(json.dumps(r))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                          os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, ann_file, image_dir], capture_output=True, text=True,
                         env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


class _ListLayout(DetectionDataset):
    """The former layout: one ``ImageRecord`` per image in a list (the control)."""

    def __init__(self, dataset: DetectionDataset) -> None:
        self.__dict__.update(dataset.__dict__)
        self.records = list(dataset.records)  # type: ignore[assignment]


def _child_walk(dataset: DetectionDataset, write_fd: int) -> None:
    for i in range(min(8, len(dataset))):  # warm the allocator
        dataset.get_annotation(i)
    before = memory_kib()
    t0 = time.perf_counter()
    for i in range(len(dataset)):
        dataset.get_annotation(i)
    seconds = time.perf_counter() - t0
    after = memory_kib()
    gc.collect()
    after_gc = memory_kib()
    os.write(write_fd, json.dumps({"before_kib": before, "after_walk_kib": after, "after_gc_kib": after_gc,
                                   "walk_seconds": seconds}).encode())


def worker_walk(dataset: DetectionDataset, layout: str = "store") -> Dict[str, Any]:
    """A forked child's memory before and after reading every record of ``dataset``
    (``layout``: ``store`` as built, or ``list``, one object per image), and after a
    full garbage collection; ``growth_mib`` is the USS growth of the walk."""
    target = dataset if layout == "store" else _ListLayout(dataset)
    read_fd, write_fd = os.pipe()
    gc.collect()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_fd)
            _child_walk(target, write_fd)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    out = json.loads(text)
    out["layout"] = layout
    out["growth_mib"] = (out["after_walk_kib"]["uss"] - out["before_kib"]["uss"]) / 1024
    out["growth_with_gc_mib"] = (out["after_gc_kib"]["uss"] - out["before_kib"]["uss"]) / 1024
    return out


class _Annotations(torch.utils.data.Dataset):
    """Items are the annotations of ``dataset`` (no image is read)."""

    def __init__(self, dataset: DetectionDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> int:
        return len(self.dataset.get_annotation(i)["labels"])


class _GcProbe(torch.utils.data.Dataset):
    """One item, read in a loader worker: that worker's USS growth (KiB) over a full
    ``gc.collect()``, i.e. the inherited pages the collector made private."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        before = memory_kib()["uss"]
        gc.collect()
        return memory_kib()["uss"] - before


def worker_gc_growth(loader_class: type = DetectionDataLoader) -> float:
    """MiB a forked worker of ``loader_class`` (``DetectionDataLoader``, or torch's
    ``DataLoader`` as the control) makes private when it collects garbage, with this
    process's objects as they are."""
    loader = loader_class(_GcProbe(), batch_size=None, num_workers=1, multiprocessing_context="fork")
    return next(iter(loader)) / 1024


def _children(pid: int) -> List[int]:
    out: List[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _rank(rank: int, ranks: int, workers: int, ann_file: str, image_dir: str, queue: Any, barrier: Any) -> None:
    dataset = CocoDetection(image_dir, ann_file)
    items = _Annotations(dataset)
    shard = list(range(rank, len(items), ranks))
    loader = torch.utils.data.DataLoader(items, batch_size=64, sampler=shard, num_workers=workers,
                                         collate_fn=sum, persistent_workers=workers > 0,
                                         multiprocessing_context="fork" if workers > 0 else None)
    boxes = sum(loader)  # every record of the shard, read in the workers
    pids = [os.getpid(), *_children(os.getpid())]
    mem = {pid: memory_kib(pid) for pid in pids}
    queue.put({"rank": rank, "boxes": boxes, "processes": len(pids),
               "rank_pss_mib": mem[os.getpid()]["pss"] / 1024,
               "workers_pss_mib": sum(m["pss"] for p, m in mem.items() if p != os.getpid()) / 1024,
               "workers_uss_mib": sum(m["uss"] for p, m in mem.items() if p != os.getpid()) / 1024})
    barrier.wait()  # every rank measures while all are alive


def rank_tree_memory(ann_file: str, image_dir: str, ranks: int = 2, workers: int = 4) -> Dict[str, Any]:
    """``ranks`` spawned processes (a DDP run's ranks on one machine, without the model),
    each parsing ``ann_file`` and reading its shard of records through ``workers``
    forked loader workers; the PSS of each rank and of its workers (MiB) and their sum."""
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(ranks)
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_rank, args=(r, ranks, workers, ann_file, image_dir, queue, barrier))
             for r in range(ranks)]
    for p in procs:
        p.start()
    per_rank = sorted((queue.get() for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    total = sum(r["rank_pss_mib"] + r["workers_pss_mib"] for r in per_rank)
    return {"ranks": ranks, "workers_per_rank": workers, "seconds": time.perf_counter() - t0,
            "per_rank": per_rank, "total_pss_mib": total}


def benchmark_records(dataset: DetectionDataset, ann_file: Optional[str] = None, image_dir: str = "",
                      ranks: int = 2, workers: int = 4) -> Dict[str, Any]:
    """The ``records`` case: worker walks of ``dataset`` (store and list layouts); with
    ``ann_file`` (a COCO file; its images need not exist), its parse cost and the memory
    of ``ranks`` x ``workers`` processes reading it, with the walks on its records."""
    if not Path(ROLLUP.format(pid="self")).exists() or not hasattr(os, "fork"):
        return {"skipped": "needs Linux /proc/<pid>/smaps_rollup and fork"}
    out: Dict[str, Any] = {}
    if ann_file:
        out["parse"] = parse_cost(ann_file, image_dir)
        dataset = CocoDetection(image_dir, ann_file)
    out.update(images=len(dataset), boxes=dataset.records.num_boxes, store_mib=dataset.records.nbytes / 2**20)
    out["worker_walk"] = {layout: worker_walk(dataset, layout) for layout in ("store", "list")}
    out["loader_worker_gc_mib"] = {"detector": worker_gc_growth(DetectionDataLoader),
                                   "torch": worker_gc_growth(torch.utils.data.DataLoader)}
    if ann_file and ranks > 0:
        del dataset
        gc.collect()
        out["rank_tree"] = rank_tree_memory(ann_file, image_dir, ranks, workers)
    return out


def format_records(r: Dict[str, Any]) -> str:
    """The console lines of a ``records`` result."""
    if "skipped" in r:
        return f"  records: skipped ({r['skipped']})"
    lines = [f"  records: {r['images']} images, {r['boxes']} boxes, store {r['store_mib']:.1f} MiB"]
    if "parse" in r:
        p = r["parse"]
        lines.append(f"    parse {p['seconds']:.1f} s (CPU {p['cpu_seconds']:.1f} s), peak RSS {p['peak_rss_mib']:.0f} MiB "
                     f"(after imports {p['baseline_rss_mib']:.0f}), RSS after {p['rss_after_mib']:.0f} MiB")
    for layout, w in r["worker_walk"].items():
        lines.append(f"    worker reading every record ({layout}): USS +{w['growth_mib']:.1f} MiB "
                     f"(+{w['growth_with_gc_mib']:.1f} MiB after gc.collect), {w['walk_seconds']:.1f} s")
    g = r["loader_worker_gc_mib"]
    lines.append(f"    a loader worker's gc.collect(): USS +{g['detector']:.1f} MiB (torch's DataLoader: "
                 f"+{g['torch']:.1f} MiB)")
    if "rank_tree" in r:
        t = r["rank_tree"]
        lines.append(f"    {t['ranks']} ranks x {t['workers_per_rank']} workers: PSS {t['total_pss_mib']:.0f} MiB in all; "
                     + "; ".join(f"rank {x['rank']} {x['rank_pss_mib']:.0f} + workers {x['workers_pss_mib']:.0f} "
                                 f"(USS {x['workers_uss_mib']:.0f})" for x in t["per_rank"]))
    return "\n".join(lines)

