"""Loading model weights (and, below, training checkpoints).

``load_weights(model, source)`` loads a state dict from a file or a dict into a model,
tolerating the usual differences between checkpoints and models:

- a ``module.`` (DDP) or ``_orig_mod.`` (torch.compile) prefix is stripped;
- ``num_batches_tracked`` buffers may be missing or extra;
- torchvision's pre-v2 key names are renamed (``rpn.head.conv.weight`` ->
  ``rpn.head.conv.0.0.weight``, ``backbone.fpn.inner_blocks.i.weight`` ->
  ``backbone.fpn.inner_blocks.i.0.weight``, likewise ``layer_blocks``);
- a predictor with a different number of classes is not loaded: the model keeps its
  freshly initialised ``roi_heads.box_predictor`` (fine-tuning on another data set);
- ``pixel_mean`` / ``pixel_std`` absent from the source (torchvision) keep the config's.

Any other shape mismatch is an error naming the key.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Union

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

PREDICTOR_PREFIX = "roi_heads.box_predictor."
_OPTIONAL_KEYS = ("pixel_mean", "pixel_std")
_PRE_V2_RENAMES = [
    (re.compile(r"^rpn\.head\.conv\.(weight|bias)$"), r"rpn.head.conv.0.0.\1"),
    (re.compile(r"^backbone\.fpn\.(inner_blocks|layer_blocks)\.(\d+)\.(weight|bias)$"), r"backbone.fpn.\1.\2.0.\3"),
]


@dataclass
class LoadReport:
    """What ``load_weights`` did.

    Attributes:
        loaded: model keys loaded from the source.
        missing: model keys the source lacks (left as they were), ``num_batches_tracked``
            and ``pixel_mean``/``pixel_std`` excluded.
        unexpected: source keys the model lacks (ignored), ``num_batches_tracked`` excluded.
        renamed: source key -> model key for pre-v2 torchvision names.
        skipped: model keys deliberately not loaded (predictor with another class count).
        notes: human-readable remarks.
    """

    loaded: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    renamed: Dict[str, str] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: counts, then the notes."""
        text = (f"{len(self.loaded)} loaded, {len(self.missing)} missing, {len(self.unexpected)} unexpected, "
                f"{len(self.renamed)} renamed, {len(self.skipped)} skipped")
        if self.missing:
            text += f"; missing e.g. {self.missing[:3]}"
        if self.unexpected:
            text += f"; unexpected e.g. {self.unexpected[:3]}"
        return "; ".join([text, *self.notes])


def _read_state_dict(source: Union[str, os.PathLike, Mapping[str, Tensor]]) -> Dict[str, Tensor]:
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"weights file not found: {source}")
        data = torch.load(source, map_location="cpu", weights_only=True)
        where = str(source)
    else:
        data, where = source, "state dict"
    if isinstance(data, Mapping):
        for key in ("model", "state_dict"):  # a training checkpoint
            if key in data and isinstance(data[key], Mapping):
                data = data[key]
                break
    if not isinstance(data, Mapping) or not all(isinstance(v, Tensor) for v in data.values()):
        raise ValueError(f"{where}: not a state dict (a mapping of names to tensors)")
    return dict(data)


def load_weights(model: nn.Module, source: Union[str, os.PathLike, Mapping[str, Tensor]]) -> LoadReport:
    """Load weights from a file (``torch.load(weights_only=True)``; a training checkpoint's
    ``model`` entry is used) or a state dict into ``model``; see the module docstring.

    Returns:
        a ``LoadReport``; its summary is also logged.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a state dict, or a shape mismatch outside the predictor.
    """
    state = _read_state_dict(source)
    target = model.state_dict()
    report = LoadReport()

    # Normalise the source names.
    renamed: Dict[str, Tensor] = {}
    for key, value in state.items():
        name = key
        for prefix in ("module.", "_orig_mod."):
            while name.startswith(prefix):
                name = name[len(prefix):]
        if name not in target:
            for pattern, replacement in _PRE_V2_RENAMES:
                new = pattern.sub(replacement, name)
                if new != name and new in target:
                    report.renamed[key] = new
                    name = new
                    break
        renamed[name] = value

    # The predictor: load it only when every shape agrees.
    pred_keys = [k for k in target if k.startswith(PREDICTOR_PREFIX)]
    pred_mismatch = any(k in renamed and renamed[k].shape != target[k].shape for k in pred_keys)
    if pred_mismatch:
        src_classes = renamed.get(PREDICTOR_PREFIX + "cls_score.weight")
        src_count = src_classes.shape[0] if src_classes is not None else "?"
        model_count = target[PREDICTOR_PREFIX + "cls_score.weight"].shape[0] \
            if PREDICTOR_PREFIX + "cls_score.weight" in target else "?"
        report.skipped = [k for k in pred_keys if k in renamed]
        report.notes.append(f"the source predictor has {src_count} classes (with background), the model "
                            f"{model_count}: roi_heads.box_predictor keeps its fresh initialisation")

    to_load: Dict[str, Tensor] = {}
    for name, value in renamed.items():
        if name not in target:
            if not name.endswith("num_batches_tracked"):
                report.unexpected.append(name)
            continue
        if name in report.skipped:
            continue
        if value.shape != target[name].shape:
            raise ValueError(f"weights key '{name}': shape {list(value.shape)} in the source, "
                             f"{list(target[name].shape)} in the model")
        to_load[name] = value
    for name in target:
        if name in to_load or name in report.skipped:
            continue
        if name.endswith("num_batches_tracked"):
            continue
        if name in _OPTIONAL_KEYS:
            report.notes.append(f"'{name}' not in the source: kept from the config")
            continue
        report.missing.append(name)

    model.load_state_dict(to_load, strict=False)
    report.loaded = sorted(to_load)
    logger.info("weights loaded: %s", report.summary())
    return report


# --------------------------------------------------------------------------- training checkpoints
# Save/resume of full training state (engine). Everything stored is plain data or
# tensors, so a checkpoint loads with ``torch.load(weights_only=True)``.

import os as _os
import random as _random
import re as _re
from pathlib import Path as _Path
from typing import Any as _Any, Dict as _Dict, List as _List, Optional as _Optional

import numpy as _np


class CheckpointError(RuntimeError):
    """A training checkpoint that cannot be read or does not fit."""


def get_rng_state() -> _Dict[str, _Any]:
    """RNG states of python, numpy, torch (CPU) and CUDA as plain data and tensors."""
    name, keys, pos, has_gauss, cached = _np.random.get_state()
    state: _Dict[str, _Any] = {
        "python": _random.getstate(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(_np.asarray(keys, dtype=_np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: _Dict[str, _Any]) -> None:
    """Restore what ``get_rng_state`` returned."""
    py = state["python"]
    _random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    _np.random.set_state(
        (n["name"], n["keys"].numpy().astype(_np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            logger.warning("checkpoint has CUDA RNG states for %d devices, this machine has %d; not restored",
                           len(cuda_states), torch.cuda.device_count())


def save_checkpoint(path: "str | os.PathLike", state: _Dict[str, _Any]) -> _Path:
    """Write ``state`` to ``path`` atomically: a temporary file in the same folder,
    flushed to disk, then ``os.replace``. A writer killed midway leaves the previous
    file intact (and at most a stray ``.tmp`` file)."""
    path = _Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{_os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            _os.fsync(f.fileno())
        _os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def link_or_copy_checkpoint(src: "str | os.PathLike", dst: "str | os.PathLike") -> _Path:
    """Make ``dst`` hold the same checkpoint as ``src``, atomically: a hard link (no
    second write) where the file system allows it, else a copy; then ``os.replace``."""
    import shutil as _shutil

    src, dst = _Path(src), _Path(dst)
    tmp = dst.with_name(f".{dst.name}.{_os.getpid()}.tmp")
    try:
        if tmp.exists():
            tmp.unlink()
        try:
            _os.link(src, tmp)
        except OSError:
            _shutil.copyfile(src, tmp)
        _os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst


def load_checkpoint(path: "str | os.PathLike", map_location: "str | torch.device" = "cpu") -> _Dict[str, _Any]:
    """Load a training checkpoint with ``torch.load(weights_only=True)``."""
    path = _Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling problem becomes one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot load checkpoint {path}: {first}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, expected a dict")
    return state


def checkpoint_dir(output_dir: "str | os.PathLike") -> _Path:
    return _Path(output_dir) / "checkpoints"


def numbered_checkpoint_name(iteration: int) -> str:
    """``iter_0001000.pth``."""
    return f"iter_{iteration:07d}.pth"


def find_resume_checkpoint(output_dir: "str | os.PathLike") -> _Optional[_Path]:
    """``<output_dir>/checkpoints/last.pth`` if present, else the highest numbered one."""
    d = checkpoint_dir(output_dir)
    last = d / "last.pth"
    if last.is_file():
        return last
    numbered = sorted(d.glob("iter_*.pth"))
    return numbered[-1] if numbered else None


def prune_checkpoints(directory: "str | os.PathLike", keep_last: int) -> _List[_Path]:
    """Delete all but the ``keep_last`` newest ``iter_*.pth`` files (``keep_last <= 0``
    keeps all); ``last.pth`` and ``best.pth`` are never touched. Returns the deleted paths."""
    if keep_last <= 0:
        return []
    files = sorted(p for p in _Path(directory).glob("iter_*.pth") if _re.fullmatch(r"iter_\d+\.pth", p.name))
    doomed = files[:-keep_last]
    for p in doomed:
        p.unlink(missing_ok=True)
    return doomed


# --------------------------------------------------------------------------- initial weights


class WeightsError(RuntimeError):
    """Initial weights (``model.weights`` / ``--weights``) that cannot be loaded."""


def _looks_like_torchvision_weights(source: str) -> bool:
    head, dot, tail = source.partition(".")
    return bool(dot) and head.endswith("_Weights") and tail.isidentifier() and "/" not in source


def load_initial_weights(model: nn.Module, source: str) -> _Any:
    """Load ``model.weights``: a local file (our training checkpoint, whose ``model``
    entry is used, or a plain state dict) or a torchvision weights name such as
    ``FasterRCNN_ResNet50_FPN_Weights.COCO_V1`` (downloaded to ``$TORCH_HOME`` once).

    Tensors whose shape does not fit (another class count) are skipped by
    ``load_weights`` and reported. Returns its ``LoadReport``.

    Raises:
        WeightsError: a missing file, an unknown torchvision name, or a download
            that failed (offline); a one-line message.
    """
    path = _Path(source).expanduser()
    if path.is_file():
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise WeightsError(f"model.weights: cannot read {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        if isinstance(state, dict) and isinstance(state.get("model"), dict):
            state = state["model"]
        what = str(path)
    elif _looks_like_torchvision_weights(source):
        from torchvision.models import get_weight

        try:
            weights = get_weight(source)
        except (ValueError, KeyError, AttributeError):
            raise WeightsError(f"model.weights: unknown torchvision weights name {source!r}") from None
        try:
            state = weights.get_state_dict(progress=False, check_hash=True)
        except Exception as exc:  # noqa: BLE001 - URLError, OSError, RuntimeError (hash)
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise WeightsError(
                f"model.weights: cannot download torchvision weights {source!r} from {weights.url} "
                f"({type(exc).__name__}: {reason}); when offline, put the file in "
                f"{torch.hub.get_dir()}/checkpoints/ or pass a local path"
            ) from None
        what = f"torchvision {source}"
    else:
        raise WeightsError(
            f"model.weights: {source!r} is neither an existing file nor a torchvision weights name "
            "like 'FasterRCNN_ResNet50_FPN_Weights.COCO_V1'"
        )
    try:
        report = load_weights(model, state)
    except ValueError as exc:
        raise WeightsError(f"model.weights: {what}: {exc}") from None
    logger.info(
        "initial weights from %s: %d tensors loaded; skipped (fresh init): %s; missing: %s; unexpected: %s",
        what, len(report.loaded), report.skipped or "none", report.missing or "none", report.unexpected or "none",
    )
    return report
