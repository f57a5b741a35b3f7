"""Batches to time on: cached from the real loader, or synthetic at the input size."""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterable, Iterator, List, Tuple

import torch

from detector.config import Config
from detector.data import build_dataset
from detector.data.loader import build_test_loader, build_train_loader

Batch = Tuple[List[torch.Tensor], List[Dict[str, Any]]]


def batches_from_loader(loader: Any, num_batches: int, pin: bool = False) -> List[Batch]:
    """The first ``num_batches`` batches of a loader, kept in memory (pinned if asked)."""
    out: List[Batch] = []
    it = iter(loader)
    for _ in range(num_batches):
        try:
            images, targets = next(it)
        except StopIteration:
            break
        if pin:
            images = [img.pin_memory() for img in images]
        out.append((list(images), list(targets)))
    del it
    if not out:
        raise ValueError("the data loader gave no batches (is the split empty?)")
    return out


def synthetic_batches(
    num_batches: int,
    batch_size: int,
    min_size: int,
    max_size: int,
    num_classes: int,
    seed: int = 0,
    max_objects: int = 8,
) -> List[Batch]:
    """Random uint8 images already at the input size (shorter side ``min_size``, 4:3
    landscape, longer side capped at ``max_size``) with 1..max_objects random boxes.

    For timing the model where the data set is not on this machine. Images are
    ``[3, H, W]`` uint8; targets hold ``boxes`` float32 [N, 4] xyxy and ``labels`` int64.
    """
    g = torch.Generator().manual_seed(seed)
    h = int(min_size)
    w = int(min(max_size, round(min_size * 4 / 3)))
    out: List[Batch] = []
    for b in range(num_batches):
        images, targets = [], []
        for k in range(batch_size):
            images.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g))
            n = int(torch.randint(1, max_objects + 1, (1,), generator=g))
            xy = torch.rand(n, 2, generator=g) * torch.tensor([w * 0.8, h * 0.8])
            wh = (torch.rand(n, 2, generator=g) * 0.5 + 0.05) * torch.tensor([w, h])
            boxes = torch.cat([xy, torch.minimum(xy + wh, torch.tensor([w - 1.0, h - 1.0]))], dim=1)
            labels = torch.randint(1, num_classes + 1, (n,), generator=g)
            targets.append(
                {
                    "boxes": boxes.float(),
                    "labels": labels.long(),
                    "image_id": b * batch_size + k,
                    "orig_size": torch.tensor([h, w]),
                    "scale": torch.ones(2),
                }
            )
        out.append((images, targets))
    return out


def cached_batches(cfg: Config, is_train: bool, num_batches: int, synthetic: bool, pin: bool) -> List[Batch]:
    """Batches to time the model on: real ones from the configured data set (through
    the real transforms and loader), or :func:`synthetic_batches`."""
    if synthetic:
        if is_train:
            size, max_size, bs = cfg.input.min_size_train[0], cfg.input.max_size_train, cfg.solver.images_per_gpu
        else:
            size, max_size, bs = cfg.input.min_size_test, cfg.input.max_size_test, cfg.eval.images_per_gpu
        batches = synthetic_batches(num_batches, bs, size, max_size, cfg.model.num_classes, seed=cfg.train.seed)
        if pin:
            batches = [([img.pin_memory() for img in ims], tg) for ims, tg in batches]
        return batches

    cfg = copy.deepcopy(cfg)
    cfg.data.persistent_workers = False
    if is_train:
        dataset = build_dataset(cfg, "train", is_train=True)
        loader = build_train_loader(cfg, dataset, 0, 1)
    else:
        dataset = build_dataset(cfg, "val", is_train=False)
        loader = build_test_loader(cfg, dataset, 0, 1)
    return batches_from_loader(loader, num_batches, pin=pin)


def cycle_epochs(loader: Iterable[Batch]) -> Iterator[Batch]:
    """The loader's batches epoch after epoch, calling ``batch_sampler.set_epoch`` before
    each epoch as training does. Raises ValueError if an epoch gives no batch."""
    epoch = 0
    while True:
        sampler = getattr(loader, "batch_sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        count = 0
        for batch in loader:
            count += 1
            yield batch
        if count == 0:
            raise ValueError("the data loader gave no batches (is the split empty?)")
        epoch += 1
