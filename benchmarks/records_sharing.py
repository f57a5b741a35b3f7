"""Every rank parsing the annotation file against one parse per machine shared through a
memory-mapped record file (``data.cache_dir``, ``detector.data.record_cache``): the
``records`` case's ``sharing`` part of ``tools/benchmark.py --task data``.

``node_sharing`` runs ``ranks`` spawned processes (a DDP run's ranks on one machine, a
gloo process group each, no model) three times on one file, one run after the other:

- ``parse``: each rank parses the file itself (no cache);
- ``shared``: local rank 0 parses and writes the record file into an empty folder, the
  others wait and map it;
- ``shared_warm``: the record file exists (a restart, or the evaluation's second build):
  every rank maps it.

Each rank then reads every record of its shard through ``workers`` forked loader workers.
Reported per run: the wall time from the ranks' start (after the process group's
rendezvous, so the imports are left out) until every rank holds its records, the
peak of the ranks' summed anonymous memory while they build (``RssAnon``, sampled every
0.1 s: the parse's transient heap), each rank's build time and peak RSS, and the PSS of
all processes afterwards (the machine's share: a mapped file's pages are counted once,
split between the processes that map them). The load average is recorded at each start.
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import resource
import socket
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from detector.data.coco import CocoDetection
from detector.data.record_cache import RecordCache

from .records_memory import _Annotations, _children, memory_kib

MODES = ("parse", "shared", "shared_warm")


def _anon_kib(pid: int) -> int:
    """``RssAnon`` of ``pid`` in KiB (0 once it has ended)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _rank(rank: int, ranks: int, workers: int, ann_file: str, image_dir: str, cache_dir: str, port: int,
          queue: Any, barrier: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks, timeout=timedelta(seconds=3600))
    t0 = time.time()
    dataset = CocoDetection(image_dir, ann_file, cache=RecordCache(Path(cache_dir)) if cache_dir else None)
    ready = time.time()
    queue.put({"rank": rank, "ready": True})
    barrier.wait()  # the parent stops sampling the build's memory
    shard = list(range(rank, len(dataset), ranks))
    loader = torch.utils.data.DataLoader(_Annotations(dataset), batch_size=64, sampler=shard, num_workers=workers,
                                         collate_fn=sum, persistent_workers=workers > 0,
                                         multiprocessing_context="fork" if workers > 0 else None)
    boxes = sum(loader)
    pids = [os.getpid(), *_children(os.getpid())]
    mem = {pid: memory_kib(pid) for pid in pids}
    queue.put({"rank": rank, "build_s": ready - t0, "started_at": t0, "ready_at": ready, "boxes": boxes,
               "processes": len(pids),
               "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "pss_mib": sum(m["pss"] for m in mem.values()) / 1024,
               "records_mapped": _mapped(dataset.records.arrays["boxes"])})
    barrier.wait()  # every rank measures while all are alive
    dist.destroy_process_group()


def _mapped(array: Any) -> bool:
    """Whether ``array`` is a view of a memory map (a record file's)."""
    while isinstance(array, np.ndarray):
        array = array.base
    return isinstance(array, memoryview) and isinstance(array.obj, mmap.mmap)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sample_anon(pids: List[int], stop: threading.Event, out: Dict[str, float]) -> None:
    peak = 0
    while not stop.is_set():
        peak = max(peak, sum(_anon_kib(p) for p in pids))
        stop.wait(0.1)
    out["peak_anon_mib"] = peak / 1024


def run_ranks(ann_file: str, image_dir: str, ranks: int, workers: int, cache_dir: str) -> Dict[str, Any]:
    """One run of ``ranks`` spawned ranks building the data set of ``ann_file`` (with the
    record cache in ``cache_dir``, or each parsing: ``""``); see the module docstring."""
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(ranks + 1)
    port, load = _free_port(), list(os.getloadavg())
    t0 = time.time()
    procs = [ctx.Process(target=_rank, args=(r, ranks, workers, ann_file, image_dir, cache_dir, port, queue, barrier))
             for r in range(ranks)]
    for p in procs:
        p.start()
    stop, sampled = threading.Event(), {}
    sampler = threading.Thread(target=_sample_anon, args=([p.pid for p in procs], stop, sampled))
    sampler.start()
    for _ in procs:
        queue.get()
    stop.set()
    sampler.join()
    barrier.wait()
    per_rank = sorted((queue.get() for _ in procs), key=lambda r: r["rank"])
    barrier.wait()
    for p in procs:
        p.join()
    return {"seconds_to_records": max(r["ready_at"] for r in per_rank) - min(r["started_at"] for r in per_rank),
            "seconds_from_launch": max(r["ready_at"] for r in per_rank) - t0, "peak_anon_mib": sampled["peak_anon_mib"],
            "total_pss_mib": sum(r["pss_mib"] for r in per_rank), "loadavg_start": load,
            "loadavg_end": list(os.getloadavg()), "per_rank": per_rank}


def node_sharing(ann_file: str, image_dir: str, ranks: int = 8, workers: int = 2,
                 cache_dir: Optional[str] = None) -> Dict[str, Any]:
    """The three runs of the module docstring, in order, on one file; the record file
    goes to ``cache_dir`` (default: a temporary folder, removed afterwards)."""
    with tempfile.TemporaryDirectory(prefix="records_sharing_") as tmp:
        folder = str(Path(cache_dir or tmp) / "cache")
        runs = {"parse": run_ranks(ann_file, image_dir, ranks, workers, ""),
                "shared": run_ranks(ann_file, image_dir, ranks, workers, folder),
                "shared_warm": run_ranks(ann_file, image_dir, ranks, workers, folder)}
        record_files = sorted(p.name for p in Path(folder).iterdir())
    return {"ranks": ranks, "workers_per_rank": workers, "runs": runs, "record_files": record_files}


def format_sharing(r: Dict[str, Any]) -> str:
    """The console lines of a ``node_sharing`` result."""
    lines = [f"    {r['ranks']} ranks x {r['workers_per_rank']} workers on one machine, building the data set:"]
    for mode, x in r["runs"].items():
        build = [p["build_s"] for p in x["per_rank"]]
        lines.append(f"      {mode:<11s} records on every rank after {x['seconds_to_records']:.1f} s (one rank's "
                     f"{min(build):.1f}-{max(build):.1f} s); peak anonymous memory of the ranks {x['peak_anon_mib']:.0f} "
                     f"MiB; PSS afterwards {x['total_pss_mib']:.0f} MiB; load {x['loadavg_start'][0]:.1f}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description="Each rank parsing a COCO file against one parse per machine "
                                            "shared through a record file (prints the lines, then the JSON).")
    p.add_argument("ann_file", help="a COCO instances file (its images need not exist)")
    p.add_argument("--ranks", type=int, default=8, help="ranks on this machine (default 8)")
    p.add_argument("--workers", type=int, default=2, help="loader workers per rank (default 2)")
    args = p.parse_args(argv)
    result = node_sharing(args.ann_file, "", args.ranks, args.workers)
    print(format_sharing(result))
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    main()
