"""Loading state dicts into a model (files are read by ``weight_files.read_weights_file``,
imported here with ``WeightsError`` and ``state_dict_from`` for the callers of this module).

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

Any other shape mismatch is a ``WeightsError`` naming the first mismatched keys and
their shapes. With ``strict=True`` (evaluation, inference, resume) missing or unexpected
keys and a predictor of another class count are errors too.

``load_initial_weights(model, source)`` resolves ``model.weights``: a local file or a
torchvision weights name such as ``FasterRCNN_ResNet50_FPN_Weights.COCO_V1``.
"""

from __future__ import annotations

import logging
import os
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torchvision.models import get_weight

from detector.messages import first_line
from detector.modeling.trained_config import trained_class_names, trained_settings
from detector.modeling.weight_files import KEYS_SHOWN, WeightsError, read_weights_file, state_dict_from

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
        trained_classes: a training checkpoint's class names, label 1..K (its stored
            config's ``data.class_names`` with contiguous labels; empty otherwise).
        trained_settings: a training checkpoint's decoding settings (its stored config's
            ``trained_config.TRAINED_KEYS``; empty for a state dict).
    """

    loaded: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    renamed: Dict[str, str] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    trained_classes: List[str] = field(default_factory=list)
    trained_settings: Dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        """One line: counts, then the notes."""
        text = (f"{len(self.loaded)} loaded, {len(self.missing)} missing, {len(self.unexpected)} unexpected, "
                f"{len(self.renamed)} renamed, {len(self.skipped)} skipped")
        if self.missing:
            text += f"; missing e.g. {self.missing[:KEYS_SHOWN]}"
        if self.unexpected:
            text += f"; unexpected e.g. {self.unexpected[:KEYS_SHOWN]}"
        return "; ".join([text, *self.notes])


# --------------------------------------------------------------------------- loading into a model


def _normalise_names(state: Mapping[str, Tensor], target: Mapping[str, Tensor],
                     report: LoadReport) -> Dict[str, Tensor]:
    """Strip ``module.`` / ``_orig_mod.`` prefixes and rename pre-v2 torchvision keys."""
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
    return renamed


def _predictor_note(source: Mapping[str, Tensor], target: Mapping[str, Tensor]) -> Optional[str]:
    """A remark when the source predictor's class count differs from the model's, else
    None (another head of the same count: ``_mismatch_error`` names its shapes)."""
    keys = [k for k in target if k.startswith(PREDICTOR_PREFIX)]
    if not any(k in source and source[k].shape != target[k].shape for k in keys):
        return None
    cls = PREDICTOR_PREFIX + "cls_score.weight"
    src_count = source[cls].shape[0] if cls in source else "?"
    model_count = target[cls].shape[0] if cls in target else "?"
    return None if src_count == model_count else (f"the source predictor has {src_count} classes (with background), the model {model_count}")


def _mismatch_error(where: str, shapes: Sequence[Tuple[str, Sequence[int], Sequence[int]]],
                    missing: Sequence[str], unexpected: Sequence[str]) -> WeightsError:
    parts = []
    if shapes:
        shown = "; ".join(f"{k} {list(s)} in the file, {list(m)} in the model" for k, s, m in shapes[:KEYS_SHOWN])
        parts.append(f"{len(shapes)} tensors differ in shape, e.g. {shown}")
    if missing:
        parts.append(f"{len(missing)} model keys missing from the file, e.g. {list(missing[:KEYS_SHOWN])}")
    if unexpected:
        parts.append(f"{len(unexpected)} file keys not in the model, e.g. {list(unexpected[:KEYS_SHOWN])}")
    return WeightsError(f"{where}: does not fit the model (another architecture or config?): " + "; ".join(parts))


def load_weights(model: nn.Module, source: Union[str, os.PathLike, Mapping[str, Any]], *,
                 strict: bool = False, name: Optional[str] = None) -> LoadReport:
    """Load weights from a file (read by ``read_weights_file``; a training checkpoint's
    ``model`` entry is used) or a state dict into ``model``; see the module docstring.

    Args:
        model: the model to load into (in place).
        source: a file path, or a state dict / training checkpoint dict.
        strict: also refuse missing or unexpected keys and a predictor of another class
            count (evaluation, inference and resume need the exact model).
        name: how to name a dict source in messages (default "state dict").

    Returns:
        a ``LoadReport``; its summary is also logged.

    Raises:
        WeightsError: the file cannot be read, is not a state dict, or does not fit the
            model; one line naming the source and the first mismatched keys and shapes.
    """
    if isinstance(source, (str, os.PathLike)):
        where = str(Path(source).expanduser())
        data: Mapping[str, Any] = read_weights_file(source)
    else:
        where, data = name or "state dict", source
    target = model.state_dict()
    report = LoadReport()
    state = _normalise_names(state_dict_from(data, where), target, report)

    note = _predictor_note(state, target)
    if note is not None:
        if strict:
            raise WeightsError(f"{where}: does not fit the model: {note}; set model.num_classes to match")
        report.skipped = [k for k in target if k.startswith(PREDICTOR_PREFIX) and k in state]
        report.notes.append(note + ": roi_heads.box_predictor keeps its fresh initialisation")

    to_load, shapes = _sort_keys(state, target, report)
    if shapes or not to_load or (strict and (report.missing or report.unexpected)):
        raise _mismatch_error(where, shapes, report.missing, report.unexpected)
    _check_values(to_load, where)

    model.load_state_dict(to_load, strict=False)
    report.loaded = sorted(to_load)
    _note_training_run(report, data)
    logger.info("weights loaded from %s: %s", where, report.summary())
    return report


def _note_training_run(report: LoadReport, data: Mapping[str, Any]) -> LoadReport:
    """``report`` with what the stored config of the training checkpoint ``data`` says
    (``trained_classes``, ``trained_settings``; empty for a state dict)."""
    report.trained_classes = trained_class_names(data)
    report.trained_settings = trained_settings(data)
    return report


def nonfinite_names(named: Iterable[Tuple[str, Any]]) -> List[str]:
    """The names of the dense floating-point tensors among ``named`` that hold a NaN or
    an Inf (one read-back for all; the tensors must share a device)."""
    floats = [(n, t) for n, t in named if isinstance(t, Tensor) and t.is_floating_point() and t.layout == torch.strided]
    if not floats:
        return []
    ok = torch.stack([torch.isfinite(t).all() for _, t in floats]).tolist()
    return [n for (n, _), good in zip(floats, ok) if not good]


def _check_values(state: Mapping[str, Tensor], where: str) -> None:
    """Weights are dense tensors of finite values: a sparse or quantized tensor cannot be
    copied into a parameter (torch raised a many-line error), and a NaN or an Inf gives a
    model that detects nothing (evaluation scored 0 without a word) or whose every
    training step is skipped as non-finite.

    Raises:
        WeightsError: one line naming the source and the first such tensor.
    """
    for key, value in state.items():
        kind = "quantized" if value.is_quantized else None if value.layout == torch.strided else str(value.layout)
        if kind is not None:
            raise WeightsError(f"{where}: '{key}' is a {kind.replace('torch.', '')} tensor; weights must be dense "
                               "float tensors (convert them with .to_dense() or .dequantize() before saving)")
    bad = nonfinite_names(state.items())
    if bad:
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise WeightsError(f"{where}: '{bad[0]}' holds NaN or Inf values{more}; these weights come from a run that "
                           "diverged, or were damaged")


def _sort_keys(state: Mapping[str, Tensor], target: Mapping[str, Tensor], report: LoadReport
               ) -> Tuple[Dict[str, Tensor], List[Tuple[str, Sequence[int], Sequence[int]]]]:
    """Split ``state`` against the model's ``target`` state dict: the tensors to load, and
    the keys whose shapes differ (``(key, source shape, model shape)``). Keys only in the
    source go to ``report.unexpected``, model keys the source lacks to ``report.missing``
    (optional keys are noted instead; predictor keys in ``report.skipped`` are left out)."""
    to_load: Dict[str, Tensor] = {}
    shapes: List[Tuple[str, Sequence[int], Sequence[int]]] = []
    for key, value in state.items():
        if key not in target:
            if not key.endswith("num_batches_tracked"):
                report.unexpected.append(key)
        elif key in report.skipped:
            continue
        elif value.shape != target[key].shape:
            shapes.append((key, value.shape, target[key].shape))
        else:
            to_load[key] = value
    for key in target:
        if key in to_load or key in report.skipped or key.endswith("num_batches_tracked"):
            continue
        if key in _OPTIONAL_KEYS:
            if key not in state:
                report.notes.append(f"'{key}' not in the source: kept from the config")
            continue
        if not any(k == key for k, _, _ in shapes):
            report.missing.append(key)
    return to_load, shapes


# --------------------------------------------------------------------------- initial weights


def uses_ema_weights(cfg: Any) -> bool:
    """Whether a training checkpoint's EMA weights are the model's: ``train.ema.enabled``
    and ``eval.use_ema``. Training then evaluates them (``eval/AP``, ``best.pth``), and
    tools/eval.py, infer.py and export.py load them, so that what is deployed is what
    was measured."""
    return bool(cfg.train.ema.enabled and cfg.eval.use_ema)


def load_model_weights(model: nn.Module, source: str, key: str = "--weights", use_ema: bool = False) -> LoadReport:
    """Strict load for evaluation and inference: ``source`` is a local file (a training
    checkpoint or a state dict) or a torchvision weights name such as
    ``FasterRCNN_ResNet50_FPN_Weights.COCO_V1`` (downloaded once to torch hub's cache;
    with ``data.label_space: category_id`` its labels are COCO's category ids).

    Raises:
        WeightsError: as ``load_weights`` and ``torchvision_state_dict``; one line naming ``key``.

    ``use_ema``: load a training checkpoint's EMA weights (its ``ema`` entry, written
    with ``train.ema.enabled``) rather than its raw ones; a file without them is an error.
    """
    if use_ema:
        if not Path(source).expanduser().exists() and _looks_like_torchvision_weights(source):
            raise WeightsError(f"{key} {source}: torchvision's weights hold no EMA weights (train.ema.enabled is "
                               "set in the config); set eval.use_ema=false to use them")
        data = read_weights_file(source)
        if not isinstance(data.get("ema"), dict):
            raise WeightsError(f"{key} {source}: holds no EMA weights (a checkpoint of a run with "
                               "train.ema.enabled); set eval.use_ema=false to use its raw weights")
        report = load_weights(model, data["ema"]["model"], strict=True, name=f"{source} (EMA)")
        return _note_training_run(report, data)  # (the EMA entry holds no config)
    found = _weights_source(source, key=key, instead="pass the downloaded file")
    if found is None:  # neither a file nor a name: the file loader says the file is missing
        return load_weights(model, source, strict=True)
    data, what = found
    return load_weights(model, data, strict=True, name=what)


def _weights_source(source: str, key: str, instead: str) -> Optional[Tuple[Union[Path, Dict[str, Tensor]], str]]:
    """``(what load_weights takes, its name for messages)`` for an existing file (its
    path) or a torchvision weights name (its state dict, downloaded once; see
    ``torchvision_state_dict`` for ``key`` and ``instead``); None for anything else."""
    path = Path(source).expanduser()
    if path.exists():
        return path, str(path)
    if _looks_like_torchvision_weights(source):
        return torchvision_state_dict(source, key=key, instead=instead), f"torchvision {source}"
    return None


def _looks_like_torchvision_weights(source: str) -> bool:
    head, dot, tail = source.partition(".")
    return bool(dot) and head.endswith("_Weights") and tail.isidentifier() and "/" not in source


def torchvision_state_dict(source: str, key: str = "model.weights",
                           instead: str = "pass a local path") -> Dict[str, Tensor]:
    """Download (once, to torch hub's cache ``$TORCH_HOME/hub/checkpoints``) and return
    torchvision weights by name, e.g. ``ResNet50_Weights.IMAGENET1K_V1``.

    Raises:
        WeightsError: an unknown name, or a download that failed (offline): one line
            naming ``key``, the file it wanted, the folder to put it in, and ``instead``.
    """
    try:
        weights = get_weight(source)
    except (ValueError, KeyError, AttributeError):
        raise WeightsError(f"{key}: unknown torchvision weights name {source!r}") from None
    try:
        return weights.get_state_dict(progress=False, check_hash=True)
    except Exception as exc:  # noqa: BLE001 - URLError, OSError, RuntimeError (hash)
        reason = first_line(exc)
        file_name = os.path.basename(urllib.parse.urlparse(weights.url).path)
        folder = Path(torch.hub.get_dir()) / "checkpoints"
        raise WeightsError(
            f"{key}: cannot download torchvision weights {source!r} ({type(exc).__name__}: {reason}); "
            f"it wants {file_name} from {weights.url}: when offline, put that file in {folder}/, or {instead}"
        ) from None


def load_initial_weights(model: nn.Module, source: str) -> LoadReport:
    """Load ``model.weights``: a local file (our training checkpoint, whose ``model``
    entry is used, or a plain state dict) or a torchvision weights name such as
    ``FasterRCNN_ResNet50_FPN_Weights.COCO_V1`` (downloaded to ``$TORCH_HOME`` once).

    A predictor of another class count is skipped (fresh init) and reported. Returns the
    ``LoadReport``.

    Raises:
        WeightsError: a missing or unreadable file, an unknown torchvision name, a
            download that failed (offline), or weights that do not fit; one line
            starting with ``model.weights:``.
    """
    found = _weights_source(source, key="model.weights", instead="pass a local path")
    if found is None:
        raise WeightsError(
            f"model.weights: {source!r} is neither an existing file nor a torchvision weights name "
            "like 'FasterRCNN_ResNet50_FPN_Weights.COCO_V1'"
        )
    data, what = found
    try:
        report = load_weights(model, data, name=what)
    except WeightsError as exc:
        raise WeightsError(f"model.weights: {exc}") from None
    logger.info(
        "initial weights from %s: %d tensors loaded; skipped (fresh init): %s; missing: %s; unexpected: %s",
        what, len(report.loaded), report.skipped or "none", report.missing or "none", report.unexpected or "none",
    )
    return report
