"""Detections drawn so that people can read them (``tools/infer.py`` and TensorBoard).

- Small images are scaled up (nearest neighbour, an integer factor) until the shorter
  side is at least ``min_side`` pixels, so the captions can be read on the demo's
  64-128 px images.
- Every caption sits on a filled rectangle of its box's colour and is kept inside the
  image: above the box where there is room, else inside it, shifted left at the right
  edge and down at the top edge.
- Ground truth (green) and predictions (orange-red) are told apart by colour, and a
  legend band under the image says which is which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

GT_COLOR = (0, 200, 0)
PRED_COLOR = (255, 64, 0)
TEXT_COLOR = (0, 0, 0)
FONT_SIZE = 13


@dataclass
class Drawing:
    """A drawn image and where its captions went.

    Attributes:
        image: uint8 [3, H', W'] (the scaled image plus the legend band at the bottom).
        scale: the integer factor the input was scaled by.
        image_height: H' without the legend band.
        label_boxes: per caption ``(x1, y1, x2, y2)``, the filled rectangle in drawn pixels.
    """

    image: torch.Tensor
    scale: int
    image_height: int
    label_boxes: List[Tuple[int, int, int, int]] = field(default_factory=list)


def _to_pil(image: torch.Tensor | np.ndarray) -> Image.Image:
    """uint8 [3, H, W] tensor or [H, W, 3] array -> RGB PIL image."""
    if isinstance(image, torch.Tensor):
        array = image.detach().to(torch.uint8).cpu().permute(1, 2, 0).numpy()
    else:
        array = np.asarray(image, dtype=np.uint8)
    return Image.fromarray(np.ascontiguousarray(array), "RGB")


def _place(text_w: int, text_h: int, box: Sequence[float], width: int, height: int) -> Tuple[int, int, int, int]:
    """The caption rectangle for a box: above its top-left corner, or inside it when
    there is no room above; clamped to the ``width x height`` image."""
    w, h = min(text_w, width), min(text_h, height)
    x1 = int(round(box[0]))
    y1 = int(round(box[1])) - h
    if y1 < 0:
        y1 = max(0, int(round(box[1])))
    x1 = max(0, min(x1, width - w))
    y1 = max(0, min(y1, height - h))
    return x1, y1, x1 + w, y1 + h


def render(
    image: torch.Tensor | np.ndarray,
    pred_boxes: torch.Tensor | np.ndarray,
    pred_labels: Sequence[str] = (),
    gt_boxes: Optional[torch.Tensor | np.ndarray] = None,
    gt_labels: Sequence[str] = (),
    min_side: int = 320,
) -> Drawing:
    """Draw ground truth and predictions with their captions.

    Args:
        image: uint8 ``[3, H, W]`` tensor or ``[H, W, 3]`` array.
        pred_boxes, gt_boxes: ``[N, 4]`` xyxy in the pixels of ``image``.
        pred_labels, gt_labels: one caption per box (empty: boxes without captions).
        min_side: scale up by an integer factor until the shorter side reaches this.
    """
    pil = _to_pil(image)
    scale = max(1, int(np.ceil(min_side / max(1, min(pil.size)))))
    if scale > 1:
        pil = pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST)
    font = ImageFont.load_default(size=FONT_SIZE)
    legend_h = FONT_SIZE + 8
    canvas = Image.new("RGB", (pil.width, pil.height + legend_h), (255, 255, 255))
    canvas.paste(pil, (0, 0))
    draw = ImageDraw.Draw(canvas)
    width, height = pil.width, pil.height
    line = max(1, round(max(width, height) / 300))
    rects: List[Tuple[int, int, int, int]] = []
    groups = [(gt_boxes, gt_labels, GT_COLOR), (pred_boxes, pred_labels, PRED_COLOR)]
    for boxes, labels, color in groups:
        if boxes is None:
            continue
        boxes = np.asarray(torch.as_tensor(boxes).detach().float().cpu(), dtype=np.float64).reshape(-1, 4) * scale
        for k, box in enumerate(boxes):
            x1, y1 = np.clip(box[[0, 1]], 0, [width - 1, height - 1])
            x2, y2 = np.clip(box[[2, 3]], 0, [width - 1, height - 1])
            draw.rectangle([x1, y1, x2, y2], outline=color, width=line)
            if k < len(labels) and labels[k]:
                left, top, right, bottom = draw.textbbox((0, 0), str(labels[k]), font=font)
                rect = _place(right - left + 4, bottom - top + 4, box, width, height)
                draw.rectangle([rect[0], rect[1], rect[2] - 1, rect[3] - 1], fill=color)
                draw.text((rect[0] + 2 - left, rect[1] + 2 - top), str(labels[k]), fill=TEXT_COLOR, font=font)
                rects.append(rect)
    # Legend band under the image.
    x = 4
    for name, color in (("ground truth", GT_COLOR), ("prediction", PRED_COLOR)):
        draw.rectangle([x, height + 5, x + 12, height + 5 + FONT_SIZE - 2], fill=color)
        draw.text((x + 16, height + 4), name, fill=TEXT_COLOR, font=font)
        x += 16 + int(draw.textlength(name, font=font)) + 14
    tensor = torch.from_numpy(np.asarray(canvas).copy()).permute(2, 0, 1).contiguous()
    return Drawing(image=tensor, scale=scale, image_height=height, label_boxes=rects)


def draw_detections(
    image: torch.Tensor,
    gt_boxes: torch.Tensor,
    pred_boxes: torch.Tensor,
    pred_labels: List[str],
) -> torch.Tensor:
    """Ground truth and captioned predictions on a uint8 ``[3, H, W]`` image (boxes
    ``[N, 4]`` xyxy pixels of that image): uint8 ``[3, H', W']`` (see :func:`render`)."""
    return render(image, pred_boxes, pred_labels, gt_boxes=gt_boxes).image
