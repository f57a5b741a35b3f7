"""Per-image arrays from COCO-format ground truth and detections.

VOC AP and the IoU metrics work image by image on ``xyxy`` arrays; this module turns
the COCO dicts that every dataset and results file speak into those arrays once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import numpy as np

from .results import Detections, as_detections


@dataclass
class ImageRecord:
    """Ground truth and detections of one image, original pixels, ``xyxy``.

    Attributes:
        gt_boxes: float64 [N, 4].
        gt_cats: int64 [N], original category ids.
        gt_ignore: bool [N], True for crowd (``iscrowd``), ``difficult`` or ``ignore``
            objects: a detection on them is neither a true nor a false positive.
        dt_boxes: float64 [M, 4].
        dt_scores: float64 [M].
        dt_cats: int64 [M].
    """

    gt_boxes: np.ndarray
    gt_cats: np.ndarray
    gt_ignore: np.ndarray
    dt_boxes: np.ndarray
    dt_scores: np.ndarray
    dt_cats: np.ndarray


def xywh_to_xyxy(boxes: np.ndarray) -> np.ndarray:
    """[N, 4] ``x, y, w, h`` -> ``x1, y1, x2, y2`` (no +1)."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    return np.concatenate([boxes[:, :2], boxes[:, :2] + boxes[:, 2:]], axis=1)


def is_ignored(ann: Dict[str, Any]) -> bool:
    """Crowd, VOC ``difficult`` and explicitly ignored objects."""
    return bool(ann.get("iscrowd", 0)) or bool(ann.get("difficult", 0)) or bool(ann.get("ignore", 0))


def _split_by_image(image_of: np.ndarray, image_ids: np.ndarray) -> List[np.ndarray]:
    """For each id of ``image_ids``, the indices ``i`` with ``image_of[i] == id``, in
    increasing order (so each image keeps the input's order)."""
    order = np.argsort(image_of, kind="stable")
    sorted_ids = image_of[order]
    lo = np.searchsorted(sorted_ids, image_ids, side="left")
    hi = np.searchsorted(sorted_ids, image_ids, side="right")
    return [order[a:b] for a, b in zip(lo.tolist(), hi.tolist())]


def group_by_image(gt: Dict[str, Any], results: Any) -> Dict[int, ImageRecord]:
    """One :class:`ImageRecord` per ground-truth image (images without objects or
    detections included), keyed by image id, in the order of ``gt["images"]``.

    ``results``: a COCO results list or :class:`Detections`. Detections of an image
    keep their input order."""
    dets: Detections = as_detections(results)
    image_ids = np.array([img["id"] for img in gt["images"]], dtype=np.int64)
    anns = gt["annotations"]
    ann_img = np.array([a["image_id"] for a in anns], dtype=np.int64)
    ann_box = xywh_to_xyxy(np.array([a["bbox"] for a in anns], dtype=np.float64).reshape(-1, 4))
    ann_cat = np.array([a["category_id"] for a in anns], dtype=np.int64)
    ann_ignore = np.array([is_ignored(a) for a in anns], dtype=bool)
    det_box = xywh_to_xyxy(dets.bbox)
    records = {}
    for image_id, g, d in zip(image_ids.tolist(), _split_by_image(ann_img, image_ids),
                              _split_by_image(dets.image_id, image_ids)):
        records[image_id] = ImageRecord(
            gt_boxes=ann_box[g],
            gt_cats=ann_cat[g],
            gt_ignore=ann_ignore[g],
            dt_boxes=det_box[d],
            dt_scores=dets.score[d],
            dt_cats=dets.category_id[d],
        )
    return records
