"""Matching boxes to ground truth by IoU, and sampling a fixed-size minibatch.

Both the RPN (anchors) and the ROI heads (proposals) label every candidate box as
foreground (1), background (0) or ignored (-1) from its best IoU with the ground
truth, then sample a minibatch with a bounded foreground fraction.

The sampler is vectorised and never synchronises with the device: it draws one
random key per candidate and uses ``topk`` twice, so it returns a fixed number of
slots (``min(batch_size, num_candidates)``) together with a ``valid`` mask. Slots are
invalid only when there are too few foreground + background candidates to fill the
batch; they must carry zero loss weight.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torchvision.ops import box_iou

FOREGROUND = 1
BACKGROUND = 0
IGNORE = -1


def match_by_iou(
    gt_boxes: Tensor,
    boxes: Tensor,
    fg_thresh: float,
    bg_lo: float,
    bg_hi: float,
    allow_low_quality: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Label each box from its best IoU with the ground truth.

    Args:
        gt_boxes: ``[G, 4]`` ground-truth boxes (G may be 0).
        boxes: ``[N, 4]`` anchors or proposals.
        fg_thresh: IoU >= fg_thresh -> foreground.
        bg_lo, bg_hi: bg_lo <= IoU < bg_hi -> background; other IoUs are ignored.
        allow_low_quality: also mark as foreground, for each ground truth, the boxes
            whose IoU with it equals its highest IoU (if that IoU is > 0), so that every
            ground truth gets at least one foreground box (the RPN rule).

    Returns:
        labels: ``[N]`` int64 in {1, 0, -1}.
        matched_idx: ``[N]`` int64 index of the best ground truth (0 when G == 0).
        max_iou: ``[N]`` float, the best IoU (0 when G == 0).
    """
    num = boxes.shape[0]
    if gt_boxes.shape[0] == 0:
        max_iou = boxes.new_zeros(num)
        matched_idx = torch.zeros(num, dtype=torch.int64, device=boxes.device)
    else:
        iou = box_iou(gt_boxes, boxes)  # [G, N]
        max_iou, matched_idx = iou.max(dim=0)
    labels = torch.full((num,), IGNORE, dtype=torch.int64, device=boxes.device)
    labels = torch.where((max_iou >= bg_lo) & (max_iou < bg_hi), BACKGROUND, labels)
    labels = torch.where(max_iou >= fg_thresh, FOREGROUND, labels)
    if allow_low_quality and gt_boxes.shape[0] > 0:
        best_per_gt = iou.max(dim=1, keepdim=True).values  # [G, 1]
        is_best = ((iou == best_per_gt) & (best_per_gt > 0)).any(dim=0)  # [N]
        labels = torch.where(is_best, FOREGROUND, labels)
    return labels, matched_idx, max_iou


class Sample(NamedTuple):
    """A fixed-size minibatch of candidate indices.

    Attributes:
        index: ``[S]`` int64 indices into the candidates.
        valid: ``[S]`` bool, False for padding slots.
        foreground: ``[S]`` bool, True for sampled foreground (implies valid).
    """

    index: Tensor
    valid: Tensor
    foreground: Tensor


def sample_minibatch(labels: Tensor, batch_size: int, positive_fraction: float) -> Sample:
    """Sample up to ``batch_size`` candidates, at most ``positive_fraction`` foreground.

    Foreground candidates are drawn at random up to ``int(batch_size * positive_fraction)``;
    background candidates, drawn at random, fill the rest. Ignored candidates (-1) are
    never drawn. The result has ``min(batch_size, N)`` slots, foreground slots first.

    Args:
        labels: ``[N]`` int64 in {1, 0, -1}.

    Returns:
        a ``Sample`` (see there).
    """
    num = labels.shape[0]
    slots = min(batch_size, num)
    fg_quota = min(int(batch_size * positive_fraction), num)
    key = torch.rand(num, device=labels.device)
    is_fg = labels == FOREGROUND
    # Draw the foreground: the fg_quota foreground candidates with the largest keys.
    fg_key = torch.where(is_fg, key, -1.0)
    fg_val, fg_idx = fg_key.topk(fg_quota)
    chosen_fg = torch.zeros(num, dtype=torch.bool, device=labels.device)
    chosen_fg[fg_idx] = fg_val >= 0
    # One ranking: chosen foreground in [2, 3), background in [1, 2), the rest -1.
    rank_key = torch.where(chosen_fg, key + 2.0, torch.where(labels == BACKGROUND, key + 1.0, -1.0))
    val, index = rank_key.topk(slots)
    return Sample(index=index, valid=val >= 0, foreground=val >= 2.0)
