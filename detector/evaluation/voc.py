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
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Sequence

import numpy as np

from .iou import is_ignored, xywh_to_xyxy
from .results import as_detections

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
    scores: np.ndarray = field(default_factory=lambda: np.zeros(0))
    flags: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))


VOC07_THRESHOLDS = ("exact", "numpy_arange")


def voc07_recall_levels(thresholds: str = "exact") -> np.ndarray:
    """The 11 recall levels of the VOC2007 rule.

    ``"exact"``: ``k / 10`` for k = 0..10, each the double nearest to the decimal, so a
    recall of exactly 3/10 (``tp / npos``, the same double) reaches level 0.3.
    ``"numpy_arange"``: ``np.arange(0, 1.1, 0.1)``, the levels of py-faster-rcnn's,
    detectron2's and mmdetection's ``voc_eval``, three of which lie just above their
    decimal (0.30000000000000004, 0.6000000000000001, 0.7000000000000001): there a
    recall of exactly 0.3, 0.6 or 0.7 does not reach the level.
    """
    if thresholds == "exact":
        return np.arange(11) / 10.0
    if thresholds == "numpy_arange":
        return np.arange(0.0, 1.1, 0.1)
    raise ValueError(f"eval.voc07_thresholds must be one of {', '.join(VOC07_THRESHOLDS)}; got {thresholds!r}")


def ap_voc07(recall: np.ndarray, precision: np.ndarray, thresholds: str = "exact") -> float:
    """VOC2007 11-point AP: mean over the recall levels t (see :func:`voc07_recall_levels`)
    of max(precision[recall >= t]), 0 where no recall reaches t.

    ``"exact"`` sums the 11 values exactly (``math.fsum``) and divides once, so a
    perfect detector scores 1.0; ``"numpy_arange"`` also adds up as the peers'
    ``voc_eval`` does (``ap = ap + p / 11``: 1.0000000000000002 for a perfect
    detector), so its value is theirs to the last bit.
    """
    recall = np.asarray(recall, dtype=np.float64)
    precision = np.asarray(precision, dtype=np.float64)
    values = []
    for t in voc07_recall_levels(thresholds):
        mask = recall >= t
        values.append(float(precision[mask].max()) if mask.any() else 0.0)
    if thresholds == "exact":
        return math.fsum(values) / 11.0
    ap = 0.0
    for p in values:
        ap = ap + p / 11.0
    return ap


def ap_area(recall: np.ndarray, precision: np.ndarray) -> float:
    """Area under the precision envelope (VOC2010+): sum of (r_i - r_{i-1}) * p_interp(r_i)."""
    mrec = np.concatenate([[0.0], np.asarray(recall, dtype=np.float64), [1.0]])
    mpre = np.concatenate([[0.0], np.asarray(precision, dtype=np.float64), [0.0]])
    mpre = np.maximum.accumulate(mpre[::-1])[::-1]
    steps = np.where(mrec[1:] != mrec[:-1])[0]
    return float(np.sum((mrec[steps + 1] - mrec[steps]) * mpre[steps + 1]))


def _pair_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of row i of ``a`` with row i of ``b``, both [P, 4] xyxy (no +1); 0 where the
    union is empty."""
    lt = np.maximum(a[:, :2], b[:, :2])
    rb = np.minimum(a[:, 2:], b[:, 2:])
    wh = np.clip(rb - lt, 0.0, None)
    inter = wh[:, 0] * wh[:, 1]
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a + area_b - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def _same_key_pairs(dt_key: np.ndarray, gt_key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (detection, ground truth) pair with equal keys: ``(pair_dt, pair_gt)``,
    grouped by detection in increasing order, each group's gt in increasing index."""
    gt_order = np.argsort(gt_key, kind="stable")
    sorted_keys = gt_key[gt_order]
    lo = np.searchsorted(sorted_keys, dt_key, side="left")
    hi = np.searchsorted(sorted_keys, dt_key, side="right")
    counts = hi - lo
    pair_dt = np.repeat(np.arange(len(dt_key)), counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    pair_gt = gt_order[np.repeat(lo, counts) + offsets]
    return pair_dt, pair_gt


def voc_match(
    gt_key: np.ndarray, gt_boxes: np.ndarray, gt_ignore: np.ndarray,
    dt_key: np.ndarray, dt_boxes: np.ndarray, dt_rank: np.ndarray, iou_thresh: float,
) -> np.ndarray:
    """The VOC devkit's matching, all images and classes at once.

    Each detection goes to the ground-truth box of the same key (image and class) with
    the highest IoU (the first such box on a tie); at IoU >= ``iou_thresh`` an ignored
    box makes it ignored (-1), a free box a true positive (1) and a box already taken
    by an earlier detection (lower ``dt_rank``) a false positive (0); below, a false
    positive.

    Args:
        gt_key, dt_key: int64 [G], [D] (image, class) keys.
        gt_boxes, dt_boxes: float64 [G, 4], [D, 4] xyxy.
        gt_ignore: bool [G].
        dt_rank: [D] distinct ranks, the order in which detections claim boxes.

    Returns:
        int8 [D] flags.
    """
    flags = np.zeros(len(dt_key), dtype=np.int8)
    pair_dt, pair_gt = _same_key_pairs(dt_key, gt_key)
    if len(pair_dt) == 0:
        return flags
    iou = _pair_iou(dt_boxes[pair_dt], gt_boxes[pair_gt])
    starts = np.flatnonzero(np.r_[True, pair_dt[1:] != pair_dt[:-1]])
    dets = pair_dt[starts]
    best_iou = np.maximum.reduceat(iou, starts)
    is_best = iou == np.repeat(best_iou, np.diff(np.r_[starts, len(iou)]))
    first = np.unique(pair_dt[is_best], return_index=True)[1]  # the first box of highest IoU
    best_gt = pair_gt[np.flatnonzero(is_best)[first]]
    hit = best_iou >= iou_thresh
    dets, best_gt = dets[hit], best_gt[hit]
    ignored = gt_ignore[best_gt]
    flags[dets[ignored]] = -1
    dets, best_gt = dets[~ignored], best_gt[~ignored]
    by_rank = np.argsort(dt_rank[dets], kind="stable")
    claim = np.unique(best_gt[by_rank], return_index=True)[1]  # the earliest claim of each box
    flags[dets[by_rank[claim]]] = 1
    return flags


def voc_evaluate_arrays(
    gt_image: np.ndarray, gt_cats: np.ndarray, gt_boxes: np.ndarray, gt_ignore: np.ndarray,
    dt_image: np.ndarray, dt_cats: np.ndarray, dt_boxes: np.ndarray, dt_scores: np.ndarray,
    cat_ids: Sequence[int], iou_thresh: float = 0.5, voc07_thresholds: str = "exact",
) -> Dict[int, VOCClassResult]:
    """VOC AP per category id, vectorised over all images.

    Args:
        gt_image, dt_image: int64 [G], [D] position of each box's image in the data
            set's image order (ties in score are broken by it, then by input order).
        gt_cats, dt_cats: int64 original category ids.
        gt_boxes, dt_boxes: float64 xyxy; gt_ignore: bool [G] (difficult / crowd);
        dt_scores: float64 [D].

    Classes without non-difficult ground truth get ``nan`` AP (left out of the mean).
    ``voc07_thresholds``: the 11-point rule's recall levels (:func:`voc07_recall_levels`).
    Detections of a category not in ``cat_ids`` are left out.
    """
    voc07_recall_levels(voc07_thresholds)  # an unknown rule fails before the work
    cat_ids = [int(c) for c in cat_ids]
    known = np.isin(dt_cats, cat_ids)
    if not known.all():
        keep = np.flatnonzero(known)
        dt_image, dt_cats, dt_boxes, dt_scores = dt_image[keep], dt_cats[keep], dt_boxes[keep], dt_scores[keep]
    # Each class's curve order: decreasing score, then image order, then input order.
    curve = np.lexsort((np.arange(len(dt_cats)), dt_image, -dt_scores, dt_cats))
    rank = np.empty(len(curve), dtype=np.int64)
    rank[curve] = np.arange(len(curve))
    span = int(max(int(gt_cats.max(initial=0)), int(dt_cats.max(initial=0)))) + 1
    flags = voc_match(gt_image * span + gt_cats, gt_boxes, gt_ignore,
                      dt_image * span + dt_cats, dt_boxes, rank, iou_thresh)
    sorted_cats = dt_cats[curve]
    out = {}
    for c in cat_ids:
        lo, hi = np.searchsorted(sorted_cats, [c, c + 1])
        f = flags[curve[lo:hi]]  # ignored detections (-1) stay as points that add nothing
        tp = np.cumsum(f == 1)
        fp = np.cumsum(f == 0)
        npos = int(np.count_nonzero((gt_cats == c) & ~gt_ignore))
        recall = tp / npos if npos > 0 else np.full(len(tp), np.nan)
        precision = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
        if npos > 0:
            a07, aarea = ap_voc07(recall, precision, voc07_thresholds), ap_area(recall, precision)
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
            scores=dt_scores[curve[lo:hi]],
            flags=f,
        )
    return out


def voc_evaluate(
    gt: Dict[str, Any], results: Any, iou_thresh: float = 0.5,
    voc07_thresholds: str = "exact",
) -> Dict[int, VOCClassResult]:
    """VOC AP per category id, from a COCO-format gt dict (``difficult``/``ignore``/
    ``iscrowd`` flags honoured) and COCO results (a list or ``Detections``)."""
    dets = as_detections(results)
    image_ids = np.array([img["id"] for img in gt["images"]], dtype=np.int64)
    by_id = np.argsort(image_ids, kind="stable")

    def position(ids: np.ndarray) -> np.ndarray:  # index in gt["images"] of each id
        return by_id[np.searchsorted(image_ids[by_id], ids)]

    anns = gt["annotations"]
    cat_ids = sorted(c["id"] for c in gt["categories"])
    return voc_evaluate_arrays(
        position(np.array([a["image_id"] for a in anns], dtype=np.int64)),
        np.array([a["category_id"] for a in anns], dtype=np.int64),
        xywh_to_xyxy(np.array([a["bbox"] for a in anns], dtype=np.float64).reshape(-1, 4)),
        np.array([is_ignored(a) for a in anns], dtype=bool),
        position(dets.image_id),
        dets.category_id, xywh_to_xyxy(dets.bbox), dets.score,
        cat_ids, iou_thresh, voc07_thresholds,
    )


def mean_ap(per_class: Dict[int, VOCClassResult], rule: str = "area") -> float:
    """Mean of the per-class AP over classes with ground truth (``rule``: ``voc07``|``area``);
    -1 where no class has any (as pycocotools reports an AP it cannot compute: 0.0 read
    as a measured, worst score)."""
    values = [r.ap_voc07 if rule == "voc07" else r.ap_area for r in per_class.values() if r.num_gt > 0]
    return float(np.mean(values)) if values else -1.0
