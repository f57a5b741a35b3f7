"""The classes of the data: how many (``model.num_classes: auto``), the name of each
label 1..K, and one labelling for training, evaluation and the tools.

A label is an index into the training set's classes. With ``data.label_space:
contiguous`` and no ``data.class_names``, each COCO file numbers its own categories by
sorted id, so a val file that orders its ids otherwise (or names them otherwise) would
score the model's "circle" as its "rectangle" without a word. So training pins the
training set's names (``resolve_class_names``: ``data.class_names``, written to the run's
``config.yaml``), and the val set, ``tools/eval.py``, ``tools/infer.py`` and
``tools/export.py`` read categories by those names. Where names cannot be pinned
(``data.label_space: category_id``, whose labels are the ids; or category names that
repeat), ``check_val_classes`` refuses a val file whose labels name other classes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from detector.config import Config, ConfigError

from detector.messages import did_you_mean

from .build import check_data_paths
from .coco import coco_label_map
from .dataset import DetectionDataset
from .files import DataError
from .schema import CocoCategory, raise_error, read_coco
from .shapes import CLASS_NAMES as SHAPES_CLASS_NAMES
from .voc import VOC_CLASSES

logger = logging.getLogger(__name__)


def data_num_classes(cfg: Config, dataset: Optional[DetectionDataset] = None, split: str = "train") -> Tuple[int, str]:
    """The number of classes K of the data, and where it comes from (for messages):
    ``len(data.class_names)``; else the data set's (when given); else VOC's 20, the
    shapes' 3, or the number of categories in COCO's ``data.<split>.ann_file``. With
    ``data.label_space: category_id``, K is the largest category id in use."""
    data = cfg.data
    if data.label_space == "category_id":
        if dataset is not None:
            return dataset.num_classes, f"the largest category id of {dataset.source}"
        if data.format == "coco":
            check_data_paths(cfg, split)
        names, source = category_id_class_names(cfg, split)
        return len(names), source
    if data.class_names:
        return len(data.class_names), "data.class_names"
    if dataset is not None:
        return dataset.num_classes, f"the classes of {dataset.source}"
    if data.format == "voc":
        return len(VOC_CLASSES), "VOC's 20 classes"
    if data.format == "shapes":
        return len(SHAPES_CLASS_NAMES), "the shapes' classes"
    check_data_paths(cfg, split)
    ann_file = getattr(data, split).ann_file
    return len(_categories_of(ann_file)), f"the categories of {ann_file}"


def _categories_of(ann_file: str) -> List[CocoCategory]:
    """The ``categories`` of a COCO-format JSON, checked against the declared types
    (``schema.read_coco``); bad input raises ``DataError`` naming the entry and field."""
    return read_coco(str(ann_file), raise_error).categories


def coco_names_by_id(categories: Sequence[CocoCategory]) -> Dict[int, str]:
    """Category id -> name (the id as text where the name is left out), sorted by id;
    of a repeated id the last entry counts (as in ``coco.parse_coco``)."""
    return {c.id: c.name if c.name is not None else str(c.id) for c in sorted(categories, key=lambda c: c.id)}


def category_id_class_names(cfg: Config, split: str = "train") -> Tuple[List[str], str]:
    """The class names of ``data.label_space: category_id`` without building the data
    set: one per label 1..K, K the largest category id in use (all categories, or those
    of ``data.class_names``), ``unused_<id>`` for the others (see ``coco_label_map``);
    and where they come from (for messages). Reads COCO's ``data.<split>.ann_file``."""
    data = cfg.data
    if data.format == "shapes":  # the shapes' ids are 1..3 in the order of their names
        names_by_id = {i + 1: name for i, name in enumerate(SHAPES_CLASS_NAMES)}
        source = "the shapes' category ids"
    else:
        source = getattr(data, split).ann_file
        names_by_id = coco_names_by_id(_categories_of(source))
    names, _, _ = coco_label_map(names_by_id, list(data.class_names) or None, "category_id", source)
    return names, f"the largest category id of {source}"


def resolve_num_classes(cfg: Config, dataset: Optional[DetectionDataset] = None, split: str = "train") -> Config:
    """``cfg`` with ``model.num_classes`` resolved from the data (see ``data_num_classes``;
    pass the ``dataset`` of ``split`` when it is built, so nothing is read twice).

    ``auto`` becomes K; an explicit value must equal K (with ``data.label_space:
    category_id``: be at least K, the largest category id).

    Raises:
        ConfigError: an explicit ``model.num_classes`` that differs from the data's K
            (category_id: is below it), one line naming the key and both numbers.
    """
    k, source = data_num_classes(cfg, dataset, split)
    n = cfg.model.num_classes
    if n is None:
        logger.info("model.num_classes=auto: %d classes (%s)", k, source)
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_classes=k))
    if cfg.data.label_space == "category_id":
        if n < k:
            raise ConfigError(f"config key 'model.num_classes' is {n} but the data's labels go up to {k} ({source}, "
                              f"data.label_space=category_id); set model.num_classes=auto or >= {k}")
        return cfg
    if n != k:
        raise ConfigError(f"config key 'model.num_classes' is {n} but the data has {k} classes ({source}); "
                          f"set model.num_classes=auto or {k}")
    return cfg


def resolve_class_names(cfg: Config, train_set: DetectionDataset) -> Config:
    """``cfg`` with ``data.class_names`` set to the training set's class names, in label
    order, where it is empty and labels are contiguous category indices of COCO-format
    data (coco, shapes): the val set and the tools then read the categories by name, as
    the model learnt them. Left as it is: names the user set, VOC (its names are fixed,
    VOC's 20 by default), ``data.label_space: category_id`` (labels are ids), and
    category names that repeat (by name they would be ambiguous; ``check_val_classes``
    checks those by label)."""
    data = cfg.data
    if data.class_names or data.label_space != "contiguous" or data.format == "voc":
        return cfg
    names = list(train_set.class_names)
    if len(set(names)) != len(names):
        return cfg
    logger.info("data.class_names: the %d classes of %s, by name (the val set and the tools read its categories "
                "by these names)", len(names), train_set.source)
    return dataclasses.replace(cfg, data=dataclasses.replace(data, class_names=names))


def check_val_classes(cfg: Config, train_set: DetectionDataset) -> None:
    """Refuse, before training, a COCO val file whose labels would not be the training
    set's classes: with class names (``data.class_names``, set or pinned by
    ``resolve_class_names``) each must name exactly one category of the val file; with
    ``data.label_space: category_id`` a category id in both files must have one name;
    with category names that repeat (not pinned) each label, the categories sorted by
    id, must have the training set's name.

    Raises:
        DataError: one line naming the val file, the class, label or id, and both names.
    """
    data = cfg.data
    if data.format != "coco":
        return
    val_file = data.val.ann_file
    val_names = coco_names_by_id(_categories_of(val_file))
    where = f"data.val.ann_file {val_file}"
    if data.label_space == "contiguous" and data.class_names:
        counts = Counter(val_names.values())
        for name in data.class_names:
            if counts[name] != 1:
                hint = did_you_mean(name, counts) if not counts[name] else ""
                found = f"{counts[name]} categories" if counts[name] else "no category"
                raise DataError(f"{where} has {found} named {name!r}{hint}, a class of the "
                                f"training set ({train_set.source}): the val set is read by the training classes' names "
                                "(data.class_names), one category each")
        return
    if data.label_space == "category_id":
        for label, cat in train_set.label_to_category_id.items():
            name = train_set.class_names[label - 1]
            if cat in val_names and val_names[cat] != name:
                raise DataError(
                    f"{where}: category id {cat} is {val_names[cat]!r} there but {name!r} in the training set "
                    f"({train_set.source}); with data.label_space=category_id the labels are the ids, so an id must "
                    "name the same class in both files")
        return
    names = coco_label_map(val_names, None, "contiguous", val_file)[0]
    label = first_other_label(train_set.class_names, names)
    if label is not None:
        raise DataError(
            f"{where}: label {label} (its categories sorted by id) is {names[label - 1]!r} there but "
            f"{train_set.class_names[label - 1]!r} in the training set ({train_set.source}); its category names "
            "repeat, so the files are matched by id order: give the categories distinct names, or the same ids in "
            "both files")


def first_other_label(names: Sequence[str], other: Sequence[str]) -> Optional[int]:
    """The first label (1-based) that ``names`` and ``other`` name differently, among the
    labels both have; None where they agree."""
    return next((label for label, (a, b) in enumerate(zip(names, other), start=1) if a != b), None)


def check_trained_classes(cfg: Config, trained: Sequence[str], names: Sequence[str], weights: str) -> None:
    """Refuse to evaluate or draw with labels named otherwise than in the run that trained
    ``weights``: ``trained`` (``LoadReport.trained_classes``) against ``names``, this
    config's names of labels 1..K (the val set's, or ``class_names_for``). Nothing to
    compare with ``category_id`` labels (the ids) or where either list is empty.

    Raises:
        DataError: one line naming the weights, the first label that differs and both names.
    """
    label = first_other_label(trained, names) if cfg.data.label_space == "contiguous" else None
    if label is not None:
        raise DataError(f"--weights {weights}: label {label} is {trained[label - 1]!r} in the run that trained it "
                        f"(its data.class_names) but {names[label - 1]!r} in this config's data: use that run's "
                        "config.yaml, or set data.class_names to the run's class names")


def class_names_for(cfg: Config) -> List[str]:
    """The name of each label 1..K without building the data set (for drawings and exported
    files): ``data.class_names`` (a training run's ``config.yaml`` holds them), else the
    shapes' names, VOC's 20, the COCO categories of ``data.val.ann_file`` when it exists,
    else ``class 1..K``; with ``data.label_space: category_id``, one name per category id
    (``unused_<id>`` slots)."""
    data = cfg.data
    val_json = data.format == "coco" and bool(data.val.ann_file) and Path(data.val.ann_file).is_file()
    if data.label_space == "category_id" and (data.format == "shapes" or val_json):
        return category_id_class_names(cfg, "val")[0]
    if data.class_names:
        return list(data.class_names)
    if data.format == "shapes":
        return list(SHAPES_CLASS_NAMES)
    if data.format == "voc":
        return list(VOC_CLASSES)
    if val_json:
        names_by_id = coco_names_by_id(_categories_of(data.val.ann_file))
        return coco_label_map(names_by_id, None, "contiguous", data.val.ann_file)[0]
    return [f"class {i + 1}" for i in range(cfg.model.num_classes)]
