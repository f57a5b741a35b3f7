"""IoU and related metrics: matched-box IoU, precision / recall / F1 at a score
threshold, object-count error and correlation, and a confusion matrix.

All boxes are ``[x1, y1, x2, y2]`` in pixels. Pairwise IoU is
``torchvision.ops.box_iou``.

Matching (:func:`greedy_match`) is greedy in decreasing score, per class: each
detection takes the still-free ground-truth box of its class with the highest IoU,
if that IoU >= the threshold. Detections left unmatched that overlap an ignored
ground-truth box (crowd or difficult) by >= the threshold are neither true nor false
positives; ignored boxes are never counted as misses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence

import numpy as np
import torch
from torchvision.ops import box_iou

from .records import ImageRecord

UNMATCHED = -1
IGNORED = -2


@dataclass
class MatchResult:
    """Output of :func:`greedy_match` for one image.

    Attributes:
        det_to_gt: int64 [M]: index of the matched ground-truth box, ``UNMATCHED`` (-1)
            for a false positive, ``IGNORED`` (-2) for a detection on an ignored box.
        iou: float [M]: IoU with the matched box (0 where not matched).
        gt_matched: bool [N].
    """

    det_to_gt: torch.Tensor
    iou: torch.Tensor
    gt_matched: torch.Tensor


def greedy_match(
    det_boxes: torch.Tensor,
    det_scores: torch.Tensor,
    det_labels: torch.Tensor,
    gt_boxes: torch.Tensor,
    gt_labels: torch.Tensor,
    iou_thresh: float = 0.5,
    gt_ignore: Optional[torch.Tensor] = None,
    class_aware: bool = True,
) -> MatchResult:
    """Greedy score-ordered one-to-one matching of detections to ground truth.

    Args:
        det_boxes: [M, 4]; det_scores: [M]; det_labels: [M].
        gt_boxes: [N, 4]; gt_labels: [N].
        iou_thresh: a match needs IoU >= this.
        gt_ignore: bool [N], crowd/difficult boxes (default none).
        class_aware: match only boxes of the same label (False: any label).
    """
    m, n = det_boxes.shape[0], gt_boxes.shape[0]
    det_to_gt = torch.full((m,), UNMATCHED, dtype=torch.int64)
    matched_iou = torch.zeros(m, dtype=torch.float64)
    gt_matched = torch.zeros(n, dtype=torch.bool)
    if m == 0 or n == 0:
        return MatchResult(det_to_gt, matched_iou, gt_matched)
    if gt_ignore is None:
        gt_ignore = torch.zeros(n, dtype=torch.bool)
    ious = box_iou(det_boxes.double(), gt_boxes.double()).cpu().numpy()  # [M, N]
    if class_aware:
        same = det_labels.cpu().numpy()[:, None] == gt_labels.cpu().numpy()[None, :]
        ious = np.where(same, ious, -1.0)
    ignore = gt_ignore.cpu().numpy().astype(bool)
    usable = np.where(ignore[None, :], -1.0, ious)
    taken = np.zeros(n, dtype=bool)
    d2g = np.full(m, UNMATCHED, dtype=np.int64)
    d_iou = np.zeros(m, dtype=np.float64)
    order = torch.argsort(det_scores.cpu(), descending=True, stable=True).numpy()
    # A detection with no usable IoU >= iou_thresh can never match (taking boxes only
    # lowers a row): the loop visits the others only, in the same order.
    reachable = usable.max(axis=1) >= iou_thresh
    for i in order[reachable[order]].tolist():
        row = np.where(taken, -1.0, usable[i])
        j = int(row.argmax())
        if row[j] >= iou_thresh:
            d2g[i], d_iou[i], taken[j] = j, row[j], True
    if ignore.any():
        on_ignored = (ious[:, ignore] >= iou_thresh).any(axis=1)
        d2g[(d2g == UNMATCHED) & on_ignored] = IGNORED
    det_to_gt = torch.from_numpy(d2g)
    matched_iou = torch.from_numpy(d_iou)
    gt_matched = torch.from_numpy(taken)
    return MatchResult(det_to_gt, matched_iou, gt_matched)


def count_mae(pred_counts: Sequence[float], gt_counts: Sequence[float]) -> float:
    """Mean absolute error between per-image object counts."""
    p = np.asarray(pred_counts, dtype=np.float64)
    g = np.asarray(gt_counts, dtype=np.float64)
    if p.shape != g.shape:
        raise ValueError(f"count arrays differ in shape: {p.shape} vs {g.shape}")
    return float(np.mean(np.abs(p - g))) if p.size else 0.0


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation coefficient; ``nan`` when either array is constant or has
    fewer than 2 values (the coefficient is undefined there)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"arrays differ in shape: {x.shape} vs {y.shape}")
    if x.size < 2:
        return float("nan")
    dx, dy = x - x.mean(), y - y.mean()
    denom = np.sqrt(np.sum(dx * dx) * np.sum(dy * dy))
    return float(np.sum(dx * dy) / denom) if denom > 0 else float("nan")


def _tensors(rec: ImageRecord, score_thresh: float):
    keep = rec.dt_scores >= score_thresh
    return (
        torch.from_numpy(rec.dt_boxes[keep]),
        torch.from_numpy(rec.dt_scores[keep]),
        torch.from_numpy(rec.dt_cats[keep]),
        torch.from_numpy(rec.gt_boxes),
        torch.from_numpy(rec.gt_cats),
        torch.from_numpy(rec.gt_ignore),
    )


def iou_metrics(
    records: Iterable[ImageRecord],
    score_thresh: float = 0.5,
    iou_thresholds: Sequence[float] = (0.5, 0.75),
) -> Dict[str, float]:
    """IoU-based metrics over images, for detections with score >= ``score_thresh``.

    Returns keys:
        ``mean_iou``: mean IoU of the detections matched at the first threshold;
        ``precision_<t>``, ``recall_<t>``, ``f1_<t>`` for each threshold t (written as
        50, 75: ``precision_50``...): TP / (TP + FP), TP / (TP + FN), harmonic mean
        (0 where the denominator is 0);
        ``count_mae``, ``count_pearson``: per-image number of detections vs number of
        (non-ignored) ground-truth objects.
    """
    records = list(records)
    tp = {t: 0 for t in iou_thresholds}
    fp = {t: 0 for t in iou_thresholds}
    fn = {t: 0 for t in iou_thresholds}
    matched_ious = []
    pred_counts, gt_counts = [], []
    for rec in records:
        db, ds, dl, gb, gl, gi = _tensors(rec, score_thresh)
        pred_counts.append(db.shape[0])
        gt_counts.append(int((~gi).sum()))
        for k, t in enumerate(iou_thresholds):
            res = greedy_match(db, ds, dl, gb, gl, t, gi)
            n_tp = int((res.det_to_gt >= 0).sum())
            tp[t] += n_tp
            fp[t] += int((res.det_to_gt == UNMATCHED).sum())
            fn[t] += int((~gi).sum()) - n_tp
            if k == 0:
                matched_ious.append(res.iou[res.det_to_gt >= 0].numpy())
    out: Dict[str, float] = {}
    ious = np.concatenate(matched_ious) if matched_ious else np.zeros(0)
    out["mean_iou"] = float(ious.mean()) if ious.size else 0.0
    for t in iou_thresholds:
        name = f"{int(round(t * 100))}"
        p = tp[t] / (tp[t] + fp[t]) if tp[t] + fp[t] else 0.0
        r = tp[t] / (tp[t] + fn[t]) if tp[t] + fn[t] else 0.0
        out[f"precision_{name}"] = p
        out[f"recall_{name}"] = r
        out[f"f1_{name}"] = 2 * p * r / (p + r) if p + r else 0.0
    out["count_mae"] = count_mae(pred_counts, gt_counts)
    out["count_pearson"] = pearson(pred_counts, gt_counts)
    return out


def confusion_matrix(
    records: Iterable[ImageRecord],
    cat_ids: Sequence[int],
    score_thresh: float = 0.5,
    iou_thresh: float = 0.5,
) -> np.ndarray:
    """Confusion matrix over classes plus background.

    Detections with score >= ``score_thresh`` are matched to ground truth regardless
    of class (greedy by score, IoU >= ``iou_thresh``). Index 0 is background, index
    i+1 is ``cat_ids[i]``.

    Returns:
        int64 [K+1, K+1], rows = true class, columns = predicted class:
        ``[g, p]`` a box of class g detected as p; ``[g, 0]`` a missed box of class g;
        ``[0, p]`` a detection of class p on background (false positive).
    """
    ids = np.asarray([int(c) for c in cat_ids], dtype=np.int64)
    by_id = np.argsort(ids)
    k = len(cat_ids)
    matrix = np.zeros((k + 1, k + 1), dtype=np.int64)

    def index(labels: torch.Tensor) -> np.ndarray:  # category id -> row/column (1..K)
        return by_id[np.searchsorted(ids[by_id], labels.numpy())] + 1

    for rec in records:
        db, ds, dl, gb, gl, gi = _tensors(rec, score_thresh)
        res = greedy_match(db, ds, dl, gb, gl, iou_thresh, gi, class_aware=False)
        d2g = res.det_to_gt.numpy()
        det_idx, gt_idx = index(dl), index(gl)
        hit = d2g >= 0
        np.add.at(matrix, (gt_idx[d2g[hit]], det_idx[hit]), 1)
        np.add.at(matrix, (0, det_idx[d2g == UNMATCHED]), 1)
        missed = ~res.gt_matched.numpy() & ~gi.numpy().astype(bool)
        np.add.at(matrix, (gt_idx[missed], 0), 1)
    return matrix
