"""Matching boxes to ground truth by IoU, and sampling a fixed-size minibatch.

Both the RPN (anchors) and the ROI heads (proposals) label every candidate box as
foreground (1), background (0) or ignored (-1) from its best IoU with the ground
truth, then sample a minibatch with a bounded foreground fraction.

Every function here works on one image or on a whole batch at once (a leading batch
dimension ``B``): the batched forms are what the training step uses, so that the
number of operators dispatched per step does not grow with the number of images.
Images with different numbers of ground-truth boxes are padded to one count by
``pad_boxes``, with a mask.

The sampler is vectorised and never synchronises with the device: it draws one
random key per candidate and uses ``topk`` twice, so it returns a fixed number of
slots (``min(batch_size, num_candidates)``) together with a ``valid`` mask. Slots are
invalid only when there are too few foreground + background candidates to fill the
batch; they must carry zero loss weight.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

FOREGROUND = 1
BACKGROUND = 0
IGNORE = -1

# What padded ground-truth and candidate slots hold: a unit box, so that encoding
# against it stays finite (its results always carry zero weight).
PAD_BOX = (0.0, 0.0, 1.0, 1.0)

# match_by_iou's IoU is computed for groups of images of at most this many
# (image, ground truth, box) triples: three float32 buffers of 256 MiB at most.
MATCH_CHUNK_ELEMENTS = 1 << 26


def pad_rows(rows: Sequence[Tensor], count: int, value: float) -> Tensor:
    """Per image ``[n_i, ...]`` -> ``[B, count, ...]``, padded with ``value``
    (``count >= max_i n_i``)."""
    first = rows[0]
    filler = torch.full((count, *first.shape[1:]), value, dtype=first.dtype, device=first.device)
    # The filler row fixes the padded length; it is dropped again.
    return pad_sequence([*rows, filler], batch_first=True, padding_value=value)[:-1]


def pad_boxes(boxes: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """Stack per-image boxes into one padded tensor.

    Args:
        boxes: per image ``[G_i, 4]`` finite boxes (``G_i`` may be 0), on one device.

    Returns:
        ``[B, G, 4]`` boxes (``G = max(max_i G_i, 1)``: at least one slot, so that a batch
        without boxes still has a ground-truth axis; padding slots hold ``PAD_BOX``) and
        ``[B, G]`` bool, True on real boxes.
    """
    count = max([int(b.shape[0]) for b in boxes] + [1])
    padded = pad_rows(boxes, count, float("nan"))  # NaN marks the padding: real boxes are finite
    real = ~torch.isnan(padded[..., 0])
    return torch.where(real[..., None], padded, padded.new_tensor(PAD_BOX)), real


def box_iou_batched(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """IoU of ``[B, G, 4]`` and ``[B, M, 4]`` (or ``[M, 4]``, shared) x1y1x2y2 boxes ->
    ``[B, G, M]``, without a gradient (matching needs none).

    The arithmetic of ``torchvision.ops.box_iou``: the same values, elementwise. It is
    computed one coordinate at a time and in place, so that at most three ``[B, G, M]``
    float tensors exist at once, the result included (``box_iou`` makes ``[G, M, 2]``
    ones)."""
    if boxes2.dim() == 2:
        boxes2 = boxes2[None]
    with torch.no_grad():
        x1a, y1a, x2a, y2a = (c[:, :, None] for c in boxes1.unbind(-1))
        x1b, y1b, x2b, y2b = (c[:, None, :] for c in boxes2.unbind(-1))
        area1 = (x2a - x1a) * (y2a - y1a)  # [B, G, 1]
        area2 = (x2b - x1b) * (y2b - y1b)  # [B, 1, M]
        inter = torch.minimum(x2a, x2b).sub_(torch.maximum(x1a, x1b)).clamp_(min=0)  # width
        height = torch.minimum(y2a, y2b).sub_(torch.maximum(y1a, y1b)).clamp_(min=0)
        inter.mul_(height)
        union = torch.add(area1, area2, out=height).sub_(inter)
        return inter.div_(union)


def match_by_iou(
    gt_boxes: Tensor,
    boxes: Tensor,
    fg_thresh: float,
    bg_lo: float,
    bg_hi: float,
    allow_low_quality: bool = False,
    gt_valid: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Label each box from its best IoU with the ground truth.

    Args:
        gt_boxes: ``[G, 4]`` ground-truth boxes (G may be 0), or ``[B, G, 4]`` for a batch.
        boxes: ``[N, 4]`` anchors or proposals (shared by the batch), or ``[B, N, 4]``.
        fg_thresh: IoU >= fg_thresh -> foreground.
        bg_lo, bg_hi: bg_lo <= IoU < bg_hi -> background; other IoUs are ignored.
        allow_low_quality: also mark as foreground, for each ground truth, the boxes
            whose IoU with it equals its highest IoU (if that IoU is > 0), so that every
            ground truth gets at least one foreground box (the RPN rule).
        gt_valid: ``[B, G]`` bool, False on padding slots (``pad_boxes``); None: all real.

    Returns:
        labels: ``[N]`` (``[B, N]``) int64 in {1, 0, -1}.
        matched_idx: ``[N]`` (``[B, N]``) int64 index of the best ground truth (0 when
            the image has none).
        max_iou: ``[N]`` (``[B, N]``) float, the best IoU (0 when the image has none).
    """
    batched = gt_boxes.dim() == 3
    if not batched:
        gt_boxes = gt_boxes[None]  # one image; its [N, 4] boxes are the shared form
    num_images, num = gt_boxes.shape[0], boxes.shape[-2]
    if gt_boxes.shape[1] == 0:
        max_iou = boxes.new_zeros(num_images, num)
        matched_idx = torch.zeros(num_images, num, dtype=torch.int64, device=boxes.device)
        is_best = None
    else:
        # Images in groups whose [b, G, N] IoU stays within MATCH_CHUNK_ELEMENTS: one group
        # for the usual batches, bounded memory for many images with many boxes.
        step = max(1, MATCH_CHUNK_ELEMENTS // (gt_boxes.shape[1] * max(num, 1)))
        parts = [_best_matches(gt_boxes[i:i + step], boxes if boxes.dim() == 2 else boxes[i:i + step],
                               None if gt_valid is None else gt_valid[i:i + step], allow_low_quality)
                 for i in range(0, num_images, step)]
        max_iou, matched_idx, is_best = (_cat_groups(list(t)) for t in zip(*parts))
    labels = torch.full((num_images, num), IGNORE, dtype=torch.int64, device=boxes.device)
    labels = torch.where((max_iou >= bg_lo) & (max_iou < bg_hi), BACKGROUND, labels)
    labels = torch.where(max_iou >= fg_thresh, FOREGROUND, labels)
    if is_best is not None:
        labels = torch.where(is_best, FOREGROUND, labels)
    if not batched:
        return labels[0], matched_idx[0], max_iou[0]
    return labels, matched_idx, max_iou


def _best_matches(gt_boxes: Tensor, boxes: Tensor, gt_valid: Optional[Tensor],
                  allow_low_quality: bool) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """For ``[b, G, 4]`` ground truth (G > 0) and ``[N, 4]`` or ``[b, N, 4]`` boxes: the best
    IoU ``[b, N]``, its ground-truth index ``[b, N]`` and, with ``allow_low_quality``, the
    ``[b, N]`` bool mask of boxes that are some ground truth's best (IoU > 0)."""
    iou = box_iou_batched(gt_boxes, boxes)  # [b, G, N]
    if gt_valid is not None:
        iou.masked_fill_(~gt_valid[:, :, None], 0.0)
    # Ties keep the first ground truth, as in the per-image form.
    max_iou, matched_idx = iou.max(dim=1)
    if not allow_low_quality:
        return max_iou, matched_idx, None
    best_per_gt = iou.max(dim=2, keepdim=True).values  # [b, G, 1]
    return max_iou, matched_idx, ((iou == best_per_gt) & (best_per_gt > 0)).any(dim=1)


def _cat_groups(groups: Sequence[Optional[Tensor]]) -> Optional[Tensor]:
    """``_best_matches``' per-group results joined along the image axis (None stays None)."""
    return groups[0] if len(groups) == 1 or groups[0] is None else torch.cat(groups)


class Sample(NamedTuple):
    """A fixed-size minibatch of candidate indices (``[S]``, or ``[B, S]`` for a batch).

    Attributes:
        index: int64 indices into the candidates (of the same image).
        valid: bool, False for padding slots.
        foreground: bool, True for sampled foreground (implies valid).
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
        labels: ``[N]`` int64 in {1, 0, -1}, or ``[B, N]``: each row is sampled on its
            own (padding candidates of a batch carry -1).

    Returns:
        a ``Sample`` (see there), ``[S]`` or ``[B, S]``.
    """
    num = labels.shape[-1]
    slots = min(batch_size, num)
    fg_quota = min(int(batch_size * positive_fraction), num)
    key = torch.rand(labels.shape, device=labels.device)
    is_fg = labels == FOREGROUND
    # Draw the foreground: the fg_quota foreground candidates with the largest keys.
    fg_key = torch.where(is_fg, key, -1.0)
    fg_val, fg_idx = fg_key.topk(fg_quota, dim=-1)
    chosen_fg = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    chosen_fg.scatter_(-1, fg_idx, fg_val >= 0)
    # One ranking: chosen foreground in [2, 3), background in [1, 2), the rest -1.
    rank_key = torch.where(chosen_fg, key + 2.0, torch.where(labels == BACKGROUND, key + 1.0, -1.0))
    val, index = rank_key.topk(slots, dim=-1)
    return Sample(index=index, valid=val >= 0, foreground=val >= 2.0)
