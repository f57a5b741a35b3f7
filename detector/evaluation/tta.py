"""Test-time augmentation (``eval.tta``): the model runs on each image at several
shorter-side sizes and, with ``flip``, also on the horizontally flipped image; each
pass's boxes are mapped back to the coordinates of the image the caller gave, the
detections of all passes are merged, NMS'd per class (the model's own NMS: hard at
``roi_heads.nms_thresh``, or Soft-NMS with ``roi_heads.nms.type: soft``) and the top
``roi_heads.detections_per_img`` kept.

Sizes are those of the original image (as ``input.min_size_test``), the longer side
capped at ``input.max_size_test``. Each pass resizes the image the caller gave with the
eval transform's own resize (``detector.data.transforms.resize_array``); with TTA on, the
eval transform leaves images at their original size (``build_transforms``), so every
pass is one interpolation of the decoded image, not a resize of a resized one. With one
pass (one size, no flip) the model's output, already NMS'd, is only mapped back (divided
by the float32 scale, as ``inference.to_original_boxes`` does); a pass at size ``s`` then
equals plain inference with ``input.min_size_test = s`` exactly.

Boxes are ``[x1, y1, x2, y2]`` pixels.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn
from torchvision.ops import batched_nms

from detector.data.transforms import resize_array, resized_shape
from detector.modeling.roi_heads import SoftNMSSettings
from detector.ops import batched_soft_nms


class TTASettings(NamedTuple):
    """``sizes``: shorter sides of the original image (pixels); ``flip``: also run the
    horizontally flipped image; ``max_size``: the longer side's cap (pixels)."""

    sizes: Tuple[int, ...]
    flip: bool
    max_size: int


def tta_settings(cfg: Any) -> Optional[TTASettings]:
    """``eval.tta`` of a Config as settings, or None when TTA is off (no sizes)."""
    tta = cfg.eval.tta
    if not tta.sizes:
        return None
    return TTASettings(tuple(int(s) for s in tta.sizes), bool(tta.flip), int(cfg.input.max_size_test))


def flip_boxes(boxes: Tensor, width: float) -> Tensor:
    """``[M, 4]`` boxes of a horizontally flipped image of ``width`` pixels -> the same
    boxes in the unflipped image: ``x1' = width - x2``, ``x2' = width - x1``."""
    return torch.stack((width - boxes[:, 2], boxes[:, 1], width - boxes[:, 0], boxes[:, 3]), dim=1)


def resize_image(image: Tensor, height: int, width: int) -> Tensor:
    """``[3, H, W]`` -> ``[3, height, width]`` on the CPU, by the eval transform's resize
    (``resize_array``: bilinear, area when shrinking more than 2x; uint8 stays uint8).
    The same tensor when the size does not change."""
    if tuple(image.shape[-2:]) == (height, width):
        return image
    hwc = np.ascontiguousarray(image.permute(1, 2, 0).cpu().numpy())
    return torch.from_numpy(resize_array(hwc, height, width)).permute(2, 0, 1)


def merge_detections(parts: Sequence[Dict[str, Tensor]], nms_thresh: float, soft: Optional[SoftNMSSettings],
                     top_k: int) -> Dict[str, Tensor]:
    """Merge one image's detections of several passes (already in one coordinate frame):
    concatenate, NMS per class (``soft`` None: hard NMS at ``nms_thresh``), keep the
    ``top_k`` best. Returns ``boxes`` ``[M, 4]``, ``scores`` ``[M]``, ``labels`` ``[M]``
    sorted by decreasing score."""
    boxes = torch.cat([p["boxes"] for p in parts]).float()
    scores = torch.cat([p["scores"] for p in parts]).float()
    labels = torch.cat([p["labels"] for p in parts])
    if soft is not None:
        keep, scores = batched_soft_nms(boxes, scores, labels, soft.method, nms_thresh, soft.sigma, soft.score_thresh)
        keep, scores = keep[:top_k], scores[:top_k]
        return {"boxes": boxes[keep], "scores": scores, "labels": labels[keep]}
    keep = batched_nms(boxes, scores, labels, nms_thresh)[:top_k]
    return {"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep]}


def _one_pass(net: nn.Module, images: List[Tensor], shapes: List[Tuple[int, int]], flip: bool) -> List[Dict[str, Tensor]]:
    """The model on ``images`` resized to ``shapes`` (and flipped), boxes mapped back to
    each given image's own pixels."""
    batch = [resize_image(img, h, w) for img, (h, w) in zip(images, shapes)]
    if flip:
        batch = [img.flip(-1) for img in batch]
    outputs = net(batch)
    mapped = []
    for out, img, (h, w) in zip(outputs, images, shapes):
        boxes = out["boxes"].float()
        if flip:
            boxes = flip_boxes(boxes, float(w))
        sx, sy = w / img.shape[-1], h / img.shape[-2]  # pass size / given size, as a data set's ``scale``
        boxes = boxes / torch.tensor([sx, sy, sx, sy], dtype=torch.float32, device=boxes.device)
        mapped.append({"boxes": boxes, "scores": out["scores"], "labels": out["labels"]})
    return mapped


def tta_forward(net: nn.Module, images: Sequence[Tensor], orig_sizes: Sequence[Tuple[int, int]],
                settings: TTASettings) -> List[Dict[str, Tensor]]:
    """Detections of each image with test-time augmentation, in the pixels of the image
    given (as ``net(images)`` returns them).

    Args:
        net: the detector in eval mode (not a DDP wrapper); its ``roi_heads`` gives
            ``nms_thresh``, ``soft_nms`` and ``detections_per_img``.
        images: ``[3, H_i, W_i]`` each.
        orig_sizes: ``(h, w)`` of each original image, for the sizes' shapes.
    """
    images = list(images)
    passes = [(s, f) for s in settings.sizes for f in ((False, True) if settings.flip else (False,))]
    per_pass = []
    for size, flip in passes:
        shapes = [resized_shape(int(h), int(w), size, settings.max_size) for h, w in orig_sizes]
        per_pass.append(_one_pass(net, images, shapes, flip))
    if len(per_pass) == 1:  # the model's own NMS and top-k already ran
        return per_pass[0]
    heads = net.roi_heads
    return [merge_detections([p[i] for p in per_pass], heads.nms_thresh, heads.soft_nms, heads.detections_per_img)
            for i in range(len(images))]
