"""Choosing ``model.canvas_sizes`` for a training set: the canvases that hold every batch,
and a few more where they cut the padding (``tools/canvas_sizes.py``).

Each canvas costs a compiled graph (``train.static_step``, ``train.compile_backbone``)
or a captured one (``train.cuda_graphs``): minutes of compilation and its memory. Each
batch is padded to the smallest canvas that holds it, so the pixels the network computes
grow with the gap between a batch and its canvas. The cost is measured on batches drawn
as the loader draws them (the training sampler and the aspect groups, a random
``input.min_size_train`` per image), from the annotations' image sizes only:

- padding: the canvases' pixels over the pixels of the same batches padded to their own
  shape (the eager step's), minus 1;
- the canvases: first ``canvases.canvases_that_hold`` (every batch fits; the fewest
  canvases that do), then, one at a time up to ``max_canvases``, the batch shape that
  lowers the padding most as an extra canvas (greedy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from detector.config import Config, load_config

from .build import build_dataset
from .canvases import batch_groups, canvases_that_hold, first_unheld, largest_batches, padded, resized_sizes
from .dataset import DetectionDataset
from .samplers import GroupedBatchSampler, TrainingSampler

Canvas = Tuple[int, int]


@dataclass
class CanvasChoice:
    """One set of canvases and what it costs on the drawn batches.

    Attributes:
        canvases: ``[(H, W), ...]`` pixels.
        padding: canvas pixels over the batches' own padded pixels, minus 1 (0.12: 12 % more).
        unheld: fraction of the drawn batches that fit no canvas (0 for the chosen sets).
    """

    canvases: List[Canvas]
    padding: float
    unheld: float


def draw_batch_shapes(heights: np.ndarray, widths: np.ndarray, cfg: Config, max_batches: int = 20000,
                      seed: int = 0) -> np.ndarray:
    """``[M, 2]`` padded (H, W) of the training batches of the first epochs (at most
    ``max_batches``), each padded to its own shape (``batch_shape`` without canvases):
    the loader's sampler and aspect groups over ``[N]`` image ``heights`` and ``widths``,
    each image resized at a random ``input.min_size_train`` (``transforms.resized_shape``'s
    arithmetic), or to ``input.lsj.size`` squared."""
    d, inp = cfg.model.size_divisibility, cfg.input
    groups = batch_groups(heights, widths, cfg).tolist()
    sampler = GroupedBatchSampler(TrainingSampler(len(heights), seed=seed), groups, cfg.solver.images_per_gpu)
    batches: List[List[int]] = []
    for epoch in range(max(1, -(-max_batches // sampler.num_batches))):
        sampler.set_epoch(epoch)
        batches += [[key.index for key in keys] for keys in sampler]
    index = np.asarray(batches[:max_batches], dtype=np.int64)  # [M, images_per_gpu]
    if inp.lsj.enabled:
        return np.full((len(index), 2), padded(inp.lsj.size, d), dtype=np.int64)
    scales = np.random.default_rng(seed).choice(np.asarray(inp.min_size_train), size=index.shape)
    new_h, new_w = resized_sizes(np.asarray(heights)[index], np.asarray(widths)[index], scales, inp.max_size_train)
    return np.stack([padded(new_h.max(1), d), padded(new_w.max(1), d)], 1)


def _canvas_pixels(shapes: np.ndarray, canvases: Sequence[Canvas]) -> np.ndarray:
    """``[M]`` pixels of the smallest canvas holding each batch shape; inf where none does."""
    out = np.full(len(shapes), np.inf)
    for h, w in canvases:
        fits = (shapes[:, 0] <= h) & (shapes[:, 1] <= w)
        out = np.where(fits, np.minimum(out, float(h * w)), out)
    return out


def evaluate_canvases(shapes: np.ndarray, canvases: Sequence[Canvas]) -> CanvasChoice:
    """``canvases``' padding and unheld fraction on the ``[M, 2]`` batch shapes (a batch
    that fits none keeps its own shape, as the eager step pads it)."""
    own = (shapes[:, 0] * shapes[:, 1]).astype(np.float64)
    pixels = _canvas_pixels(shapes, canvases)
    unheld = ~np.isfinite(pixels)
    used = np.where(unheld, own, pixels)
    return CanvasChoice([tuple(map(int, c)) for c in canvases], float(used.sum() / own.sum() - 1),
                        float(unheld.mean()))


def choose_canvases(heights: np.ndarray, widths: np.ndarray, cfg: Config, max_canvases: int = 4,
                    max_batches: int = 20000, seed: int = 0, shapes: Optional[np.ndarray] = None) -> List[CanvasChoice]:
    """Canvas sets for the training set of ``[N]`` image ``heights`` and ``widths``, one
    per count: the fewest that hold every batch (``canvases_that_hold``), then each with
    one more canvas (the drawn batch shape that lowers the padding most), up to
    ``max_canvases`` canvases or until no shape lowers it. Padding measured on ``shapes``
    (default: ``draw_batch_shapes`` with ``max_batches`` and ``seed``)."""
    if shapes is None:
        shapes = draw_batch_shapes(heights, widths, cfg, max_batches, seed)
    chosen: List[Canvas] = [tuple(c) for c in canvases_that_hold(largest_batches(heights, widths, cfg))]
    out = [evaluate_canvases(shapes, chosen)]
    candidates = np.unique(shapes, axis=0)
    while len(chosen) < max_canvases:
        best = _best_extra(shapes, candidates, _canvas_pixels(shapes, chosen), chosen)
        if best is None:
            break
        chosen = chosen + [best]
        out.append(evaluate_canvases(shapes, chosen))
    return out


def _best_extra(shapes: np.ndarray, candidates: np.ndarray, current: np.ndarray,
                chosen: Sequence[Canvas]) -> Optional[Canvas]:
    """The candidate shape that, added as a canvas, lowers the summed ``current`` canvas
    pixels of the batches most; None where none lowers them."""
    best, best_gain = None, 0.0
    for h, w in candidates.tolist():
        if (h, w) in chosen:
            continue
        fits = (shapes[:, 0] <= h) & (shapes[:, 1] <= w)
        gain = float(np.maximum(current[fits] - h * w, 0).sum())
        if gain > best_gain:
            best, best_gain = (int(h), int(w)), gain
    return best


def _listed(canvases: Sequence[Canvas]) -> str:
    return "[" + ", ".join(f"[{h}, {w}]" for h, w in canvases) + "]"


def canvas_report(cfg: Config, dataset: DetectionDataset, max_canvases: int = 4, max_batches: int = 20000) -> str:
    """``tools/canvas_sizes.py``'s text: the training set's largest batches, the canvas
    sets of ``choose_canvases`` with their padding, and the config's own canvases."""
    heights, widths = dataset.records.arrays["heights"], dataset.records.arrays["widths"]
    inp, d = cfg.input, cfg.model.size_divisibility
    sizing = (f"large-scale jitter to {inp.lsj.size} px squared" if inp.lsj.enabled else
              f"shorter side from {list(inp.min_size_train)}, longer up to {inp.max_size_train}")
    grouping = "aspect groups on" if cfg.data.aspect_ratio_grouping else "aspect groups off"
    batches = largest_batches(heights, widths, cfg)
    largest = ", ".join(f"{name} {h}x{w}" for name, h, w, _ in batches if name != "one image") or "one image per batch"
    shapes = draw_batch_shapes(heights, widths, cfg, max_batches)
    choices = choose_canvases(heights, widths, cfg, max_canvases, shapes=shapes)
    lines = [f"training set: {dataset.source}, {len(dataset)} images; {cfg.solver.images_per_gpu} images per batch "
             f"({grouping}); {sizing}; padded to multiples of {d} (model.size_divisibility)",
             f"largest batches (height x width): {largest}",
             f"{len(shapes)} batches drawn as the loader draws them; padding: the canvases' pixels over the same "
             "batches padded to their own shape, minus 1", "",
             f"{'canvases':>8}  {'padding':>8}  model.canvas_sizes"]
    lines += [f"{len(c.canvases):>8}  {100 * c.padding:>+7.1f}%  {_listed(c.canvases)}" for c in choices]
    if cfg.model.canvas_sizes:
        own = evaluate_canvases(shapes, [tuple(c) for c in cfg.model.canvas_sizes])
        held = ("holds every batch" if first_unheld(batches, cfg.model.canvas_sizes) is None else
                f"{100 * own.unheld:.1f} % of the drawn batches fit none: train.static_step would stop")
        lines.append(f"this config's {_listed(own.canvases)}: padding {100 * own.padding:+.1f}%, {held}")
    lines += ["", "Each canvas is one more compiled graph (train.static_step, train.compile_backbone; minutes of "
              "compilation, and its memory): take the fewest whose padding you accept, e.g.",
              f"    model.canvas_sizes={_listed(choices[0].canvases).replace(' ', '')}"]
    return "\n".join(lines)


def canvas_sizes_command(config_file: str, overrides: Sequence[str] = (), max_canvases: int = 4,
                         max_batches: int = 20000) -> int:
    """``tools/canvas_sizes.py``: print ``canvas_report`` for the training set of the
    config with ``overrides``. Returns 0."""
    cfg = load_config(config_file, list(overrides))
    print(canvas_report(cfg, build_dataset(cfg, "train", True), max_canvases, max_batches))
    return 0
