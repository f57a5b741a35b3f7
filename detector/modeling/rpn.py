"""Region Proposal Network: head, proposals, anchor targets and losses.

Shapes: N images, L levels, A anchors per location, ``T = sum_l H_l * W_l * A``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.ops import batched_nms

from .anchors import AnchorGenerator
from .box_coder import BoxCoder, clip_boxes
from .losses import weighted_smooth_l1
from .matching import Sample, match_by_iou, pad_boxes, sample_minibatch
from .training_stats import TrainingLosses, anchor_sample_stats


class RPNHead(nn.Module):
    """Shared conv(s) + ReLU, then 1x1 convs for objectness and deltas.

    Parameter names follow torchvision: ``conv.0.0`` (first 3x3 conv), ``cls_logits``,
    ``bbox_pred``. Convs are initialised with N(0, 0.01), biases with 0.

    Forward: list of ``[N, C, H_l, W_l]`` -> (list of ``[N, A, H_l, W_l]`` logits,
    list of ``[N, 4A, H_l, W_l]`` deltas).
    """

    def __init__(self, in_channels: int, num_anchors: int, conv_depth: int = 1) -> None:
        super().__init__()
        if conv_depth < 1:
            raise ValueError(f"rpn.conv_depth must be >= 1, got {conv_depth}")
        self.conv = nn.Sequential(*[
            nn.Sequential(nn.Conv2d(in_channels, in_channels, 3, padding=1), nn.ReLU(inplace=True))
            for _ in range(conv_depth)
        ])
        self.cls_logits = nn.Conv2d(in_channels, num_anchors, 1)
        self.bbox_pred = nn.Conv2d(in_channels, num_anchors * 4, 1)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, std=0.01)
                nn.init.constant_(m.bias, 0.0)

    def forward(self, features: List[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
        logits, deltas = [], []
        for x in features:
            t = self.conv(x)
            logits.append(self.cls_logits(t))
            deltas.append(self.bbox_pred(t))
        return logits, deltas


def flatten_head_outputs(logits: List[Tensor], deltas: List[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
    """Per level: ``[N, A, H, W]`` -> ``[N, H*W*A]`` and ``[N, 4A, H, W]`` -> ``[N, H*W*A, 4]``
    (the anchor order of ``AnchorGenerator``)."""
    flat_logits, flat_deltas = [], []
    for lg, dl in zip(logits, deltas):
        n, a, h, w = lg.shape
        flat_logits.append(lg.permute(0, 2, 3, 1).reshape(n, -1))
        flat_deltas.append(dl.view(n, a, 4, h, w).permute(0, 3, 4, 1, 2).reshape(n, -1, 4))
    return flat_logits, flat_deltas


def top_count(available: int, k: int) -> int:
    """``min(k, available)``. While tracing for export ``available`` (a tensor size) is a
    0-dim tensor; the minimum then stays in the traced graph instead of becoming a
    constant of the example image's size."""
    if torch.jit.is_tracing() and isinstance(available, Tensor):
        return available.clamp(max=k)  # type: ignore[return-value]
    return min(k, available)


def rpn_outside_weights(sample: Sample, positive_weight: float) -> Tensor:
    """Per-anchor outside weights of the sampled anchors (py-faster-rcnn), per image.

    ``positive_weight < 0``: ``1 / num_sampled`` for every sampled anchor (they sum to 1).
    ``positive_weight = p`` in (0, 1): ``p / num_pos`` for foreground and
    ``(1 - p) / num_neg`` for background anchors.

    Returns:
        ``[S]`` (``[B, S]`` for a batched sample) float, 0 on invalid slots.
    """
    valid = sample.valid.float()
    if positive_weight < 0:
        return valid / valid.sum(-1, keepdim=True).clamp(min=1.0)
    if not 0.0 < positive_weight < 1.0:
        raise ValueError(f"rpn.positive_weight must be -1 or in (0, 1), got {positive_weight}")
    fg = sample.foreground.float()
    bg = valid - fg
    return (positive_weight * fg / fg.sum(-1, keepdim=True).clamp(min=1.0)
            + (1.0 - positive_weight) * bg / bg.sum(-1, keepdim=True).clamp(min=1.0))


class RegionProposalNetwork(nn.Module):
    """Proposals from anchors, and the RPN losses in training.

    Args:
        anchor_generator: anchors per level.
        head: ``RPNHead``.
        box_coder_weights: ``rpn.box_coder_weights``.
        pre_nms_topk: (train, test) top-k per level before NMS.
        post_nms_topk: (train, test) proposals kept per image after NMS.
        nms_thresh, min_size, score_thresh: proposal filtering (min_size in pixels,
            score_thresh on the sigmoid objectness).
        fg_iou_thresh, bg_iou_thresh: anchor labels (>= fg foreground, < bg background).
        batch_size_per_image, positive_fraction: anchor sampling.
        sigma, positive_weight: the weighted SmoothL1 (see ``rpn_outside_weights``).
    """

    def __init__(
        self,
        anchor_generator: AnchorGenerator,
        head: RPNHead,
        box_coder_weights: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
        pre_nms_topk: Tuple[int, int] = (2000, 1000),
        post_nms_topk: Tuple[int, int] = (2000, 1000),
        nms_thresh: float = 0.7,
        min_size: float = 1e-3,
        score_thresh: float = 0.0,
        fg_iou_thresh: float = 0.7,
        bg_iou_thresh: float = 0.3,
        batch_size_per_image: int = 256,
        positive_fraction: float = 0.5,
        sigma: float = 3.0,
        positive_weight: float = -1.0,
    ) -> None:
        super().__init__()
        self.anchor_generator = anchor_generator
        self.head = head
        self.box_coder = BoxCoder(box_coder_weights)
        self.pre_nms_topk = pre_nms_topk
        self.post_nms_topk = post_nms_topk
        self.nms_thresh = nms_thresh
        self.min_size = min_size
        self.score_thresh = score_thresh
        self.fg_iou_thresh = fg_iou_thresh
        self.bg_iou_thresh = bg_iou_thresh
        self.batch_size_per_image = batch_size_per_image
        self.positive_fraction = positive_fraction
        self.sigma = sigma
        self.positive_weight = positive_weight
        if positive_weight >= 0 and not 0.0 < positive_weight < 1.0:
            raise ValueError(f"rpn.positive_weight must be -1 or in (0, 1), got {positive_weight}")

    # ------------------------------------------------------------------ proposals

    @torch.no_grad()
    def propose(
        self,
        anchors: List[Tensor],
        logits: List[Tensor],
        deltas: List[Tensor],
        image_sizes: List[Tuple[int, int]],
    ) -> List[Tensor]:
        """Decode the top anchors of each level, clip, filter, NMS per level.

        Args:
            anchors: per level ``[T_l, 4]``.
            logits: per level ``[N, T_l]``; deltas: per level ``[N, T_l, 4]``.
            image_sizes: ``(h, w)`` of each image before padding (boxes are clipped to it).

        Returns:
            per image ``[P_i, 4]`` proposals sorted by decreasing objectness.
        """
        pre_nms = self.pre_nms_topk[0] if self.training else self.pre_nms_topk[1]
        post_nms = self.post_nms_topk[0] if self.training else self.post_nms_topk[1]
        num_images = logits[0].shape[0]
        all_deltas, all_anchors, all_logits, all_levels = [], [], [], []
        for level, (anc, lg, dl) in enumerate(zip(anchors, logits, deltas)):
            k = top_count(lg.shape[1], pre_nms)
            top_logits, top_idx = lg.detach().topk(k, dim=1)  # [N, k]
            all_deltas.append(torch.gather(dl.detach(), 1, top_idx[:, :, None].expand(-1, -1, 4)))  # [N, k, 4]
            all_anchors.append(anc[top_idx])  # [N, k, 4]
            all_logits.append(top_logits)
            all_levels.append(torch.full((k,), level, dtype=torch.int64, device=lg.device))
        # One decode and one sigmoid for all levels and images (elementwise: the same values).
        top_deltas = torch.cat(all_deltas, dim=1).float()
        boxes = self.box_coder.decode(top_deltas.reshape(-1, 4), torch.cat(all_anchors, dim=1).reshape(-1, 4))
        boxes = boxes.view(num_images, -1, 4)
        scores = torch.sigmoid(torch.cat(all_logits, dim=1).float())
        levels = torch.cat(all_levels)

        # The inputs are detached: the proposals carry no gradient.
        return [self.filter_and_nms(boxes[i], scores[i], levels, image_sizes[i], post_nms) for i in range(num_images)]

    def filter_and_nms(self, boxes: Tensor, scores: Tensor, levels: Tensor, size: Tuple[int, int],
                       post_nms: int) -> Tensor:
        """One image's proposals: ``[P, 4]`` decoded boxes, ``[P]`` scores and levels ->
        clipped to ``size``, small (and low-scoring) boxes dropped, NMS per level, the
        ``post_nms`` best -> ``[P', 4]`` sorted by decreasing score."""
        b = clip_boxes(boxes, size)
        w, h = b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
        keep = (w >= self.min_size) & (h >= self.min_size)
        if self.score_thresh > 0:
            keep &= scores >= self.score_thresh
        keep = torch.where(keep)[0]
        b, s, lv = b[keep], scores[keep], levels[keep]
        keep = batched_nms(b, s, lv, self.nms_thresh)[:post_nms]
        return b[keep]

    # ------------------------------------------------------------------ training

    def label_anchors(self, anchors: Tensor, gt_boxes: Tensor,
                      gt_valid: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Anchor labels: IoU >= fg_iou_thresh foreground (1), < bg_iou_thresh background
        (0), between ignored (-1); each ground truth's best anchors are foreground too.

        Args:
            anchors: ``[T, 4]``; gt_boxes: ``[G, 4]``, or ``[B, G, 4]`` with ``gt_valid``
                ``[B, G]`` (``matching.pad_boxes``) for a batch.

        Returns:
            labels ``[T]`` (``[B, T]``) int64 and matched ground-truth index ``[T]`` (``[B, T]``).
        """
        labels, matched, _ = match_by_iou(gt_boxes, anchors, self.fg_iou_thresh, 0.0, self.bg_iou_thresh,
                                          allow_low_quality=True, gt_valid=gt_valid)
        return labels, matched

    def losses(
        self,
        anchors: Tensor,
        logits: Tensor,
        deltas: Tensor,
        targets: List[Dict[str, Tensor]],
    ) -> TrainingLosses:
        """Objectness BCE and weighted SmoothL1 on the sampled anchors, for all images at
        once (labels, sampling and targets are batched: no loop over images).

        Each image's losses are normalised as in py-faster-rcnn (the BCE by the number
        of sampled anchors, the box loss by the outside weights); the batch loss is the
        mean over images. An image without boxes has only background anchors and no
        box loss.

        Returns a ``TrainingLosses``: the two losses, with the sampled anchors' counts in
        its ``stats`` (``training_stats.anchor_sample_stats``).

        Args:
            anchors: ``[T, 4]`` all levels concatenated.
            logits: ``[N, T]``; deltas: ``[N, T, 4]``.
            targets: per image ``boxes`` ``[G, 4]``.
        """
        gt, gt_valid = pad_boxes([t["boxes"] for t in targets])  # [N, G, 4], [N, G]
        return self.padded_losses(anchors, logits, deltas, gt, gt_valid)

    def padded_losses(self, anchors: Tensor, logits: Tensor, deltas: Tensor, gt: Tensor,
                      gt_valid: Tensor) -> TrainingLosses:
        """``losses`` with the ground truth already padded: ``gt`` ``[N, G, 4]`` (padding
        slots hold ``matching.PAD_BOX``), ``gt_valid`` ``[N, G]`` bool (G >= 1)."""
        return TrainingLosses(*self.padded_losses_and_stats(anchors, logits, deltas, gt, gt_valid))

    def padded_losses_and_stats(self, anchors: Tensor, logits: Tensor, deltas: Tensor, gt: Tensor,
                                gt_valid: Tensor) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
        """``padded_losses`` as ``(losses, stats)`` plain dicts. Shapes depend on the
        inputs' shapes only; the static step compiles it (torch 2.6's dynamo cannot build
        a dict subclass inside a graph)."""
        labels, matched = self.label_anchors(anchors, gt, gt_valid)  # [N, T]
        sample = sample_minibatch(labels, self.batch_size_per_image, self.positive_fraction)  # [N, S]
        idx = sample.index
        valid = sample.valid.to(logits.dtype)
        fg = sample.foreground.to(logits.dtype)
        bce = F.binary_cross_entropy_with_logits(logits.gather(1, idx), fg, reduction="none")
        loss_cls = ((bce * valid).sum(1) / valid.sum(1).clamp(min=1.0)).sum()
        # Background and padding slots get inside weight 0; an image without boxes is
        # matched to PAD_BOX, whose finite targets then carry no weight.
        matched_gt = gt.gather(1, matched.gather(1, idx)[:, :, None].expand(-1, -1, 4))  # [N, S, 4]
        reg_targets = self.box_coder.encode(anchors[idx], matched_gt)
        inside = fg[:, :, None].expand(-1, -1, 4)
        outside = rpn_outside_weights(sample, self.positive_weight)[:, :, None].expand(-1, -1, 4)
        sampled_deltas = deltas.gather(1, idx[:, :, None].expand(-1, -1, 4))
        loss_box = weighted_smooth_l1(sampled_deltas, reg_targets, inside, outside, self.sigma)
        n = max(gt.shape[0], 1)
        return {"loss_rpn_cls": loss_cls / n, "loss_rpn_box": loss_box / n}, anchor_sample_stats(sample)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        features: List[Tensor],
        image_size: Tuple[int, int],
        image_sizes: List[Tuple[int, int]],
        targets: Optional[List[Dict[str, Tensor]]] = None,
    ) -> Tuple[List[Tensor], Dict[str, Tensor]]:
        """
        Args:
            features: per level ``[N, C, H_l, W_l]``.
            image_size: ``(H, W)`` of the padded batch.
            image_sizes: ``(h, w)`` of each image before padding.
            targets: per image dicts with ``boxes`` (training only).

        Returns:
            proposals (per image ``[P_i, 4]``) and a dict of losses (empty without targets).
        """
        logits, deltas = self.head(features)
        logits, deltas = flatten_head_outputs(logits, deltas)
        feature_sizes = [tuple(f.shape[-2:]) for f in features]
        anchors = self.anchor_generator(image_size, feature_sizes, features[0].device, torch.float32)
        proposals = self.propose(anchors, logits, deltas, image_sizes)
        losses: Dict[str, Tensor] = {}
        if targets is not None:
            losses = self.losses(torch.cat(anchors), torch.cat(logits, 1).float(), torch.cat(deltas, 1).float(),
                                 targets)
        return proposals, losses
