"""The static training forward: Faster R-CNN's training losses with every tensor shape
fixed by the config and the batch canvas, and no host synchronisation.

Two parts:

- ``make_static_batch`` (host side, before the step): images padded to one of
  ``model.canvas_sizes`` (any other shape is refused), the real image sizes as a tensor,
  and the ground truth padded to ``data.max_gt_per_image`` with a mask. An image with
  more boxes keeps its first ``max_gt`` and is reported in one log line naming it.
- ``static_losses`` (the step, compilable as one graph): backbone, RPN head, fixed
  top-k + ``static_nms`` proposals (``static_rpn``), the RPN losses, RoI sampling into
  fixed slots with zero-weight padding, pooling, the box head and its losses
  (``static_roi_heads``). The losses and their normalisation are the eager step's
  (``RegionProposalNetwork.padded_losses``, ``ROIHeads.losses``). Random sampling uses
  random keys + top-k (``matching.sample_minibatch``), drawn in the same order and with
  the same shapes as the eager step when the padded counts agree.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, NamedTuple, Sequence, Tuple

import torch
from torch import Tensor

from .faster_rcnn import FasterRCNN, check_inputs
from .matching import PAD_BOX
from .nms import DEFAULT_MAX_ITERS
from .static_roi_heads import static_roi_losses
from .static_rpn import static_backbone_and_proposals

logger = logging.getLogger(__name__)


class StaticBatch(NamedTuple):
    """One batch in fixed shapes (B images, canvas ``H x W``, ``G = max_gt_per_image``).

    Attributes:
        images: ``[B, 3, H, W]`` float32, normalised and zero-padded.
        image_sizes: ``[B, 2]`` int64 ``(height, width)`` before padding.
        gt_boxes: ``[B, G, 4]`` float32 (padding slots hold ``matching.PAD_BOX``).
        gt_labels: ``[B, G]`` int64 (0 on padding).
        gt_valid: ``[B, G]`` bool.
    """

    images: Tensor
    image_sizes: Tensor
    gt_boxes: Tensor
    gt_labels: Tensor
    gt_valid: Tensor


def pad_ground_truth(targets: Sequence[Dict[str, Any]], max_gt: int,
                     device: torch.device) -> Tuple[Tensor, Tensor, Tensor]:
    """Per image ``boxes`` ``[G_i, 4]`` / ``labels`` ``[G_i]`` -> ``[B, max_gt, 4]``,
    ``[B, max_gt]`` labels and mask, on ``device``. An image with ``G_i > max_gt`` keeps
    its first ``max_gt`` boxes and gets one warning line naming it (its ``image_id``)."""
    boxes = torch.tensor(PAD_BOX, dtype=torch.float32).repeat(len(targets), max_gt, 1)
    labels = torch.zeros(len(targets), max_gt, dtype=torch.int64)
    valid = torch.zeros(len(targets), max_gt, dtype=torch.bool)
    for i, t in enumerate(targets):
        b = torch.as_tensor(t["boxes"]).reshape(-1, 4)
        count = int(b.shape[0])  # a shape: no device read
        if count > max_gt:
            name = t.get("image_id", f"#{i} of the batch")
            name = int(name) if isinstance(name, Tensor) and name.device.type == "cpu" else name
            logger.warning("image %s has %d ground-truth boxes, more than data.max_gt_per_image=%d: "
                           "the static step trains on its first %d", name, count, max_gt, max_gt)
            count = max_gt
        boxes[i, :count] = b[:count].to("cpu", torch.float32)
        labels[i, :count] = torch.as_tensor(t["labels"])[:count].to("cpu", torch.int64)
        valid[i, :count] = True
    return (boxes.to(device, non_blocking=True), labels.to(device, non_blocking=True),
            valid.to(device, non_blocking=True))


def make_static_batch(model: FasterRCNN, images: Sequence[Tensor], targets: Sequence[Dict[str, Any]],
                      max_gt: int) -> StaticBatch:
    """``images`` (``[3, H_i, W_i]`` each) and ``targets`` -> a ``StaticBatch`` on the
    model's device. Raises ``ValueError`` naming ``model.canvas_sizes`` when the model has
    no canvases or the batch fits none."""
    if not model.canvas_sizes:
        raise ValueError("the static step needs fixed batch shapes: set model.canvas_sizes")
    check_inputs(images, targets, model.roi_heads.num_classes)
    batch, sizes = model.preprocess(images)
    if tuple(batch.shape[-2:]) not in model.canvas_sizes:
        raise ValueError(f"a batch of images up to {tuple(batch.shape[-2:])} px fits no canvas of "
                         f"model.canvas_sizes {[list(c) for c in model.canvas_sizes]}: add a larger one")
    gt_boxes, gt_labels, gt_valid = pad_ground_truth(targets, max_gt, model.device)
    image_sizes = torch.tensor(sizes, dtype=torch.int64).to(model.device, non_blocking=True)
    return StaticBatch(batch, image_sizes, gt_boxes, gt_labels, gt_valid)


def static_losses(model: FasterRCNN, batch: StaticBatch,
                  nms_max_iters: int = DEFAULT_MAX_ITERS) -> Tuple[Dict[str, Tensor], Dict[str, Tensor], Tensor]:
    """The four training losses of ``model`` (in training mode) for a ``StaticBatch``.

    Returns:
        ``{"loss_rpn_cls", "loss_rpn_box", "loss_roi_cls", "loss_roi_box"}`` (scalars),
        the samplers' statistics (``training_stats``: the eager model's ``stats``, 0-d
        detached) and a ``[B * L]`` bool device tensor: the proposal NMS of that image
        and level did not converge within ``nms_max_iters``. Read the last two at
        logging points only.
    """
    features, anchors, logits, deltas, props = static_backbone_and_proposals(model, batch.images, batch.image_sizes,
                                                                             nms_max_iters)
    gt_boxes = batch.gt_boxes.float()
    rpn_losses, rpn_stats = model.rpn.padded_losses_and_stats(torch.cat(anchors), torch.cat(logits, 1).float(),
                                                              torch.cat(deltas, 1).float(), gt_boxes, batch.gt_valid)
    pooled = [features[name] for name in model.backbone.pooled_levels]
    roi_losses, roi_stats = static_roi_losses(model.roi_heads, pooled, props.boxes, props.valid, gt_boxes, batch.gt_labels,
                                   batch.gt_valid)
    return {**rpn_losses, **roi_losses}, {**rpn_stats, **roi_stats}, props.nms_unconverged
