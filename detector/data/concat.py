"""Several training sets trained on as one: ``data.train`` plus ``data.train_extra``
(VOC 2007+2012 trainval, the paper's "07+12"; COCO plus one's own COCO-format file).

``concat_datasets`` joins data sets of one format that share their classes, in one order
(label ``k`` names the same class in each), into one ``DetectionDataset`` whose records
are one ``RecordStore``: the samplers, the aspect-ratio groups, repeat-factor sampling
and copy-paste see one set. Two rules keep the result honest:

- the classes must be equal, name for name (two COCO files that number or name their
  categories otherwise would train one label on two classes): else one line naming both
  sets and the first label that differs; ``data.class_names`` picks the same classes
  from each;
- an image file is in one set only (the same set listed twice, or under a linked
  folder, would train twice on each image, silently): else one line naming the file and
  both sets.

Image ids stay those of the files while no two sets share one; a set whose ids meet an
earlier set's is shifted past them (one log line), so ids name one image each.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .dataset import DetectionDataset, Transform, missing_class_line
from .files import DataError
from .records import RecordStore

logger = logging.getLogger(__name__)


def _first_difference(a: Sequence[str], b: Sequence[str]) -> str:
    """Where two class lists first differ: ``"label 3 is 'cat' against 'dog'"``, or
    ``"3 classes against 4"``."""
    if len(a) != len(b):
        return f"{len(a)} classes against {len(b)}"
    label = next(i for i, (x, y) in enumerate(zip(a, b), start=1) if x != y)
    return f"label {label} is {a[label - 1]!r} against {b[label - 1]!r}"


def _check_classes(parts: Sequence[Tuple[str, DetectionDataset]]) -> None:
    key0, first = parts[0]
    for key, dataset in parts[1:]:
        if dataset.class_names != first.class_names:
            raise DataError(
                f"{key} ({dataset.source}) and {key0} ({first.source}) have other classes "
                f"({_first_difference(dataset.class_names, first.class_names)}): the training sets must share "
                "their classes, in one order; set data.class_names to the classes to train on")


def file_in_two_sets(parts: Sequence[Tuple[str, Iterable[str]]]) -> Optional[Tuple[str, str]]:
    """The first image file that two sets hold, as ``(the second set's key, one line
    naming the file and both sets)``; None where each file is in one set. ``parts``:
    ``(config key, image paths)`` pairs. Files are compared by name within their folder's
    real path (one ``realpath`` per folder: a set linked under a second name is caught)."""
    seen: dict = {}
    folders: dict = {}
    for key, paths in parts:
        for path in paths:
            folder, name = os.path.split(path)
            real = folders.get(folder)
            if real is None:
                real = folders[folder] = os.path.realpath(folder)
            other = seen.setdefault(os.path.join(real, name), key)
            if other != key:
                return key, (f"image file {path} is in {other} and in {key}: each training set must hold other "
                             "images (is one set listed twice?)")
    return None


def _id_offsets(parts: Sequence[Tuple[str, DetectionDataset]]) -> List[int]:
    """Per set, what its image ids are shifted by: 0, or past every earlier set's ids
    where some of its ids are an earlier set's."""
    offsets, taken = [], np.zeros(0, np.int64)
    for key, dataset in parts:
        ids = dataset.records.arrays["image_ids"]
        offset = 0
        if len(taken) and len(np.intersect1d(ids, taken)):
            offset = int(taken.max()) + 1 - int(ids.min())
            logger.info("%s (%s): its image ids meet an earlier training set's: shifted by %d", key, dataset.source,
                        offset)
        offsets.append(offset)
        taken = np.concatenate([taken, ids + offset])
    return offsets


def check_every_class(dataset: DetectionDataset, keys: Sequence[str]) -> None:
    """A joined training set holds a training box of every class (``data.class_names`` of
    VOC data: each set alone need not), by the rule each VOC set applies alone
    (``missing_class_line``: difficult objects count with ``use_difficult``).

    Raises:
        DataError: the first class without one, naming the sets' keys."""
    a = dataset.records.arrays
    line = missing_class_line(a["labels"], a["difficult"], dataset.class_names, dataset.use_difficult,
                              f"the training sets ({', '.join(keys)})")
    if line is not None:
        raise DataError(line)


def concat_datasets(parts: Sequence[Tuple[str, DetectionDataset]],
                    transforms: Optional[Transform] = None) -> DetectionDataset:
    """One training set of ``parts``, ``(config key, data set)`` pairs (``data.train``
    first), each already filtered (``data.filter_empty``); ``transforms``: the joined
    set's (the parts' own are not used). One part is returned as it is, with
    ``transforms`` set.

    Raises:
        DataError: the parts' classes differ, or an image file is in two parts.
    """
    if len(parts) == 1:
        dataset = parts[0][1]
        dataset.transforms = transforms
        return dataset
    _check_classes(parts)
    twice = file_in_two_sets([(key, map(d.records.path, range(len(d.records)))) for key, d in parts])
    if twice is not None:
        raise DataError(twice[1])
    first = parts[0][1]
    store = RecordStore.concatenate([d.records for _, d in parts], _id_offsets(parts))
    skipped: Counter = sum((d.skipped for _, d in parts), Counter())
    joined = DetectionDataset(store, first.class_names, first.label_to_category_id, transforms=transforms,
                              use_difficult=first.use_difficult, skipped=skipped,
                              source=" + ".join(d.source for _, d in parts),
                              images_before_filter=sum(d.num_images_before_filter for _, d in parts))
    joined.label_space = first.label_space
    logger.info("training sets joined: %s: %d images, %d boxes",
                ", ".join(f"{key} {len(d)} images" for key, d in parts), len(joined), store.num_boxes)
    return joined
