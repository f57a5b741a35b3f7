"""The files of ``tools/eval.py``'s file mode: a COCO-format ground-truth JSON (field
types by the data layer's declared COCO records, ``detector.data.schema``; then its ids
and references) and a results file checked against it, vectorised like :func:`detector.evaluation.results.detections_from_records`.
A bad record is a :class:`~detector.evaluation.results.ResultsError` of one line naming the
file, the section, the index and the field."""

from __future__ import annotations

import logging
from pathlib import Path, PurePath
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from detector.data.schema import CocoGroundTruth, load_coco_json

from .results import (
    Detections, ResultsError, _describe, _first_bad, _id_and_box_columns, _int_column, _is_int, check_detection_ids,
    detections_from_records, read_results_file,
)

logger = logging.getLogger(__name__)


def _gt_ids(items: Any, section: str, source: str) -> np.ndarray:
    """int64 ids of the ``images`` or ``categories`` section, checked: each entry an
    object with an integer ``id``, no id twice."""
    if not isinstance(items, list):
        raise ResultsError(f"{source}: '{section}' must be a list, got {_describe(items)}")
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            raise ResultsError(f"{source}: {section}[{i}] is not an object: {_describe(it)}")
    ids = _int_column([it.get("id") for it in items]) if items else np.zeros(0, np.int64)
    if ids is None:
        i = _first_bad(items, "id", _is_int)
        if i < 0:
            raise ResultsError(f"{source}: the {section}' ids do not fit 64-bit integers")
        item = items[i]
        if "id" not in item:
            raise ResultsError(f"{source}: {section}[{i}] has no 'id'")
        raise ResultsError(f"{source}: {section}[{i}]: 'id' must be an integer, got {_describe(item['id'])}")
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        dup = int(uniq[np.argmax(counts > 1)])
        raise ResultsError(f"{source}: '{section}' lists id {dup} {int(counts.max())} times")
    return ids


def check_ground_truth(gt: Any, source: str = "ground truth") -> Tuple[np.ndarray, np.ndarray]:
    """Check a COCO-format ground-truth dict; return its image ids and category ids.

    Checks: the three sections; every image and category an object with an integer
    ``id`` (no id twice); every annotation with integer ``image_id`` and
    ``category_id`` that the sections hold and a ``bbox`` of four finite numbers with
    ``w, h >= 0``. Vectorised like :func:`detections_from_records`.

    Raises:
        ResultsError: one line naming the section, the index and the field.
    """
    if not isinstance(gt, dict):
        raise ResultsError(f"{source}: expected a COCO dict with 'images', 'annotations', 'categories'; got {type(gt).__name__}")
    for key in ("images", "annotations", "categories"):
        if key not in gt:
            raise ResultsError(f"{source}: missing the '{key}' section")
    image_ids = _gt_ids(gt["images"], "images", source)
    cat_ids = _gt_ids(gt["categories"], "categories", source)
    anns = gt["annotations"]
    if not isinstance(anns, list):
        raise ResultsError(f"{source}: 'annotations' must be a list, got {_describe(anns)}")
    if not anns:
        return image_ids, cat_ids
    for i, ann in enumerate(anns):
        if not isinstance(ann, dict):
            raise ResultsError(f"{source}: annotations[{i}] is not an object: {_describe(ann)}")
    cols = {f: [a.get(f) for a in anns] for f in ("image_id", "category_id", "bbox")}

    img, cat, _ = _id_and_box_columns(anns, cols, source, lambda i: f"annotations[{i}]", "the annotations'")
    bad = ~np.isin(img, image_ids)
    if bad.any():
        i = int(np.argmax(bad))
        raise ResultsError(f"{source}: annotations[{i}]: image_id {int(img[i])} is not in 'images'")
    bad = ~np.isin(cat, cat_ids)
    if bad.any():
        i = int(np.argmax(bad))
        raise ResultsError(f"{source}: annotations[{i}]: category_id {int(cat[i])} is not in 'categories'")
    return image_ids, cat_ids


def load_ground_truth(path: str | Path) -> Dict[str, Any]:
    """A COCO-format ground-truth JSON file, checked (errors name the file, the
    section, the index and the field): field types by the data layer's declared COCO
    records (``detector.data.schema``), then ids and references."""
    gt = load_coco_json(str(path), CocoGroundTruth)
    check_ground_truth(gt, source=str(path))
    return gt


def load_predictions(path: str | Path, gt: Dict[str, Any]) -> Detections:
    """Detections from a JSON file, checked against ``gt`` (every record: see
    :mod:`detector.evaluation.results`), as arrays.

    Accepted forms: a COCO results list (ids must be ``gt``'s), or a COCO-format dict
    whose ``annotations`` carry a ``score``; its ``images`` (by ``file_name``) and
    ``categories`` (by ``name``), when present, map its own ids onto ``gt``'s.

    Raises:
        ResultsError (a ValueError): a form not understood, a bad record (index and
        field), or a file/category name ``gt`` lacks (named).
    """
    image_ids, cat_ids = check_ground_truth(gt)
    data = read_results_file(path)
    if isinstance(data, Detections):
        dets, source = data, str(path)
    else:
        dets, source = _dict_form_detections(data, gt, path), f"{path}: annotations"
    check_detection_ids(dets, image_ids, cat_ids, source=source)
    if not len(dets.score):  # scored 0 everywhere: say why (an export that failed, a wrong file)
        logger.warning("%s holds no detections: every metric is 0 (or -1 where there is no ground truth)", path)
    return dets


def _dict_form_detections(data: Any, gt: Dict[str, Any], path: str | Path) -> Detections:
    """The detections of a COCO-format dict results file, its own image and category ids
    mapped onto ``gt``'s (``_id_map``)."""
    if not isinstance(data, dict) or "annotations" not in data:
        raise ResultsError(f"{path}: expected a list of COCO results or a dict with 'annotations'")
    image_map = _id_map(data, "images", "file_name", _gt_image_names(gt), path)
    cat_map = _id_map(data, "categories", "name", _gt_category_names(gt), path)
    results = []
    for i, ann in enumerate(data["annotations"]):
        if not isinstance(ann, dict):
            raise ResultsError(f"{path}: annotations[{i}] is not an object")
        if "score" not in ann:
            raise ResultsError(f"{path}: annotations[{i}] has no 'score' (is this a ground-truth file?)")
        res = {k: ann[k] for k in ("image_id", "category_id", "bbox", "score") if k in ann}
        for key, section, mapping in (("image_id", "images", image_map), ("category_id", "categories", cat_map)):
            if mapping is None:
                continue
            value = ann.get(key)
            if not _is_int(value) or int(value) not in mapping:
                raise ResultsError(f"{path}: annotations[{i}] has {key} {_describe(value)}, not an id of its '{section}'")
            res[key] = mapping[int(value)]
        results.append(res)
    return detections_from_records(results, source=f"{path}: annotations")


def _gt_image_names(gt: Dict[str, Any]) -> Callable[[str], Any]:
    """A lookup of ``gt``'s image ids by ``file_name``: the whole name first, else the
    base name where one ground-truth image has it (a results file written beside other
    folders: ``a/x.jpg`` against ``x.jpg``). A base name two ground-truth images share
    (``a/x.jpg``, ``b/x.jpg``) is not guessed: ``ResultsError`` naming both."""
    by_name = {str(img["file_name"]): img["id"] for img in gt["images"] if "file_name" in img}
    by_base: Dict[str, List[str]] = {}
    for name in by_name:
        by_base.setdefault(PurePath(name.replace("\\", "/")).name, []).append(name)

    def lookup(name: str) -> Any:
        if name in by_name:
            return by_name[name]
        found = by_base.get(PurePath(name.replace("\\", "/")).name, [])
        if len(found) > 1:
            raise ResultsError(f"file name {name!r} matches {len(found)} ground-truth images by its base name "
                               f"({found[0]!r}, {found[1]!r}): give the file names as the ground truth does")
        return by_name[found[0]] if found else None
    return lookup


def _gt_category_names(gt: Dict[str, Any]) -> Callable[[str], Any]:
    """A lookup of ``gt``'s category ids by ``name`` (the id as text where it has none).
    A name two ground-truth categories share is not guessed: ``ResultsError`` naming
    their ids (the last one was taken, and scored as the other's detections)."""
    by_name: Dict[str, List[Any]] = {}
    for c in gt["categories"]:
        by_name.setdefault(str(c.get("name", c["id"])), []).append(c["id"])

    def lookup(name: str) -> Any:
        found = by_name.get(name, [])
        if len(found) > 1:
            raise ResultsError(f"name {name!r} is the name of {len(found)} ground-truth categories (ids "
                               f"{', '.join(str(i) for i in found)}): give the category ids as the ground truth does")
        return found[0] if found else None
    return lookup


def _id_map(data: Dict[str, Any], section: str, key: str, lookup: Callable[[str], Any],
            path: str | Path) -> Optional[Dict[int, Any]]:
    """The results file's own ids of ``section`` (``images`` by ``file_name``,
    ``categories`` by ``name``) -> ``gt``'s ids via ``lookup``; None where no entry
    names itself (the file uses ``gt``'s ids). Every entry or none must name itself:
    mapping some and taking the others' ids as ``gt``'s would pair wrong ones silently."""
    entries = data.get(section)
    if not entries:
        return None
    if not isinstance(entries, list):
        raise ResultsError(f"{path}: '{section}' must be a list, got {_describe(entries)}")
    named = [isinstance(e, dict) and key in e for e in entries]
    if not any(named):
        return None
    mapping: Dict[int, Any] = {}
    for i, entry in enumerate(entries):
        if not named[i]:
            raise ResultsError(f"{path}: {section}[{i}] has no '{key}' ({section}[{named.index(True)}] has one: "
                               f"the {section} are matched to the ground truth's by {key}, every one or none)")
        own, name = entry.get("id"), entry[key]
        if not _is_int(own):
            raise ResultsError(f"{path}: {section}[{i}]: 'id' must be an integer, got {_describe(own)}")
        if not isinstance(name, str):
            raise ResultsError(f"{path}: {section}[{i}]: '{key}' must be a string, got {_describe(name)}")
        try:
            target = lookup(name)
        except ResultsError as exc:
            raise ResultsError(f"{path}: {section}[{i}]: {exc}") from None
        if target is None:
            raise ResultsError(f"{path}: {section}[{i}] ({key} {name!r}) is not in the ground truth")
        if int(own) in mapping:
            raise ResultsError(f"{path}: '{section}' lists id {int(own)} twice")
        mapping[int(own)] = target
    return mapping
