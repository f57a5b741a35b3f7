"""PASCAL VOC average precision, per class.

Two rules:

- ``ap_voc07``: the VOC2007 11-point interpolation, the mean over recall levels
  t = 0, 0.1, ..., 1 of the best precision at recall >= t (0 if none);
- ``ap_area``: VOC2010+ area under the precision envelope (precision made monotone
  from the right, summed over the recall steps).

Matching follows the VOC devkit (VOCevaldet.m): detections of a class are taken in
decreasing score; each goes to the ground-truth box of that class in its image with
the highest IoU; if that IoU >= ``iou_thresh`` and the box is ``difficult`` (or crowd,
or ``ignore``), the detection is neither a true nor a false positive; if the box is
free, a true positive; if already taken, a false positive (duplicate). Difficult
objects do not count in the number of positives. IoU uses continuous coordinates,
no "+1" pixel convention.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

import numpy as np

from .records import ImageRecord, group_by_image

logger = logging.getLogger(__name__)

@dataclass
class VOCClassResult:
    """AP of one class and its precision/recall curve (one point per detection, in
    decreasing score order; ``num_gt`` counts non-difficult objects)."""

    ap_voc07: float
    ap_area: float
    recall: np.ndarray
    precision: np.ndarray
    num_gt: int
    num_det: int
    num_tp: int


def ap_voc07(recall: np.ndarray, precision: np.ndarray) -> float:
    """VOC2007 11-point AP: mean over t in {0, 0.1, ..., 1} of max(precision[recall >= t])."""
    recall = np.asarray(recall, dtype=np.float64)
    precision = np.asarray(precision, dtype=np.float64)
    total = 0.0
    for t in np.linspace(0.0, 1.0, 11):
        mask = recall >= t - 1e-12
        total += float(precision[mask].max()) if mask.any() else 0.0
    return total / 11.0


def ap_area(recall: np.ndarray, precision: np.ndarray) -> float:
    """Area under the precision envelope (VOC2010+): sum of (r_i - r_{i-1}) * p_interp(r_i)."""
    mrec = np.concatenate([[0.0], np.asarray(recall, dtype=np.float64), [1.0]])
    mpre = np.concatenate([[0.0], np.asarray(precision, dtype=np.float64), [0.0]])
    mpre = np.maximum.accumulate(mpre[::-1])[::-1]
    steps = np.where(mrec[1:] != mrec[:-1])[0]
    return float(np.sum((mrec[steps + 1] - mrec[steps]) * mpre[steps + 1]))


def _iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of [N, 4] and [M, 4] xyxy boxes -> [N, M] (no +1)."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    wh = np.clip(rb - lt, 0.0, None)
    inter = wh[..., 0] * wh[..., 1]
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def _match_image_class(
    dt_boxes: np.ndarray, gt_boxes: np.ndarray, gt_ignore: np.ndarray, iou_thresh: float
) -> np.ndarray:
    """Per detection (already in decreasing score order): 1 TP, 0 FP, -1 ignored."""
    flags = np.zeros(len(dt_boxes), dtype=np.int8)
    if len(gt_boxes) == 0:
        return flags
    ious = _iou_matrix(dt_boxes, gt_boxes)
    best = ious.argmax(axis=1)
    best_iou = ious[np.arange(len(dt_boxes)), best]
    taken = np.zeros(len(gt_boxes), dtype=bool)
    for i in range(len(dt_boxes)):
        if best_iou[i] < iou_thresh:
            continue  # false positive
        j = best[i]
        if gt_ignore[j]:
            flags[i] = -1
        elif not taken[j]:
            taken[j] = True
            flags[i] = 1
    return flags


def voc_evaluate_records(
    records: Dict[int, ImageRecord], cat_ids: Sequence[int], iou_thresh: float = 0.5
) -> Dict[int, VOCClassResult]:
    """VOC AP per category id from per-image records (see :func:`group_by_image`).

    Classes without non-difficult ground truth get ``nan`` AP (left out of the mean).
    """
    scores: Dict[int, List[np.ndarray]] = {c: [] for c in cat_ids}
    flags: Dict[int, List[np.ndarray]] = {c: [] for c in cat_ids}
    num_gt = {c: 0 for c in cat_ids}
    known = set(int(c) for c in cat_ids)
    for rec in records.values():
        present = np.union1d(rec.gt_cats, rec.dt_cats).tolist()  # classes of this image only
        for c in present:
            if c not in known:
                continue
            gt_mask = rec.gt_cats == c
            num_gt[c] += int(np.count_nonzero(gt_mask & ~rec.gt_ignore))
            dt_idx = np.nonzero(rec.dt_cats == c)[0]
            if len(dt_idx) == 0:
                continue
            order = dt_idx[np.argsort(-rec.dt_scores[dt_idx], kind="stable")]
            scores[c].append(rec.dt_scores[order])
            flags[c].append(_match_image_class(rec.dt_boxes[order], rec.gt_boxes[gt_mask], rec.gt_ignore[gt_mask], iou_thresh))
    out = {}
    for c in cat_ids:
        s = np.concatenate(scores[c]) if scores[c] else np.zeros(0)
        f = np.concatenate(flags[c]) if flags[c] else np.zeros(0, dtype=np.int8)
        order = np.argsort(-s, kind="stable")
        f = f[order]
        tp = np.cumsum(f == 1)
        fp = np.cumsum(f == 0)
        npos = num_gt[c]
        recall = tp / npos if npos > 0 else np.full(len(tp), np.nan)
        precision = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
        if npos > 0:
            a07, aarea = ap_voc07(recall, precision), ap_area(recall, precision)
        else:
            a07 = aarea = float("nan")
        out[c] = VOCClassResult(
            ap_voc07=a07,
            ap_area=aarea,
            recall=recall,
            precision=precision,
            num_gt=npos,
            num_det=int(np.count_nonzero(f >= 0)),
            num_tp=int(tp[-1]) if len(tp) else 0,
        )
    return out


def voc_evaluate(
    gt: Dict[str, Any], results: Sequence[Dict[str, Any]], iou_thresh: float = 0.5
) -> Dict[int, VOCClassResult]:
    """VOC AP per category id, from a COCO-format gt dict (``difficult``/``ignore``/
    ``iscrowd`` flags honoured) and COCO results."""
    cat_ids = sorted(c["id"] for c in gt["categories"])
    return voc_evaluate_records(group_by_image(gt, results), cat_ids, iou_thresh)


def mean_ap(per_class: Dict[int, VOCClassResult], rule: str = "area") -> float:
    """Mean of the per-class AP over classes with ground truth (``rule``: ``voc07``|``area``)."""
    values = [r.ap_voc07 if rule == "voc07" else r.ap_area for r in per_class.values() if r.num_gt > 0]
    return float(np.mean(values)) if values else 0.0
