"""ROI heads: RoI pooling, the two-FC box head, the predictor, proposal sampling,
class-specific regression targets, losses and post-processing.

Shapes: R RoIs in the batch, C = K + 1 classes (0 = background).
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.ops import batched_nms, box_area

from ..ops import batched_soft_nms, multi_level_roi_align, roi_align
from .box_coder import BoxCoder, clip_boxes
from .losses import weighted_smooth_l1
from .matching import IGNORE, match_by_iou, pad_boxes, pad_rows, sample_minibatch
from .training_stats import TrainingLosses, roi_sample_stats


class MultiLevelRoIAlign(nn.Module):
    """RoIAlign over FPN levels (the FPN paper's level assignment, as
    ``torchvision.ops.MultiScaleRoIAlign``, plus the ``aligned`` switch).

    A box of area ``w * h`` goes to level
    ``floor(canonical_level + log2(sqrt(w * h) / canonical_scale) + 1e-6)``, clamped to
    the available levels, where level k has stride ``2^k``.

    Args:
        strides: stride of each pooled feature map, powers of 2 (e.g. 4, 8, 16, 32).
        output_size: pooled size (square).
        sampling_ratio: RoIAlign samples per bin side (0 = adaptive).
        aligned: shift boxes by -0.5 px (pixel-centre model, ``roi_align(aligned=True)``).

    Forward: features (per level ``[N, C, H_l, W_l]``), boxes (per image ``[R_i, 4]``, or
    ``[N, R, 4]``) -> ``[sum R_i, C, S, S]``.
    """

    def __init__(self, strides: Sequence[int], output_size: int = 7, sampling_ratio: int = 2,
                 aligned: bool = False, canonical_scale: float = 224.0, canonical_level: int = 4) -> None:
        super().__init__()
        levels = [math.log2(s) for s in strides]
        if any(lv != int(lv) for lv in levels):
            raise ValueError(f"pooled feature strides must be powers of 2, got {list(strides)}")
        self.scales = [1.0 / s for s in strides]
        self.k_min, self.k_max = int(levels[0]), int(levels[-1])
        self.output_size = (output_size, output_size)
        self.sampling_ratio = sampling_ratio
        self.aligned = aligned
        self.canonical_scale = canonical_scale
        self.canonical_level = canonical_level

    def level_of(self, boxes: Tensor) -> Tensor:
        """``[R]`` int64 index into the pooled levels for ``[R, 4]`` boxes."""
        size = torch.sqrt(box_area(boxes))
        k = torch.floor(self.canonical_level + torch.log2(size / self.canonical_scale) + 1e-6)
        return k.clamp(self.k_min, self.k_max).to(torch.int64) - self.k_min

    def forward(self, features: List[Tensor], boxes: Union[List[Tensor], Tensor]) -> Tensor:
        if isinstance(boxes, Tensor):  # [N, S, 4]: S boxes for each image
            concat = boxes.reshape(-1, 4)
            batch_idx = torch.arange(boxes.shape[0], dtype=concat.dtype, device=concat.device)
            batch_idx = batch_idx.repeat_interleave(boxes.shape[1])[:, None]
        else:
            concat = torch.cat(boxes, dim=0)
            batch_idx = torch.cat([torch.full_like(b[:, :1], i, dtype=concat.dtype) for i, b in enumerate(boxes)])
        rois = torch.cat((batch_idx, concat), dim=1)
        if len(features) == 1:
            return roi_align(features[0], rois, self.output_size, self.scales[0], self.sampling_ratio, self.aligned)
        return multi_level_roi_align(features, rois, self.level_of(concat), self.output_size, self.scales,
                                     self.sampling_ratio, self.aligned)


class TwoMLPHead(nn.Module):
    """``[R, C, S, S]`` -> flatten -> fc6 -> ReLU -> fc7 -> ReLU -> ``[R, representation_size]``."""

    def __init__(self, in_features: int, representation_size: int) -> None:
        super().__init__()
        self.fc6 = nn.Linear(in_features, representation_size)
        self.fc7 = nn.Linear(representation_size, representation_size)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.fc6(x.flatten(1)))
        return F.relu(self.fc7(x))


class FastRCNNPredictor(nn.Module):
    """``[R, D]`` -> class logits ``[R, C]`` and class-specific deltas ``[R, 4C]``.

    Initialised with N(0, 0.01) (classes) and N(0, 0.001) (deltas), zero biases.
    """

    def __init__(self, in_features: int, num_classes_with_bg: int) -> None:
        super().__init__()
        self.cls_score = nn.Linear(in_features, num_classes_with_bg)
        self.bbox_pred = nn.Linear(in_features, num_classes_with_bg * 4)
        nn.init.normal_(self.cls_score.weight, std=0.01)
        nn.init.normal_(self.bbox_pred.weight, std=0.001)
        nn.init.constant_(self.cls_score.bias, 0.0)
        nn.init.constant_(self.bbox_pred.bias, 0.0)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return self.cls_score(x), self.bbox_pred(x)


def class_specific_targets(deltas: Tensor, labels: Tensor, num_classes_with_bg: int) -> Tuple[Tensor, Tensor]:
    """Spread per-RoI regression targets into the class-specific layout.

    Args:
        deltas: ``[R, 4]`` encoded targets of each RoI's matched ground truth.
        labels: ``[R]`` int64 class of each RoI (0 = background).
        num_classes_with_bg: C.

    Returns:
        targets ``[R, 4C]`` (the 4 columns ``4c .. 4c+3`` of the RoI's class c hold its
        deltas, everything else 0) and inside weights ``[R, 4C]`` (1 on those columns
        for foreground RoIs, 0 elsewhere).
    """
    num = deltas.shape[0]
    fg = (labels > 0).to(deltas.dtype)[:, None]
    cols = labels[:, None] * 4 + torch.arange(4, device=labels.device)
    targets = deltas.new_zeros(num, 4 * num_classes_with_bg).scatter_(1, cols, deltas * fg)
    inside = deltas.new_zeros(num, 4 * num_classes_with_bg).scatter_(1, cols, fg.expand(-1, 4).contiguous())
    return targets, inside


class SoftNMSSettings(NamedTuple):
    """Soft-NMS at test time (``roi_heads.nms`` with ``type: soft``): the decay
    ``method`` (``linear`` | ``gaussian``), the Gaussian ``sigma``, and the
    ``score_thresh`` below which a decayed box is dropped. The linear rule's IoU
    threshold is the head's ``nms_thresh``."""

    method: str = "linear"
    sigma: float = 0.5
    score_thresh: float = 0.001


class ROIHeads(nn.Module):
    """Box branch of Faster R-CNN.

    Args:
        pooler: ``MultiLevelRoIAlign``.
        box_head: ``TwoMLPHead``; box_predictor: ``FastRCNNPredictor``.
        num_classes: K (background excluded).
        fg_iou_thresh, bg_iou_lo, bg_iou_hi: proposal labels (IoU >= fg_iou_thresh
            foreground, bg_iou_lo <= IoU < bg_iou_hi background, others ignored).
        batch_size_per_image, positive_fraction: RoI sampling.
        box_coder_weights: e.g. (10, 10, 5, 5).
        sigma: the weighted SmoothL1's sigma.
        score_thresh, nms_thresh, detections_per_img, min_box_size: post-processing.
        nms: ``SoftNMSSettings`` for Soft-NMS per class, None for hard NMS (torchvision's
            ``batched_nms`` at ``nms_thresh``).
    """

    def __init__(
        self,
        pooler: MultiLevelRoIAlign,
        box_head: TwoMLPHead,
        box_predictor: FastRCNNPredictor,
        num_classes: int,
        fg_iou_thresh: float = 0.5,
        bg_iou_lo: float = 0.0,
        bg_iou_hi: float = 0.5,
        batch_size_per_image: int = 512,
        positive_fraction: float = 0.25,
        box_coder_weights: Sequence[float] = (10.0, 10.0, 5.0, 5.0),
        sigma: float = 1.0,
        score_thresh: float = 0.05,
        nms_thresh: float = 0.5,
        detections_per_img: int = 100,
        min_box_size: float = 1e-2,
        nms: Optional[SoftNMSSettings] = None,
    ) -> None:
        super().__init__()
        self.box_roi_pool = pooler
        self.box_head = box_head
        self.box_predictor = box_predictor
        self.num_classes = num_classes
        self.fg_iou_thresh = fg_iou_thresh
        self.bg_iou_lo = bg_iou_lo
        self.bg_iou_hi = bg_iou_hi
        self.batch_size_per_image = batch_size_per_image
        self.positive_fraction = positive_fraction
        self.box_coder = BoxCoder(box_coder_weights)
        self.sigma = sigma
        self.score_thresh = score_thresh
        self.nms_thresh = nms_thresh
        self.detections_per_img = detections_per_img
        self.min_box_size = min_box_size
        self.soft_nms = nms

    # ------------------------------------------------------------------ training

    @torch.no_grad()
    def sample_proposals(
        self, proposals: List[Tensor], targets: List[Dict[str, Tensor]]
    ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """Append the ground truth to the proposals, label and sample them, for all
        images at once (no loop over images: proposals and ground truth are padded to
        one count per image, and padding candidates are never drawn).

        Returns:
            rois: ``[N, S, 4]`` sampled boxes of each image (``S`` slots per image).
            labels: ``[R]`` int64 class per RoI (0 background), R = N * S.
            reg_targets: ``[R, 4]`` encoded matched ground truth (0 for background).
            valid: ``[R]`` bool, False for padding slots (zero loss weight).
        """
        props, props_real = pad_boxes(proposals)  # [N, P, 4]
        gt_boxes, gt_real = pad_boxes([t["boxes"].to(props.dtype) for t in targets])  # [N, G, 4]
        gt_labels = pad_rows([t["labels"] for t in targets], gt_boxes.shape[1], 0)  # [N, G]
        return self.sample_padded(props, props_real, gt_boxes, gt_real, gt_labels)

    @torch.no_grad()
    def sample_padded(self, props: Tensor, props_real: Tensor, gt_boxes: Tensor, gt_real: Tensor,
                      gt_labels: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """``sample_proposals`` with proposals and ground truth already padded: ``props``
        ``[N, P, 4]`` and ``gt_boxes`` ``[N, G, 4]`` (G >= 1; padding slots hold
        ``matching.PAD_BOX``), their ``[N, P]`` / ``[N, G]`` bool masks and ``gt_labels``
        ``[N, G]``. Every result's shape depends on the inputs' shapes only."""
        candidates = torch.cat((props, gt_boxes), dim=1)  # [N, M, 4]
        match_labels, matched, _ = match_by_iou(gt_boxes, candidates, self.fg_iou_thresh,
                                                self.bg_iou_lo, self.bg_iou_hi, gt_valid=gt_real)
        match_labels = torch.where(torch.cat((props_real, gt_real), dim=1), match_labels, IGNORE)
        sample = sample_minibatch(match_labels, self.batch_size_per_image, self.positive_fraction)  # [N, S]
        boxes = candidates.gather(1, sample.index[:, :, None].expand(-1, -1, 4))
        gt_idx = matched.gather(1, sample.index)
        cls = torch.where(sample.foreground, gt_labels.gather(1, gt_idx), 0)
        matched_gt = gt_boxes.gather(1, gt_idx[:, :, None].expand(-1, -1, 4))
        deltas = self.box_coder.encode(boxes, matched_gt) * sample.foreground[:, :, None]
        return boxes, cls.flatten(), deltas.reshape(-1, 4), sample.valid.flatten()

    def losses(self, class_logits: Tensor, box_deltas: Tensor, labels: Tensor, reg_targets: Tensor,
               valid: Tensor) -> TrainingLosses:
        """``losses_and_stats`` as a ``TrainingLosses``."""
        return TrainingLosses(*self.losses_and_stats(class_logits, box_deltas, labels, reg_targets, valid))

    def losses_and_stats(self, class_logits: Tensor, box_deltas: Tensor, labels: Tensor, reg_targets: Tensor,
                         valid: Tensor) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
        """Cross-entropy and class-specific weighted SmoothL1, both divided by the number
        of sampled RoIs in the batch; the sample's foreground fraction and classification
        accuracy in ``stats`` (``training_stats.roi_sample_stats``): ``(losses, stats)``,
        plain dicts (the static step compiles this).

        Args:
            class_logits: ``[R, C]``; box_deltas: ``[R, 4C]``; labels: ``[R]``;
            reg_targets: ``[R, 4]``; valid: ``[R]`` bool.
        """
        class_logits, box_deltas = class_logits.float(), box_deltas.float()
        weight = valid.to(class_logits.dtype)
        num_sampled = weight.sum().clamp(min=1.0)
        loss_cls = (F.cross_entropy(class_logits, labels, reduction="none") * weight).sum() / num_sampled
        targets, inside = class_specific_targets(reg_targets, labels * valid, class_logits.shape[1])
        loss_box = weighted_smooth_l1(box_deltas, targets, inside, None, self.sigma) / num_sampled
        return {"loss_roi_cls": loss_cls, "loss_roi_box": loss_box}, roi_sample_stats(class_logits, labels, valid)

    # ------------------------------------------------------------------ inference

    @torch.no_grad()
    def postprocess(self, class_logits: Tensor, box_deltas: Tensor, proposals: List[Tensor],
                    image_sizes: List[Tuple[int, int]]) -> List[Dict[str, Tensor]]:
        """Softmax, class-specific decoding, clipping, score threshold, per-class NMS, top-k.

        Returns:
            per image ``{"boxes": [M, 4], "scores": [M], "labels": [M]}`` (labels 1..K),
            sorted by decreasing score.
        """
        num_classes_with_bg = class_logits.shape[1]
        scores_all = F.softmax(class_logits.float(), dim=-1)
        deltas_all = box_deltas.float().view(-1, num_classes_with_bg, 4)
        counts = [p.shape[0] for p in proposals]  # tensor sizes, so that tracing keeps them dynamic
        per_image = list(zip(scores_all.split(counts), deltas_all.split(counts), proposals, image_sizes))
        return [self.detections_of_image(*args) for args in per_image]

    def detections_of_image(self, scores: Tensor, deltas: Tensor, proposals: Tensor,
                            size: Tuple[int, int]) -> Dict[str, Tensor]:
        """One image: ``[P, C]`` class probabilities, ``[P, C, 4]`` deltas, ``[P, 4]``
        proposals -> ``{"boxes", "scores", "labels"}`` (see ``postprocess``)."""
        fg_scores = scores[:, 1:]  # [P, K]
        roi_idx, cls_idx = torch.where(fg_scores > self.score_thresh)
        labels = cls_idx + 1
        s = fg_scores[roi_idx, cls_idx]
        boxes = self.box_coder.decode(deltas[roi_idx, labels], proposals[roi_idx])
        boxes = clip_boxes(boxes, size)
        w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        keep = torch.where((w >= self.min_box_size) & (h >= self.min_box_size))[0]
        boxes, s, labels = boxes[keep], s[keep], labels[keep]
        if self.soft_nms is not None:
            keep, s = batched_soft_nms(boxes, s, labels, self.soft_nms.method, self.nms_thresh,
                                       self.soft_nms.sigma, self.soft_nms.score_thresh)
            keep, s = keep[: self.detections_per_img], s[: self.detections_per_img]
            return {"boxes": boxes[keep], "scores": s, "labels": labels[keep]}
        keep = batched_nms(boxes, s, labels, self.nms_thresh)[: self.detections_per_img]
        return {"boxes": boxes[keep], "scores": s[keep], "labels": labels[keep]}

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        features: List[Tensor],
        proposals: List[Tensor],
        image_sizes: List[Tuple[int, int]],
        targets: Optional[List[Dict[str, Tensor]]] = None,
    ) -> Tuple[List[Dict[str, Tensor]], Dict[str, Tensor]]:
        """
        Args:
            features: the pooled levels, ``[N, C, H_l, W_l]`` each.
            proposals: per image ``[P_i, 4]``.
            image_sizes: ``(h, w)`` per image before padding.
            targets: per image ``boxes`` ``[G, 4]`` and ``labels`` ``[G]`` (training).

        Returns:
            (detections, {}) without targets, ([], losses) with them.
        """
        if targets is not None:
            rois, labels, reg_targets, valid = self.sample_proposals(proposals, targets)
            x = self.box_head(self.box_roi_pool(features, rois))
            class_logits, box_deltas = self.box_predictor(x)
            return [], self.losses(class_logits, box_deltas, labels, reg_targets, valid)
        x = self.box_head(self.box_roi_pool(features, proposals))
        class_logits, box_deltas = self.box_predictor(x)
        return self.postprocess(class_logits, box_deltas, proposals, image_sizes), {}
