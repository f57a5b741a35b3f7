"""IoU and related metrics: matched-box IoU, precision / recall / F1 at a score
threshold, object-count error and correlation, and a confusion matrix.

All boxes are ``[x1, y1, x2, y2]`` in pixels. Pairwise IoU is
``torchvision.ops.box_iou``.

Matching (:func:`greedy_match`) is greedy in decreasing score, per class: each
detection takes the still-free ground-truth box of its class with the highest IoU,
if that IoU >= the threshold. Detections left unmatched that overlap an ignored
ground-truth box (crowd or difficult) by >= the threshold are neither true nor false
positives; ignored boxes are never counted as misses.

The metrics work image by image: :func:`group_by_image` turns a COCO-format ground
truth and its detections into one :class:`EvalImage` per image (the VOC AP uses it too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torchvision.ops import box_iou

from .results import Detections, as_detections

UNMATCHED = -1
IGNORED = -2


@dataclass
class EvalImage:
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


def group_by_image(gt: Dict[str, Any], results: Any) -> Dict[int, EvalImage]:
    """One :class:`EvalImage` per ground-truth image (images without objects or
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
        records[image_id] = EvalImage(
            gt_boxes=ann_box[g],
            gt_cats=ann_cat[g],
            gt_ignore=ann_ignore[g],
            dt_boxes=det_box[d],
            dt_scores=dets.score[d],
            dt_cats=dets.category_id[d],
        )
    return records


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


def _pair_iou_torchvision(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of row i of ``a`` with row i of ``b`` ([P, 4] xyxy, float64) with
    ``torchvision.ops.box_iou``'s operations (so the same doubles; nan where the union
    is 0)."""
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    wh = np.clip(np.minimum(a[:, 2:], b[:, 2:]) - np.maximum(a[:, :2], b[:, :2]), 0.0, None)
    inter = wh[:, 0] * wh[:, 1]
    with np.errstate(invalid="ignore", divide="ignore"):
        return inter / (area_a + area_b - inter)


def _live_pairs(
    dt_key: np.ndarray, dt_boxes: np.ndarray, gt_key: np.ndarray, gt_boxes: np.ndarray, gt_ignore: np.ndarray,
    iou_thresh: float, max_pairs: int = 1_000_000,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The (detection, gt) pairs of equal key that can decide a greedy match: a usable
    box at IoU >= ``iou_thresh``, or a nan IoU (np.argmax picks it, and the detection
    stays unmatched). Built ``max_pairs`` at a time (class-agnostic matching pairs every
    detection with every box of its image).

    Returns:
        ``pair_dt, pair_gt`` int64 [P] (grouped by detection, boxes in index order),
        ``iou`` float64 [P], and ``on_ignored`` bool [D]: the detection overlaps an
        ignored box at IoU >= ``iou_thresh``.
    """
    gt_order = np.argsort(gt_key, kind="stable")
    sorted_keys = gt_key[gt_order]
    lo = np.searchsorted(sorted_keys, dt_key, side="left")
    counts = np.searchsorted(sorted_keys, dt_key, side="right") - lo
    on_ignored = np.zeros(len(dt_key), dtype=bool)
    cum = np.cumsum(counts)
    cuts = np.searchsorted(cum, np.arange(max_pairs, int(cum[-1]) if len(cum) else 0, max_pairs), side="right")
    parts = []
    for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(dt_key)].tolist()):
        c = counts[a:b]
        pair_dt = a + np.repeat(np.arange(b - a), c)
        pair_gt = gt_order[np.repeat(lo[a:b], c) + np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c)]
        iou = _pair_iou_torchvision(dt_boxes[pair_dt], gt_boxes[pair_gt])
        ignored = gt_ignore[pair_gt]
        on_ignored[pair_dt[ignored & (iou >= iou_thresh)]] = True
        live = ~ignored & ((iou >= iou_thresh) | np.isnan(iou))
        parts.append((pair_dt[live], pair_gt[live], iou[live]))
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), on_ignored
    return (*(np.concatenate([p[i] for p in parts]) for i in range(3)), on_ignored)


@dataclass
class MatchArrays:
    """:func:`greedy_match` of many images at once (see :func:`greedy_match_all`).

    Attributes:
        det_to_gt: int64 [D]: index of the matched ground-truth box (into the gt arrays),
            ``UNMATCHED`` or ``IGNORED``.
        iou: float64 [D]: IoU with the matched box (0 where not matched).
        gt_matched: bool [G].
    """

    det_to_gt: np.ndarray
    iou: np.ndarray
    gt_matched: np.ndarray


def greedy_match_all(
    dt_img: np.ndarray, dt_boxes: np.ndarray, dt_scores: np.ndarray, dt_labels: np.ndarray,
    gt_img: np.ndarray, gt_boxes: np.ndarray, gt_labels: np.ndarray, gt_ignore: np.ndarray,
    iou_thresh: float = 0.5, class_aware: bool = True,
) -> MatchArrays:
    """:func:`greedy_match` of every image at once, the same result per image.

    The k-th detections (by decreasing score, stable) of all images are matched
    together, k = 0, 1, ...: detections of different images never compete for a box.

    Args:
        dt_img, gt_img: int64 [D], [G] image index of each box.
        dt_boxes, gt_boxes: float64 [D, 4], [G, 4] xyxy; dt_scores: [D];
        dt_labels, gt_labels: int64; gt_ignore: bool [G].
        iou_thresh: a match needs IoU >= this (> 0).
    """
    num_d, num_g = len(dt_img), len(gt_img)
    d2g = np.full(num_d, UNMATCHED, dtype=np.int64)
    d_iou = np.zeros(num_d)
    taken = np.zeros(num_g, dtype=bool)
    if num_d == 0 or num_g == 0:
        return MatchArrays(d2g, d_iou, taken)
    if class_aware:  # key = (image, label)
        shift = int(min(dt_labels.min(), gt_labels.min()))
        span = int(max(dt_labels.max(), gt_labels.max())) - shift + 1
        dt_key, gt_key = dt_img * span + (dt_labels - shift), gt_img * span + (gt_labels - shift)
    else:
        dt_key, gt_key = dt_img, gt_img
    pair_dt, pair_gt, iou, on_ignored = _live_pairs(dt_key, dt_boxes, gt_key, gt_boxes, gt_ignore, iou_thresh)
    order = np.argsort(-dt_scores, kind="stable")
    order = order[np.argsort(dt_img[order], kind="stable")]  # by image, then score
    first = np.r_[True, dt_img[order][1:] != dt_img[order][:-1]]
    starts = np.flatnonzero(first)
    rank = np.empty(num_d, dtype=np.int64)
    rank[order] = np.arange(num_d) - np.repeat(starts, np.diff(np.r_[starts, num_d]))
    sel = np.argsort(rank[pair_dt], kind="stable")  # by round, then det, then gt order
    rounds = rank[pair_dt[sel]]
    bounds = np.searchsorted(rounds, np.arange(int(rounds.max(initial=-1)) + 2))
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        if a == b:
            continue
        blk = sel[a:b]
        d, g = pair_dt[blk], pair_gt[blk]
        seg = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
        key = np.where(taken[g], -1.0, iou[blk])
        best = np.maximum.reduceat(key, seg)  # nan wins, as in np.argmax
        pos = np.where(key == np.repeat(best, np.diff(np.r_[seg, len(d)])), np.arange(len(d)), len(d))
        j = np.minimum.reduceat(pos, seg)  # the first box of the highest IoU
        hit = best >= iou_thresh
        d2g[d[seg[hit]]] = g[j[hit]]
        d_iou[d[seg[hit]]] = best[hit]
        taken[g[j[hit]]] = True
    d2g[(d2g == UNMATCHED) & on_ignored] = IGNORED
    return MatchArrays(d2g, d_iou, taken)


def _concat(records: Sequence[EvalImage], score_thresh: float):
    """The records' boxes as arrays (dt_img, dt_boxes, dt_scores, dt_cats, gt_img,
    gt_boxes, gt_cats, gt_ignore), detections below ``score_thresh`` left out; image
    index = position in ``records``, each image's boxes in their order."""
    keep = [r.dt_scores >= score_thresh for r in records]
    n_dt = [int(k.sum()) for k in keep]
    n_gt = [len(r.gt_cats) for r in records]

    def cat(parts, shape, dtype):
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(shape, dtype)

    return (
        np.repeat(np.arange(len(records)), n_dt),
        cat([r.dt_boxes[k] for r, k in zip(records, keep)], (0, 4), np.float64),
        cat([r.dt_scores[k] for r, k in zip(records, keep)], (0,), np.float64),
        cat([r.dt_cats[k] for r, k in zip(records, keep)], (0,), np.int64),
        np.repeat(np.arange(len(records)), n_gt),
        cat([r.gt_boxes for r in records], (0, 4), np.float64),
        cat([r.gt_cats for r in records], (0,), np.int64),
        cat([r.gt_ignore for r in records], (0,), bool),
    )


def iou_metrics(
    records: Iterable[EvalImage],
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
    dt_img, db, ds, dl, gt_img, gb, gl, gi = _concat(records, score_thresh)
    tp, fp, fn = {}, {}, {}
    matched_ious = []
    for k, t in enumerate(iou_thresholds):
        res = greedy_match_all(dt_img, db, ds, dl, gt_img, gb, gl, gi, t)
        tp[t] = int((res.det_to_gt >= 0).sum())
        fp[t] = int((res.det_to_gt == UNMATCHED).sum())
        fn[t] = int((~gi).sum()) - tp[t]
        if k == 0:
            matched_ious.append(res.iou[res.det_to_gt >= 0])  # image order, then detection order
    pred_counts = np.bincount(dt_img, minlength=len(records)).tolist()
    gt_counts = np.bincount(gt_img[~gi], minlength=len(records)).tolist()
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
    records: Iterable[EvalImage],
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

    def index(labels: np.ndarray) -> np.ndarray:  # category id -> row/column (1..K)
        return by_id[np.searchsorted(ids[by_id], labels)] + 1

    dt_img, db, ds, dl, gt_img, gb, gl, gi = _concat(list(records), score_thresh)
    res = greedy_match_all(dt_img, db, ds, dl, gt_img, gb, gl, gi, iou_thresh, class_aware=False)
    d2g = res.det_to_gt
    det_idx, gt_idx = index(dl), index(gl)
    hit = d2g >= 0
    np.add.at(matrix, (gt_idx[d2g[hit]], det_idx[hit]), 1)
    np.add.at(matrix, (0, det_idx[d2g == UNMATCHED]), 1)
    missed = ~res.gt_matched & ~gi
    np.add.at(matrix, (gt_idx[missed], 0), 1)
    return matrix
