"""Training checkpoints: atomic save, load, RNG state, names, pruning.

Everything stored is plain data or tensors, so a checkpoint loads with
``torch.load(weights_only=True)``; reading goes through the one safe reader,
``detector.modeling.weights.read_weights_file``. Loading weights into a model lives in
``detector.modeling.weights``.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from detector.modeling.weights import WeightsError, read_weights_file

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A training checkpoint that cannot be read or does not fit."""


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


def save_checkpoint(path: "str | os.PathLike", state: Dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically: a temporary file in the same folder,
    flushed to disk, then ``os.replace``. A writer killed midway leaves the previous
    file intact (and at most a stray ``.tmp`` file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


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


def load_checkpoint(path: "str | os.PathLike") -> Dict[str, Any]:
    """Load a training checkpoint (tensors on the CPU) through ``read_weights_file``.

    Raises:
        CheckpointError: one line naming the file: missing, empty, truncated, corrupt,
            a pickle of other Python objects, or not a dict.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        state = read_weights_file(path)
    except WeightsError as exc:
        raise CheckpointError(f"cannot load checkpoint {exc}") from None
    return state


def checkpoint_dir(output_dir: "str | os.PathLike") -> Path:
    return Path(output_dir) / "checkpoints"


def numbered_checkpoint_name(iteration: int) -> str:
    """``iter_0001000.pth``."""
    return f"iter_{iteration:07d}.pth"


def find_resume_checkpoint(output_dir: "str | os.PathLike") -> Optional[Path]:
    """``<output_dir>/checkpoints/last.pth`` if present, else the highest numbered one."""
    d = checkpoint_dir(output_dir)
    last = d / "last.pth"
    if last.is_file():
        return last
    numbered = sorted(d.glob("iter_*.pth"))
    return numbered[-1] if numbered else None


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
