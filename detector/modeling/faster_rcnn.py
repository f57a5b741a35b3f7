"""Faster R-CNN: input checks and preprocessing, backbone, RPN, ROI heads."""

from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .backbone import ResNetFPN
from .roi_heads import ROIHeads
from .rpn import RegionProposalNetwork
from .training_stats import TrainingLosses, stats_of

logger = logging.getLogger(__name__)


def check_inputs(images: Sequence[Tensor], targets: Optional[Sequence[Dict[str, Tensor]]],
                 num_classes: int) -> None:
    """Raise ``ValueError`` naming the image index and field for malformed input.

    Images must be ``[3, H, W]``; target ``boxes`` ``[G, 4]`` finite with x2 > x1 and
    y2 > y1; ``labels`` ``[G]`` integers in 1..K.
    """
    for i, image in enumerate(images):
        if not isinstance(image, Tensor) or image.dim() != 3 or image.shape[0] != 3:
            shape = list(image.shape) if isinstance(image, Tensor) else type(image).__name__
            raise ValueError(f"image {i}: field 'image' must be a [3, H, W] RGB tensor, got {shape}")
        if image.shape[1] == 0 or image.shape[2] == 0:
            raise ValueError(f"image {i}: field 'image' is empty, shape {list(image.shape)}")
    if targets is None:
        return
    if len(targets) != len(images):
        raise ValueError(f"got {len(images)} images but {len(targets)} targets")
    shaped = [_target_tensors(i, target) for i, target in enumerate(targets)]
    # The value checks run once over all images (few operators per batch); only when
    # one fails are the images checked one by one, to name the first bad one.
    boxes = [b for b, _ in shaped if b.shape[0] > 0]
    if not boxes:
        return
    all_boxes = torch.cat(boxes)
    all_labels = torch.cat([lb for _, lb in shaped])
    x1, y1, x2, y2 = all_boxes.unbind(1)
    bad = ~torch.isfinite(all_boxes).all() | ((x2 <= x1) | (y2 <= y1)).any() \
        | ((all_labels < 1) | (all_labels > num_classes)).any()
    if bad:
        for i, (b, lb) in enumerate(shaped):
            _check_target_values(i, b, lb, num_classes)


def _target_tensors(i: int, target: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
    """Image ``i``'s ``boxes`` ``[G, 4]`` and integer ``labels`` ``[G]``, or ``ValueError``
    naming the field."""
    for key in ("boxes", "labels"):
        if key not in target:
            raise ValueError(f"image {i}: field '{key}' is missing from the target")
    boxes, labels = target["boxes"], target["labels"]
    if boxes.numel() == 0:
        boxes = boxes.reshape(0, 4)
    if boxes.dim() != 2 or boxes.shape[1] != 4:
        raise ValueError(f"image {i}: field 'boxes' must have shape [N, 4], got {list(boxes.shape)}")
    if labels.dim() != 1 or labels.shape[0] != boxes.shape[0]:
        raise ValueError(f"image {i}: field 'labels' must have shape [{boxes.shape[0]}], got {list(labels.shape)}")
    if boxes.shape[0] > 0 and (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool):
        raise ValueError(f"image {i}: field 'labels' must be integers, got {labels.dtype}")
    return boxes, labels


def _check_target_values(i: int, boxes: Tensor, labels: Tensor, num_classes: int) -> None:
    """``ValueError`` naming image ``i``'s first non-finite or empty box, or label outside 1..K."""
    if boxes.shape[0] == 0:
        return
    if not torch.isfinite(boxes).all():
        j = int((~torch.isfinite(boxes)).any(dim=1).nonzero()[0])
        raise ValueError(f"image {i}: field 'boxes': box {j} has a non-finite coordinate {boxes[j].tolist()}")
    bad = (boxes[:, 2] <= boxes[:, 0]) | (boxes[:, 3] <= boxes[:, 1])
    if bad.any():
        j = int(bad.nonzero()[0])
        raise ValueError(f"image {i}: field 'boxes': box {j} {boxes[j].tolist()} needs x2 > x1 and y2 > y1")
    bad = (labels < 1) | (labels > num_classes)
    if bad.any():
        j = int(bad.nonzero()[0])
        raise ValueError(f"image {i}: field 'labels': label {int(labels[j])} at index {j} is outside 1..{num_classes}")


def batch_shape(sizes: Sequence[Tuple[int, int]], size_divisibility: int,
                canvas_sizes: Sequence[Sequence[int]] = ()) -> Tuple[int, int]:
    """The padded ``(H, W)`` of a batch of images of ``sizes`` ``[(H_i, W_i), ...]`` pixels.

    Without canvases: the largest height and width, each rounded up to a multiple of
    ``size_divisibility``. With ``canvas_sizes`` ``[[H, W], ...]``: the smallest canvas
    (by area, then in the given order) that holds that padded shape, or the padded shape
    itself when no canvas does.
    """
    d = size_divisibility
    height = int(math.ceil(max(s[0] for s in sizes) / d) * d)
    width = int(math.ceil(max(s[1] for s in sizes) / d) * d)
    fitting = [(int(h) * int(w), i) for i, (h, w) in enumerate(canvas_sizes) if h >= height and w >= width]
    if fitting:
        _, best = min(fitting)
        return int(canvas_sizes[best][0]), int(canvas_sizes[best][1])
    return height, width


class FasterRCNN(nn.Module):
    """Faster R-CNN with an FPN backbone.

    Train mode: ``model(images, targets)`` -> ``{"loss_rpn_cls", "loss_rpn_box",
    "loss_roi_cls", "loss_roi_box"}`` (scalars), as a ``TrainingLosses``: that dict, with
    the samplers' statistics in its ``stats`` attribute (``training_stats``; no losses).
    Eval mode: ``model(images)`` -> per image ``{"boxes": [M, 4], "scores": [M],
    "labels": [M]}`` in the coordinates of the given tensor.

    ``images``: a list of ``[3, H_i, W_i]`` tensors (uint8 0..255 or float 0..1) or one
    ``[N, 3, H, W]`` tensor, on any device; the model moves them to its own device,
    normalises with ``pixel_mean`` / ``pixel_std`` (buffers, on the 0..1 scale) and pads
    them (bottom/right, with zeros after normalisation) to a multiple of
    ``size_divisibility`` into one batch.

    Args:
        backbone: ``ResNetFPN``; rpn: ``RegionProposalNetwork``; roi_heads: ``ROIHeads``.
        pixel_mean, pixel_std: per channel, 0..1 scale.
        size_divisibility: pad the batch's height and width to a multiple of this.
        canvas_sizes: fixed batch shapes ``[[H, W], ...]``; a batch is padded to the
            smallest that holds it (see ``batch_shape``), so the convolutional part sees
            few distinct shapes. Detections and losses keep the real image sizes; only
            the zero padding around the images grows.
    """

    def __init__(self, backbone: ResNetFPN, rpn: RegionProposalNetwork, roi_heads: ROIHeads,
                 pixel_mean: Sequence[float] = (0.485, 0.456, 0.406),
                 pixel_std: Sequence[float] = (0.229, 0.224, 0.225), size_divisibility: int = 32,
                 canvas_sizes: Sequence[Sequence[int]] = ()) -> None:
        super().__init__()
        self.backbone = backbone
        self.rpn = rpn
        self.roi_heads = roi_heads
        self.register_buffer("pixel_mean", torch.tensor(pixel_mean, dtype=torch.float32).view(3, 1, 1))
        self.register_buffer("pixel_std", torch.tensor(pixel_std, dtype=torch.float32).view(3, 1, 1))
        self.size_divisibility = size_divisibility
        self.canvas_sizes = [tuple(int(v) for v in c) for c in canvas_sizes]

    @property
    def device(self) -> torch.device:
        return self.pixel_mean.device

    def _load_from_state_dict(self, state_dict: Dict[str, Tensor], prefix: str, *args: object) -> None:
        """Weights that carry another ``pixel_mean`` / ``pixel_std`` than the config's
        replace them (the model was trained with theirs): said once each, since the
        config (and a run's ``config.yaml``) then names values the model does not use."""
        for name in ("pixel_mean", "pixel_std"):
            theirs = state_dict.get(prefix + name)
            ours = getattr(self, name)
            if isinstance(theirs, Tensor) and theirs.shape == ours.shape and not torch.allclose(
                    theirs.float().cpu(), ours.float().cpu(), rtol=0, atol=1e-6):
                logger.warning("the weights' %s %s replace model.%s %s of the config: the model normalises with "
                               "the weights' (set model.%s to them to keep both alike)", name,
                               [round(v, 4) for v in theirs.flatten().tolist()], name,
                               [round(v, 4) for v in ours.flatten().tolist()], name)
        super()._load_from_state_dict(state_dict, prefix, *args)  # type: ignore[arg-type]

    def preprocess(self, images: Sequence[Tensor]) -> Tuple[Tensor, List[Tuple[int, int]]]:
        """List of ``[3, H_i, W_i]`` -> padded normalised ``[N, 3, H, W]`` float32 and the
        ``(H_i, W_i)`` sizes."""
        sizes = [(int(im.shape[1]), int(im.shape[2])) for im in images]
        height, width = batch_shape(sizes, self.size_divisibility, self.canvas_sizes)
        batch = torch.zeros((len(images), 3, height, width), dtype=torch.float32, device=self.device)
        for i, im in enumerate(images):
            im = im.to(self.device, non_blocking=True)
            im = im.float() / 255.0 if im.dtype == torch.uint8 else im.float()
            batch[i, :, : im.shape[1], : im.shape[2]] = (im - self.pixel_mean) / self.pixel_std
        return batch, sizes

    def forward(
        self,
        images: Union[Sequence[Tensor], Tensor],
        targets: Optional[Sequence[Dict[str, Tensor]]] = None,
    ) -> Union[Dict[str, Tensor], List[Dict[str, Tensor]]]:
        if isinstance(images, Tensor) and images.dim() == 4:
            images = list(images.unbind(0))
        if self.training and targets is None:
            raise ValueError("the model is in training mode: targets (boxes and labels per image) are required")
        check_inputs(images, targets, self.roi_heads.num_classes)
        batch, sizes = self.preprocess(images)
        if targets is not None:
            targets = [{"boxes": t["boxes"].to(self.device, non_blocking=True).float().reshape(-1, 4),
                        "labels": t["labels"].to(self.device, non_blocking=True).long()} for t in targets]
        features = self.backbone(batch)
        feature_list = list(features.values())
        proposals, rpn_losses = self.rpn(feature_list, tuple(batch.shape[-2:]), sizes,
                                         targets if self.training else None)
        pooled = [features[name] for name in self.backbone.pooled_levels]
        detections, roi_losses = self.roi_heads(pooled, proposals, sizes, targets if self.training else None)
        if self.training:
            return TrainingLosses({**rpn_losses, **roi_losses}, {**stats_of(rpn_losses), **stats_of(roi_losses)})
        return detections
