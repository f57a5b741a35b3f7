"""Colours and caption places for drawn boxes (used by ``plots.render``).

- ``class_color(label)``: one colour per class label, the same in every image and
  every tool. The first ten are matplotlib's ``tab10``; the rest are picked from an RGB
  grid (steps of 51, neither very dark nor very light), each the farthest from those
  already taken, so any two of the first 80 differ by at least 51 (RGB distance).
- ``text_color(fill)``: black or white, whichever reads better on ``fill``.
- ``place_caption``: a caption rectangle for a box that stays inside the image and does
  not overlap the captions already placed, when a free place exists.
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, Sequence, Tuple

import numpy as np

from .mpl import colormaps

Color = Tuple[int, int, int]
Rect = Tuple[int, int, int, int]  # x1, y1, x2, y2 (end exclusive), pixels


@lru_cache(maxsize=1)
def palette() -> Tuple[Color, ...]:
    """The class colours, in label order (label k has ``palette()[(k - 1) % len]``)."""
    chosen = [np.array(colormaps()["tab10"](i)[:3]) * 255 for i in range(10)]
    levels = np.arange(0, 256, 51, dtype=np.float64)
    grid = np.stack(np.meshgrid(levels, levels, levels, indexing="ij"), -1).reshape(-1, 3)
    luminance = grid @ np.array([0.299, 0.587, 0.114])
    grid = grid[(luminance > 40) & (luminance < 235)]
    dist = np.min(np.linalg.norm(grid[:, None] - np.array(chosen)[None], axis=-1), axis=1)
    while dist.max() > 0:
        j = int(np.argmax(dist))
        chosen.append(grid[j])
        dist = np.minimum(dist, np.linalg.norm(grid - grid[j], axis=1))
    return tuple(tuple(int(round(v)) for v in c) for c in chosen)  # type: ignore[misc]


def class_color(label: int) -> Color:
    """The colour of class ``label`` (1..K; any int is accepted, wrapping around)."""
    colors = palette()
    return colors[(int(label) - 1) % len(colors)]


def text_color(fill: Sequence[int]) -> Color:
    """Black on light fills, white on dark ones (ITU-R BT.601 luma)."""
    luma = 0.299 * fill[0] + 0.587 * fill[1] + 0.114 * fill[2]
    return (0, 0, 0) if luma >= 128 else (255, 255, 255)


def overlaps(a: Rect, b: Rect) -> bool:
    """Whether two end-exclusive rectangles share a pixel."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _clamp(x: int, y: int, w: int, h: int, width: int, height: int) -> Rect:
    x = max(0, min(x, width - w))
    y = max(0, min(y, height - h))
    return x, y, x + w, y + h


def place_caption(text_w: int, text_h: int, box: Sequence[float], width: int, height: int,
                  taken: Sequence[Rect] = ()) -> Rect:
    """The caption rectangle for ``box`` (xyxy pixels) in a ``width x height`` image.

    Tried in order, each kept inside the image: above the box's top-left corner (inside
    the box when there is no room above), inside the top-left corner, below the bottom-
    left corner, inside the bottom-left corner; the first that overlaps none of ``taken``
    wins. When all collide, the first is moved down one caption height at a time until
    it is free; when nothing is free, the first place is used.
    """
    w, h = min(text_w, width), min(text_h, height)
    x1, y1, y2 = int(round(box[0])), int(round(box[1])), int(round(box[3]))
    first = _clamp(x1, y1 - h if y1 - h >= 0 else max(0, y1), w, h, width, height)
    candidates: List[Rect] = [first, _clamp(x1, y1, w, h, width, height),
                              _clamp(x1, y2, w, h, width, height), _clamp(x1, y2 - h, w, h, width, height)]
    for rect in candidates:
        if not any(overlaps(rect, t) for t in taken):
            return rect
    for y in range(first[1] + h, height - h + 1, h):
        rect = _clamp(first[0], y, w, h, width, height)
        if not any(overlaps(rect, t) for t in taken):
            return rect
    return first
