"""What a training checkpoint's stored config says about its weights that the weights
themselves do not show.

A checkpoint written by training holds the run's config (``data["config"]``, a plain
dict). Two parts of it decide what the weights mean without changing any tensor's shape,
so a load succeeds with the wrong values and the results are silently worse:

- the class names of labels 1..K (``trained_class_names``; ``detector.data`` compares them
  with the config's and refuses a difference);
- the decoding settings (``TRAINED_KEYS``: the anchors the RPN's outputs are offsets of,
  the box coders' weights that scale those offsets, the RoIAlign sampling the box head was
  trained on). ``other_settings`` lists the ones this config sets otherwise, and
  ``warn_other_settings`` says so in one warning: another recipe's config passed with its
  weights (another ``model.anchors.sizes``, say) loads, then finds fewer objects.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Mapping

from detector.config import Config

logger = logging.getLogger(__name__)

# Config keys whose value the weights were trained for and whose change no tensor shape shows.
TRAINED_KEYS = (
    "model.anchors.sizes",
    "model.anchors.aspect_ratios",
    "rpn.box_coder_weights",
    "roi_heads.box_coder_weights",
    "roi_heads.aligned",
    "roi_heads.sampling_ratio",
)
_MISSING = object()


def _stored_config(data: Mapping[str, Any]) -> Mapping[str, Any]:
    stored = data.get("config")
    return stored if isinstance(stored, Mapping) else {}


def _lookup(section: Any, key: str) -> Any:
    """The value at the dotted ``key`` in nested mappings or config sections, else ``_MISSING``."""
    for part in key.split("."):
        if isinstance(section, Mapping):
            section = section.get(part, _MISSING)
        else:
            section = getattr(section, part, _MISSING)
        if section is _MISSING:
            return _MISSING
    return section


def _plain(value: Any) -> Any:
    """Numbers as floats (a YAML ``32`` equals ``32.0``), sequences as lists, booleans kept."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "__iter__") and not isinstance(value, (str, Mapping)):  # lists, tuples, ListConfig
        return [_plain(v) for v in value]
    return value


def trained_class_names(data: Mapping[str, Any]) -> List[str]:
    """The class names, label 1..K, of the run that wrote the training checkpoint
    ``data``: its stored config's ``data.class_names`` where its labels are contiguous
    (training writes them there, ``detector.data.classes``); empty for a state dict, an
    older checkpoint or ``category_id`` labels."""
    section = _stored_config(data).get("data", {})
    if not isinstance(section, Mapping):  # a crafted or damaged file: nothing to compare with
        return []
    names = section.get("class_names")
    if section.get("label_space", "contiguous") != "contiguous" or not isinstance(names, list):
        return []
    return [str(n) for n in names]


def trained_settings(data: Mapping[str, Any]) -> Dict[str, Any]:
    """``TRAINED_KEYS`` -> value in the training checkpoint ``data``'s stored config (keys
    it lacks left out; empty for a state dict or a torchvision file)."""
    stored = _stored_config(data)
    found = {key: _lookup(stored, key) for key in TRAINED_KEYS}
    return {key: _plain(value) for key, value in found.items() if value is not _MISSING}


def other_settings(trained: Mapping[str, Any], cfg: Config) -> List[str]:
    """``"key=<this config's> (trained with <the run's>)"`` for each of ``trained``'s keys
    (``trained_settings``) that ``cfg`` sets otherwise."""
    out = []
    for key, value in trained.items():
        mine = _plain(_lookup(cfg, key))
        if mine is not _MISSING and mine != value:
            out.append(f"{key}={_shown(mine)} (trained with {_shown(value)})")
    return out


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).lower() if isinstance(value, bool) else str(value)


def warn_other_settings(trained: Mapping[str, Any], cfg: Config, weights: str) -> List[str]:
    """One warning where ``cfg`` decodes ``weights`` otherwise than the run that trained
    them (``other_settings``); returns what differs."""
    changed = other_settings(trained, cfg)
    if changed:
        logger.warning("--weights %s: this config decodes them otherwise than the run that trained them: %s; the "
                       "results will be worse than that run's: use its config.yaml, or set these keys as it did",
                       weights, "; ".join(changed))
    return changed
