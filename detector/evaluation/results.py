"""Results files: detections as arrays, reading and writing COCO results files, reading
ground-truth files, and the checks of every results and ground-truth record.

A COCO results file is a JSON list of ``{"image_id", "category_id", "bbox": [x, y, w,
h], "score"}``. Scoring works on :class:`Detections`, four arrays that hold the same
data in ~56 bytes per detection instead of ~600 as Python dicts, built once:

- :func:`detections_from_records` converts a list of dicts (checking every field on the
  way, vectorised);
- :func:`read_results_file` parses a results file with ``json`` and converts it;
  :func:`load_predictions` and :func:`load_ground_truth` read and check the files of
  ``tools/eval.py``'s file mode; :func:`write_results_file` writes ``detections.json``.

Every record is checked before scoring: ``image_id`` and ``category_id`` integers that
the ground truth has, a ``bbox`` of four finite numbers with ``w, h >= 0``, and a finite
numeric ``score``. A bad record is a :class:`ResultsError` (a ``ValueError``) of one line
naming the file, the record's index and the field. Ground truth gets the same checks
(:func:`check_ground_truth`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from detector.data.schema import CocoGroundTruth, load_coco_json
from detector.messages import DetectorError

FIELDS = ("image_id", "category_id", "bbox", "score")


class ResultsError(DetectorError, ValueError):
    """A results or ground-truth record that cannot be scored (one line, named)."""


class UnknownImageError(ResultsError):
    """A detection names an image id that the ground truth does not have."""


@dataclass
class Detections:
    """N detections as arrays (original-image pixels, COCO ``bbox`` layout).

    Attributes:
        image_id: int64 [N].
        category_id: int64 [N], original category ids.
        bbox: float64 [N, 4], ``x, y, w, h``.
        score: float64 [N].
    """

    image_id: np.ndarray
    category_id: np.ndarray
    bbox: np.ndarray
    score: np.ndarray

    def __len__(self) -> int:
        return int(self.image_id.shape[0])

    @classmethod
    def empty(cls) -> "Detections":
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 4)), np.zeros(0))

    @classmethod
    def concatenate(cls, parts: Sequence["Detections"]) -> "Detections":
        if not parts:
            return cls.empty()
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in FIELDS))

    def take(self, index: np.ndarray) -> "Detections":
        """The detections at ``index`` (int indices or a bool mask), in that order."""
        return Detections(self.image_id[index], self.category_id[index], self.bbox[index], self.score[index])

    def to_records(self) -> List[Dict[str, Any]]:
        """COCO results dicts (Python ints and floats)."""
        return [
            {"image_id": i, "category_id": c, "bbox": b, "score": s}
            for i, c, b, s in zip(self.image_id.tolist(), self.category_id.tolist(), self.bbox.tolist(), self.score.tolist())
        ]


# --------------------------------------------------------------------------- checks


def _describe(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, list, dict, bool)) or value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _record_error(source: str, label: str, record: Any, field: str) -> ResultsError:
    """The one-line message for the bad ``field`` of ``record`` (``label``: e.g. ``result 17``)."""
    where = f"{source}: {label}"
    if not isinstance(record, dict):
        return ResultsError(f"{where} is not an object: {_describe(record)}")
    if field not in record:
        return ResultsError(f"{where} has no '{field}'")
    value = record[field]
    if field in ("image_id", "category_id", "id"):
        return ResultsError(f"{where}: '{field}' must be an integer, got {_describe(value)}")
    if field == "bbox":
        if not isinstance(value, (list, tuple)) or len(value) != 4 or not all(_is_number(v) for v in value):
            return ResultsError(f"{where}: 'bbox' must be 4 numbers [x, y, w, h], got {_describe(value)}")
        if not all(np.isfinite(v) for v in value):
            return ResultsError(f"{where}: 'bbox' has a non-finite number: {_describe(value)}")
        return ResultsError(f"{where}: 'bbox' has a negative width or height: {_describe(value)}")
    if field == "score":
        if not _is_number(value):
            return ResultsError(f"{where}: 'score' must be a number, got {_describe(value)}")
        return ResultsError(f"{where}: 'score' is {value!r}; it must be finite")
    return ResultsError(f"{where}: bad '{field}': {_describe(value)}")


def _first_bad(records: Sequence[Any], field: str, ok) -> int:
    """Index of the first record whose ``field`` fails ``ok`` (or that lacks it)."""
    for i, r in enumerate(records):
        if not isinstance(r, dict) or field not in r or not ok(r[field]):
            return i
    return -1


def _int_column(values: List[Any]) -> Optional[np.ndarray]:
    """int64 [N] when every value is an integer, else None."""
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError, OverflowError):
        return None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        return None
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        return None  # 2**63 .. 2**64 - 1: would wrap around in int64
    return arr.astype(np.int64, copy=False)


def _float_column(values: List[Any], width: int = 0) -> Optional[np.ndarray]:
    """float64 [N] (or [N, width]) when every value is a number (or ``width`` numbers)."""
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError, OverflowError):  # ragged lists, ...
        return None
    shape_ok = arr.ndim == 1 if width == 0 else (arr.ndim == 2 and arr.shape[1] == width)
    if not shape_ok:
        return None
    if arr.dtype.kind not in "iuf":  # strings, None, bools, nested junk
        return None
    return arr.astype(np.float64, copy=False).reshape((-1, width) if width else (-1,))


def _box_ok(b: Any) -> bool:
    return (isinstance(b, (list, tuple)) and len(b) == 4 and all(_is_number(v) for v in b)
            and all(np.isfinite(v) for v in b) and b[2] >= 0 and b[3] >= 0)


def _field_error(records: Sequence[Any], field: str, ok, source: str, label, owner: str) -> ResultsError:
    """The error naming the first record whose ``field`` fails ``ok``, as ``label(i)``;
    when every record passes (integers beyond 64 bits), one line about the column."""
    i = _first_bad(records, field, ok)
    if i < 0:
        return ResultsError(f"{source}: {owner} '{field}' values do not fit 64-bit numbers")
    return _record_error(source, label(i), records[i], field)


def _id_and_box_columns(records: Sequence[Any], cols: Dict[str, List[Any]], source: str, label,
                        owner: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``image_id`` and ``category_id`` columns (int64 ``[N]``) and the ``bbox``
    column (float64 ``[N, 4]``, xywh, finite, ``w, h >= 0``) of ``records``, from their
    field lists ``cols``; else a ResultsError naming the first bad record as ``label(i)``."""
    image_id = _int_column(cols["image_id"])
    if image_id is None:
        raise _field_error(records, "image_id", _is_int, source, label, owner)
    category_id = _int_column(cols["category_id"])
    if category_id is None:
        raise _field_error(records, "category_id", _is_int, source, label, owner)
    bbox = _float_column(cols["bbox"], 4)
    if bbox is None:
        raise _field_error(records, "bbox", _box_ok, source, label, owner)
    bad = ~np.isfinite(bbox).all(axis=1) | (bbox[:, 2] < 0) | (bbox[:, 3] < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise _record_error(source, label(i), records[i], "bbox")
    return image_id, category_id, bbox


def detections_from_records(records: Sequence[Any], source: str = "detections") -> Detections:
    """Check the fields of every record and return them as :class:`Detections`.

    Vectorised: one list pass per field and one array conversion; only when a column
    does not convert is it scanned again to name the first bad record.

    Args:
        records: COCO results dicts.
        source: the file (or other origin) named in the message.

    Raises:
        ResultsError: the first record with a missing or ill-typed field, a non-finite
            number, or a negative box width or height, named by index and field.
    """
    n = len(records)
    if n == 0:
        return Detections.empty()
    try:
        cols = {f: [r.get(f) for r in records] for f in FIELDS}
    except AttributeError:  # a record that is not an object
        i = next(i for i, r in enumerate(records) if not isinstance(r, dict))
        raise _record_error(source, f"result {i}", records[i], "image_id") from None

    def label(i: int) -> str:
        return f"result {i}"

    image_id, category_id, bbox = _id_and_box_columns(records, cols, source, label, "the")
    score = _float_column(cols["score"])
    if score is None:
        raise _field_error(records, "score", lambda v: _is_number(v) and np.isfinite(v), source, label, "the")
    bad = ~np.isfinite(score)
    if bad.any():
        i = int(np.argmax(bad))
        raise _record_error(source, label(i), records[i], "score")
    return Detections(image_id, category_id, bbox, score)


def check_detection_ids(dets: Detections, image_ids: np.ndarray, cat_ids: np.ndarray, source: str = "detections") -> None:
    """Every detection names a ground-truth image and category.

    Raises:
        UnknownImageError: the first detection with an unknown ``image_id`` (named).
        ResultsError: the first one with an unknown ``category_id``.
    """
    bad = ~np.isin(dets.image_id, image_ids)
    if bad.any():
        i = int(np.argmax(bad))
        raise UnknownImageError(
            f"{source}: result {i}: image_id {int(dets.image_id[i])} is not in the ground truth ({len(image_ids)} images)"
        )
    bad = ~np.isin(dets.category_id, cat_ids)
    if bad.any():
        i = int(np.argmax(bad))
        raise ResultsError(
            f"{source}: result {i}: category_id {int(dets.category_id[i])} is not among the ground-truth "
            f"categories {sorted(int(c) for c in cat_ids)}"
        )


def as_detections(results: Any, source: str = "detections") -> Detections:
    """``results`` as :class:`Detections` (a list of dicts is checked and converted)."""
    if isinstance(results, Detections):
        return results
    return detections_from_records(results, source)


# --------------------------------------------------------------------------- ground truth


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


# --------------------------------------------------------------------------- files


def load_json_file(path: str | Path, what: str) -> Any:
    """A JSON file parsed by ``json`` (``what`` names the file in the messages).

    Raises:
        FileNotFoundError: no such file; ResultsError: unreadable, not UTF-8, or not
        valid JSON (with the position).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file not found: {path}")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{path}: cannot read the {what} file: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not valid JSON ({exc})") from None


def read_results_file(path: str | Path) -> Any:
    """Read a results file: a JSON list of results becomes checked :class:`Detections`;
    any other JSON (e.g. a COCO-format dict with ``annotations``) is returned as parsed.

    Raises:
        FileNotFoundError; ResultsError: not valid JSON (with the position) or a bad
        record (index and field).
    """
    data = load_json_file(path, "predictions")
    if isinstance(data, list):
        return detections_from_records(data, str(path))
    return data


_RECORD_JSON = '{"image_id": %d, "category_id": %d, "bbox": [%r, %r, %r, %r], "score": %r}'


def write_results_file(path: str | Path, dets: Detections, chunk: int = 100_000) -> Path:
    """Write ``dets`` as a COCO results JSON list (temp file, then rename): the text
    ``json.dumps`` gives for the records (floats by ``repr``), formatted directly.

    Raises:
        ValueError: a non-finite box or score (not valid JSON).
    """
    if not (np.isfinite(dets.bbox).all() and np.isfinite(dets.score).all()):
        raise ValueError("Out of range float values are not JSON compliant: a detection has a non-finite box or score")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        f.write("[")
        for k in range(0, len(dets), chunk):
            part = dets.take(slice(k, k + chunk))
            rows = zip(part.image_id.tolist(), part.category_id.tolist(), part.bbox.tolist(), part.score.tolist())
            body = ", ".join([_RECORD_JSON % (i, c, *b, s) for i, c, b, s in rows])
            f.write(("," if k else "") + "\n" + body)
        f.write("\n]\n")
    tmp.replace(path)
    return path


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
