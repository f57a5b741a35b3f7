"""Results files: detections as arrays, reading and writing COCO results files, reading
ground-truth files, and the checks of every results and ground-truth record.

A COCO results file is a JSON list of ``{"image_id", "category_id", "bbox": [x, y, w,
h], "score"}``. Scoring works on :class:`Detections`, four arrays that hold the same
data in ~56 bytes per detection instead of ~600 as Python dicts, built once:

- :func:`detections_from_records` converts a list of dicts (checking every field on the
  way, vectorised);
- :func:`read_results_file` parses a results file with ``json`` and converts it;
  :func:`write_results_file` writes ``detections.json`` (the file mode's readers are in
  :mod:`detector.evaluation.eval_files`).

Every record is checked before scoring: ``image_id`` and ``category_id`` integers that
the ground truth has, a ``bbox`` of four finite numbers with ``w, h >= 0``, and a finite
numeric ``score``. A bad record is a :class:`ResultsError` (a ``ValueError``) of one line
naming the file, the record's index and the field. Ground truth gets the same checks
(:func:`detector.evaluation.eval_files.check_ground_truth`).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from detector.files import atomic_write, no_file_message
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


def _has_bool(values: List[Any], width: int = 0) -> bool:
    """Whether a JSON ``true`` / ``false`` is among ``values`` (or their ``width``-long
    lists): numpy turns them into 1 / 0 beside numbers."""
    flat = itertools.chain.from_iterable(v for v in values if isinstance(v, (list, tuple))) if width else values
    return bool in set(map(type, flat))


def _int_column(values: List[Any]) -> Optional[np.ndarray]:
    """int64 [N] when every value is an integer, else None."""
    if _has_bool(values):
        return None
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
    if _has_bool(values, width):
        return None
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
    with np.errstate(over="ignore"):  # scoring computes x + w and w * h: both must be finite
        huge = ~(np.isfinite(bbox[:, :2] + bbox[:, 2:]).all(axis=1) & np.isfinite(bbox[:, 2] * bbox[:, 3]))
    if huge.any():
        i = int(np.argmax(huge))
        raise ResultsError(f"{source}: {label(i)}: 'bbox' is too large to score (its corner or area is not a finite "
                           f"number): {_describe(records[i]['bbox'])}")
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


# --------------------------------------------------------------------------- files


def load_json_file(path: str | Path, what: str) -> Any:
    """A JSON file parsed by ``json`` (``what`` names the file in the messages).

    Raises:
        FileNotFoundError: no such file; ResultsError: unreadable, not text (UTF-8, -16
        or -32, as ``json`` detects it), not valid JSON (with the position), or nested
        too deep.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(no_file_message(f"{what} file", path))
    try:
        # bytes: json detects UTF-8 (a byte-order mark dropped), UTF-16 and UTF-32 itself
        return json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{path}: cannot read the {what} file: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:  # json's decoder recurses once per level
        raise ResultsError(f"{path}: the {what} file is nested too deep (more than about 1000 levels of lists and "
                           "objects)") from None


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
    """Write ``dets`` as a COCO results JSON list (``detector.files.atomic_write``: an
    ``OutputError`` naming the file, no partial file): the text ``json.dumps`` gives for
    the records (floats by ``repr``), formatted directly. A non-finite box or score
    (not valid JSON) is a ``ValueError``."""
    if not (np.isfinite(dets.bbox).all() and np.isfinite(dets.score).all()):
        raise ValueError("Out of range float values are not JSON compliant: a detection has a non-finite box or score")

    def write(f: Any) -> None:
        f.write("[")
        for k in range(0, len(dets), chunk):
            part = dets.take(slice(k, k + chunk))
            rows = zip(part.image_id.tolist(), part.category_id.tolist(), part.bbox.tolist(), part.score.tolist())
            body = ", ".join([_RECORD_JSON % (i, c, *b, s) for i, c, b, s in rows])
            f.write(("," if k else "") + "\n" + body)
        f.write("\n]\n")

    return atomic_write(path, write, mode="w")
