"""The ROI heads' training losses with fixed shapes and no host synchronisation.

``static_roi_losses`` is ``ROIHeads.forward`` in training for padded proposals and
ground truth: the same sampling (``ROIHeads.sample_padded``), the same losses and
normalisation (``ROIHeads.losses``). The multi-level RoIAlign calls torchvision's kernel
once per level with every RoI and keeps each RoI's own level (``static_roi_align``,
through ``ops.roi_align.pool_every_level``, which the eager pooler uses off the CPU too):
the eager pooler groups RoIs by level, whose group sizes are data. That costs one
kernel launch per level instead of one in all, with the same values per RoI. In each
level's call, the RoIs of the other levels are moved outside the feature map, where the
kernel reads nothing and its backward adds nothing: pooled where they were, they made
RoIAlign 36 % of the 8-image CUDA-graph step on an H200 (23 ms of backward atomics,
torchvision's step 4.7 ms).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import Tensor
from torchvision.ops import roi_align as tv_roi_align

from .matching import PAD_BOX
from ..ops.roi_align import pool_every_level, rois_for_kernel
from .roi_heads import MultiLevelRoIAlign, ROIHeads


def static_roi_align(pooler: MultiLevelRoIAlign, features: List[Tensor], boxes: Tensor) -> Tensor:
    """``pooler(features, boxes)`` with fixed shapes: ``boxes`` ``[B, S, 4]`` ->
    ``[B * S, C, R, R]`` (RoI-major, image by image), each RoI pooled on its level with
    torchvision's ``roi_align`` (values equal to the eager pooler's)."""
    concat = boxes.reshape(-1, 4)
    batch_idx = torch.arange(boxes.shape[0], dtype=concat.dtype, device=concat.device)
    rois = torch.cat((batch_idx.repeat_interleave(boxes.shape[1])[:, None], concat), dim=1)  # [R, 5]
    if len(features) == 1:
        return tv_roi_align(features[0], rois_for_kernel(rois, features[0]), pooler.output_size, pooler.scales[0],
                            pooler.sampling_ratio, pooler.aligned)
    return pool_every_level(features, rois, pooler.level_of(concat), pooler.output_size, pooler.scales,
                            pooler.sampling_ratio, pooler.aligned)


def static_roi_losses(roi_heads: ROIHeads, features: List[Tensor], proposals: Tensor, proposals_valid: Tensor,
                      gt_boxes: Tensor, gt_labels: Tensor, gt_valid: Tensor
                      ) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    """``({"loss_roi_cls", "loss_roi_box"}, stats)`` for padded inputs, as
    ``ROIHeads.losses_and_stats``.

    Args:
        features: the pooled levels, ``[B, C, H_l, W_l]`` each.
        proposals: ``[B, P, 4]``; proposals_valid: ``[B, P]`` bool.
        gt_boxes: ``[B, G, 4]`` (padding slots hold ``PAD_BOX``); gt_labels: ``[B, G]``
            int64; gt_valid: ``[B, G]`` bool.
    """
    # PAD_BOX made on the device (a host-to-device copy could not be captured in a CUDA graph).
    pad = torch.stack([proposals.new_full((), v) for v in PAD_BOX])
    props = torch.where(proposals_valid[..., None], proposals, pad)
    rois, labels, reg_targets, valid = roi_heads.sample_padded(props, proposals_valid, gt_boxes, gt_valid, gt_labels)
    x = roi_heads.box_head(static_roi_align(roi_heads.box_roi_pool, features, rois))
    class_logits, box_deltas = roi_heads.box_predictor(x)
    return roi_heads.losses_and_stats(class_logits, box_deltas, labels, reg_targets, valid)
