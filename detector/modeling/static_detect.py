"""Inference with fixed shapes and no host synchronisation (``eval.static``).

``static_detect`` computes what the model's eval forward returns, in fixed-size padded
tensors with a validity mask, so that a batch of one canvas (``model.canvas_sizes``) runs
without reading anything on the host and can be captured in a CUDA graph
(``evaluation.static_inference``). Every shape depends on the batch shape and the config.

- Proposals: ``static_rpn.static_backbone_and_proposals`` in eval mode (the test top-k).
- Pooling and box head: every proposal slot, padding included (``static_roi_align``:
  each RoI's values are the eager pooler's).
- Detections (``static_detections``): ``ROIHeads.detections_of_image`` for every
  (RoI, class) pair at once: class probabilities, class-specific decoding, clipping, the
  score threshold and the small-box filter as a mask. The candidates that pass go, by
  decreasing score, through ``static_nms`` with ``torchvision.ops.batched_nms``'s
  coordinate offsets (each class shifted by ``label * (max coordinate + 1)``, the same
  arithmetic), and the first ``detections_per_img`` kept are the detections.

Candidates: at most ``max_candidates`` per image enter the NMS, the best by score (a
stable sort keeps the eager order on ties). Greedy NMS decides each box from the
higher-scored boxes alone, so the cut changes nothing for the boxes before it: the
detections equal the eager ones whenever an image has at most ``max_candidates``
candidates or keeps ``detections_per_img`` boxes among them. Otherwise the image is
flagged in ``truncated`` (read it with the detections; ``eval.static_candidates``).

Shapes: B images, P proposal slots, K foreground classes, D = ``detections_per_img``.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

import torch
from torch import Tensor

from .nms import DEFAULT_MAX_ITERS, static_nms
from .roi_heads import ROIHeads
from .static_roi_heads import static_roi_align
from .static_rpn import clip_to_sizes, static_backbone_and_proposals


class StaticDetections(NamedTuple):
    """``static_detect``'s result.

    Attributes:
        boxes: ``[B, D, 4]`` x1y1x2y2 in the (resized) input image's pixels.
        scores: ``[B, D]`` class probabilities, decreasing along each row's valid prefix.
        labels: ``[B, D]`` int64, 1..K.
        valid: ``[B, D]`` bool, a prefix of each row: the image's detections.
        truncated: ``[B]`` bool: more candidates than ``max_candidates`` and fewer than
            D kept among them (the detections may then lack some of the eager ones).
        nms_unconverged: ``[B]`` bool: a proposal or detection NMS of the image did not
            reach its fixed point within ``nms_max_iters`` (``nms.static_nms``).
    """

    boxes: Tensor
    scores: Tensor
    labels: Tensor
    valid: Tensor
    truncated: Tensor
    nms_unconverged: Tensor


def check_static_heads(roi_heads: ROIHeads) -> None:
    """One-line ``ValueError`` when the heads post-process in a way ``static_detections``
    does not (Soft-NMS)."""
    if roi_heads.soft_nms is not None:
        raise ValueError("config key 'eval.static' runs greedy NMS: it cannot be combined with roi_heads.soft_nms")


def static_detections(roi_heads: ROIHeads, class_logits: Tensor, box_deltas: Tensor, proposals: Tensor,
                      proposals_valid: Tensor, image_sizes: Tensor, max_candidates: int,
                      nms_max_iters: int = DEFAULT_MAX_ITERS) -> StaticDetections:
    """``ROIHeads.postprocess`` with fixed shapes (see the module docstring).

    Args:
        class_logits: ``[B * P, K + 1]``; box_deltas: ``[B * P, (K + 1) * 4]`` (RoI-major,
            image by image, as ``static_roi_align`` pools).
        proposals: ``[B, P, 4]``; proposals_valid: ``[B, P]`` bool.
        image_sizes: ``[B, 2]`` ``(height, width)`` before padding (boxes are clipped to it).
        max_candidates: (RoI, class) pairs per image that enter the NMS (>= 1).
    """
    check_static_heads(roi_heads)
    num_images, slots = proposals_valid.shape
    classes = class_logits.shape[1] - 1
    probs = torch.softmax(class_logits.float(), dim=-1).view(num_images, slots, classes + 1)
    scores = probs[..., 1:].reshape(num_images, -1)  # [B, P*K], RoI-major
    deltas = box_deltas.float().view(num_images * slots, classes + 1, 4)[:, 1:].reshape(num_images * slots, -1)
    boxes = roi_heads.box_coder.decode(deltas, proposals.reshape(-1, 4).float()).view(num_images, -1, 4)
    boxes = clip_to_sizes(boxes, image_sizes)  # [B, P*K, 4]
    w, h = boxes[..., 2] - boxes[..., 0], boxes[..., 3] - boxes[..., 1]
    ok = (proposals_valid[:, :, None].expand(-1, -1, classes).reshape(num_images, -1)
          & (scores > roi_heads.score_thresh) & (w >= roi_heads.min_box_size) & (h >= roi_heads.min_box_size))
    labels = torch.arange(1, classes + 1, device=scores.device).repeat(slots)  # [P*K]: class-minor, as torch.where
    count = min(max_candidates, slots * classes)
    order = torch.sort(torch.where(ok, scores, float("-inf")), dim=1, descending=True, stable=True).indices[:, :count]
    cand_boxes = boxes.gather(1, order[:, :, None].expand(-1, -1, 4))
    cand_scores, cand_ok, cand_labels = scores.gather(1, order), ok.gather(1, order), labels[order]
    # batched_nms's offsets: the largest coordinate of the image's candidates (all of them).
    top = torch.where(ok[:, :, None], boxes, float("-inf")).amax(dim=(1, 2))
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    shifted = cand_boxes + (cand_labels.to(cand_boxes.dtype) * (top[:, None] + 1))[:, :, None]
    det = roi_heads.detections_per_img
    res = static_nms(shifted, cand_scores, roi_heads.nms_thresh, det, max_iters=nms_max_iters, valid=cand_ok)
    out_boxes = cand_boxes.gather(1, res.keep[:, :, None].expand(-1, -1, 4))
    truncated = (ok.sum(dim=1) > count) & (res.valid.sum(dim=1) < det)
    return StaticDetections(out_boxes, cand_scores.gather(1, res.keep), cand_labels.gather(1, res.keep), res.valid,
                            truncated, res.unconverged)


def static_detect(model: torch.nn.Module, images: Tensor, image_sizes: Tensor, max_candidates: int,
                  nms_max_iters: int = DEFAULT_MAX_ITERS) -> StaticDetections:
    """The detections of a ``FasterRCNN`` in eval mode for one padded batch.

    Args:
        images: ``[B, 3, H, W]`` normalised and padded (``model.preprocess``), H x W one of
            ``model.canvas_sizes`` for a captured graph (any shape runs eagerly).
        image_sizes: ``[B, 2]`` int64 ``(height, width)`` before padding, on the device.
        max_candidates: see ``static_detections``.
        nms_max_iters: ``static_nms``'s bound (``rpn.nms_max_iters``).
    """
    front = static_backbone_and_proposals(model, images, image_sizes, nms_max_iters)
    props, heads = front.proposals, model.roi_heads
    pooled = static_roi_align(heads.box_roi_pool, [front.features[n] for n in model.backbone.pooled_levels],
                              props.boxes)
    class_logits, box_deltas = heads.box_predictor(heads.box_head(pooled))
    dets = static_detections(heads, class_logits, box_deltas, props.boxes, props.valid, image_sizes,
                             max_candidates, nms_max_iters)
    proposal_unconverged = props.nms_unconverged.view(images.shape[0], -1).any(dim=1)
    return dets._replace(nms_unconverged=dets.nms_unconverged | proposal_unconverged)


def detections_list(dets: StaticDetections, counts: Optional[List[int]] = None) -> List[Dict[str, Tensor]]:
    """``StaticDetections`` -> per image ``{"boxes": [M, 4], "scores": [M], "labels": [M]}``
    (the eval forward's result). ``counts``: each image's M, already read on the host;
    None reads them (one host sync)."""
    counts = dets.valid.sum(dim=1).tolist() if counts is None else counts
    return [{"boxes": dets.boxes[i, :m], "scores": dets.scores[i, :m], "labels": dets.labels[i, :m]}
            for i, m in enumerate(counts)]
