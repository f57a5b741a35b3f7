"""Data sets from the config: ``build_dataset(cfg, split, is_train)``, the checks of
``cfg.data``'s paths before anything is read, and the number and names of the classes
(``model.num_classes: auto``) are in ``classes.py``, the loaders in ``loader.py``."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import List, Optional, Tuple

from detector.config import Config, ConfigError, SplitConfig
from detector.distributed import get_world_size
from detector.files import missing_file_state
from detector.messages import shown_path

from .coco import CocoDetection
from .concat import check_every_class, concat_datasets
from .dataset import DetectionDataset
from .files import DataError
from .record_cache import RecordCache
from .shapes import ensure_shapes
from .copy_paste import DatasetSource
from .transforms import DetectionTransform, build_transforms
from .voc import VOCDetection


FORMATS = ("coco", "voc", "shapes")

logger = logging.getLogger(__name__)


def _need_folder(key: str, path: Path, what: str) -> None:
    if not path.is_dir():
        state = "is not a folder" if path.exists() else "not found"
        raise DataError(f"{key}: {what} {path} {state}")


def _need_file(key: str, path: Path, what: str) -> None:
    if not path.is_file():
        state = "is not a file" if path.exists() else "not found"
        raise DataError(f"{key}: {what} {path} {state}")


def split_sources(cfg: Config, split: str) -> List[Tuple[str, SplitConfig]]:
    """``(config key, SplitConfig)`` of each set that ``split`` reads: ``data.val``; or
    ``data.train`` then each ``data.train_extra[i]`` (trained on as one set)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if split == "val":
        return [("data.val", cfg.data.val)]
    extra = [(f"data.train_extra[{i}]", sc) for i, sc in enumerate(cfg.data.train_extra)]
    return [("data.train", cfg.data.train), *extra]


def check_data_paths(cfg: Config, split: str) -> None:
    """Check, without reading them, that the folders and files of ``cfg.data.<split>``
    (and, for "train", of each ``data.train_extra`` entry) exist: COCO's image folder and
    instances JSON; VOC's year folder with ``ImageSets/Main/<split>.txt``,
    ``Annotations/`` and ``JPEGImages/``. (The shapes set is generated when missing.)

    Raises:
        DataError: one line naming the config key and the path.
    """
    fmt = cfg.data.format
    if fmt not in FORMATS:
        raise ConfigError(f"config key 'data.format' must be one of {', '.join(FORMATS)}, got {fmt!r}")
    for key, sc in split_sources(cfg, split):
        _check_source_paths(fmt, key, sc, split)


def _check_source_paths(fmt: str, key: str, sc: SplitConfig, split: str) -> None:
    if not sc.root:
        raise DataError(f"{key}.root is empty: set it to the {fmt} data folder")
    root = Path(sc.root)
    if fmt == "coco":
        if not sc.ann_file:
            raise DataError(f"{key}.ann_file is empty: set it to the COCO instances JSON")
        _need_folder(f"{key}.root", root, "image folder")
        _need_file(f"{key}.ann_file", Path(sc.ann_file), "annotation file")
    elif fmt == "voc":
        years = sorted(p.name for p in root.glob("VOC20*") if (p / "Annotations").is_dir()) if root.is_dir() else []
        if years and not (root / "Annotations").is_dir():
            raise DataError(f"{key}.root: {root} is a VOCdevkit folder; set it to the year folder, "
                            f"e.g. {root / years[-1]}")
        _need_folder(f"{key}.root", root, "VOC year folder")
        _need_file(f"{key}.split", root / "ImageSets" / "Main" / f"{sc.split or split}.txt", "VOC split file")
        _need_folder(f"{key}.root", root / "Annotations", "VOC annotation folder")
        _need_folder(f"{key}.root", root / "JPEGImages", "VOC image folder")
    elif root.exists() and not root.is_dir():
        raise DataError(f"{key}.root: {root} is not a folder")


def record_cache(cfg: Config) -> Optional[RecordCache]:
    """Where the parsed records of COCO-format data are shared (``data.cache_dir``): a
    folder, ``auto`` = ``<train.output_dir>/cache`` in a distributed run (more than one
    rank; the same answer on every rank) and no cache in one process; ``""``: none."""
    folder = cfg.data.cache_dir
    if folder == "auto":
        return RecordCache(Path(cfg.train.output_dir) / "cache") if get_world_size() > 1 else None
    return RecordCache(Path(folder)) if folder else None


def cache_in(cfg: Config, folder: str | os.PathLike) -> Config:
    """``cfg`` whose ``data.cache_dir: auto`` puts the shared records under ``folder``
    (``<folder>/cache``) instead of ``train.output_dir``: for a tool that writes into a
    folder of its own (``tools/eval.py --output-dir``), so that it writes nothing into the
    run folder its config names (or a folder of that name under the working folder).
    Other values are the user's choice and kept."""
    if cfg.data.cache_dir != "auto" or get_world_size() <= 1:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_dir=str(Path(folder) / "cache")))


def _check_first_images(dataset: DetectionDataset, key: str, count: int = 16) -> DetectionDataset:
    """A wrong image folder shows at once: the first ``count`` image files must exist
    (the rest are found missing when loaded, as any single missing file is)."""
    for record in dataset.records[:count]:
        if not os.path.isfile(record.path):
            state = missing_file_state(record.path)
            hint = _missing_image_hint(record.path, key, dataset.source) if state == "not found" else ""
            raise DataError(f"{key}: image file {shown_path(record.path)} (image_id {record.image_id}) {state}{hint}")
    return dataset


def _missing_image_hint(path: str, key: str, source: str) -> str:
    """What a missing image file's name suggests: Windows separators (``train\\a.jpg``),
    the same name with another suffix (``a.png`` for ``a.jpg``: VOC reads
    ``JPEGImages/<id>.jpg``), else a wrong image folder."""
    if "\\" in path and os.path.isfile(path.replace("\\", "/")):
        return "; its name uses Windows separators ('\\'): write the file names with '/'"
    folder, name = os.path.split(path)
    stem = os.path.splitext(name)[0]
    try:
        others = sorted(n for n in os.listdir(folder) if os.path.splitext(n)[0] == stem and n != name) if stem else []
    except (OSError, ValueError):
        others = []
    if others:
        return (f"; the folder holds {others[0]!r}: the annotations name {name!r} (VOC reads JPEGImages/<id>.jpg; "
                "convert the images, or give their names in a COCO file)")
    return f"; is {key} the folder that holds the images of {source}?"


def build_dataset(cfg: Config, split: str, is_train: bool) -> DetectionDataset:
    """The data set of ``cfg.data.<split>`` (split "train" or "val") with the train or
    eval transforms of ``cfg.input``.

    - ``coco``: ``root`` = image folder, ``ann_file`` = instances JSON;
    - ``voc``: ``root`` = VOCdevkit year folder, ``split`` = ImageSets/Main name
      (default: the split argument);
    - ``shapes``: ``root`` = folder written by ``shapes.generate_shapes`` (or
      ``tools/make_shapes.py``; generated from ``data.shapes`` if missing), ``split`` =
      "train" / "val" (default: the split argument).

    ``data.class_names`` picks the classes (labels 1..K in its order): VOC class names
    (default VOC's 20) or COCO / shapes category names (default all); the other classes'
    boxes are dropped and counted in one log line. In training every listed class must
    have an object. ``data.filter_empty`` drops images without training boxes, in training only.
    ``data.label_space: category_id`` (COCO / shapes) keeps label = category id instead.
    ``data.cache_dir`` (COCO / shapes): the records are parsed once per machine and shared
    through a memory-mapped file (``record_cache``); in a distributed run every rank must
    call this function (it holds a collective).

    ``data.train_extra`` (training): more sets of ``data.format``, read as ``data.train``
    and joined with it into one set (``concat.concat_datasets``: the same classes in each,
    no image in two).

    Raises:
        DataError / FileNotFoundError: a missing path (see ``check_data_paths``) or bad data.
    """
    check_data_paths(cfg, split)
    transforms = build_transforms(cfg, is_train, seed=cfg.train.seed)
    sources = split_sources(cfg, split)
    # A VOC class subset must have objects in the training set: in the joined one, where several.
    every_class = is_train and len(sources) == 1
    parts = [(key, _build_source(cfg, key, sc, split, is_train, every_class)) for key, sc in sources]
    dataset = concat_datasets(parts, transforms)
    if is_train and len(parts) > 1 and cfg.data.format == "voc" and cfg.data.class_names:
        check_every_class(dataset, [key for key, _ in parts])
    return _ready(dataset, cfg, split, is_train)


def _build_source(cfg: Config, key: str, sc: SplitConfig, split: str, is_train: bool,
                  every_class: bool) -> DetectionDataset:
    """The data set of one ``SplitConfig`` (``key``: its config key), without transforms;
    ``every_class``: a VOC class subset must have objects in it."""
    data = cfg.data
    filter_empty = bool(data.filter_empty and is_train)
    names = list(data.class_names) or None
    cache = record_cache(cfg)
    if data.format == "coco":
        dataset: DetectionDataset = CocoDetection(sc.root, sc.ann_file, filter_empty=filter_empty,
                                                  use_difficult=data.use_difficult, class_names=names,
                                                  label_space=data.label_space, cache=cache)
        return _check_first_images(dataset, f"{key}.root")
    if data.format == "voc":
        dataset = VOCDetection(sc.root, sc.split or split, class_names=names, filter_empty=filter_empty,
                               use_difficult=data.use_difficult, require_every_class=every_class)
        return _check_first_images(dataset, f"{key}.root")
    s = data.shapes
    root = ensure_shapes(sc.root, s.num_train, s.num_val, s.seed, s.min_side, s.max_side)
    name = sc.split or split
    # Each format reads its own keys only: a shapes folder's annotations are <root>/<split>.json,
    # whatever data.<split>.ann_file (a COCO key, e.g. inherited from a COCO base config) says.
    return CocoDetection(Path(root) / name, Path(root) / f"{name}.json", filter_empty=filter_empty,
                         use_difficult=data.use_difficult, class_names=names, label_space=data.label_space,
                         cache=cache)


def _ready(dataset: DetectionDataset, cfg: Config, split: str, is_train: bool) -> DetectionDataset:
    """``dataset`` with ``data.apply_exif`` set; a training set must have a box to learn from.

    Raises:
        DataError: a training set without any training box, one line naming it.
    """
    dataset.apply_exif = cfg.data.apply_exif
    _with_paste_source(dataset)
    if is_train and dataset.num_training_boxes() == 0:
        untrained = "crowd boxes do not train" if cfg.data.use_difficult else "crowd and difficult boxes do not train"
        raise DataError(f"{dataset.source}: no training boxes in its {len(dataset)} images (data.{split}; {untrained}): "
                        "nothing to learn; check the annotation file and data.class_names")
    return dataset


def _with_paste_source(dataset: DetectionDataset) -> DetectionDataset:
    """Copy-paste (``input.copy_paste``) takes its partner images from the data set itself."""
    transforms = dataset.transforms
    if isinstance(transforms, DetectionTransform) and transforms.copy_paste is not None:
        transforms.set_source(DatasetSource(dataset), len(dataset))
    return dataset
