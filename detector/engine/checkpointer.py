"""Writing training checkpoints under the run's policy.

``Checkpointer.save(names, iteration)`` is the one path by which the engine writes a
checkpoint. It

- writes only finite states: a state whose model or optimizer tensors hold a NaN or an
  Inf is refused (``save`` returns None and logs why), so every file it leaves can be
  resumed from;
- writes atomically (temporary file, fsync, rename): a failure leaves the previous
  file intact, and a full disk or an unwritable folder raises ``CheckpointWriteError``,
  one line naming ``train.output_dir``;
- remembers the newest file it wrote (``newest``), which the non-finite guard names.

Under DDP every rank calls ``save`` (the state function may gather across ranks);
rank 0 checks and writes, and every rank returns rank 0's outcome.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from detector.engine import checkpoint as ckpt
from detector.distributed import all_gather_object
from detector.messages import first_line

logger = logging.getLogger(__name__)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, no permission): one line."""


def nonfinite_tensors(state: Dict[str, Any]) -> List[str]:
    """Names of the floating-point tensors of ``state["model"]`` and of the optimizer
    state (``state["optimizer"]["state"]``) that hold a NaN or an Inf."""
    named: List[tuple] = list((state.get("model") or {}).items())
    for pid, per_param in ((state.get("optimizer") or {}).get("state") or {}).items():
        named.extend((f"optimizer.state.{pid}.{k}", v) for k, v in per_param.items())
    floats = [(n, t) for n, t in named if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        return []
    # One read-back for all tensors.
    ok = torch.stack([torch.isfinite(t).all() for _, t in floats]).tolist()
    return [n for (n, _), good in zip(floats, ok) if not good]


class Checkpointer:
    """Saves ``state_fn()`` under ``<output_dir>/checkpoints``.

    Args:
        output_dir: the run folder (``train.output_dir``).
        state_fn: returns the full training state (tensors and plain data); called on
            every rank.
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
        self.directory = ckpt.checkpoint_dir(self.output_dir)
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
            first = ckpt.save_checkpoint(self.directory / names[0], state)
            for name in names[1:]:  # the same bytes under another name: a hard link if possible
                ckpt.link_or_copy_checkpoint(first, self.directory / name)
        except (OSError, RuntimeError) as exc:  # torch's zip writer reports a failed write as RuntimeError
            text = first_line(exc)
            reason = getattr(exc, "strerror", None) or text
            return None, (
                f"cannot write checkpoint {self.directory / names[0]} ({reason}); free space in "
                f"or fix the permissions of train.output_dir={self.output_dir} and resume with --resume"
            )
        if any(n.startswith("iter_") for n in names):
            for p in ckpt.prune_checkpoints(self.directory, self.keep_last):
                logger.debug("removed old checkpoint %s", p)
                self.saved.pop(p.name, None)
        logger.info("saved checkpoint %s at iteration %d", ", ".join(names), iteration)
        # last.pth, where written, outlives the numbered files (pruned) and best.pth (replaced).
        return str(self.directory / ("last.pth" if "last.pth" in names else names[0])), None
