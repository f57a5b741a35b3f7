"""Training checkpoints: the file format, the writing policy and loading (resuming from
one: ``detector.engine.resume``).

- **format**: ``TrainingState`` assembles what a checkpoint holds (model, optimizer,
  scheduler, AMP scaler, iteration, epoch and the batches done in it, every rank's RNG
  states, the best metric, the config) as tensors and plain data, so a file loads with
  ``torch.load(weights_only=True)``.
- **save**: ``Checkpointer.save(names, iteration)``, the one path by which the engine
  writes: finite states only (a NaN or an Inf in the model or optimizer tensors: nothing
  written, logged why); atomic (temporary file, fsync, rename; a full disk raises
  ``CheckpointWriteError``, one line naming ``train.output_dir``); old ``iter_*.pth``
  pruned; ``newest`` remembered. Under DDP every rank calls it, rank 0 writes, every
  rank returns rank 0's outcome.
- **load**: ``load_checkpoint`` reads through the one safe reader
  (``detector.modeling.weights.read_weights_file``); ``find_resume_checkpoint`` picks the
  file ``--resume`` continues.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from detector.config import Config, config_to_dict
from detector.distributed import all_gather_object
from detector.files import atomic_write, missing_file_state, no_file_message, write_reason
from detector.engine.optim import WarmupLRScheduler
from detector.engine.resume_checks import (
    CheckpointError,
)
from detector.messages import DetectorError
from detector.modeling.weights import WeightsError, nonfinite_names, read_weights_file

logger = logging.getLogger(__name__)


class CheckpointWriteError(DetectorError, RuntimeError):
    """A checkpoint could not be written (disk full, no permission): one line."""


# --------------------------------------------------------------------------- format


def get_rng_state() -> Dict[str, Any]:
    """RNG states of python, numpy, torch (CPU) and CUDA as plain data and tensors."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: Dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what ``get_rng_state`` returned."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            logger.warning("checkpoint has CUDA RNG states for %d devices, this machine has %d; not restored",
                           len(cuda_states), torch.cuda.device_count())


@dataclass
class TrainingState:
    """Callable: the checkpoint dict of the run as it stands (tensors and plain data).
    Every rank calls it (the RNG states are gathered).

    Attributes:
        model: the model without the DDP wrapper.
        optimizer, scheduler, scaler: the training step's.
        loop: the loop's ``LoopState`` (iteration, epoch, epoch_position are read).
        cfg: the resolved config, stored as plain data.
        world_size: processes of the run.
        best: an object whose ``best_value`` is the best ``train.best_metric`` so far
            (the evaluation hook, set once it is built); None: no best value.
        extras: more entries, each the value its callable returns at save time
            (``early_stop``: the patience count, ``ema``: the weights' moving average).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: WarmupLRScheduler
    scaler: torch.amp.GradScaler
    loop: Any
    cfg: Config
    world_size: int = 1
    best: Optional[Any] = None
    extras: Dict[str, Callable[[], Any]] = field(default_factory=dict)

    def __call__(self) -> Dict[str, Any]:
        rng = get_rng_state()
        per_rank = all_gather_object(rng) if self.world_size > 1 else [rng]
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "optimizer_type": type(self.optimizer).__name__,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "iteration": self.loop.iteration,
            "epoch": self.loop.epoch,
            "epoch_position": self.loop.epoch_position,
            "best_value": self.best.best_value if self.best is not None else None,
            "best_metric": self.cfg.train.best_metric,
            **{k: fn() for k, fn in self.extras.items()},
            "rng": {"per_rank": per_rank},
            "config": config_to_dict(self.cfg),
            "world_size": self.world_size,
        }


CHECKPOINT_DIR_NAME = "checkpoints"


def checkpoint_dir(output_dir: "str | os.PathLike") -> Path:
    return Path(output_dir) / CHECKPOINT_DIR_NAME


def numbered_checkpoint_name(iteration: int) -> str:
    """``iter_0001000.pth``."""
    return f"iter_{iteration:07d}.pth"


def find_resume_checkpoint(output_dir: "str | os.PathLike") -> Optional[Path]:
    """``<output_dir>/checkpoints/last.pth`` if present, else the highest numbered one."""
    d = checkpoint_dir(output_dir)
    last = d / "last.pth"
    if last.is_file():
        return last
    numbered = sorted(p for p in d.glob("iter_*.pth") if p.is_file())
    if last.is_symlink() or last.exists():  # there, but no file: say so before using another
        logger.warning("%s %s; %s", last, missing_file_state(last),
                       f"resuming from {numbered[-1].name}" if numbered else "no numbered checkpoint either")
    return numbered[-1] if numbered else None


# --------------------------------------------------------------------------- save


def save_checkpoint(path: "str | os.PathLike", state: Dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` through the one atomic writer
    (``detector.files.atomic_write``: a temporary file in the same folder, flushed and
    fsynced, then ``os.replace``). A writer killed midway leaves the previous file intact
    (and at most a stray ``.tmp`` file).

    Raises:
        OutputError: the write failed (the temporary file removed; its ``__cause__`` is
            the file system's or torch's own error).
    """
    return atomic_write(path, lambda f: torch.save(state, f))


def link_or_copy_checkpoint(src: "str | os.PathLike", dst: "str | os.PathLike") -> Path:
    """Make ``dst`` hold the same checkpoint as ``src``, atomically: a hard link (no
    second write) where the file system allows it, else a copy; then ``os.replace``."""
    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        if tmp.exists():
            tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst


def prune_checkpoints(directory: "str | os.PathLike", keep_last: int) -> List[Path]:
    """Delete all but the ``keep_last`` newest ``iter_*.pth`` files (``keep_last <= 0``
    keeps all); ``last.pth`` and ``best.pth`` are never touched. Returns the deleted paths."""
    if keep_last <= 0:
        return []
    files = sorted(p for p in Path(directory).glob("iter_*.pth") if re.fullmatch(r"iter_\d+\.pth", p.name))
    doomed = files[:-keep_last]
    for p in doomed:
        p.unlink(missing_ok=True)
    return doomed


def nonfinite_tensors(state: Dict[str, Any]) -> List[str]:
    """Names of the floating-point tensors of ``state["model"]`` and of the optimizer
    state (``state["optimizer"]["state"]``) that hold a NaN or an Inf."""
    named: List[tuple] = list((state.get("model") or {}).items())
    for pid, per_param in ((state.get("optimizer") or {}).get("state") or {}).items():
        named.extend((f"optimizer.state.{pid}.{k}", v) for k, v in per_param.items())
    return nonfinite_names(named)


# Free space below which a failed write is put down to a full disk (torch's zip writer
# says "unexpected pos ..." where the file system said ENOSPC).
LOW_SPACE_BYTES = 64 * 2**20


def _write_failure_reason(exc: BaseException, folder: Path) -> str:
    """Why a checkpoint write failed, in words: ``detector.files.write_reason``'s, except
    that torch's zip writer's error (not an ``OSError``) on a (nearly) full file system
    says "no space left on the device"."""
    if not isinstance(exc, OSError):
        try:
            free: Optional[int] = shutil.disk_usage(folder).free
        except OSError:
            free = None
        if free is not None and free < LOW_SPACE_BYTES:
            return f"no space left on the device ({free / 2**20:.1f} MiB free)"
    return write_reason(exc)


class Checkpointer:
    """Saves ``state_fn()`` under ``<output_dir>/checkpoints``.

    Args:
        output_dir: the run folder (``train.output_dir``).
        state_fn: returns the full training state (``TrainingState``); called on every rank.
        is_main: this process writes the files.
        keep_last: how many ``iter_*.pth`` files to keep (``<= 0``: all).
        world_size: > 1: rank 0's outcome is shared with every rank.
    """

    def __init__(
        self,
        output_dir: "str | os.PathLike",
        state_fn: Callable[[], Dict[str, Any]],
        is_main: bool = True,
        keep_last: int = 0,
        world_size: int = 1,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.directory = checkpoint_dir(self.output_dir)
        self.state_fn = state_fn
        self.is_main = is_main
        self.keep_last = keep_last
        self.world_size = world_size
        self.newest: Optional[Path] = None  # the newest file written (or resumed from) ...
        self.newest_iteration: Optional[int] = None  # ... and the iteration it holds
        self.saved: Dict[str, int] = {}  # name -> iteration of the state it holds

    def save(self, names: Iterable[str], iteration: int) -> Optional[Path]:
        """Write the current state under each of ``names`` (the first is written, the
        others are hard links or copies of it). Returns the path written (``last.pth``
        where among ``names``), or None when the state is not finite (nothing written).

        Raises:
            CheckpointWriteError: the file system refused the write (on every rank).
        """
        names = list(names)
        state = self.state_fn()
        outcome: Tuple[Optional[str], Optional[str]] = (None, None)  # (path written, error)
        if self.is_main:
            outcome = self._write(names, state, iteration)
        if self.world_size > 1:
            outcome = all_gather_object(outcome)[0]
        written, error = outcome
        if error is not None:
            raise CheckpointWriteError(error)
        if written is None:
            return None
        path = Path(written)
        for name in names:
            self.saved[name] = iteration
        self.newest, self.newest_iteration = path, iteration
        return path

    def register_existing(self, resumed_from: Path, iteration: int) -> None:
        """After a resume: the file resumed from (holding ``iteration``) and the folder's
        ``iter_N.pth`` files count as written by this run."""
        for p in self.directory.glob("iter_*.pth"):
            digits = p.stem[len("iter_"):]
            if digits.isdigit():
                self.saved[p.name] = int(digits)
        if resumed_from.parent == self.directory:
            self.saved[resumed_from.name] = iteration
        self.newest, self.newest_iteration = resumed_from, iteration

    def newest_at_most(self, iteration: int) -> Optional[Tuple[Path, int]]:
        """The newest file this run wrote (or found) holding a state at ``iteration`` or
        before, and its iteration; None if there is none on disk. ``last.pth`` is
        preferred among files of the same iteration."""
        known = [(it, name) for name, it in self.saved.items()
                 if it <= iteration and name != "best.pth" and (self.directory / name).is_file()]
        if not known:
            return None
        it, name = max(known, key=lambda k: (k[0], k[1] == "last.pth"))
        return self.directory / name, it

    def _write(self, names: List[str], state: Dict[str, Any], iteration: int) -> Tuple[Optional[str], Optional[str]]:
        bad = nonfinite_tensors(state)
        if bad:
            logger.error(
                "checkpoint %s at iteration %d NOT written: %d tensors are not finite (e.g. %s); "
                "the newest finite checkpoint is %s",
                ", ".join(names), iteration, len(bad), ", ".join(bad[:3]), self.newest or "none",
            )
            return None, None
        try:
            first = save_checkpoint(self.directory / names[0], state)
            for name in names[1:]:  # the same bytes under another name: a hard link if possible
                link_or_copy_checkpoint(first, self.directory / name)
        except (OSError, RuntimeError) as exc:  # torch's zip writer reports a failed write as RuntimeError
            exc = exc.__cause__ or exc  # atomic_write's OutputError: the file system's own error
            reason = _write_failure_reason(exc, self.directory)
            return None, (
                f"cannot write checkpoint {self.directory / names[0]} ({reason}); free space in "
                f"or fix the permissions of train.output_dir={self.output_dir} and resume with --resume"
            )
        if any(n.startswith("iter_") for n in names):
            for p in prune_checkpoints(self.directory, self.keep_last):
                logger.debug("removed old checkpoint %s", p)
                self.saved.pop(p.name, None)
        logger.info("saved checkpoint %s at iteration %d", ", ".join(names), iteration)
        # last.pth, where written, outlives the numbered files (pruned) and best.pth (replaced).
        return str(self.directory / ("last.pth" if "last.pth" in names else names[0])), None


# --------------------------------------------------------------------------- load, validate, resume


def load_checkpoint(path: "str | os.PathLike") -> Dict[str, Any]:
    """Load a training checkpoint (tensors on the CPU) through ``read_weights_file``.

    Raises:
        CheckpointError: one line naming the file: missing, empty, truncated, corrupt,
            a pickle of other Python objects, or not a dict.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(no_file_message("checkpoint", path))
    try:
        return read_weights_file(path)
    except WeightsError as exc:
        raise CheckpointError(f"cannot load checkpoint {exc}") from None
