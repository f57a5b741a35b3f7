"""COCO box evaluation on arrays: pycocotools' ``COCOeval`` (``iouType="bbox"``,
default parameters) vectorised with numpy, the same numbers without a Python object
per detection.

What pycocotools does, and how it is done here:

- ``computeIoU``: per (image, category), detections in decreasing score (stable), the
  first ``maxDets[-1]`` kept, IoU with every ground-truth box of the pair as
  ``maskApi.c``'s ``bbIou`` computes it (crowd boxes: intersection over the
  detection's area). Here: one IoU per (detection, ground truth) pair of the same
  image and category, the same floating-point operations.
- ``evaluateImg``: per area range and IoU threshold, each detection in score order
  takes the best still-free non-ignored box (IoU >= the threshold, the last box on a
  tie), else the best ignored box (crowd boxes stay free). Here: the k-th detections
  of every (image, category) are matched together, k = 0, 1, ..., for all area ranges
  and thresholds at once (pairs never cross an (image, category)).
- ``accumulate``: per category, area range and max-dets, the detections of all images
  (image order, each image's top ``maxDet``) sorted by decreasing score (stable),
  cumulative true/false positives, the precision envelope read at the 101 recall
  thresholds. Here: the same arrays, the same order, the same arithmetic.
- ``summarize``: the 12 means over the entries > -1, in the array order of pycocotools.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

# pycocotools' Params for iouType="bbox".
IOU_THRS = np.linspace(0.5, 0.95, int(np.round((0.95 - 0.5) / 0.05)) + 1, endpoint=True)
REC_THRS = np.linspace(0.0, 1.00, int(np.round((1.00 - 0.0) / 0.01)) + 1, endpoint=True)
MAX_DETS = (1, 10, 100)
AREA_RNG = ((0**2, 1e5**2), (0**2, 32**2), (32**2, 96**2), (96**2, 1e5**2))  # all, small, medium, large


def box_iou_pairs(dt: np.ndarray, gt: np.ndarray, crowd: np.ndarray) -> np.ndarray:
    """IoU of row i of ``dt`` with row i of ``gt`` as pycocotools' ``bbIou`` computes it.

    Args:
        dt, gt: float64 [P, 4] ``x, y, w, h`` in pixels.
        crowd: bool [P], the gt box is a crowd region (IoU = intersection / dt area).

    Returns:
        float64 [P]; 0 where the boxes do not overlap.
    """
    w = np.minimum(dt[:, 2] + dt[:, 0], gt[:, 2] + gt[:, 0]) - np.maximum(dt[:, 0], gt[:, 0])
    h = np.minimum(dt[:, 3] + dt[:, 1], gt[:, 3] + gt[:, 1]) - np.maximum(dt[:, 1], gt[:, 1])
    da = dt[:, 2] * dt[:, 3]
    ga = gt[:, 2] * gt[:, 3]
    inter = w * h
    union = np.where(crowd, da, da + ga - inter)
    hit = (w > 0) & (h > 0)
    out = np.zeros(len(dt))
    out[hit] = inter[hit] / union[hit]
    return out


def _segments(sorted_keys: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Start of each run of equal values in ``sorted_keys`` [N], and each element's
    position in its run (int64 [N])."""
    n = len(sorted_keys)
    first = np.r_[True, sorted_keys[1:] != sorted_keys[:-1]] if n else np.zeros(0, bool)
    starts = np.flatnonzero(first)
    run_start = np.repeat(starts, np.diff(np.r_[starts, n]))
    return starts, np.arange(n) - run_start


def _last_best(key: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per segment of the last axis of ``key`` [..., n] (segments begin at ``starts``):
    the position of the last maximum among entries >= 0, or -1 where all are < 0."""
    n = key.shape[-1]
    lengths = np.diff(np.r_[starts, n])
    best = np.repeat(np.maximum.reduceat(key, starts, axis=-1), lengths, axis=-1)
    pos = np.where((key == best) & (key >= 0), np.arange(n), -1)
    return np.maximum.reduceat(pos, starts, axis=-1)


def match_detections(
    pair_dt: np.ndarray, pair_gt: np.ndarray, pair_iou: np.ndarray, pair_round: np.ndarray,
    gt_ignore: np.ndarray, gt_crowd: np.ndarray, dt_out_of_range: np.ndarray,
) -> Tuple[np.ndarray, np.ndarray]:
    """pycocotools' ``evaluateImg`` greedy matching for every area range and threshold.

    Args:
        pair_dt, pair_gt: int64 [P] (detection, gt box) pairs of the same image and
            category, grouped by detection, each detection's boxes in gt order.
        pair_iou: float64 [P].
        pair_round: int64 [P] the detection's rank in its (image, category) (0 = best
            score): detections of the same round never compete for a box.
        gt_ignore: bool [A, G] per area range: crowd or area outside the range.
        gt_crowd: bool [G].
        dt_out_of_range: bool [A, D] the detection's area lies outside the range.

    Returns:
        ``matched`` bool [A, T, D] and ``ignored`` bool [A, T, D] (``dtMatches > 0`` and
        ``dtIgnore`` of pycocotools).
    """
    num_a, num_d = dt_out_of_range.shape
    thr = np.minimum(IOU_THRS, 1 - 1e-10)[None, :, None]  # [1, T, 1]
    taken = np.zeros((num_a, len(IOU_THRS), gt_ignore.shape[1]), dtype=bool)
    matched = np.zeros((num_a, len(IOU_THRS), num_d), dtype=bool)
    ignored = np.repeat(dt_out_of_range[:, None, :], len(IOU_THRS), axis=1)
    order = np.lexsort((np.arange(len(pair_dt)), pair_round))  # by round, then as given
    rounds = pair_round[order]
    bounds = np.searchsorted(rounds, np.arange(int(rounds.max(initial=-1)) + 2))
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        if lo == hi:
            continue
        sel = order[lo:hi]
        d, g, iou = pair_dt[sel], pair_gt[sel], pair_iou[sel]
        starts, _ = _segments(d)
        ign = gt_ignore[:, g][:, None, :]  # [A, 1, n]
        free = ~(taken[:, :, g] & ~gt_crowd[g])  # crowd boxes can be matched again
        ok = free & (iou >= thr)  # [A, T, n]
        best = _last_best(np.where(ok & ~ign, iou, -1.0), starts)  # a non-ignored box first
        other = _last_best(np.where(ok & ign, iou, -1.0), starts)
        pick = np.where(best >= 0, best, other)  # [A, T, S] pair position or -1
        hit = pick >= 0
        a, t, s = np.nonzero(hit)
        p = pick[hit]
        det = d[starts[s]]
        taken[a, t, g[p]] = True
        matched[a, t, det] = True
        ignored[a, t, det] = gt_ignore[a, g[p]]
    return matched, ignored


def _accumulate_class(
    scores: np.ndarray, matched: np.ndarray, ignored: np.ndarray, npig: np.ndarray,
    precision: np.ndarray, recall: np.ndarray, score_out: np.ndarray,
) -> None:
    """pycocotools' ``accumulate`` for one category and one max-dets setting; fills
    ``precision`` [T, R, A], ``recall`` [T, A], ``score_out`` [T, R, A] in place.

    Args:
        scores: float64 [n] the detections, in image order then score order.
        matched, ignored: bool [A, T, n].
        npig: int64 [A] non-ignored gt boxes of the category per area range.
    """
    order = np.argsort(-scores, kind="mergesort")
    sorted_scores = scores[order]
    nd = len(order)
    areas = np.flatnonzero(npig > 0)  # pycocotools skips a range without gt boxes
    if len(areas) == 0:
        return
    dtm, dtig = matched[areas][:, :, order], ignored[areas][:, :, order]  # [A', T, n]
    tp = np.cumsum(dtm & ~dtig, axis=2).astype(float)
    fp = np.cumsum(~dtm & ~dtig, axis=2).astype(float)
    rc = tp / npig[areas][:, None, None]
    pr = tp / (fp + tp + np.spacing(1))
    recall[:, areas] = rc[:, :, -1].T if nd else 0
    pr = np.maximum.accumulate(pr[:, :, ::-1], axis=2)[:, :, ::-1]  # the precision envelope
    for i, a in enumerate(areas.tolist()):
        for t in range(len(IOU_THRS)):
            idx = np.searchsorted(rc[i, t], REC_THRS, side="left")
            idx = idx[idx < nd]
            q = np.zeros(len(REC_THRS))
            ss = np.zeros(len(REC_THRS))
            q[: len(idx)] = pr[i, t, idx]
            ss[: len(idx)] = sorted_scores[idx]
            precision[t, :, a] = q
            score_out[t, :, a] = ss


def evaluate_boxes(
    image_ids: np.ndarray, cat_ids: np.ndarray,
    gt_image: np.ndarray, gt_cat: np.ndarray, gt_box: np.ndarray, gt_area: np.ndarray, gt_crowd: np.ndarray,
    dt_image: np.ndarray, dt_cat: np.ndarray, dt_box: np.ndarray, dt_score: np.ndarray,
) -> Dict[str, np.ndarray]:
    """``COCOeval.evaluate()`` + ``accumulate()`` for boxes, from arrays.

    Args:
        image_ids: int64 [I] sorted ground-truth image ids; cat_ids: int64 [K] sorted.
        gt_image, gt_cat: int64 [G]; gt_box: float64 [G, 4] ``x, y, w, h``;
            gt_area: float64 [G] (the annotations' ``area``); gt_crowd: bool [G].
        dt_image, dt_cat: int64 [D] (ids in ``image_ids``; other categories are left
            out); dt_box: float64 [D, 4] ``x, y, w, h``; dt_score: float64 [D]; in the
            results file's order (it breaks ties in score, as in pycocotools).

    Returns:
        ``precision`` [T=10, R=101, K, A=4, M=3], ``scores`` (same shape), ``recall``
        [T, K, A, M] as ``COCOeval.eval`` holds them (-1 where undefined).
    """
    num_i, num_k = len(image_ids), len(cat_ids)
    gt_keep = np.isin(gt_cat, cat_ids)
    dt_keep = np.isin(dt_cat, cat_ids) & np.isin(dt_image, image_ids)
    gt_key = (np.searchsorted(cat_ids, gt_cat) * num_i + np.searchsorted(image_ids, gt_image))[gt_keep]
    gt_box, gt_area, gt_crowd = gt_box[gt_keep], gt_area[gt_keep], gt_crowd[gt_keep].astype(bool)
    dt_idx = np.flatnonzero(dt_keep)
    dt_key = np.searchsorted(cat_ids, dt_cat[dt_idx]) * num_i + np.searchsorted(image_ids, dt_image[dt_idx])
    # Detections by (category, image), then decreasing score, then file order; the
    # first MAX_DETS[-1] of each (image, category) are evaluated.
    order = np.lexsort((dt_idx, -dt_score[dt_idx], dt_key))
    _, rank = _segments(dt_key[order])
    keep = rank < MAX_DETS[-1]
    sel = dt_idx[order[keep]]
    key, rank = dt_key[order[keep]], rank[keep]
    box, score = dt_box[sel], dt_score[sel]
    # Every (detection, gt box) pair of the same key, grouped by detection, gt in file order.
    gt_order = np.argsort(gt_key, kind="stable")
    lo = np.searchsorted(gt_key[gt_order], key, side="left")
    hi = np.searchsorted(gt_key[gt_order], key, side="right")
    counts = hi - lo
    pair_dt = np.repeat(np.arange(len(key)), counts)
    pair_gt = gt_order[np.repeat(lo, counts) + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)]
    pair_iou = box_iou_pairs(box[pair_dt], gt_box[pair_gt], gt_crowd[pair_gt])

    rng = np.asarray(AREA_RNG)
    gt_ignore = gt_crowd[None, :] | (gt_area[None, :] < rng[:, :1]) | (gt_area[None, :] > rng[:, 1:])
    dt_area = box[:, 2] * box[:, 3]
    dt_out = (dt_area[None, :] < rng[:, :1]) | (dt_area[None, :] > rng[:, 1:])
    matched, ignored = match_detections(pair_dt, pair_gt, pair_iou, rank[pair_dt], gt_ignore, gt_crowd, dt_out)

    shape = (len(IOU_THRS), len(REC_THRS), num_k, len(AREA_RNG), len(MAX_DETS))
    precision, scores = -np.ones(shape), -np.ones(shape)
    recall = -np.ones((len(IOU_THRS), num_k, len(AREA_RNG), len(MAX_DETS)))
    gt_k = gt_key // max(num_i, 1)
    cat_of = key // max(num_i, 1)
    bounds = np.searchsorted(cat_of, np.arange(num_k + 1))
    for k in range(num_k):
        npig = (~gt_ignore[:, gt_k == k]).sum(axis=1)
        lo_k, hi_k = int(bounds[k]), int(bounds[k + 1])
        for m, max_det in enumerate(MAX_DETS):
            top = np.flatnonzero(rank[lo_k:hi_k] < max_det) + lo_k
            _accumulate_class(score[top], matched[:, :, top], ignored[:, :, top], npig,
                              precision[:, :, k, :, m], recall[:, k, :, m], scores[:, :, k, :, m])
    return {"precision": precision, "recall": recall, "scores": scores}


def summarize(precision: np.ndarray, recall: np.ndarray) -> List[float]:
    """``COCOeval.summarize()``'s 12 numbers (AP, AP50, AP75, APs/m/l, AR1/10/100,
    ARs/m/l) from the accumulated arrays; -1 where nothing is defined."""

    def mean(s: np.ndarray) -> float:
        valid = s[s > -1]
        return float(np.mean(valid)) if valid.size else -1.0

    def ap(area: int, m: int = 2, iou: float | None = None) -> float:
        s = precision if iou is None else precision[np.where(iou == IOU_THRS)[0]]
        return mean(s[:, :, :, [area]][..., [m]])

    def ar(area: int, m: int) -> float:
        return mean(recall[:, :, [area]][..., [m]])

    return [ap(0), ap(0, iou=0.5), ap(0, iou=0.75), ap(1), ap(2), ap(3),
            ar(0, 0), ar(0, 1), ar(0, 2), ar(1, 2), ar(2, 2), ar(3, 2)]
