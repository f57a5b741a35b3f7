"""Training samples as the model sees them: after the training transforms (resize or
large-scale jitter, flip, colour jitter, copy-paste), drawn with their boxes in class
colours and captioned with class names (``tools/browse_dataset.py``).

The samples are the first ``num`` of epoch ``epoch`` in the training order of one
process (``TrainingSampler`` with ``train.seed``), each drawn from its ``SampleKey``, so
they are exactly the samples that epoch's training batches hold.
"""

from __future__ import annotations

import math
from itertools import islice
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import torch
from PIL import Image

from detector.config import Config
from detector.data import build_dataset
from detector.data.samplers import TrainingSampler

from .plots import Drawing, render


def training_samples(cfg: Config, num: int, epoch: int = 0) -> Tuple[List[Tuple[torch.Tensor, Dict[str, Any]]], List[str]]:
    """The first ``num`` training samples ``(image uint8 [3, H, W], target)`` of ``epoch``
    (targets as ``DetectionDataset`` gives them: ``boxes`` float32 ``[N, 4]`` xyxy pixels
    of the image, ``labels`` int64 ``[N]``), and the class names of labels 1..K."""
    if num < 1:
        raise ValueError(f"--num must be at least 1, got {num}")
    if not 0 <= epoch < 2**62:  # the sampler's seed is an int64 built from it
        raise ValueError(f"--epoch must be in 0..{2**62 - 1} (0: the first epoch), got {epoch}")
    dataset = build_dataset(cfg, "train", is_train=True)
    sampler = TrainingSampler(len(dataset), shuffle=True, seed=cfg.train.seed)
    sampler.set_epoch(epoch)
    return [dataset[key] for key in islice(iter(sampler), num)], list(dataset.class_names)


def draw_training_samples(cfg: Config, num: int, epoch: int = 0, min_side: int = 320) -> List[Drawing]:
    """The first ``num`` training samples of ``epoch``, drawn (ground-truth boxes in
    their class colours, captions with the class names, a legend of the classes drawn)."""
    samples, names = training_samples(cfg, num, epoch)
    drawings = []
    for image, target in samples:
        labels = target["labels"].tolist()
        captions = [names[lab - 1] if 0 < lab <= len(names) else str(lab) for lab in labels]
        drawings.append(render(image, None, gt_boxes=target["boxes"], gt_labels=captions, gt_classes=labels,
                               class_names=names, min_side=min_side))
    return drawings


def tile(images: List[torch.Tensor], pad: int = 4) -> np.ndarray:
    """uint8 ``[3, H_i, W_i]`` images on a white grid of ``ceil(sqrt(n))`` columns, each
    cell the largest image's size plus ``pad`` pixels: uint8 ``[H, W, 3]``."""
    cols = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    cell_h = max(im.shape[1] for im in images) + pad
    cell_w = max(im.shape[2] for im in images) + pad
    grid = np.full((rows * cell_h, cols * cell_w, 3), 255, np.uint8)
    for i, im in enumerate(images):
        r, c = divmod(i, cols)
        grid[r * cell_h:r * cell_h + im.shape[1], c * cell_w:c * cell_w + im.shape[2]] = im.permute(1, 2, 0).numpy()
    return grid


def browse_dataset(cfg: Config, output_dir: str | Path, num: int = 8, grid: bool = False, epoch: int = 0) -> List[Path]:
    """Write the first ``num`` training samples of ``epoch`` (see ``draw_training_samples``)
    to ``output_dir``: ``sample_000.png``, ``sample_001.png``, ... (in sample order), or one
    ``grid.png``.
    Returns the files written."""
    drawings = draw_training_samples(cfg, num, epoch)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if grid:
        path = out / "grid.png"
        Image.fromarray(tile([d.image for d in drawings])).save(path)
        return [path]
    paths = []
    for i, d in enumerate(drawings):
        path = out / f"sample_{i:03d}.png"
        Image.fromarray(d.image.permute(1, 2, 0).numpy()).save(path)
        paths.append(path)
    return paths
