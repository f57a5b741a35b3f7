"""Per-image arrays from COCO-format ground truth and detections.

VOC AP and the IoU metrics work image by image on ``xyxy`` arrays; this module turns
the COCO dicts that every dataset and results file speak into those arrays once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

import numpy as np


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


def group_by_image(gt: Dict[str, Any], results: Sequence[Dict[str, Any]]) -> Dict[int, ImageRecord]:
    """One :class:`ImageRecord` per ground-truth image (images without objects or
    detections included), keyed by image id, in the order of ``gt["images"]``."""
    gt_lists: Dict[int, List[Dict[str, Any]]] = {img["id"]: [] for img in gt["images"]}
    dt_lists: Dict[int, List[Dict[str, Any]]] = {img["id"]: [] for img in gt["images"]}
    for ann in gt["annotations"]:
        gt_lists[ann["image_id"]].append(ann)
    for res in results:
        dt_lists[res["image_id"]].append(res)
    records = {}
    for image_id, anns in gt_lists.items():
        dets = dt_lists[image_id]
        records[image_id] = ImageRecord(
            gt_boxes=xywh_to_xyxy(np.array([a["bbox"] for a in anns], dtype=np.float64).reshape(-1, 4)),
            gt_cats=np.array([a["category_id"] for a in anns], dtype=np.int64),
            gt_ignore=np.array([is_ignored(a) for a in anns], dtype=bool),
            dt_boxes=xywh_to_xyxy(np.array([d["bbox"] for d in dets], dtype=np.float64).reshape(-1, 4)),
            dt_scores=np.array([d["score"] for d in dets], dtype=np.float64),
            dt_cats=np.array([d["category_id"] for d in dets], dtype=np.int64),
        )
    return records
