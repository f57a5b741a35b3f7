"""Copy-paste augmentation on box regions (Ghiasi et al. 2021, "Simple Copy-Paste",
here without masks): objects of a second training image are pasted onto a sample.

The data sets of this project have boxes only, so an object is its box region: the
pixels of the partner image inside the (rounded out) box are copied to the same place
of the sample, and the pasted box is added with its label. Pasting a rectangle also
copies the background around the object inside the box; with masks (not read here) it
would be the object's pixels only.

Occlusion: a box (an original one, or one pasted earlier) keeps the pixels that no
later paste covers. A box with less than ``min_visible`` of its area left is dropped
with its label; a box partly covered shrinks to the tight box around its visible
pixels (intersected with the old box). Pixels are counted on the integer grid that
contains the box (``floor(x1) .. ceil(x2)``).

Determinism: every random number comes from the generator passed in, which the
transform seeds from the sample's key ``(seed, epoch, position)``; the partner image is
drawn from that generator too (``DetectionTransform``, transforms.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

import numpy as np


@dataclass(frozen=True)
class CopyPasteSettings:
    """``input.copy_paste``: paste with probability ``prob`` up to ``max_objects`` boxes;
    keep an occluded box while at least ``min_visible`` of its area shows."""

    prob: float = 0.5
    max_objects: int = 10
    min_visible: float = 0.3


class DatasetSource:
    """The raw training sample of a data set item, for pasting: ``source(index)`` ->
    ``(image uint8 [H, W, 3], boxes float32 [N, 4] xyxy pixels, labels int64 [N])`` with
    the boxes the data set trains on (no crowd boxes; no VOC difficult ones unless
    ``use_difficult``). Picklable, so DataLoader workers can use it."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __call__(self, index: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        ann = self.dataset.get_annotation(index)
        keep = ~ann["iscrowd"]
        if not getattr(self.dataset, "use_difficult", False):
            keep &= ~ann["difficult"]
        return self.dataset.load_image(index), ann["boxes"][keep].numpy(), ann["labels"][keep].numpy()


def _pixel_region(box: np.ndarray, width: int, height: int) -> Tuple[int, int, int, int]:
    """The integer pixel rectangle ``(x1, y1, x2, y2)`` (end exclusive) holding ``box``, clipped."""
    x1 = min(max(int(np.floor(box[0])), 0), width)
    y1 = min(max(int(np.floor(box[1])), 0), height)
    x2 = min(max(int(np.ceil(box[2])), 0), width)
    y2 = min(max(int(np.ceil(box[3])), 0), height)
    return x1, y1, x2, y2


def _visible_box(box: np.ndarray, layer: np.ndarray, owner: int, min_visible: float) -> np.ndarray | None:
    """``box`` after occlusion: itself when nothing covers it, None when less than
    ``min_visible`` of its pixels show, else the box shrunk to its visible pixels."""
    height, width = layer.shape
    x1, y1, x2, y2 = _pixel_region(box, width, height)
    if x2 <= x1 or y2 <= y1:
        return None
    visible = layer[y1:y2, x1:x2] == owner
    fraction = float(visible.mean())
    if fraction >= 1.0:
        return box
    if fraction < min_visible:
        return None
    ys, xs = np.nonzero(visible)
    tight = np.array([x1 + xs.min(), y1 + ys.min(), x1 + xs.max() + 1, y1 + ys.max() + 1], np.float32)
    shrunk = np.concatenate([np.maximum(box[:2], tight[:2]), np.minimum(box[2:], tight[2:])]).astype(np.float32)
    return shrunk if shrunk[2] > shrunk[0] and shrunk[3] > shrunk[1] else None


def paste_objects(
    image: np.ndarray,
    boxes: np.ndarray,
    labels: np.ndarray,
    src_image: np.ndarray,
    src_boxes: np.ndarray,
    src_labels: np.ndarray,
    rng: np.random.Generator,
    max_objects: int = 10,
    min_visible: float = 0.3,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Paste between 1 and ``max_objects`` boxes of ``src_image`` onto ``image``.

    Args:
        image, src_image: uint8 ``[H, W, C]`` and ``[H', W', C]``; a source box is pasted
            at its own coordinates, cut to the part that lies in both images.
        boxes, src_boxes: float32 ``[N, 4]``, ``[M, 4]`` xyxy pixels of their images.
        labels, src_labels: int64 ``[N]``, ``[M]``.
        rng: draws how many and which source boxes (in their order, later ones on top).

    Returns:
        ``(image [H, W, C], boxes float32 [K, 4], labels int64 [K])``: the originals that
        stay visible (shrunk when partly covered), then the pasted boxes that stay visible.
    """
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    labels = np.asarray(labels, np.int64).reshape(-1)
    if len(src_boxes) == 0:
        return image, boxes, labels
    height, width = image.shape[:2]
    count = int(rng.integers(1, min(max_objects, len(src_boxes)) + 1))
    chosen = np.sort(rng.choice(len(src_boxes), size=count, replace=False))
    out = image.copy()
    layer = np.full((height, width), -1, np.int32)  # which paste shows at each pixel (-1: the image's own)
    common_w, common_h = min(width, src_image.shape[1]), min(height, src_image.shape[0])
    entries: List[Tuple[np.ndarray, int, int]] = [(b, int(lab), -1) for b, lab in zip(boxes, labels)]
    for k, j in enumerate(chosen):
        x1, y1, x2, y2 = _pixel_region(src_boxes[j], common_w, common_h)
        if x2 <= x1 or y2 <= y1:
            continue
        out[y1:y2, x1:x2] = src_image[y1:y2, x1:x2]
        layer[y1:y2, x1:x2] = k
        box = np.clip(np.asarray(src_boxes[j], np.float32), 0, [common_w, common_h, common_w, common_h])
        entries.append((box.astype(np.float32), int(src_labels[j]), k))
    kept_boxes, kept_labels = [], []
    for box, label, owner in entries:
        visible = _visible_box(box, layer, owner, min_visible)
        if visible is not None:
            kept_boxes.append(visible)
            kept_labels.append(label)
    return (out, np.asarray(kept_boxes, np.float32).reshape(-1, 4), np.asarray(kept_labels, np.int64))
