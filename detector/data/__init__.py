"""Data: COCO / VOC / generated shapes data sets, albumentations transforms, samplers
and loaders. See docs/data.md for formats, coordinates and the bad-input policy."""

from __future__ import annotations

import os
from pathlib import Path

from detector.config import Config

# albumentations asks PyPI for a newer version at import unless this is set: offline that
# is a warning and a wait on every start. Set before any submodule imports albumentations.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

from .datasets import CocoDetection, DataError, DetectionDataset, VOCDetection
from .loader import build_test_loader, build_train_loader, measure_loader_throughput
from .transforms import build_transforms

__all__ = [
    "CocoDetection",
    "DataError",
    "DetectionDataset",
    "VOCDetection",
    "build_dataset",
    "build_test_loader",
    "build_train_loader",
    "build_transforms",
    "measure_loader_throughput",
]

FORMATS = ("coco", "voc", "shapes")


def build_dataset(cfg: Config, split: str, is_train: bool) -> DetectionDataset:
    """The data set of ``cfg.data.<split>`` (split "train" or "val") with the train or
    eval transforms of ``cfg.input``.

    - ``coco``: ``root`` = image folder, ``ann_file`` = instances JSON;
    - ``voc``: ``root`` = VOCdevkit year folder, ``split`` = ImageSets/Main name
      (default: the split argument), class names from ``data.class_names`` (default VOC's 20);
    - ``shapes``: ``root`` = folder written by ``detector.data.shapes`` (generated from
      ``data.shapes`` if missing), ``split`` = "train" / "val" (default: the split argument).

    ``data.filter_empty`` drops images without training boxes, in training only.
    """
    if split not in ("train", "val"):
        raise ValueError(f"build_dataset: split must be 'train' or 'val', got {split!r}")
    data = cfg.data
    sc = getattr(data, split)
    fmt = data.format
    if fmt not in FORMATS:
        raise ValueError(f"data.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not sc.root:
        raise ValueError(f"data.{split}.root is empty: set it to the {fmt} data folder")
    transforms = build_transforms(cfg, is_train, seed=cfg.train.seed)
    filter_empty = bool(data.filter_empty and is_train)
    if fmt == "coco":
        if not sc.ann_file:
            raise ValueError(f"data.{split}.ann_file is empty: set it to the COCO instances JSON")
        return CocoDetection(sc.root, sc.ann_file, transforms=transforms, filter_empty=filter_empty,
                             use_difficult=data.use_difficult)
    if fmt == "voc":
        return VOCDetection(sc.root, sc.split or split, class_names=data.class_names or None,
                            transforms=transforms, filter_empty=filter_empty, use_difficult=data.use_difficult)
    from .shapes import ensure_shapes  # here, so `python -m detector.data.shapes` runs cleanly

    s = data.shapes
    root = ensure_shapes(sc.root, s.num_train, s.num_val, s.seed, s.min_side, s.max_side)
    name = sc.split or split
    ann_file = Path(sc.ann_file) if sc.ann_file else Path(root) / f"{name}.json"
    return CocoDetection(Path(root) / name, ann_file, transforms=transforms, filter_empty=filter_empty,
                         use_difficult=data.use_difficult)
