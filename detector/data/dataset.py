"""The base detection data set and the box policy shared by every format.

A data set reads its annotations once, at construction, into one ``ImageRecord`` per
image (boxes already in the project's convention: ``[x1, y1, x2, y2]`` float32 absolute
pixels, continuous coordinates, x2 > x1, no "+1"), keeps them in a ``RecordStore``
(``records.py``: a few flat arrays, which forked loader workers share instead of copying),
and decodes the image file only in ``__getitem__``. The formats: ``coco.py``
(``CocoDetection``, which also reads the generated shapes set) and ``voc.py``
(``VOCDetection``).

Bad-input policy (see docs/data.md):

- errors (``DataError``, a ``ValueError``, or ``FileNotFoundError``; one line naming the
  file, field, index or id): a missing or undecodable annotation file, invalid JSON, a
  missing top-level key, an ``image_id`` that appears twice, an annotation whose
  ``image_id`` or ``category_id`` is unknown, a malformed ``bbox``, a VOC object with a class
  name outside ``class_names``, a missing/truncated/corrupt image file (raised when the
  item is loaded), a decoded image whose size differs from the metadata, an image of
  32-bit pixels (no defined 8-bit scale; 16-bit images are scaled, see
  ``files.to_rgb8``), a COCO ``file_name`` or VOC id that resolves outside the image
  root, and a data set that is empty after filtering;
- counted, logged skips (a warning naming the annotation id, counted in
  ``dataset.skipped``): boxes with non-positive width or height and boxes wholly outside
  their image (``check_box``). Boxes partly outside are clipped to the image (counted in
  ``skipped["clipped"]``). VOC boxes with fractional coordinates are accepted as floats
  and counted (``Issues.non_integer``, reported by the checker).
"""

from __future__ import annotations

import logging
import os
import unicodedata
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from detector.messages import did_you_mean

from .files import DataError, decode_image, decoded_warnings
from .records import ImageRecord, RecordStore
from .samplers import SampleKey

logger = logging.getLogger(__name__)

# A box may extend this far (pixels) past the image edge before the checker calls it faulty
# (the data set clips any overshoot).
PAST_EDGE_TOLERANCE = 1.0


# transforms(image HWC uint8, boxes [N,4] float32, labels [N] int64[, key=(epoch, position)])
#   -> (image [3,H',W'] uint8 tensor, boxes [M,4] float32 tensor, labels [M] int64 tensor)
# (``key`` is passed when the item is fetched with a ``SampleKey``; see transforms.py.)
Transform = Callable[..., Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class DataWarning(UserWarning):
    """A data item that is read, but perhaps not as its author meant (named in the message)."""


@dataclass
class Issues:
    """Problems found while parsing annotations.

    With ``strict=True`` an error raises ``DataError`` at once (the dataset's behaviour);
    with ``strict=False`` errors are collected (the checker's behaviour). Skips are always
    counted and logged.
    """

    strict: bool = True
    errors: List[str] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    skip_messages: List[str] = field(default_factory=list)
    log_skips: bool = True
    past_edge: List[str] = field(default_factory=list)  # clipped by more than PAST_EDGE_TOLERANCE
    non_integer: List[str] = field(default_factory=list)  # VOC objects with fractional pixel coordinates (accepted)
    # Boxes of classes left out of data.class_names (a class subset), by class name: dropped.
    other_classes: Counter = field(default_factory=Counter)

    def error(self, message: str) -> None:
        if self.strict:
            raise DataError(message)
        self.errors.append(message)

    def skip(self, kind: str, message: str) -> None:
        self.skipped[kind] += 1
        self.skip_messages.append(message)
        if self.log_skips:
            logger.warning("%s", message)


def _empty_record_arrays(n: int = 0) -> Dict[str, np.ndarray]:
    return {
        "boxes": np.zeros((n, 4), np.float32),
        "labels": np.zeros((n,), np.int64),
        "iscrowd": np.zeros((n,), bool),
        "difficult": np.zeros((n,), bool),
        "ann_ids": np.zeros((n,), np.int64),
        "areas": np.zeros((n,), np.float32),
    }


# Images whose longer side is at least this many pixels (median over the set) cannot
# have every box inside their top-left 1 x 1 px: the coordinates are fractions.
MIN_SIDE_FOR_FRACTION_CHECK = 16


def fraction_coordinates_problem(store: "RecordStore | Sequence[ImageRecord]", source: str) -> Optional[str]:
    """The one-line problem where every box of the set lies within ``[0, 1] x [0, 1]`` px
    of images of ordinary size: coordinates as fractions of the image size (YOLO's), read
    as pixels. Such boxes pass every box check (positive size, inside the image) and
    train on nothing: no anchor overlaps them. None where any box is larger."""
    if not isinstance(store, RecordStore):
        store = RecordStore.from_records(list(store))
    a = store.arrays
    boxes = a["boxes"]
    if not len(boxes) or float(boxes[:, 2:].max()) > 1.0:
        return None
    sides = np.maximum(a["widths"], a["heights"])
    if float(np.median(sides)) < MIN_SIDE_FOR_FRACTION_CHECK:
        return None
    i = int(np.searchsorted(a["box_start"], 0, side="right") - 1)
    return (f"{source}: every box lies within 1 x 1 px at its image's top-left corner (e.g. image_id "
            f"{int(a['image_ids'][i])}, {int(a['widths'][i])} x {int(a['heights'][i])} px: box "
            f"{[round(float(v), 4) for v in boxes[0]]}): are the coordinates fractions of the image size (YOLO's)? "
            "COCO's bbox and VOC's bndbox are in pixels")


def check_box(
    box: Sequence[float], width: int, height: int, where: str, issues: Issues
) -> Optional[Tuple[float, float, float, float]]:
    """Validate one xyxy box against its image; return it clipped, or None when skipped.

    ``where`` names the annotation (e.g. "annotations.json: annotation id 7") in messages.
    """
    x1, y1, x2, y2 = (float(v) for v in box)
    if not all(np.isfinite([x1, y1, x2, y2])):
        issues.skip("degenerate", f"{where}: box {[x1, y1, x2, y2]} is not finite; skipped")
        return None
    with np.errstate(over="ignore"):  # (a coordinate past float32's range: inf, and outside the image below)
        f32 = np.asarray([x1, y1, x2, y2], np.float32)  # as the box is stored: 1e-9 wide would be 0 wide
    if x2 <= x1 or y2 <= y1 or f32[2] <= f32[0] or f32[3] <= f32[1]:
        stored = f" in float32, as boxes are stored: {f32[2] - f32[0]:g} x {f32[3] - f32[1]:g}" if (
            x2 > x1 and y2 > y1) else ""
        issues.skip("degenerate", f"{where}: box has non-positive width or height ({x2 - x1:g} x {y2 - y1:g}"
                                  f"{stored}); skipped")
        return None
    if x1 >= width or y1 >= height or x2 <= 0 or y2 <= 0:
        issues.skip(
            "outside",
            f"{where}: box [{x1:g}, {y1:g}, {x2:g}, {y2:g}] lies wholly outside the {width}x{height} image; skipped",
        )
        return None
    cx1, cy1, cx2, cy2 = max(x1, 0.0), max(y1, 0.0), min(x2, float(width)), min(y2, float(height))
    if (cx1, cy1, cx2, cy2) != (x1, y1, x2, y2):
        issues.skipped["clipped"] += 1
        overshoot = max(-x1, -y1, x2 - width, y2 - height)
        message = (f"{where}: box [{x1:g}, {y1:g}, {x2:g}, {y2:g}] extends {overshoot:g} px past the edge of "
                   f"the {width}x{height} image; clipped")
        if overshoot > PAST_EDGE_TOLERANCE:
            issues.past_edge.append(message)
        logger.debug("%s", message)
    return cx1, cy1, cx2, cy2


def rows_to_arrays(rows: list) -> Dict[str, np.ndarray]:
    """The record arrays of ``rows``, each ``(box xyxy, label, iscrowd, difficult, ann_id,
    area)``: ``boxes`` float32 ``[N, 4]``, ``labels`` int64 ``[N]``, ``iscrowd`` and
    ``difficult`` bool ``[N]``, ``ann_ids`` int64 ``[N]``, ``areas`` float32 ``[N]`` (pixels^2)."""
    if not rows:
        return _empty_record_arrays()
    boxes, labels, crowd, difficult, ids, areas = zip(*rows)
    return {
        "boxes": np.asarray(boxes, np.float32).reshape(-1, 4),
        "labels": np.asarray(labels, np.int64),
        "iscrowd": np.asarray(crowd, bool),
        "difficult": np.asarray(difficult, bool),
        "ann_ids": np.asarray(ids, np.int64),
        "areas": np.asarray(areas, np.float32),
    }


MAX_SHOWN_NAME = 40  # characters of a class name in a message


def _same_class(name: str, class_names: Sequence[str]) -> Optional[str]:
    """The one of ``class_names`` that ``name`` differs from only in case, spacing or
    Unicode normalisation (``Cat``, ``cat ``, NFD ``café``), else None."""
    def key(text: str) -> str:
        return " ".join(unicodedata.normalize("NFC", text).casefold().split())
    return next((c for c in class_names if key(c) == key(name)), None)


def other_classes_text(class_names: Sequence[str], dropped: Counter) -> str:
    """``"dog 3, Cat 1 (differs from 'cat' only in case or spacing: ...)"``: the boxes
    of classes outside ``class_names`` per class, most first, each name cut to
    ``MAX_SHOWN_NAME`` characters; a name that is one of ``class_names`` written otherwise
    (a labelling slip whose boxes are dropped) says so."""
    parts = []
    for name, n in dropped.most_common():
        shown = name if len(name) <= MAX_SHOWN_NAME else name[:MAX_SHOWN_NAME - 3] + "..."
        same = _same_class(name, class_names)
        hint = (f" (differs from {same!r} only in case or spacing: the same class? write it as {same!r} in the "
                "annotations, or its boxes are dropped)") if same is not None else ""
        parts.append(f"{shown} {n}{hint}")
    return ", ".join(parts)


def log_other_classes(source: str, class_names: Sequence[str], dropped: Counter) -> None:
    """One line on the boxes of classes outside ``class_names`` that were dropped, per
    class: info, or a warning where a dropped name is a kept class written otherwise."""
    if dropped:
        slip = any(_same_class(name, class_names) is not None for name in dropped)
        logger.log(logging.WARNING if slip else logging.INFO,
                   "%s: training on %d classes (data.class_names); dropped %d boxes of other classes: %s",
                   source, len(class_names), sum(dropped.values()), other_classes_text(class_names, dropped))


def record_boxes(records: Sequence[ImageRecord]) -> Tuple[np.ndarray, np.ndarray]:
    """The labels (int64 ``[N]``) and difficult flags (bool ``[N]``) of every box of ``records``."""
    if not records:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    return np.concatenate([r.labels for r in records]), np.concatenate([r.difficult for r in records])


def missing_class_line(labels: np.ndarray, difficult: np.ndarray, class_names: Sequence[str], use_difficult: bool,
                       where: str, others: Optional[Mapping[str, int]] = None) -> Optional[str]:
    """Training's rule for a class subset: every class of ``class_names`` (labels 1..K) has
    a training box among the boxes ``labels`` (int ``[N]``) and ``difficult`` (bool
    ``[N]``; a difficult box trains only with ``use_difficult``; VOC has no crowd boxes).
    The line for the first class that has none, ``data.class_names: 'cat' has no object
    in <where>`` (with a hint from ``others``, the data's other class names, where given)
    or ``... has only difficult objects (...) in <where>``; None when each class has one."""
    trains = labels if use_difficult else labels[~difficult]
    present, anywhere = set(np.unique(trains).tolist()), set(np.unique(labels).tolist())
    label, name = next(((k, n) for k, n in enumerate(class_names, start=1) if k not in present), (0, None))
    if name is None:
        return None
    if label in anywhere:
        return f"data.class_names: {name!r} has only difficult objects (trained on with data.use_difficult=true) in {where}"
    hint = ""
    if others is not None:
        hint = did_you_mean(name, others) or f"; the data's other classes: {', '.join(sorted(others)) or 'none'}"
    return f"data.class_names: {name!r} has no object in {where}{hint}"


def drop_images_without_training_boxes(store: RecordStore, use_difficult: bool) -> RecordStore:
    """``store`` without the images that have no training box (not crowd; not difficult
    unless ``use_difficult``): ``data.filter_empty``. The same store when none is dropped."""
    a = store.arrays
    mask = ~a["iscrowd"] if use_difficult else ~(a["iscrowd"] | a["difficult"])
    trainable = np.bincount(store.box_image_index()[mask], minlength=len(store))
    keep = np.flatnonzero(trainable > 0)
    return store.subset(keep) if len(keep) < len(store) else store


class DetectionDataset(torch.utils.data.Dataset):
    """Common behaviour of the detection data sets (see the module docstring).

    Items: ``(image, target)`` with ``image`` a uint8 tensor ``[3, H, W]`` and ``target``
    a dict: ``boxes`` float32 ``[N, 4]`` (transformed image coordinates), ``labels`` int64
    ``[N]`` (1..K), ``image_id`` int, ``orig_size`` int64 ``[2]`` = (h, w) of the file,
    ``scale`` float32 ``[2]`` = (sx, sy) = transformed size / original size. Crowd boxes
    (and VOC ``difficult`` boxes unless ``use_difficult``) are not in the target; they are
    in ``get_annotation`` and ``coco_gt`` for evaluation.

    ``class_names[label - 1]`` names each label 1..K; the classes in use are the keys of
    ``label_to_category_id`` (all of 1..K, except the ``unused_<id>`` slots of COCO data
    read with ``label_space="category_id"``, which are neither trained nor evaluated).
    """

    label_space = "contiguous"  # CocoDetection: its ``label_space`` argument
    apply_exif = False  # data.apply_exif (set by build_dataset): see files.decode_image

    def __init__(
        self,
        records: Union[List[ImageRecord], RecordStore],
        class_names: List[str],
        label_to_category_id: Dict[int, int],
        transforms: Optional[Transform] = None,
        use_difficult: bool = False,
        filter_empty: bool = False,
        skipped: Optional[Counter] = None,
        source: str = "",
        images_before_filter: Optional[int] = None,
    ) -> None:
        self.class_names = list(class_names)
        self.label_to_category_id = dict(label_to_category_id)
        self.category_id_to_label = {c: lab for lab, c in self.label_to_category_id.items()}
        self.transforms = transforms
        self.use_difficult = use_difficult
        self.source = source
        self.skipped: Counter = Counter(skipped or {})
        store = records if isinstance(records, RecordStore) else RecordStore.from_records(records)
        # A parser may have filtered already (``images_before_filter``: the count before).
        self.num_images_before_filter = len(store) if images_before_filter is None else images_before_filter
        if filter_empty:
            store = drop_images_without_training_boxes(store, use_difficult)
            if len(store) < self.num_images_before_filter:
                logger.info("%s: %d of %d images have no training boxes and were filtered out (data.filter_empty)",
                            source, self.num_images_before_filter - len(store), self.num_images_before_filter)
        if not len(store):
            why = "; no training boxes in any image" if filter_empty and self.num_images_before_filter else ""
            raise DataError(
                f"{source}: data set is empty after filtering ({self.num_images_before_filter} images before, "
                f"filter_empty={filter_empty}){why}"
            )
        problem = fraction_coordinates_problem(store, source)
        if problem is not None:
            raise DataError(problem)
        # Flat arrays, not one object per image: see records.py (forked loader workers).
        self.records: RecordStore = store

    @property
    def image_ids(self) -> List[int]:
        """The image id of each item, in item order."""
        return self.records.arrays["image_ids"].tolist()

    @property
    def aspect_ratios(self) -> List[float]:
        """width / height of each item's image, in item order."""
        a = self.records.arrays
        return (a["widths"] / a["heights"]).tolist()

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return len(self.records)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def num_training_boxes(self) -> int:
        """Boxes that train (not crowd; not difficult unless ``use_difficult``)."""
        a = self.records.arrays
        mask = ~a["iscrowd"] if self.use_difficult else ~(a["iscrowd"] | a["difficult"])
        return int(mask.sum())

    def _train_mask(self, record: ImageRecord) -> np.ndarray:
        mask = ~record.iscrowd
        if not self.use_difficult:
            mask &= ~record.difficult
        return mask

    def get_annotation(self, idx: int) -> Dict[str, Any]:
        """Raw annotations of item ``idx`` in original-image coordinates: ``boxes`` float32
        ``[N,4]``, ``labels`` int64 ``[N]``, ``iscrowd`` bool ``[N]``, ``difficult`` bool ``[N]``,
        plus ``image_id``, ``height``, ``width``, ``path``."""
        r = self.records[idx]
        return {
            "image_id": r.image_id,
            "height": r.height,
            "width": r.width,
            "path": r.path,
            "boxes": torch.from_numpy(r.boxes.copy()),
            "labels": torch.from_numpy(r.labels.copy()),
            "iscrowd": torch.from_numpy(r.iscrowd.copy()),
            "difficult": torch.from_numpy(r.difficult.copy()),
        }

    def load_image(self, idx: int) -> np.ndarray:
        """The decoded file of item ``idx``, uint8 ``[H, W, 3]`` RGB, checked against the metadata size."""
        r = self.records[idx]
        decoded = decode_image(r.path, r.image_id, self.apply_exif)
        for message in decoded_warnings(r.path, decoded, self.apply_exif):
            warnings.warn(message, DataWarning, stacklevel=2)  # once per file and process
        image = decoded.array
        h, w = image.shape[:2]
        if (h, w) != (r.height, r.width):
            raise DataError(
                f"image file {r.path} (image_id {r.image_id}) is {w}x{h} but its annotation says {r.width}x{r.height}"
            )
        return image

    def __getitem__(self, key: int | SampleKey) -> Tuple[torch.Tensor, Dict[str, Any]]:
        """Item ``key``: an index, or a training sampler's ``SampleKey``, whose epoch and
        position seed the item's augmentation (the transform's ``key``)."""
        idx = key.index if isinstance(key, SampleKey) else key
        r = self.records[idx]
        image = self.load_image(idx)
        mask = self._train_mask(r)
        boxes, labels = r.boxes[mask], r.labels[mask]
        if self.transforms is not None and isinstance(key, SampleKey):
            image_t, boxes_t, labels_t = self.transforms(image, boxes, labels, key=(key.epoch, key.position))
        elif self.transforms is not None:
            image_t, boxes_t, labels_t = self.transforms(image, boxes, labels)
        else:
            image_t = torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))
            boxes_t, labels_t = torch.from_numpy(boxes.copy()), torch.from_numpy(labels.copy())
        new_h, new_w = image_t.shape[-2:]
        target = {
            "boxes": boxes_t.reshape(-1, 4).to(torch.float32),
            "labels": labels_t.reshape(-1).to(torch.int64),
            "image_id": int(r.image_id),
            "orig_size": torch.tensor([r.height, r.width], dtype=torch.int64),
            "scale": torch.tensor([new_w / r.width, new_h / r.height], dtype=torch.float32),
        }
        return image_t, target

    # ------------------------------------------------------------------ evaluation
    def coco_gt(self) -> Dict[str, Any]:
        """Ground truth in COCO format, original image coordinates and category ids.

        Crowd boxes have ``iscrowd: 1``; VOC difficult objects ``iscrowd: 0, ignore: 1,
        difficult: 1``. Skipped annotations (degenerate, outside) are not included; clipped
        boxes appear clipped.
        """
        images, annotations = [], []
        for r in self.records:
            images.append({"id": int(r.image_id), "file_name": os.path.basename(r.path),
                           "width": int(r.width), "height": int(r.height)})
            for j in range(len(r.labels)):
                x1, y1, x2, y2 = (float(v) for v in r.boxes[j])
                ann = {
                    "id": int(r.ann_ids[j]),
                    "image_id": int(r.image_id),
                    "category_id": int(self.label_to_category_id[int(r.labels[j])]),
                    "bbox": [x1, y1, x2 - x1, y2 - y1],
                    "area": float(r.areas[j]),
                    "iscrowd": int(r.iscrowd[j]),
                }
                if r.difficult[j]:
                    ann["ignore"] = 1
                    ann["difficult"] = 1
                annotations.append(ann)
        categories = [{"id": int(cat), "name": self.class_names[label - 1]}
                      for label, cat in self.label_to_category_id.items()]
        return {"images": images, "annotations": annotations, "categories": categories}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.source!r}, images={len(self)}, classes={self.num_classes}, "
                f"skipped={dict(self.skipped)})")
