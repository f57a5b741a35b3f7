"""Do the training batches fit ``model.canvas_sizes``? Checked from the records, before
any image is decoded.

A batch is padded to the smallest canvas that holds it (``modeling.faster_rcnn.batch_shape``).
The static step (``train.static_step``) has one compiled graph per canvas and refuses a
batch that fits none; before this check that refusal came at the first such batch, which
could be hours into a run. Here the largest batch the loader can form is computed from
each image's size in the annotations:

- an image's largest training size is its resize at the largest ``input.min_size_train``
  capped at ``input.max_size_train`` (``transforms.resized_shape``; the resize only grows
  with the shorter side), or ``input.lsj.size`` squared with large-scale jitter;
- a batch holds images of one aspect group (``data.aspect_ratio_grouping``: portrait,
  landscape or square; else all one group), in any combination, so its padded shape is
  at most the group's largest height by its largest width, each rounded up to
  ``model.size_divisibility``; with one image per batch, each image's own.

Every such batch fits a canvas iff these largest shapes do (a canvas that holds a batch
holds every smaller one).
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

import numpy as np

from detector.config import Config, ConfigError

from .dataset import DetectionDataset
from .samplers import aspect_ratio_group_ids

logger = logging.getLogger(__name__)

GROUP_NAMES = {0: "portrait", 1: "landscape or square"}


def largest_training_sizes(heights: np.ndarray, widths: np.ndarray, cfg: Config) -> Tuple[np.ndarray, np.ndarray]:
    """``[N]`` image heights and widths in pixels -> the ``[N]`` heights and widths of
    each image's largest training size, before padding (``transforms.resized_shape`` at the
    largest ``input.min_size_train``, in the same float64 arithmetic and rounding)."""
    inp = cfg.input
    if inp.lsj.enabled:
        side = np.full(len(heights), inp.lsj.size, dtype=np.int64)
        return side, side.copy()
    h, w = np.asarray(heights, dtype=np.float64), np.asarray(widths, dtype=np.float64)
    scale = np.minimum(max(inp.min_size_train) / np.minimum(h, w), inp.max_size_train / np.maximum(h, w))
    return (np.maximum(1, np.round(h * scale)).astype(np.int64),
            np.maximum(1, np.round(w * scale)).astype(np.int64))


def _padded(side: int, divisibility: int) -> int:
    return -(-int(side) // divisibility) * divisibility


def largest_batches(heights: np.ndarray, widths: np.ndarray, cfg: Config) -> List[Tuple[str, int, int, List[int]]]:
    """The largest padded batch shape of each aspect group of the training set:
    ``[(group name, H, W, [indices of the images that set H and W])]``, pixels. With
    ``solver.images_per_gpu == 1``, one entry per distinct padded image shape instead
    (an image is its own batch)."""
    d = cfg.model.size_divisibility
    new_h, new_w = largest_training_sizes(heights, widths, cfg)
    if cfg.solver.images_per_gpu == 1:
        shapes = {}
        for i, (h, w) in enumerate(zip(new_h.tolist(), new_w.tolist())):
            shapes.setdefault((_padded(h, d), _padded(w, d)), i)
        return [("one image", h, w, [i]) for (h, w), i in shapes.items()]
    if cfg.data.aspect_ratio_grouping:
        groups = np.asarray(aspect_ratio_group_ids((np.asarray(widths) / np.asarray(heights)).tolist()))
    else:
        groups = np.zeros(len(heights), dtype=np.int64)
    out = []
    for g in sorted(set(groups.tolist())):
        members = np.flatnonzero(groups == g)
        tallest, widest = members[np.argmax(new_h[members])], members[np.argmax(new_w[members])]
        name = GROUP_NAMES[g] if cfg.data.aspect_ratio_grouping else "all images"
        out.append((name, _padded(new_h[tallest], d), _padded(new_w[widest], d), sorted({int(tallest), int(widest)})))
    return out


def _fits(h: int, w: int, canvases: Sequence[Sequence[int]]) -> bool:
    return any(ch >= h and cw >= w for ch, cw in canvases)


def canvases_that_hold(batches: Sequence[Tuple[str, int, int, List[int]]]) -> List[List[int]]:
    """Canvases that hold every batch of ``largest_batches``: the largest shapes, without
    those another one holds."""
    shapes = sorted({(h, w) for _, h, w, _ in batches}, key=lambda s: (-s[0] * s[1], s))
    kept: List[List[int]] = []
    for h, w in shapes:
        if not _fits(h, w, kept):
            kept.append([h, w])
    return kept


def canvas_problem(cfg: Config, dataset: DetectionDataset, consequence: str) -> Optional[str]:
    """One line naming ``model.canvas_sizes``, the first batch shape of ``dataset`` (the
    training set) that fits no canvas, the image files that make it, and canvases that
    would hold every batch; None where every batch fits (or there are no canvases).
    ``consequence``: what such a batch would do, e.g. "the static step would stop at the
    first such batch"."""
    canvases = [list(c) for c in cfg.model.canvas_sizes]
    if not canvases or len(dataset) == 0:
        return None
    heights, widths = dataset.records.arrays["heights"], dataset.records.arrays["widths"]
    batches = largest_batches(heights, widths, cfg)
    bad = next(((name, h, w, idx) for name, h, w, idx in batches if not _fits(h, w, canvases)), None)
    if bad is None:
        return None
    name, h, w, idx = bad
    inp = cfg.input
    sizing = (f"input.lsj.size={inp.lsj.size}" if inp.lsj.enabled else
              f"shorter side up to {max(inp.min_size_train)} (input.min_size_train), longer up to "
              f"{inp.max_size_train} (input.max_size_train)")
    batch = (f"a batch of one image of {h}x{w} px" if name == "one image" else
             f"a batch of {cfg.solver.images_per_gpu} images ({name}) of up to {h}x{w} px")
    images = " and ".join(f"{dataset.records.path(i)} ({int(heights[i])}x{int(widths[i])})" for i in idx)
    return (f"model.canvas_sizes {canvases} has no canvas for {batch} (height x width; {sizing}; padded to "
            f"multiples of model.size_divisibility={cfg.model.size_divisibility}) in {dataset.source}, e.g. from "
            f"{images}: {consequence}. Canvases that hold every training batch "
            f"of this data: model.canvas_sizes={canvases_that_hold(batches)}")


def check_canvases(cfg: Config, dataset: DetectionDataset) -> None:
    """Before training: with ``train.static_step``, ``ConfigError`` (``canvas_problem``'s
    line) where a training batch could fit no canvas; with ``train.compile_backbone``
    alone, a warning (such a batch recompiles the backbone at its own shape). Nothing
    for the eager step, which pads such a batch to its own shape."""
    if cfg.train.static_step:
        problem = canvas_problem(cfg, dataset, "the static step would stop at the first such batch")
        if problem is not None:
            raise ConfigError(problem)
    elif cfg.train.compile_backbone:
        problem = canvas_problem(cfg, dataset, "train.compile_backbone compiles the backbone again for each such "
                                               "batch's own shape (minutes each)")
        if problem is not None:
            logger.warning("%s", problem)
