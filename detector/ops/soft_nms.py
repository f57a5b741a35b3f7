"""Soft-NMS (Bodla et al., "Soft-NMS -- Improving Object Detection With One Line of
Code", ICCV 2017): instead of removing every box that overlaps a kept one, decay its
score by a function of the overlap.

At each step the box of highest (current) score is kept; every remaining box's score
is multiplied by

- ``linear``: ``1 - IoU`` if ``IoU > iou_thresh`` (the paper's N_t), else 1;
- ``gaussian``: ``exp(-IoU^2 / sigma)``;

and boxes whose score falls below ``score_thresh`` are dropped. Ties go to the lower
index. Boxes are ``[x1, y1, x2, y2]`` in pixels.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor
from torchvision.ops import box_iou

METHODS = ("linear", "gaussian")


def _decay(iou: Tensor, method: str, iou_thresh: float, sigma: float) -> Tensor:
    """Score multiplier for overlaps ``iou`` ``[R]`` with the box just kept."""
    if method == "linear":
        return torch.where(iou > iou_thresh, 1.0 - iou, torch.ones_like(iou))
    return torch.exp(-(iou * iou) / sigma)


def soft_nms(boxes: Tensor, scores: Tensor, method: str = "linear", iou_thresh: float = 0.3,
             sigma: float = 0.5, score_thresh: float = 0.001) -> Tuple[Tensor, Tensor]:
    """Soft-NMS over one set of boxes (one class).

    Args:
        boxes: ``[N, 4]`` xyxy; scores: ``[N]``.
        method: ``linear`` or ``gaussian``.
        iou_thresh: N_t of the linear rule (unused by ``gaussian``).
        sigma: the Gaussian rule's sigma (> 0; unused by ``linear``).
        score_thresh: a box whose decayed score is below this is dropped.

    Returns:
        ``keep`` int64 ``[M]`` indices into ``boxes`` in the order they were kept (so by
        non-increasing new score), and their new scores ``[M]`` (dtype of ``scores``).
    """
    if method not in METHODS:
        raise ValueError(f"soft_nms method must be one of {', '.join(METHODS)}, got {method!r}")
    n = boxes.shape[0]
    current = scores.clone()
    alive = current >= score_thresh
    iou = box_iou(boxes, boxes) if n else boxes.new_zeros((0, 0))
    keep = []
    neg_inf = torch.tensor(float("-inf"), dtype=current.dtype, device=current.device)
    for _ in range(n):
        if not bool(alive.any()):
            break
        i = int(torch.argmax(torch.where(alive, current, neg_inf)))
        keep.append(i)
        alive[i] = False
        current = torch.where(alive, current * _decay(iou[i].to(current.dtype), method, iou_thresh, sigma), current)
        alive &= current >= score_thresh
    idx = torch.tensor(keep, dtype=torch.int64, device=boxes.device)
    return idx, current[idx]


def batched_soft_nms(boxes: Tensor, scores: Tensor, idxs: Tensor, method: str = "linear", iou_thresh: float = 0.3,
                     sigma: float = 0.5, score_thresh: float = 0.001) -> Tuple[Tensor, Tensor]:
    """Soft-NMS within each category ``idxs`` ``[N]`` separately (as
    ``torchvision.ops.batched_nms`` does for hard NMS).

    Returns:
        ``keep`` int64 ``[M]`` and the new scores ``[M]``, sorted by decreasing new score
        (stable: equal scores keep the order of category, then selection).
    """
    keep_all, score_all = [], []
    for c in torch.unique(idxs).tolist():
        members = torch.where(idxs == c)[0]
        keep, new = soft_nms(boxes[members], scores[members], method, iou_thresh, sigma, score_thresh)
        keep_all.append(members[keep])
        score_all.append(new)
    if not keep_all:
        return torch.zeros(0, dtype=torch.int64, device=boxes.device), scores.new_zeros(0)
    keep, new = torch.cat(keep_all), torch.cat(score_all)
    order = torch.sort(new, descending=True, stable=True).indices
    return keep[order], new[order]
