"""Detection data sets: COCO (instances JSON) and PASCAL VOC (VOCdevkit XML).

Both read their annotations once, at construction, into one ``ImageRecord`` per image
(boxes already in the project's convention: ``[x1, y1, x2, y2]`` float32 absolute pixels,
continuous coordinates, x2 > x1, no "+1"), and decode the image file only in
``__getitem__``. The generated shapes set is written in COCO format and read by
``CocoDetection``.

Bad-input policy (see docs/data.md):

- errors (``DataError``, a ``ValueError``, or ``FileNotFoundError``; one line naming the
  file, field, index or id): a missing or undecodable annotation file, invalid JSON, a
  missing top-level key, an ``image_id`` that appears twice, an annotation whose
  ``image_id`` or ``category_id`` is unknown, a malformed ``bbox``, a VOC object with a class
  name outside ``class_names``, a missing/truncated/corrupt image file (raised when the
  item is loaded), a decoded image whose size differs from the metadata, an image of
  32-bit pixels (no defined 8-bit scale; 16-bit images are scaled, see ``to_rgb8``), a
  COCO ``file_name`` or VOC id that resolves outside the image root, and a data set that
  is empty after filtering;
- counted, logged skips (a warning naming the annotation id, counted in
  ``dataset.skipped``): boxes with non-positive width or height and boxes wholly outside
  their image. Boxes partly outside are clipped to the image (counted in ``skipped["clipped"]``).
  VOC boxes with fractional coordinates are accepted as floats and counted
  (``Issues.non_integer``, reported by the checker).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import json
import logging
import os
import re
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from .samplers import SampleKey

from detector.messages import first_line

logger = logging.getLogger(__name__)

# The 20 PASCAL VOC classes, in the usual order (used when data.class_names is empty).
VOC_CLASSES: Tuple[str, ...] = (
    "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
    "train", "tvmonitor",
)  # fmt: skip


# A box may extend this far (pixels) past the image edge before the checker calls it faulty
# (the data set clips any overshoot).
PAST_EDGE_TOLERANCE = 1.0


class DataError(ValueError):
    """Bad input data (annotation file, image file, or a data set empty after filtering)."""


# transforms(image HWC uint8, boxes [N,4] float32, labels [N] int64[, key=(epoch, position)])
#   -> (image [3,H',W'] uint8 tensor, boxes [M,4] float32 tensor, labels [M] int64 tensor)
# (``key`` is passed when the item is fetched with a ``SampleKey``; see transforms.py.)
Transform = Callable[..., Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class ImageRecord:
    """One image and its raw annotations in original-image pixel coordinates."""

    image_id: int
    path: str
    width: int
    height: int
    boxes: np.ndarray  # float32 [N, 4] xyxy, clipped to the image
    labels: np.ndarray  # int64 [N], 1..K
    iscrowd: np.ndarray  # bool [N]
    difficult: np.ndarray  # bool [N]
    ann_ids: np.ndarray  # int64 [N], annotation ids (VOC: running index within the set)
    areas: np.ndarray  # float32 [N], area for COCO size buckets (pixels^2)


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
    if x2 <= x1 or y2 <= y1:
        issues.skip("degenerate", f"{where}: box has non-positive width or height ({x2 - x1:g} x {y2 - y1:g}); skipped")
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


def to_rgb8(img: Image.Image, what: str) -> np.ndarray:
    """A decoded PIL image as uint8 ``[H, W, 3]`` RGB, scaled correctly from any bit depth.

    - 16-bit grayscale (modes ``I;16``, ``I;16B``, ``I;16L``; ``I`` from a PNG, which can
      only be 16-bit) maps the full range 0..65535 linearly onto 0..255:
      ``round(v * 255 / 65535)`` = ``round(v / 257)``, so 65535 -> 255 and 0 -> 0.
      (PIL's own ``convert("RGB")`` clips every value above 255 to 255, a blank image.)
      16-bit RGB(A) PNGs are already reduced to 8 bits by PIL when opened (high byte).
    - 32-bit integer (``I``, other than PNG) and 32-bit float (``F``) pixels have no
      defined 8-bit scale (a float TIFF may hold 0..1, 0..255 or physical units), so
      they are refused with a ``DataError`` naming the file and mode.
    - Every other mode (``L``, ``P``, ``LA``, ``PA``, ``RGBA``, ``CMYK``, ``1``, ``YCbCr``,
      ...) goes through PIL's ``convert("RGB")``; alpha is dropped, CMYK is converted
      without a colour profile.
    """
    mode = img.mode
    if mode.startswith("I;16") or (mode == "I" and img.format == "PNG"):
        gray = np.clip(np.asarray(img).astype(np.int64), 0, 65535)
        gray8 = ((gray * 255 + 65535 // 2) // 65535).astype(np.uint8)
        return np.repeat(gray8[:, :, None], 3, axis=2)
    if mode in ("I", "F"):
        kind = "32-bit integer" if mode == "I" else "32-bit float"
        raise DataError(f"{what} has {kind} pixels (mode {mode}) with no defined 8-bit scale; "
                        f"save it as an 8- or 16-bit image")
    if mode != "RGB":
        img = img.convert("RGB")
    return np.asarray(img)


def load_image(path: str, image_id: Optional[int] = None) -> np.ndarray:
    """Decode an image file to uint8 RGB ``[H, W, 3]`` (no EXIF rotation: annotation
    sizes refer to the stored pixel array); other bit depths as in ``to_rgb8``.

    Raises:
        FileNotFoundError: the file does not exist.
        DataError: the file cannot be decoded (truncated or corrupt), or its pixel type
            has no defined 8-bit scale.
    """
    what = f"image file {path}" + (f" (image_id {image_id})" if image_id is not None else "")
    try:
        with Image.open(path) as img:
            img.load()
            array = to_rgb8(img, what)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found") from None
    except DataError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        reason = first_line(exc)
        raise DataError(f"cannot decode {what}: {reason}") from None
    return array


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

    def __init__(
        self,
        records: List[ImageRecord],
        class_names: List[str],
        label_to_category_id: Dict[int, int],
        transforms: Optional[Transform] = None,
        use_difficult: bool = False,
        filter_empty: bool = False,
        skipped: Optional[Counter] = None,
        source: str = "",
    ) -> None:
        self.class_names = list(class_names)
        self.label_to_category_id = dict(label_to_category_id)
        self.category_id_to_label = {c: lab for lab, c in self.label_to_category_id.items()}
        self.transforms = transforms
        self.use_difficult = use_difficult
        self.source = source
        self.skipped: Counter = Counter(skipped or {})
        self.num_images_before_filter = len(records)
        if filter_empty:
            kept = [r for r in records if self._train_mask(r).any()]
            if len(kept) < len(records):
                logger.info("%s: %d of %d images have no training boxes and were filtered out (data.filter_empty)",
                            source, len(records) - len(kept), len(records))
            records = kept
        if not records:
            raise DataError(
                f"{source}: data set is empty after filtering ({self.num_images_before_filter} images before, "
                f"filter_empty={filter_empty})"
            )
        self.records = records
        self.image_ids: List[int] = [r.image_id for r in records]
        self.aspect_ratios: List[float] = [r.width / r.height for r in records]

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return len(self.records)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

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
        image = load_image(r.path, r.image_id)
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


# ---------------------------------------------------------------------------- COCO


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; a missing file or invalid JSON is a one-line error naming it."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"annotation file not found: {path}") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise DataError(f"annotation file {path} is not valid JSON: {msg}{where}") from None


def path_within(root: str, name: str) -> Optional[str]:
    """``root/name``, or None when ``name`` is empty, absolute or climbs out of ``root``
    with ``..`` (checked on the text, no file access). Symbolic links inside ``root`` are
    followed: linking files into an image folder is a common, deliberate set-up."""
    if not name or os.path.isabs(name) or os.path.splitdrive(name)[0]:
        return None
    rel = os.path.normpath(name)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return None
    return os.path.join(root, rel)


def _coco_subset(names_by_id: Dict[Any, str], class_names: Sequence[str], ann_file: str) -> List[Any]:
    """The category ids of ``class_names`` (category names), in that order.

    Raises:
        DataError: a name that is no category of ``ann_file`` (with the nearest one), or
            a name that two categories share.
    """
    ids_by_name: Dict[str, List[Any]] = {}
    for c, name in names_by_id.items():
        ids_by_name.setdefault(name, []).append(c)
    out = []
    for name in class_names:
        ids = ids_by_name.get(name, [])
        if not ids:
            near = difflib.get_close_matches(name, list(ids_by_name), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise DataError(f"data.class_names: {name!r} is not a category name of {ann_file}{hint}")
        if len(ids) > 1:
            raise DataError(f"data.class_names: {name!r} names {len(ids)} categories of {ann_file} (ids {ids})")
        out.append(ids[0])
    return out


def coco_label_map(
    names_by_id: Dict[Any, str], class_names: Optional[Sequence[str]], label_space: str, ann_file: str
) -> Tuple[List[str], Dict[int, int], List[Any]]:
    """Labels of the COCO categories ``names_by_id`` (category id -> name, sorted by id).

    Returns ``(class_names, label_to_category_id, cat_ids)``: ``class_names[label - 1]``
    names each label, ``cat_ids`` are the ids in use (as in the JSON, in label order):

    - ``contiguous``: the categories (sorted by id, or those of ``class_names`` in that
      order) are labels 1..K;
    - ``category_id``: label = category id, so there are ``max(id)`` labels; ids that are
      no category in use (undefined, or left out of ``class_names``) are named
      ``unused_<id>`` and are not in ``label_to_category_id`` (nor evaluated).

    Raises:
        DataError: with ``category_id``, a category id in use that is not an integer >= 1.
    """
    cat_ids = _coco_subset(names_by_id, class_names, ann_file) if class_names else list(names_by_id)
    if label_space == "contiguous":
        return [names_by_id[c] for c in cat_ids], {i + 1: int(c) for i, c in enumerate(cat_ids)}, cat_ids
    for c in cat_ids:
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise DataError(f"annotation file {ann_file}: category {names_by_id[c]!r} has id {c!r}; "
                            f"data.label_space=category_id needs integer category ids >= 1")
    used = sorted(cat_ids)
    label_to_category_id = {c: c for c in used}
    names = [names_by_id[i] if i in label_to_category_id else f"unused_{i}" for i in range(1, max(used, default=0) + 1)]
    return names, label_to_category_id, used


def _read_coco_json(ann_file: str) -> Dict[str, Any]:
    """Read ``ann_file`` and check its top level.

    Returns the parsed object (a dict whose ``images`` and ``categories`` are lists; a
    missing ``annotations`` is set to ``[]``).

    Raises:
        DataError: the top level is no object, or ``images``/``categories`` is missing or
            not a list (and :func:`read_json`'s errors).
    """
    data = read_json(ann_file)
    if not isinstance(data, dict):
        raise DataError(f"annotation file {ann_file}: the top level must be an object with 'images', 'annotations', 'categories'")
    for key in ("images", "categories"):
        if not isinstance(data.get(key), list):
            raise DataError(f"annotation file {ann_file}: missing or malformed top-level key '{key}'")
    data.setdefault("annotations", [])
    return data


def _coco_categories(categories_list: list, ann_file: str, issues: Issues) -> Dict[Any, dict]:
    """The ``categories`` entries by id (a repeated id: an error in ``issues``; the last wins).

    Raises:
        DataError: an entry that is no object with an ``id``.
    """
    categories = {}
    for i, cat in enumerate(categories_list):
        if not isinstance(cat, dict) or "id" not in cat:
            raise DataError(f"annotation file {ann_file}: categories[{i}] has no 'id'")
        if cat["id"] in categories:
            issues.error(f"annotation file {ann_file}: category id {cat['id']} appears twice in 'categories'")
        categories[cat["id"]] = cat
    return categories


def _coco_images(
    images: list, ann_file: str, image_dir: str | os.PathLike, issues: Issues
) -> Tuple[List[dict], Dict[Any, str]]:
    """The valid ``images`` entries: required fields, integer id, positive size,
    ``file_name`` inside ``image_dir``, unique id (pycocotools would silently keep the
    last one). Each invalid entry is an error in ``issues`` and left out.

    Returns ``(good_images, seen)``: the valid entries in file order, and their
    ``file_name`` by image id.
    """
    seen: Dict[Any, str] = {}
    good_images = []
    for i, img in enumerate(images):
        missing = [k for k in ("id", "file_name", "width", "height") if not isinstance(img, dict) or k not in img]
        if missing:
            issues.error(f"annotation file {ann_file}: images[{i}] lacks {', '.join(repr(k) for k in missing)}")
            continue
        if not isinstance(img["id"], int) or isinstance(img["id"], bool):
            issues.error(f"annotation file {ann_file}: images[{i}] has id {img['id']!r}; image ids must be integers")
            continue
        if not all(isinstance(img[k], (int, float)) and img[k] > 0 for k in ("width", "height")):
            issues.error(f"annotation file {ann_file}: image_id {img['id']}: width/height must be positive numbers, "
                         f"got {img['width']!r} x {img['height']!r}")
            continue
        if not isinstance(img["file_name"], str) or path_within(str(image_dir), img["file_name"]) is None:
            issues.error(f"annotation file {ann_file}: image_id {img['id']}: file_name {img['file_name']!r} "
                         f"resolves outside the image root {image_dir}")
            continue
        if img["id"] in seen:
            issues.error(
                f"annotation file {ann_file}: image_id {img['id']} appears twice "
                f"({seen[img['id']]!r} and {img['file_name']!r})"
            )
            continue
        seen[img["id"]] = img["file_name"]
        good_images.append(img)
    return good_images, seen


def _coco_annotations(
    annotations: list,
    ann_file: str,
    seen: Dict[Any, str],
    category_id_to_label: Dict[Any, int],
    names_by_id: Dict[Any, str],
    issues: Issues,
) -> Tuple[Dict[Any, list], List[dict]]:
    """The valid ``annotations`` entries: an object with a unique ``id``, a valid
    ``image_id`` (a key of ``seen``, the valid images), a ``category_id`` in use and a
    ``bbox`` of 4 numbers. Each invalid entry is an error in ``issues`` and left out; an
    annotation of a category left out of ``data.class_names`` is counted by name in
    ``issues.other_classes`` and left out.

    Returns ``(anns_by_image, good_anns)``: the valid entries by image id (every id of
    ``seen``, in its order) and in file order.
    """
    anns_by_image: Dict[Any, list] = {image_id: [] for image_id in seen}
    good_anns = []
    ann_ids: set = set()
    for i, ann in enumerate(annotations):
        if not isinstance(ann, dict) or "id" not in ann:
            issues.error(f"annotation file {ann_file}: annotations[{i}] is not an object with an 'id'")
            continue
        where = f"annotation file {ann_file}: annotation id {ann['id']}"
        if ann["id"] in ann_ids:
            issues.error(f"{where} appears twice")
            continue
        ann_ids.add(ann["id"])
        if ann.get("image_id") not in seen:  # the keys of anns_by_image
            issues.error(f"{where}: image_id {ann.get('image_id')!r} is not in 'images'")
            continue
        if ann.get("category_id") not in category_id_to_label:
            if ann.get("category_id") in names_by_id:  # a category left out of data.class_names
                issues.other_classes[names_by_id[ann["category_id"]]] += 1
            else:
                issues.error(f"{where}: category_id {ann.get('category_id')!r} is not in 'categories'")
            continue
        bbox = ann.get("bbox")
        if not isinstance(bbox, (list, tuple)) or len(bbox) != 4 or not all(isinstance(v, (int, float)) for v in bbox):
            issues.error(f"{where}: 'bbox' must be 4 numbers [x, y, w, h], got {bbox!r}")
            continue
        anns_by_image[ann["image_id"]].append(ann)
        good_anns.append(ann)
    return anns_by_image, good_anns


def _coco_records(
    good_images: List[dict],
    anns_by_image: Dict[Any, list],
    category_id_to_label: Dict[Any, int],
    image_dir: str | os.PathLike,
    ann_file: str,
    issues: Issues,
) -> List[ImageRecord]:
    """One ``ImageRecord`` per valid image, in order: each ``[x, y, w, h]`` becomes
    ``[x, y, x + w, y + h]`` and goes through :func:`check_box` (skips and clips counted in
    ``issues``); area is the annotation's positive ``area``, else ``w * h``."""
    records = []
    image_dir = str(image_dir)
    for img in good_images:
        width, height = int(img["width"]), int(img["height"])
        rows = []
        for ann in anns_by_image[img["id"]]:
            x, y, w, h = (float(v) for v in ann["bbox"])
            box = check_box((x, y, x + w, y + h), width, height,
                            f"annotation file {ann_file}: annotation id {ann.get('id')} (image_id {img['id']})", issues)
            if box is None:
                continue
            area = float(ann["area"]) if isinstance(ann.get("area"), (int, float)) and ann["area"] > 0 else w * h
            rows.append((box, category_id_to_label[ann["category_id"]], bool(ann.get("iscrowd", 0)),
                         bool(ann.get("difficult", 0) or ann.get("ignore", 0) and not ann.get("iscrowd", 0)),
                         int(ann.get("id", 0)), area))
        arrays = _rows_to_arrays(rows)
        records.append(ImageRecord(image_id=int(img["id"]), path=path_within(image_dir, img["file_name"]),
                                   width=width, height=height, **arrays))
    return records


def parse_coco(
    ann_file: str | os.PathLike,
    image_dir: str | os.PathLike,
    issues: Issues,
    class_names: Optional[Sequence[str]] = None,
    label_space: str = "contiguous",
) -> Tuple[List[ImageRecord], List[str], Dict[int, int], Any]:
    """Parse a COCO instances JSON (through pycocotools' index) into image records.

    Returns ``(records, class_names, label_to_category_id, coco)``: labels as
    :func:`coco_label_map` gives them for ``label_space``. ``[x, y, w, h]`` becomes
    ``[x, y, x + w, y + h]``.

    ``class_names`` (category names, e.g. ``data.class_names``) keeps those categories
    only; annotations of the other categories are dropped and counted by name in
    ``issues.other_classes``.
    """
    from pycocotools.coco import COCO

    ann_file = str(ann_file)
    data = _read_coco_json(ann_file)

    # Categories -> labels (see coco_label_map).
    categories = _coco_categories(data["categories"], ann_file, issues)
    names_by_id = {c: str(categories[c].get("name", c)) for c in sorted(categories)}
    class_names, label_to_category_id, cat_ids = coco_label_map(names_by_id, class_names, label_space, ann_file)
    category_id_to_label = {c: lab for lab, c in label_to_category_id.items()}

    good_images, seen = _coco_images(data["images"], ann_file, image_dir, issues)
    anns_by_image, good_anns = _coco_annotations(data["annotations"], ann_file, seen, category_id_to_label,
                                                 names_by_id, issues)

    # pycocotools' index over the validated content (it would silently keep the last of
    # two equal ids, and fail on annotations without one).
    coco = COCO()
    coco.dataset = {**data, "images": good_images, "annotations": good_anns,
                    "categories": [categories[c] for c in cat_ids]}
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()

    records = _coco_records(good_images, anns_by_image, category_id_to_label, image_dir, ann_file, issues)
    return records, class_names, label_to_category_id, coco


def _rows_to_arrays(rows: list) -> Dict[str, np.ndarray]:
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


class CocoDetection(DetectionDataset):
    """A COCO instances JSON plus an image folder.

    Category ids (any, e.g. 1, 7, 90) map to contiguous labels 1..K in id order and back
    (``label_to_category_id``). ``iscrowd`` boxes are kept for evaluation, not trained on.

    Args:
        image_dir: folder holding the ``file_name`` of each image.
        ann_file: the instances JSON.
        transforms: callable applied to (image, boxes, labels); None = no resize.
        filter_empty: drop images without a trainable box.
        class_names: category names to keep, as labels 1..K in this order (a subset;
            the other categories' boxes are dropped and counted in the log); None = all.
        label_space: ``contiguous`` (labels 1..K) or ``category_id`` (label = category
            id; see :func:`coco_label_map`).
    """

    def __init__(
        self,
        image_dir: str | os.PathLike,
        ann_file: str | os.PathLike,
        transforms: Optional[Transform] = None,
        filter_empty: bool = False,
        use_difficult: bool = False,
        class_names: Optional[Sequence[str]] = None,
        label_space: str = "contiguous",
    ) -> None:
        issues = Issues(strict=True)
        records, class_names, label_to_cat, coco = parse_coco(ann_file, image_dir, issues, class_names, label_space)
        self.label_space = label_space
        self.coco = coco
        self.image_dir = str(image_dir)
        self.ann_file = str(ann_file)
        if issues.skipped:
            logger.warning("%s: skipped annotations: %s", ann_file, dict(issues.skipped))
        log_other_classes(str(ann_file), [class_names[lab - 1] for lab in label_to_cat], issues.other_classes)
        super().__init__(records, class_names, label_to_cat, transforms=transforms, use_difficult=use_difficult,
                         filter_empty=filter_empty, skipped=issues.skipped, source=str(ann_file))


# ---------------------------------------------------------------------------- VOC


def _xml_text(node: Optional[ET.Element], tag: str) -> Optional[str]:
    child = node.find(tag) if node is not None else None
    return child.text.strip() if child is not None and child.text is not None else None


def voc_image_ids(ids: Sequence[str]) -> List[int]:
    """Integer image ids for VOC ids: "2008_000123" -> 2008000123, "000005" -> 5 when every
    id is of that form and the results are unique; otherwise 1..N in split-file order."""
    pattern = re.compile(r"^\d+(_\d+)?$")
    if all(pattern.match(s) for s in ids):
        ints = [int(s.replace("_", "")) for s in ids]
        if len(set(ints)) == len(ints):
            return ints
    return list(range(1, len(ids) + 1))


def log_other_classes(source: str, class_names: Sequence[str], dropped: Counter) -> None:
    """One info line: the boxes of classes outside ``class_names`` that were dropped, per class."""
    if dropped:
        logger.info("%s: training on %d classes (data.class_names); dropped %d boxes of other classes: %s",
                    source, len(class_names), sum(dropped.values()),
                    ", ".join(f"{name} {n}" for name, n in dropped.most_common()))


def _voc_split_ids(split_file: Path, issues: Issues) -> List[str]:
    """The image ids listed in ``split_file`` (first word of each non-blank line), each
    once, in file order; an id listed more than once is an error in ``issues``.

    Raises:
        FileNotFoundError: ``split_file`` does not exist.
    """
    if not split_file.is_file():
        raise FileNotFoundError(f"VOC split file not found: {split_file}")
    ids = [line.split()[0] for line in split_file.read_text().splitlines() if line.strip()]
    counts = Counter(ids)
    for name, n in counts.items():
        if n > 1:
            issues.error(f"VOC split file {split_file}: image id '{name}' appears {n} times")
    return list(dict.fromkeys(ids))


def _read_voc_xml(xml_path: Path, issues: Issues) -> Optional[Tuple[ET.Element, int, int]]:
    """Parse one VOC XML file: ``(root element, width, height)`` in pixels, or None after
    an error in ``issues`` (missing file, invalid XML, missing/bad or non-positive size)."""
    try:
        tree = ET.parse(xml_path)
    except FileNotFoundError:
        issues.error(f"VOC annotation file not found: {xml_path}")
        return None
    except ET.ParseError as exc:
        issues.error(f"VOC annotation file {xml_path} is not valid XML: {exc}")
        return None
    node = tree.getroot()
    size = node.find("size")
    try:
        width, height = int(float(_xml_text(size, "width"))), int(float(_xml_text(size, "height")))
    except (TypeError, ValueError):
        issues.error(f"VOC annotation file {xml_path}: missing or bad <size><width>/<height>")
        return None
    if width <= 0 or height <= 0:
        issues.error(f"VOC annotation file {xml_path}: image size {width}x{height} is not positive")
        return None
    return node, width, height


def _voc_object_row(
    obj: ET.Element,
    where: str,
    width: int,
    height: int,
    name_to_label: Dict[str, int],
    drop_other_classes: bool,
    ann_id: int,
    issues: Issues,
) -> Optional[tuple]:
    """One ``<object>`` (``where`` names it in messages) of a ``width`` x ``height`` image.

    Returns the row ``(box xyxy, label, iscrowd=False, difficult, ann_id, area)`` with the
    box converted from VOC's 1-based inclusive pixels and checked by :func:`check_box`, or
    None: an unknown class (an error in ``issues``, or with ``drop_other_classes``
    counted in ``issues.other_classes``), bad ``<bndbox>`` coordinates (an error), or a
    box that :func:`check_box` skips. Fractional coordinates are accepted and noted in
    ``issues.non_integer``.
    """
    name = _xml_text(obj, "name")
    if name not in name_to_label:
        if drop_other_classes and name:
            issues.other_classes[name] += 1
        else:
            issues.error(f"{where}: class name {name!r} is not in data.class_names")
        return None
    bnd = obj.find("bndbox")
    try:
        xmin, ymin, xmax, ymax = (float(_xml_text(bnd, k)) for k in ("xmin", "ymin", "xmax", "ymax"))
    except (TypeError, ValueError):
        issues.error(f"{where}: missing or bad <bndbox> coordinates")
        return None
    box = check_box((xmin - 1.0, ymin - 1.0, xmax, ymax), width, height, where, issues)
    if box is None:
        return None
    if not all(float(v).is_integer() for v in (xmin, ymin, xmax, ymax)):
        # VOC writes integer pixel indices; some tools write fractions. Accepted as
        # floats (same conversion), counted for check_dataset's report.
        issues.non_integer.append(f"{where}: non-integer coordinates "
                                  f"[{xmin:g}, {ymin:g}, {xmax:g}, {ymax:g}] (accepted as floats)")
    difficult = (_xml_text(obj, "difficult") or "0") not in ("0", "")
    area = (box[2] - box[0]) * (box[3] - box[1])
    return box, name_to_label[name], False, difficult, ann_id, area


def parse_voc(
    root: str | os.PathLike,
    split: str,
    class_names: Sequence[str],
    issues: Issues,
    drop_other_classes: bool = False,
) -> List[ImageRecord]:
    """Parse ``<root>/ImageSets/Main/<split>.txt`` and ``<root>/Annotations/<id>.xml``.

    An object whose class is not in ``class_names`` is an error, or, with
    ``drop_other_classes`` (a class subset), dropped and counted by name in
    ``issues.other_classes``.

    VOC boxes are 1-based inclusive pixel indices: ``xmin..xmax`` covers pixels xmin to
    xmax. In continuous 0-based coordinates that is ``[xmin - 1, xmax]`` (width
    ``xmax - xmin + 1``); likewise for y. This conversion happens here, once.
    """
    root = Path(root)
    split_file = root / "ImageSets" / "Main" / f"{split}.txt"
    ids = _voc_split_ids(split_file, issues)
    int_ids = voc_image_ids(ids)
    name_to_label = {name: i + 1 for i, name in enumerate(class_names)}
    records = []
    ann_counter = 0
    for vid, image_id in zip(ids, int_ids):
        if path_within(str(root / "JPEGImages"), f"{vid}.jpg") is None:
            issues.error(f"VOC split file {split_file}: image id {vid!r} resolves outside the year folder {root}")
            continue
        xml_path = root / "Annotations" / f"{vid}.xml"
        parsed = _read_voc_xml(xml_path, issues)
        if parsed is None:
            continue
        node, width, height = parsed
        rows = []
        for j, obj in enumerate(node.findall("object")):
            ann_counter += 1  # every object counts, kept or not
            row = _voc_object_row(obj, f"VOC annotation file {xml_path}: object {j}", width, height,
                                  name_to_label, drop_other_classes, ann_counter, issues)
            if row is not None:
                rows.append(row)
        records.append(ImageRecord(image_id=image_id, path=str(root / "JPEGImages" / f"{vid}.jpg"),
                                   width=width, height=height, **_rows_to_arrays(rows)))
    return records


class VOCDetection(DetectionDataset):
    """A PASCAL VOC year folder (``VOCdevkit/VOC2007``): ``JPEGImages/``,
    ``Annotations/*.xml``, ``ImageSets/Main/<split>.txt``.

    Labels follow ``class_names`` (1..K); ``label_to_category_id`` is the identity.
    ``class_names`` None means VOC's 20 (another class in the XML is an error); a given
    list is a subset: objects of other classes are dropped and counted in the log, and
    with ``require_every_class`` (training) a listed class without any object is an error.
    ``difficult`` objects are flagged; they are trained on only with ``use_difficult``.
    Image ids: see ``voc_image_ids``.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        split: str,
        class_names: Optional[Sequence[str]] = None,
        transforms: Optional[Transform] = None,
        filter_empty: bool = False,
        use_difficult: bool = False,
        require_every_class: bool = False,
    ) -> None:
        subset = bool(class_names)
        class_names = list(class_names) if class_names else list(VOC_CLASSES)
        issues = Issues(strict=True)
        records = parse_voc(root, split, class_names, issues, drop_other_classes=subset)
        self.root = str(root)
        self.split = split
        if issues.skipped:
            logger.warning("%s (%s): skipped objects: %s", root, split, dict(issues.skipped))
        if issues.non_integer:
            logger.info("%s (%s): %d objects have non-integer <bndbox> coordinates, used as floats (first: %s)",
                        root, split, len(issues.non_integer), issues.non_integer[0])
        self.num_non_integer_boxes = len(issues.non_integer)
        if subset and require_every_class:
            _check_every_class(records, class_names, issues.other_classes, f"{root} ({split})")
        log_other_classes(f"{root} ({split})", class_names, issues.other_classes)
        super().__init__(records, class_names, {i + 1: i + 1 for i in range(len(class_names))},
                         transforms=transforms, use_difficult=use_difficult, filter_empty=filter_empty,
                         skipped=issues.skipped, source=f"{root} ({split})")


def _check_every_class(records: List[ImageRecord], class_names: Sequence[str], others: Counter, source: str) -> None:
    """A training set must hold at least one object of every class of ``data.class_names``."""
    present = set()
    for r in records:
        present.update(int(lab) for lab in r.labels.tolist())
    for label, name in enumerate(class_names, start=1):
        if label not in present:
            near = difflib.get_close_matches(name, list(others), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f"; the data's other classes: {', '.join(sorted(others)) or 'none'}"
            raise DataError(f"data.class_names: {name!r} has no object in {source}{hint}")
