"""Do the training batches fit ``model.canvas_sizes``? Checked from the records, before
any image is decoded (the evaluation batches too, with ``train.compile_backbone``:
``warn_of_evaluation_canvases``).

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


def resized_sizes(heights: np.ndarray, widths: np.ndarray, min_sizes: "np.ndarray | int",
                  max_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """``transforms.resized_shape`` over arrays, in the same float64 arithmetic and
    rounding: image ``heights`` and ``widths`` (pixels, any shape) with shorter sides
    ``min_sizes`` (broadcast) capped at ``max_size`` -> the int64 new heights and widths."""
    h, w = np.asarray(heights, dtype=np.float64), np.asarray(widths, dtype=np.float64)
    scale = np.minimum(np.asarray(min_sizes, dtype=np.float64) / np.minimum(h, w), max_size / np.maximum(h, w))
    return (np.maximum(1, np.round(h * scale)).astype(np.int64),
            np.maximum(1, np.round(w * scale)).astype(np.int64))


def largest_training_sizes(heights: np.ndarray, widths: np.ndarray, cfg: Config) -> Tuple[np.ndarray, np.ndarray]:
    """``[N]`` image heights and widths in pixels -> the ``[N]`` heights and widths of
    each image's largest training size, before padding (``resized_sizes`` at the largest
    ``input.min_size_train``), or ``input.lsj.size`` with large-scale jitter."""
    inp = cfg.input
    if inp.lsj.enabled:
        side = np.full(len(heights), inp.lsj.size, dtype=np.int64)
        return side, side.copy()
    return resized_sizes(heights, widths, max(inp.min_size_train), inp.max_size_train)


def padded(sides: "np.ndarray | int", divisibility: int) -> "np.ndarray | int":
    """``sides`` (pixels; an int or an int array) rounded up to multiples of ``divisibility``."""
    return -(-sides // divisibility) * divisibility


def batch_groups(heights: np.ndarray, widths: np.ndarray, cfg: Config) -> np.ndarray:
    """``[N]`` the aspect group of each image as the training sampler groups them
    (``samplers.aspect_ratio_group_ids``; all 0 without ``data.aspect_ratio_grouping``)."""
    if not cfg.data.aspect_ratio_grouping:
        return np.zeros(len(heights), dtype=np.int64)
    return np.asarray(aspect_ratio_group_ids((np.asarray(widths) / np.asarray(heights)).tolist()), dtype=np.int64)


def largest_batches(heights: np.ndarray, widths: np.ndarray, cfg: Config) -> List[Tuple[str, int, int, List[int]]]:
    """The largest padded batch shape of each aspect group of the training set:
    ``[(group name, H, W, [indices of the images that set H and W])]``, pixels. With
    ``solver.images_per_gpu == 1``, one entry per distinct padded image shape instead
    (an image is its own batch)."""
    d = cfg.model.size_divisibility
    new_h, new_w = largest_training_sizes(heights, widths, cfg)
    if cfg.solver.images_per_gpu == 1:
        shapes = {}
        for i, (h, w) in enumerate(zip(padded(new_h, d).tolist(), padded(new_w, d).tolist())):
            shapes.setdefault((h, w), i)
        return [("one image", h, w, [i]) for (h, w), i in shapes.items()]
    groups = batch_groups(heights, widths, cfg)
    out = []
    for g in sorted(set(groups.tolist())):
        members = np.flatnonzero(groups == g)
        tallest, widest = members[np.argmax(new_h[members])], members[np.argmax(new_w[members])]
        name = GROUP_NAMES[g] if cfg.data.aspect_ratio_grouping else "all images"
        out.append((name, int(padded(new_h[tallest], d)), int(padded(new_w[widest], d)),
                    sorted({int(tallest), int(widest)})))
    return out


def _fits(h: int, w: int, canvases: Sequence[Sequence[int]]) -> bool:
    return any(ch >= h and cw >= w for ch, cw in canvases)


def first_unheld(batches: Sequence[Tuple[str, int, int, List[int]]],
                 canvases: Sequence[Sequence[int]]) -> Optional[Tuple[str, int, int, List[int]]]:
    """The first of ``largest_batches`` that fits no canvas of ``canvases``; None where
    every one fits (then every batch of the data does)."""
    return next((b for b in batches if not _fits(b[1], b[2], canvases)), None)


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
    bad = first_unheld(batches, canvases)
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


def evaluation_batches(heights: np.ndarray, widths: np.ndarray, cfg: Config) -> List[Tuple[str, int, int, List[int]]]:
    """The padded shape of each evaluation batch of one process, in data-set order:
    ``eval.images_per_gpu`` consecutive images resized to ``input.min_size_test`` capped
    at ``input.max_size_test`` (as the eval pipeline does), the batch's largest height by
    its largest width rounded up to ``model.size_divisibility``, as ``largest_batches``
    gives them: ``[("evaluation batch", H, W, [image indices that set H and W])]``, pixels."""
    d, n = cfg.model.size_divisibility, cfg.eval.images_per_gpu
    new_h, new_w = resized_sizes(heights, widths, cfg.input.min_size_test, cfg.input.max_size_test)
    out = []
    for start in range(0, len(new_h), n):
        h, w = new_h[start:start + n], new_w[start:start + n]
        tallest, widest = start + int(np.argmax(h)), start + int(np.argmax(w))
        out.append(("evaluation batch", int(padded(h.max(), d)), int(padded(w.max(), d)), sorted({tallest, widest})))
    return out


def warn_of_evaluation_canvases(cfg: Config, dataset: DetectionDataset) -> Optional[str]:
    """With ``train.compile_backbone``, one warning line (logged, and returned) where
    evaluation batches of ``dataset`` fit no canvas of ``model.canvas_sizes``: each such
    batch's own shape compiles the backbone again (minutes each on a GPU; torch.compile
    runs eagerly once its recompile limit is reached). It names the first such batch's
    images, and the canvases plus those that would hold the batches left out. Nothing
    without canvases or a compiled backbone, with test-time augmentation
    (``eval.tta.sizes``: the images keep their own sizes), or where every batch fits.
    Several processes split the set into other batches: the check is one process's."""
    canvases = [list(c) for c in cfg.model.canvas_sizes]
    if not (cfg.train.compile_backbone and canvases) or cfg.eval.tta.sizes or len(dataset) == 0:
        return None
    heights, widths = dataset.records.arrays["heights"], dataset.records.arrays["widths"]
    batches = evaluation_batches(heights, widths, cfg)
    unheld = [b for b in batches if not _fits(b[1], b[2], canvases)]
    if not unheld:
        return None
    _, h, w, idx = unheld[0]
    images = " and ".join(f"{dataset.records.path(i)} ({int(heights[i])}x{int(widths[i])})" for i in idx)
    extra = canvases_that_hold(unheld)
    line = (f"train.compile_backbone: model.canvas_sizes {canvases} has no canvas for {len(unheld)} of the "
            f"{len(batches)} evaluation batches of {dataset.source} (eval.images_per_gpu={cfg.eval.images_per_gpu}, "
            f"shorter side input.min_size_test={cfg.input.min_size_test}, longer up to "
            f"input.max_size_test={cfg.input.max_size_test}), e.g. {h}x{w} px from {images}: the backbone compiles "
            f"again for each such shape (minutes each). Canvases that hold them all: "
            f"model.canvas_sizes={canvases + extra}; or eval.images_per_gpu=1 where portrait and landscape images "
            f"share batches")
    logger.warning("%s", line)
    return line
