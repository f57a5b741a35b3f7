"""Box encoding: boxes <-> regression deltas (R-CNN parameterisation).

For a reference box (anchor or proposal) with centre ``(cx, cy)`` and size ``(w, h)``
and a target box with centre ``(gx, gy)`` and size ``(gw, gh)``::

    dx = wx * (gx - cx) / w        dw = ww * log(gw / w)
    dy = wy * (gy - cy) / h        dh = wh * log(gh / h)

The weights ``(wx, wy, ww, wh)`` are the inverse target standard deviations: the ROI
heads use (10, 10, 5, 5), i.e. stds (0.1, 0.1, 0.2, 0.2); the RPN uses (1, 1, 1, 1).
Decoding clamps ``dw`` and ``dh`` at ``log(1000 / 16)`` so that ``exp`` cannot overflow.
Widths are ``x2 - x1`` (no "+1").
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple, Union

import torch
from torch import Tensor

DEFAULT_SCALE_CLAMP = math.log(1000.0 / 16)


class BoxCoder:
    """Encodes and decodes boxes with fixed weights.

    Args:
        weights: ``(wx, wy, ww, wh)``.
        scale_clamp: upper bound for ``dw`` and ``dh`` (after dividing by the weights)
            when decoding.
    """

    def __init__(self, weights: Sequence[float], scale_clamp: float = DEFAULT_SCALE_CLAMP) -> None:
        if len(weights) != 4:
            raise ValueError(f"box coder weights must have 4 values, got {list(weights)}")
        self.weights = tuple(float(w) for w in weights)
        self.scale_clamp = scale_clamp

    def encode(self, reference: Tensor, target: Tensor) -> Tensor:
        """Deltas that turn ``reference`` boxes into ``target`` boxes.

        Args:
            reference: ``[..., 4]`` boxes (anchors or proposals), x1y1x2y2 pixels.
            target: ``[..., 4]`` matched ground-truth boxes, the same shape.

        Returns:
            ``[..., 4]`` deltas ``(dx, dy, dw, dh)`` scaled by the weights.
        """
        wx, wy, ww, wh = self.weights
        rx1, ry1, rx2, ry2 = reference.unbind(-1)
        tx1, ty1, tx2, ty2 = target.unbind(-1)
        ref_w = rx2 - rx1
        ref_h = ry2 - ry1
        ref_cx = rx1 + 0.5 * ref_w
        ref_cy = ry1 + 0.5 * ref_h
        gt_w = tx2 - tx1
        gt_h = ty2 - ty1
        gt_cx = tx1 + 0.5 * gt_w
        gt_cy = ty1 + 0.5 * gt_h
        dx = wx * (gt_cx - ref_cx) / ref_w
        dy = wy * (gt_cy - ref_cy) / ref_h
        dw = ww * torch.log(gt_w / ref_w)
        dh = wh * torch.log(gt_h / ref_h)
        return torch.stack((dx, dy, dw, dh), dim=-1)

    def decode(self, deltas: Tensor, reference: Tensor) -> Tensor:
        """Apply deltas to reference boxes.

        Args:
            deltas: ``[N, 4 * k]`` deltas, ``k`` boxes per reference (e.g. one per class).
            reference: ``[N, 4]`` boxes.

        Returns:
            ``[N, 4 * k]`` decoded boxes x1y1x2y2 (not clipped).
        """
        reference = reference.to(deltas.dtype)
        wx, wy, ww, wh = self.weights
        widths = (reference[:, 2] - reference[:, 0])[:, None]
        heights = (reference[:, 3] - reference[:, 1])[:, None]
        ctr_x = reference[:, 0, None] + 0.5 * widths
        ctr_y = reference[:, 1, None] + 0.5 * heights

        dx = deltas[:, 0::4] / wx
        dy = deltas[:, 1::4] / wy
        dw = (deltas[:, 2::4] / ww).clamp(max=self.scale_clamp)
        dh = (deltas[:, 3::4] / wh).clamp(max=self.scale_clamp)

        pred_cx = dx * widths + ctr_x
        pred_cy = dy * heights + ctr_y
        half_w = 0.5 * (torch.exp(dw) * widths)
        half_h = 0.5 * (torch.exp(dh) * heights)
        boxes = torch.stack((pred_cx - half_w, pred_cy - half_h, pred_cx + half_w, pred_cy + half_h), dim=2)
        return boxes.flatten(1)


def clip_boxes(boxes: Tensor, size: Tuple[Union[int, Tensor], Union[int, Tensor]]) -> Tensor:
    """Clip ``[N, 4]`` x1y1x2y2 boxes to ``size = (height, width)`` pixels, as
    ``torchvision.ops.clip_boxes_to_image`` does in eager mode (the same values).

    While tracing for export the sizes are 0-dim tensors, and torchvision's function would
    record them as constants; here they stay inputs of the traced graph, so an exported
    model clips to each image's own size.
    """
    height, width = size
    x = boxes[..., 0::2].clamp(min=0).clamp(max=width)
    y = boxes[..., 1::2].clamp(min=0).clamp(max=height)
    return torch.stack((x, y), dim=-1).reshape(boxes.shape)
