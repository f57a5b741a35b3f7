"""The run folder (``train.output_dir``): one run at a time, and no mixing of runs.

``RunFolder.open(output_dir, resume, overwrite)``, on rank 0:

- takes an exclusive ``fcntl.flock`` on ``<output_dir>/.lock`` for the whole run; a
  second run into a busy folder fails with one line naming the folder ("busy");
- refuses a fresh start (no ``resume``) into a folder that already holds checkpoints,
  naming what it holds and the choices: ``--resume``, another ``--output-dir``, or
  ``--overwrite``, which deletes the old checkpoints, metrics, TensorBoard events,
  evaluations and log (``clear_previous_run``, called once the new run is built: a run
  that fails its checks deletes nothing but the old ``log.txt``, which then holds the
  refused attempt's log);
- refuses a folder that no run of this project used (no ``.lock``) but holds a name a
  run writes (``eval/``, ``config.yaml``...: ``RUN_FILES``; a ``log.txt`` is appended
  to): they are the user's, and a run would replace them;
- refuses ``--resume <checkpoint>`` of another folder into a folder that holds
  checkpoints of its own (the resumed run would replace them);
- with ``resume=True`` picks ``checkpoints/last.pth`` (or the newest ``iter_*.pth``),
  or, when there is none, says so and starts fresh: one command line serves the first
  start and every automatic restart;
- on every fresh start removes the previous run's ``metrics.jsonl``, ``tb/``, ``eval/``
  and ``log.txt``, so old records never mix with new ones;
- removes stale ``*.tmp`` files left by saves that were killed midway.

``check_output_dir(path)`` is the check before any of that (and before the process
group starts): the path can become a folder we may write into.

Every rank calls ``open``; rank 0 decides and the other ranks get its decision (the
error, or the checkpoint to resume from). The lock is released by ``close`` or when
the process ends, however it ends.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import IO, Any, List, Optional, Sequence, Tuple

from detector.config import Config, ConfigError
from detector.engine import checkpointing as ckpt
from detector.distributed import all_gather_object
from detector.files import missing_file_state
from detector.messages import DetectorError

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
LOG_NAME = "log.txt"
# The previous run's records, cleared with its checkpoints (the log: at once, see _resume_point).
_RUN_RECORDS = ("metrics.jsonl", "tb", "eval")
_RUN_OUTPUTS = (*_RUN_RECORDS, LOG_NAME)
# Every name a run writes at the top of its folder (besides LOCK_NAME).
RUN_FILES = (*_RUN_OUTPUTS, ckpt.CHECKPOINT_DIR_NAME, "config.yaml", "summary.json")


class RunFolderError(DetectorError, RuntimeError):
    """The run folder cannot be used as asked: one line."""


def _checkpoint_files(output_dir: Path) -> List[Path]:
    return sorted(ckpt.checkpoint_dir(output_dir).glob("*.pth"))


def _shown(files: Sequence[Path]) -> str:
    return ", ".join(p.name for p in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove_stale_temp_files(output_dir: "str | os.PathLike") -> List[Path]:
    """Delete ``*.tmp`` files in the run folder and its ``checkpoints/``; returns them.
    Only safe while holding the folder's lock (no live writer)."""
    out = Path(output_dir)
    stale = [p for d in (out, ckpt.checkpoint_dir(out)) if d.is_dir() for p in d.glob("*.tmp") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def _drop_inherited_lock(lock_file: IO[str]) -> None:
    """In a forked child: close the inherited copy of the run folder's lock descriptor
    (the parent's copy keeps the lock). Nothing to do once the parent has closed it."""
    if not lock_file.closed:
        try:
            lock_file.close()
        except OSError:
            pass


class RunFolder:
    """A run folder held by this process (rank 0), or a plain handle (other ranks).

    Attributes:
        path: the folder.
        resume_from: the checkpoint to resume from, or None for a fresh start.
    """

    def __init__(self, path: Path, resume_from: Optional[Path], lock_file: Optional[IO[str]] = None,
                 to_clear: Sequence[Path] = ()) -> None:
        self.path = path
        self.resume_from = resume_from
        self._lock_file = lock_file
        self._to_clear = list(to_clear)

    @classmethod
    def open(
        cls,
        output_dir: "str | os.PathLike",
        resume: "bool | str | os.PathLike | None" = None,
        overwrite: bool = False,
        is_main: bool = True,
        world_size: int = 1,
    ) -> "RunFolder":
        """Lock and prepare ``output_dir`` (see the module docstring).

        Args:
            resume: None/False: a fresh start; True: continue the folder's newest
                checkpoint, if any; a path: continue from that checkpoint file.
            overwrite: a fresh start may delete the checkpoints the folder holds.

        Raises:
            RunFolderError: busy, used, unwritable, or no such checkpoint (every rank).
        """
        path = Path(output_dir)
        folder: Optional[RunFolder] = None
        decision: Tuple[Optional[str], Optional[str]] = (None, None)  # (resume path, error)
        if is_main:
            try:
                folder = cls._open_main(path, resume, overwrite)
                decision = (str(folder.resume_from) if folder.resume_from else None, None)
            except RunFolderError as exc:
                decision = (None, str(exc))
        if world_size > 1:
            decision = all_gather_object(decision)[0]
        resume_from, error = decision
        if error is not None:
            raise RunFolderError(error)
        if folder is None:
            folder = cls(path, Path(resume_from) if resume_from else None)
        return folder

    @classmethod
    def _open_main(cls, path: Path, resume: Any, overwrite: bool) -> "RunFolder":
        if resume not in (None, False) and overwrite:
            raise RunFolderError("--resume and --overwrite exclude each other: continue the run, or delete it and start over")
        used = (path / LOCK_NAME).exists()  # a run of this project had the folder
        try:
            path.mkdir(parents=True, exist_ok=True)
            lock_file = open(path / LOCK_NAME, "a+")
        except OSError as exc:
            raise RunFolderError(f"cannot use train.output_dir={path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock_file.seek(0)
            holder = lock_file.read().strip() or "another process"
            lock_file.close()
            raise RunFolderError(
                f"run folder {path} is busy: {holder} is training into it; wait for it to end or use another --output-dir"
            ) from None
        # Forked children (DataLoader workers) inherit the descriptor, and a flock lives
        # as long as any copy of it: orphaned workers of a killed run would keep the
        # folder "busy". Each child closes its copy at once; the lock dies with this process.
        os.register_at_fork(after_in_child=functools.partial(_drop_inherited_lock, lock_file))
        try:
            lock_file.seek(0)
            lock_file.truncate()
            lock_file.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
            lock_file.flush()
            resume_from, to_clear = cls._resume_point(path, resume, overwrite, used)
            folder = cls(path, resume_from, lock_file, to_clear)
        except BaseException:
            lock_file.close()
            if not used:
                (path / LOCK_NAME).unlink(missing_ok=True)  # refused: the folder stays as it was
            raise
        stale = remove_stale_temp_files(path)
        if stale:
            logger.info("removed %d stale temporary files from saves that were killed midway", len(stale))
        return folder

    @staticmethod
    def _resume_point(path: Path, resume: Any, overwrite: bool, used: bool) -> Tuple[Optional[Path], List[Path]]:
        """The checkpoint to continue from (None: fresh), and for a fresh start the old
        run's files to delete (``clear_previous_run``). ``used``: the folder had a lock
        file (a run of this project used it)."""
        held = _checkpoint_files(path)
        if resume not in (None, False, True, ""):
            explicit = Path(resume)
            if not explicit.is_file():
                state = missing_file_state(explicit)
                if state == "not found":
                    raise RunFolderError(f"--resume: checkpoint not found: {explicit}")
                last = explicit / "checkpoints" / "last.pth"
                hint = f" (a run folder: --resume {last})" if last.is_file() else ""
                raise RunFolderError(f"--resume: checkpoint {explicit} {state}; --resume takes a checkpoint file{hint}")
            if held and explicit.resolve().parent != ckpt.checkpoint_dir(path).resolve():
                raise RunFolderError(
                    f"--resume {explicit}: run folder {path} holds checkpoints of its own ({_shown(held)}), which "
                    f"the resumed run would replace: resume into another --output-dir (or --resume "
                    f"{ckpt.checkpoint_dir(path) / 'last.pth'} to continue the folder's own run)")
            return explicit, []
        if resume in (True, ""):
            found = ckpt.find_resume_checkpoint(path)
            if found is not None:
                return found, []
            logger.info("--resume: no checkpoint to continue in %s; starting a fresh run", ckpt.checkpoint_dir(path))
            held = []  # (at most a best.pth: the new run replaces it at its first evaluation)
        if held and not overwrite:
            raise RunFolderError(
                f"run folder {path} already holds checkpoints ({_shown(held)}): continue it with --resume, "
                "choose another --output-dir, or pass --overwrite to delete them and start over"
            )
        if not used:  # no previous run to clear; a log.txt is appended to (setup_logging may have opened it)
            foreign = [name for name in RUN_FILES if name != LOG_NAME and (path / name).exists()]
            if foreign:
                raise RunFolderError(
                    f"train.output_dir {path} holds {', '.join(foreign)}, but no run of this project used it (it has "
                    f"no {LOCK_NAME}): a run would replace them; choose another --output-dir (a new or empty folder)")
            return None, []
        # The previous run's records must not mix with this one's. The log goes now: this
        # attempt's log starts here (a refused one leaves its reason in log.txt).
        _remove(path / LOG_NAME)
        return None, ([ckpt.checkpoint_dir(path)] if held else []) + [path / n for n in _RUN_RECORDS]

    def clear_previous_run(self) -> None:
        """Delete the previous run's checkpoints (``--overwrite``) and records, for a fresh
        start (rank 0; nothing on a resume). Called once the new run is built, so a run
        refused by its checks (a typo in a class name) deletes nothing."""
        held = [p for p in self._to_clear if p.name == ckpt.CHECKPOINT_DIR_NAME and p.is_dir()]
        if held:
            logger.warning("--overwrite: deleting %d checkpoints of the previous run in %s",
                           len(_checkpoint_files(self.path)), self.path)
        for path in self._to_clear:
            _remove(path)
        self._to_clear = []

    def close(self) -> None:
        """Release the lock (rank 0)."""
        if self._lock_file is not None:
            self._lock_file.close()  # closing the descriptor drops the flock
            self._lock_file = None

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_output_dir(path: "str | os.PathLike", key: str = "train.output_dir") -> None:
    """Check that ``path`` can be the run folder: it, and the nearest of its parents that
    exists, must be folders we may write into. Nothing is created.

    Raises:
        ConfigError: one line naming ``key`` and the path that is in the way.
    """
    if not str(path).strip():
        raise ConfigError(f"config key '{key}' is empty: name the run folder (it would be the working directory "
                          f"{os.getcwd()})")
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.is_symlink():
            raise ConfigError(f"config key '{key}': {probe} is a broken symbolic link")
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        what = "is a file" if probe == path else f"cannot be created: {probe} is a file"
        raise ConfigError(f"config key '{key}': {path} {what}, not a folder")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"config key '{key}': {probe} is not writable")


def check_run_folder_apart_from_data(cfg: Config) -> None:
    """The run folder and the data folders must not contain one another: a data set
    regenerated (or cleaned) would take the run with it, and a run folder cleared by
    ``--overwrite`` would take the data.

    Raises:
        ConfigError: one line naming both keys and paths.
    """
    out_key = "train.output_dir"
    out = Path(cfg.train.output_dir).resolve()
    for split in ("train", "val"):
        root = getattr(cfg.data, split).root
        if not root:
            continue
        data = Path(root).resolve()
        if out == data or data in out.parents:
            raise ConfigError(f"config key '{out_key}' ({cfg.train.output_dir}) is inside data.{split}.root ({root}): "
                              "a run folder must not live in a data folder; choose another train.output_dir")
        if out in data.parents:
            raise ConfigError(f"config key 'data.{split}.root' ({root}) is inside {out_key} ({cfg.train.output_dir}): "
                              "a data folder must not live in a run folder; move the data or the run")


def check_overwrite_keeps_weights(cfg: Config, overwrite: bool) -> None:
    """``--overwrite`` deletes the folder's checkpoints and records (``_RUN_OUTPUTS``)
    before the model is built: ``model.weights`` (``--weights``) must not be among them,
    or the run would delete the file it starts from.

    Raises:
        RunFolderError: one line naming the file and what to do.
    """
    if not overwrite or not cfg.model.weights or not os.path.exists(cfg.model.weights):
        return
    out = Path(cfg.train.output_dir).resolve()
    weights = Path(cfg.model.weights).resolve()
    for deleted in (ckpt.checkpoint_dir(out), *(out / name for name in _RUN_OUTPUTS)):
        if weights == deleted or deleted in weights.parents:
            raise RunFolderError(
                f"--overwrite would delete {cfg.model.weights}, the weights this run starts from (model.weights), "
                f"with the old run's files in {cfg.train.output_dir}: copy it out of the folder first, or train "
                "into another --output-dir")
