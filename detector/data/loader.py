"""DataLoaders for training and evaluation.

``build_train_loader`` gives a loader whose ``batch_sampler`` has ``set_epoch(epoch)`` and
``set_start(num_batches_done)``; ``len(loader)`` is the number of batches per epoch for
this rank and is the same on every rank. ``build_test_loader`` shards the data set
contiguously (``InferenceSampler``), no duplicates.

Batches are ``(list of uint8 [3,H,W] tensors, list of target dicts)``: no padding on the
CPU side (the model pads). The training loader's batch sampler yields ``SampleKey``s, and
each sample's augmentation is drawn from ``(train.seed, epoch, position)``: a batch is the
same with any number of workers, on any rank that owns it, and after a resume.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import multiprocessing.util
import os
import random
import re
import signal
import weakref
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from detector.config import Config
from detector.messages import first_line

from .samplers import (
    GroupedBatchSampler,
    InferenceSampler,
    RepeatFactorSampler,
    TrainingSampler,
    aspect_ratio_group_ids,
    repeat_factors_from_labels,
)

logger = logging.getLogger(__name__)

_SHM_ADVICE = (
    "a DataLoader worker died from a bus error, which usually means the shared memory "
    "(/dev/shm) is too small for the batches in flight: use fewer workers "
    "(data.num_workers=0 or 1), a smaller data.prefetch_factor or batch, or give the "
    "container more shared memory (docker run --shm-size=8g / --ipc=host)"
)


def collate_list(batch: List[Tuple[torch.Tensor, Dict[str, Any]]]) -> Tuple[List[torch.Tensor], List[Dict[str, Any]]]:
    """``[(image, target), ...]`` -> ``([image, ...], [target, ...])``."""
    images, targets = zip(*batch) if batch else ((), ())
    return list(images), list(targets)


class PackedBatch:
    """A collated batch packed into two tensors for the trip from a worker process.

    Every tensor a worker returns travels through its own shared-memory segment whose
    file descriptor the main process fetches over a socket; with several small tensors
    per image that costs more than decoding a small image. So a worker packs the images
    of a batch into one flat pixel buffer (allocated in shared memory, so it is copied
    only once) and ``boxes``, ``labels``, ``orig_size``, ``scale`` of every target into one
    float64 tensor (exact for float32 values and for integers below 2**53). ``unpack``, in
    the main process, returns the usual lists; the images are views of the buffer.
    """

    _PACKED_KEYS = ("boxes", "labels", "orig_size", "scale", "image_id")

    def __init__(self, images: Sequence[torch.Tensor], targets: Sequence[Dict[str, Any]]) -> None:
        self.shapes = [tuple(img.shape) for img in images]
        self.pixels = torch.empty(sum(img.numel() for img in images), dtype=images[0].dtype if images else torch.uint8)
        if torch.utils.data.get_worker_info() is not None:
            self.pixels.share_memory_()
        offset = 0
        for img in images:
            self.pixels[offset : offset + img.numel()].view(img.shape).copy_(img)
            offset += img.numel()
        self.counts = [int(t["labels"].numel()) for t in targets]
        parts = [t["boxes"].reshape(-1) for t in targets] + [t["labels"].reshape(-1) for t in targets]
        parts += [t["orig_size"].reshape(2) for t in targets] + [t["scale"].reshape(2) for t in targets]
        self.meta = torch.cat([p.to(torch.float64) for p in parts]) if parts else torch.zeros(0, dtype=torch.float64)
        self.image_ids = [t["image_id"] for t in targets]
        self.extras = [{k: v for k, v in t.items() if k not in self._PACKED_KEYS} for t in targets]

    def pin_memory(self) -> "PackedBatch":
        """Called by the DataLoader's pin-memory thread."""
        self.pixels = self.pixels.pin_memory()
        self.meta = self.meta.pin_memory()
        return self

    def unpack(self) -> Tuple[List[torch.Tensor], List[Dict[str, Any]]]:
        images, offset = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            images.append(self.pixels[offset : offset + n].view(shape))
            offset += n
        total, b = sum(self.counts), len(self.counts)
        pin = self.meta.is_pinned()
        meta = self.meta
        boxes = meta[: 4 * total].to(torch.float32).view(-1, 4)
        labels = meta[4 * total : 5 * total].to(torch.int64)
        orig_sizes = meta[5 * total : 5 * total + 2 * b].to(torch.int64).view(-1, 2)
        scales = meta[5 * total + 2 * b :].to(torch.float32).view(-1, 2)
        if pin:
            boxes, labels, orig_sizes, scales = (x.pin_memory() for x in (boxes, labels, orig_sizes, scales))
        targets, start = [], 0
        for i, n in enumerate(self.counts):
            targets.append({
                "boxes": boxes[start : start + n],
                "labels": labels[start : start + n],
                "image_id": self.image_ids[i],
                "orig_size": orig_sizes[i],
                "scale": scales[i],
                **self.extras[i],
            })
            start += n
        return images, targets


def collate_detection(batch: List[Tuple[torch.Tensor, Dict[str, Any]]]) -> Any:
    """The loaders' collate: ``(list of images, list of targets)`` in the main process;
    in a worker, the same packed as a ``PackedBatch`` (unpacked by the loader's iterator)
    when every image has one dtype and every target has the standard keys."""
    images, targets = collate_list(batch)
    if torch.utils.data.get_worker_info() is None or not images:
        return images, targets
    if len({img.dtype for img in images}) == 1 and all(
        isinstance(t, dict) and all(k in t for k in PackedBatch._PACKED_KEYS) for t in targets
    ):
        return PackedBatch(images, targets)
    return images, targets


def worker_init_fn(worker_id: int, rank: int = 0) -> None:
    """Seed ``random``, numpy and torch in a worker, turn off OpenCV's thread pool, and
    ignore SIGTERM.

    SIGTERM: a signal sent to the whole process group (SLURM's ``scancel`` and
    preemption, ``timeout``, ``kill -TERM -PGID``) reaches the workers too. Killed by it,
    a worker makes the main process raise "DataLoader worker ... is killed by signal"
    from wherever it is, before its own handler can save a checkpoint; ignoring it, the
    workers live on until the main process has stopped at the iteration's end and shuts
    them down. A worker still ends with its main process (torch's parent watchdog), and
    SIGKILL still kills it.

    The seed is torch's per-worker seed (``base_seed + worker_id``, drawn from the loader's
    generator), mixed with the rank. The augmentation does not use these generators (its
    random numbers come from each sample's ``SampleKey``); they only keep any other random
    code in a worker reproducible and different across workers and ranks.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    seed = (torch.initial_seed() + 1_000_003 * rank) % 2**32
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    try:
        import cv2

        cv2.setNumThreads(0)  # no OpenCV thread pools inside workers
    except ImportError:  # pragma: no cover
        pass


def _is_bus_error(exc: BaseException, iterator: Any = None) -> bool:
    """True when a worker died from SIGBUS: torch says "killed by signal: Bus error", or
    just "exited unexpectedly" while the worker's exit code is -SIGBUS."""
    text = str(exc).lower()
    if "bus error" in text or "sigbus" in text:
        return True
    workers = getattr(iterator, "_workers", None) or []  # torch's worker processes (private)
    return any(getattr(w, "exitcode", None) == -signal.SIGBUS for w in workers)


_WORKER_ERROR = re.compile(r"^Caught \w+ in (DataLoader worker process \d+|pin memory thread[^\n]*)\.\nOriginal "
                           r"Traceback \(most recent call last\):\n")


def unwrap_worker_error(exc: BaseException) -> Optional[BaseException]:
    """The exception a DataLoader worker raised, as raised without workers; None when
    ``exc`` is no worker's error.

    torch re-raises a worker's exception in the main process as the same type with the
    message ``"Caught DataError in DataLoader worker process 1.\nOriginal Traceback
    ..."`` followed by the worker's traceback text; the original message is the text
    after ``"<module>.<type>: "`` on the traceback's last exception line. So a corrupt
    image is the same one line with 0 or N workers (the traceback stays in the chain).
    """
    text = str(exc)
    if not _WORKER_ERROR.match(text):
        return None
    cls = type(exc)
    names = {cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"}
    lines = text.rstrip("\n").split("\n")
    for i in range(len(lines) - 1, 0, -1):
        name, sep, message = lines[i].partition(": ")
        if name in names and sep:
            try:
                unwrapped = cls("\n".join([message, *lines[i + 1:]]))
            except Exception:  # noqa: BLE001 - a type that takes other arguments: keep torch's
                return None
            unwrapped.__cause__ = exc
            return unwrapped
        if lines[i] in names:
            return None  # an exception without a message: torch's text says more
    return None


def _stop_workers(iterator: Iterator[Any]) -> None:
    """Stop a multi-process iterator's workers now (a no-op without workers). The
    exception being raised keeps the iterator alive through its traceback; stopped later,
    by the garbage collector, each worker waited out its 5 s join timeout."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


@contextlib.contextmanager
def _gc_frozen(enabled: bool) -> Iterator[None]:
    """Inside: every object the garbage collector tracks is frozen (``gc.freeze``), so
    that workers forked here never collect them. A worker's full collection otherwise
    writes to the header of every object it inherited, copying the memory pages they lie
    on (about 100 MiB per worker of a training process, docs/data.md). The parent is
    unfrozen on the way out; a freeze someone else made is left alone."""
    if not enabled or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _stop_workers_of(ref: "weakref.ref[Any]") -> None:
    """``_stop_workers`` of the iterator ``ref`` points to, if it is still alive."""
    iterator = ref()
    if iterator is not None:
        _stop_workers(iterator)


def _stop_workers_at_exit(iterator: Iterator[Any]) -> None:
    """Stop ``iterator``'s workers when the process ends, before ``multiprocessing``'s
    exit handler joins its child processes (a finalizer of exit priority >= 0 runs
    first). That handler stops daemon children with SIGTERM, which the workers ignore
    (``worker_init_fn``): a process that ends with a live multi-process iterator (a
    ``Trainer`` or a loader with persistent workers held in a module's global) waited
    for them for ever. Registered once per iterator; dropped when it is collected."""
    if getattr(iterator, "_workers", None) and getattr(iterator, "_detector_exit_stop", None) is None:
        iterator._detector_exit_stop = multiprocessing.util.Finalize(  # type: ignore[attr-defined]
            iterator, _stop_workers_of, args=(weakref.ref(iterator),), exitpriority=10)


class DetectionDataLoader(DataLoader):
    """A ``DataLoader`` whose workers' errors read as without workers
    (``unwrap_worker_error``), that turns a worker killed by a shared-memory bus error
    into a ``RuntimeError`` saying what to do, whose forked workers leave the parent's
    objects to it (``_gc_frozen``), and whose workers stop when the process ends
    (``_stop_workers_at_exit``) or the loader is closed."""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        with _gc_frozen(self.num_workers > 0):
            iterator = super().__iter__()  # the workers start (fork) here
        _stop_workers_at_exit(iterator)
        return self._iterate(iterator)

    def close(self) -> None:
        """Stop the persistent workers now (``data.persistent_workers``; a later
        iteration starts new ones). Without persistent workers there is nothing to stop:
        an iteration's workers stop at its end."""
        iterator = getattr(self, "_iterator", None)  # torch keeps the persistent workers' iterator here
        if iterator is not None:
            _stop_workers(iterator)
            self._iterator = None

    @staticmethod
    def _iterate(iterator: Iterator[Any]) -> Iterator[Any]:
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001 - re-raised, unwrapped where a worker raised it
                _stop_workers(iterator)
                unwrapped = unwrap_worker_error(exc)
                if unwrapped is not None:
                    raise unwrapped from exc
                if not isinstance(exc, RuntimeError):
                    raise
                if _is_bus_error(exc, iterator):
                    raise RuntimeError(f"{_SHM_ADVICE} (original error: {first_line(exc)})") from exc
                raise
            if isinstance(batch, PackedBatch):
                batch = batch.unpack()
            yield batch


def _pin_memory(cfg: Config) -> bool:
    return torch.cuda.is_available() and cfg.train.device != "cpu"


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; ``os.cpu_count()`` elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _worker_kwargs(cfg: Config, num_workers: int, log_level: int = logging.INFO) -> Dict[str, Any]:
    """DataLoader worker arguments; ``num_workers`` above the CPU count is capped to it
    (more workers than CPUs only compete, and torch warns), with a log line at ``log_level``."""
    if num_workers <= 0:
        return {"num_workers": 0}
    cpus = available_cpus()
    if num_workers > cpus:
        logger.log(log_level, "data.num_workers=%d is more than the %d CPUs this process may use; using %d workers",
                   num_workers, cpus, cpus)
        num_workers = cpus
    return {
        "num_workers": num_workers,
        "persistent_workers": cfg.data.persistent_workers,
        "prefetch_factor": cfg.data.prefetch_factor,
    }


def _labels_per_image(dataset: Dataset) -> List[List[int]]:
    """Training labels of each image, from annotations (no decoding)."""
    out = []
    for idx in range(len(dataset)):
        ann = dataset.get_annotation(idx)
        keep = ~ann["iscrowd"]
        if not getattr(dataset, "use_difficult", False):
            keep &= ~ann["difficult"]
        out.append(ann["labels"][keep].tolist())
    return out


def build_train_sampler(cfg: Config, dataset: Dataset, rank: int = 0, world_size: int = 1) -> GroupedBatchSampler:
    """The batch sampler of ``build_train_loader`` (grouped by aspect ratio when
    ``data.aspect_ratio_grouping``, repeat-factor sampling when
    ``data.repeat_factor_threshold > 0``)."""
    seed = cfg.train.seed
    if cfg.data.repeat_factor_threshold > 0:
        factors = repeat_factors_from_labels(_labels_per_image(dataset), cfg.data.repeat_factor_threshold)
        sampler: TrainingSampler = RepeatFactorSampler(factors, seed=seed, rank=rank, world_size=world_size)
    else:
        sampler = TrainingSampler(len(dataset), shuffle=True, seed=seed, rank=rank, world_size=world_size)
    if cfg.data.aspect_ratio_grouping:
        group_ids = aspect_ratio_group_ids(dataset.aspect_ratios)
    else:
        group_ids = [0] * len(dataset)
    return GroupedBatchSampler(sampler, group_ids, cfg.solver.images_per_gpu)


def build_train_loader(cfg: Config, dataset: Dataset, rank: int = 0, world_size: int = 1,
                       num_workers: Optional[int] = None) -> DetectionDataLoader:
    """Training loader: ``len(loader)`` batches of ``solver.images_per_gpu`` images per
    epoch (same on every rank). Call ``loader.batch_sampler.set_epoch(e)`` each epoch and
    ``loader.batch_sampler.set_start(n)`` to resume after ``n`` batches of an epoch.

    ``num_workers`` overrides ``data.num_workers``.
    """
    num_workers = cfg.data.num_workers if num_workers is None else num_workers
    batch_sampler = build_train_sampler(cfg, dataset, rank, world_size)
    generator = torch.Generator().manual_seed(cfg.train.seed + rank)
    return DetectionDataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate_detection,
        pin_memory=_pin_memory(cfg),
        worker_init_fn=partial(worker_init_fn, rank=rank),
        generator=generator,
        **_worker_kwargs(cfg, num_workers),
    )


def build_test_loader(cfg: Config, dataset: Dataset, rank: int = 0, world_size: int = 1,
                      num_workers: Optional[int] = None) -> DetectionDataLoader:
    """Evaluation loader: this rank's contiguous shard in order, ``eval.images_per_gpu``
    images per batch, the last batch possibly smaller."""
    num_workers = cfg.data.num_workers if num_workers is None else num_workers
    sampler = InferenceSampler(len(dataset), rank, world_size)
    batch_sampler = torch.utils.data.BatchSampler(sampler, cfg.eval.images_per_gpu, drop_last=False)
    kwargs = _worker_kwargs(cfg, num_workers, logging.DEBUG)  # the training loader said it already
    kwargs.pop("persistent_workers", None)  # evaluation runs now and then; free the workers
    return DetectionDataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate_detection,
        pin_memory=_pin_memory(cfg),
        worker_init_fn=partial(worker_init_fn, rank=rank),
        **kwargs,
    )
