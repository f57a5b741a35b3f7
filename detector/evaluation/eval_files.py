"""The files of ``tools/eval.py``'s file mode: a COCO-format ground-truth JSON (field
types by the data layer's declared COCO records, ``detector.data.schema``; then its ids
and references) and a results file checked against it, vectorised like :func:`detector.evaluation.results.detections_from_records`.
A bad record is a :class:`~detector.evaluation.results.ResultsError` of one line naming the
file, the section, the index and the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np

from detector.data.schema import CocoGroundTruth, load_coco_json

from .results import (
    Detections, ResultsError, _describe, _first_bad, _id_and_box_columns, _int_column, _is_int, check_detection_ids,
    detections_from_records, read_results_file,
)


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
        check_detection_ids(data, image_ids, cat_ids, source=str(path))
        return data
    if not isinstance(data, dict) or "annotations" not in data:
        raise ResultsError(f"{path}: expected a list of COCO results or a dict with 'annotations'")
    image_map: Optional[Dict[Any, Any]] = None
    cat_map: Optional[Dict[Any, Any]] = None
    if data.get("images") and all("file_name" in img for img in data["images"]):
        gt_by_name = {Path(img["file_name"]).name: img["id"] for img in gt["images"] if "file_name" in img}
        image_map = {}
        for img in data["images"]:
            name = Path(img["file_name"]).name
            if name not in gt_by_name:
                raise ResultsError(f"{path}: image {img.get('id')!r} ({name}) is not in the ground truth")
            image_map[img.get("id")] = gt_by_name[name]
    if data.get("categories") and all("name" in c for c in data["categories"]):
        gt_cats = {c["name"]: c["id"] for c in gt["categories"]}
        cat_map = {}
        for cat in data["categories"]:
            if cat["name"] not in gt_cats:
                raise ResultsError(f"{path}: category {cat['name']!r} is not in the ground-truth categories")
            cat_map[cat.get("id")] = gt_cats[cat["name"]]
    results = []
    for i, ann in enumerate(data["annotations"]):
        if not isinstance(ann, dict):
            raise ResultsError(f"{path}: annotations[{i}] is not an object")
        if "score" not in ann:
            raise ResultsError(f"{path}: annotations[{i}] has no 'score' (is this a ground-truth file?)")
        res = {k: ann[k] for k in ("image_id", "category_id", "bbox", "score") if k in ann}
        if image_map is not None:
            if ann.get("image_id") not in image_map:
                raise ResultsError(f"{path}: annotations[{i}] has image_id {ann.get('image_id')!r}, not in its 'images'")
            res["image_id"] = image_map[ann["image_id"]]
        if cat_map is not None:
            if ann.get("category_id") not in cat_map:
                raise ResultsError(f"{path}: annotations[{i}] has category_id {ann.get('category_id')!r}, not in its 'categories'")
            res["category_id"] = cat_map[ann["category_id"]]
        results.append(res)
    dets = detections_from_records(results, source=f"{path}: annotations")
    check_detection_ids(dets, image_ids, cat_ids, source=f"{path}: annotations")
    return dets
