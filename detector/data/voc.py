"""PASCAL VOC year folders (``VOCdevkit/VOC2007``): the split file, one XML per image
(read and type-checked by ``voc_xml.read_voc_xml``; see ``dataset.py`` for the bad-input
policy), and ``VOCDetection``."""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .dataset import (DetectionDataset, ImageRecord, Issues, Transform, check_box, log_other_classes,
                      missing_class_line, record_boxes, rows_to_arrays)
from .files import DataError, path_within
from .schema import VocObject
from .voc_xml import read_voc_split, read_voc_xml

logger = logging.getLogger(__name__)

# The 20 PASCAL VOC classes, in the usual order (used when data.class_names is empty).
VOC_CLASSES: Tuple[str, ...] = (
    "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
    "train", "tvmonitor",
)  # fmt: skip


def voc_image_ids(ids: Sequence[str]) -> List[int]:
    """Integer image ids for VOC ids: "2008_000123" -> 2008000123, "000005" -> 5 when every
    id is of that form and the results are unique int64 values; otherwise 1..N in
    split-file order."""
    pattern = re.compile(r"^\d+(_\d+)?$")
    if all(pattern.match(s) for s in ids):
        ints = [int(s.replace("_", "")) for s in ids]
        if len(set(ints)) == len(ints) and max(ints, default=0) < 2**63:
            return ints
    return list(range(1, len(ids) + 1))



def _voc_split_ids(split_file: Path, issues: Issues) -> List[str]:
    """The image ids listed in ``split_file`` (``voc_xml.read_voc_split``), each once, in
    file order; an id listed more than once is an error in ``issues``.

    Raises:
        FileNotFoundError: ``split_file`` does not exist; DataError: see ``read_voc_split``.
    """
    ids = read_voc_split(split_file)
    counts = Counter(ids)
    for name, n in counts.items():
        if n > 1:
            issues.error(f"VOC split file {split_file}: image id '{name}' appears {n} times")
    return list(dict.fromkeys(ids))


def _voc_object_row(
    obj: VocObject,
    where: str,
    width: int,
    height: int,
    name_to_label: Dict[str, int],
    drop_other_classes: bool,
    ann_id: int,
    issues: Issues,
) -> Optional[tuple]:
    """One ``<object>`` (types checked by the schema; ``where`` names it in messages) of a
    ``width`` x ``height`` image.

    Returns the row ``(box xyxy, label, iscrowd=False, difficult, ann_id, area)`` with the
    box converted from VOC's 1-based inclusive pixels and checked by :func:`check_box`, or
    None: an unknown class (an error in ``issues``, or with ``drop_other_classes``
    counted in ``issues.other_classes``), or a box that :func:`check_box` skips.
    Fractional coordinates are accepted and noted in ``issues.non_integer``.
    """
    name = obj.name
    if name not in name_to_label:
        if drop_other_classes and name:
            issues.other_classes[name] += 1
        else:
            issues.error(f"{where}: class name {name!r} is not in data.class_names")
        return None
    b = obj.bndbox
    xmin, ymin, xmax, ymax = b.xmin, b.ymin, b.xmax, b.ymax
    box = check_box((xmin - 1.0, ymin - 1.0, xmax, ymax), width, height, where, issues)
    if box is None:
        return None
    if not all(float(v).is_integer() for v in (xmin, ymin, xmax, ymax)):
        # VOC writes integer pixel indices; some tools write fractions. Accepted as
        # floats (same conversion), counted for check_dataset's report.
        issues.non_integer.append(f"{where}: non-integer coordinates "
                                  f"[{xmin:g}, {ymin:g}, {xmax:g}, {ymax:g}] (accepted as floats)")
    area = (box[2] - box[0]) * (box[3] - box[1])
    return box, name_to_label[name], False, bool(obj.difficult), ann_id, area


def parse_voc(
    root: str | os.PathLike,
    split: str,
    class_names: Sequence[str],
    issues: Issues,
    drop_other_classes: bool = False,
) -> List[ImageRecord]:
    """Parse ``<root>/ImageSets/Main/<split>.txt`` and ``<root>/Annotations/<id>.xml``.

    An object whose class is not in ``class_names`` is an error, or, with
    ``drop_other_classes`` (a class subset), dropped and counted by name in
    ``issues.other_classes``.

    VOC boxes are 1-based inclusive pixel indices: ``xmin..xmax`` covers pixels xmin to
    xmax. In continuous 0-based coordinates that is ``[xmin - 1, xmax]`` (width
    ``xmax - xmin + 1``); likewise for y. This conversion happens here, once.
    """
    root = Path(root)
    split_file = root / "ImageSets" / "Main" / f"{split}.txt"
    ids = _voc_split_ids(split_file, issues)
    int_ids = voc_image_ids(ids)
    name_to_label = {name: i + 1 for i, name in enumerate(class_names)}
    records = []
    ann_counter = 0
    for vid, image_id in zip(ids, int_ids):
        if path_within(str(root / "JPEGImages"), f"{vid}.jpg") is None:
            issues.error(f"VOC split file {split_file}: image id {vid!r} resolves outside the year folder {root}")
            continue
        xml_path = root / "Annotations" / f"{vid}.xml"
        parsed = read_voc_xml(xml_path, issues.error)
        if parsed is None:
            continue
        width, height = parsed.size.width, parsed.size.height
        rows = []
        for j, obj in enumerate(parsed.objects):
            ann_counter += 1  # every object counts, kept or not
            if obj is None:  # reported by read_voc_xml
                continue
            row = _voc_object_row(obj, f"VOC annotation file {xml_path}: object {j}", width, height,
                                  name_to_label, drop_other_classes, ann_counter, issues)
            if row is not None:
                rows.append(row)
        records.append(ImageRecord(image_id=image_id, path=str(root / "JPEGImages" / f"{vid}.jpg"),
                                   width=width, height=height, **rows_to_arrays(rows)))
    return records


class VOCDetection(DetectionDataset):
    """A PASCAL VOC year folder (``VOCdevkit/VOC2007``): ``JPEGImages/``,
    ``Annotations/*.xml``, ``ImageSets/Main/<split>.txt``.

    Labels follow ``class_names`` (1..K); ``label_to_category_id`` is the identity.
    ``class_names`` None means VOC's 20 (another class in the XML is an error); a given
    list is a subset: objects of other classes are dropped and counted in the log, and
    with ``require_every_class`` (training) a listed class without a training box (an
    object; not only difficult ones, unless ``use_difficult``) is an error.
    ``difficult`` objects are flagged; they are trained on only with ``use_difficult``.
    Image ids: see ``voc_image_ids``.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        split: str,
        class_names: Optional[Sequence[str]] = None,
        transforms: Optional[Transform] = None,
        filter_empty: bool = False,
        use_difficult: bool = False,
        require_every_class: bool = False,
    ) -> None:
        subset = bool(class_names)
        class_names = list(class_names) if class_names else list(VOC_CLASSES)
        issues = Issues(strict=True)
        records = parse_voc(root, split, class_names, issues, drop_other_classes=subset)
        self.root = str(root)
        self.split = split
        if issues.skipped:
            logger.warning("%s (%s): skipped objects: %s", root, split, dict(issues.skipped))
        if issues.non_integer:
            logger.info("%s (%s): %d objects have non-integer <bndbox> coordinates, used as floats (first: %s)",
                        root, split, len(issues.non_integer), issues.non_integer[0])
        self.num_non_integer_boxes = len(issues.non_integer)
        if subset and require_every_class:
            _check_every_class(records, class_names, issues.other_classes, f"{root} ({split})", use_difficult)
        log_other_classes(f"{root} ({split})", class_names, issues.other_classes)
        super().__init__(records, class_names, {i + 1: i + 1 for i in range(len(class_names))},
                         transforms=transforms, use_difficult=use_difficult, filter_empty=filter_empty,
                         skipped=issues.skipped, source=f"{root} ({split})")


def _check_every_class(records: List[ImageRecord], class_names: Sequence[str], others: Counter, source: str,
                       use_difficult: bool) -> None:
    """A training set must hold a training box of every class of ``data.class_names``."""
    line = missing_class_line(*record_boxes(records), class_names, use_difficult, source, others)
    if line is not None:
        raise DataError(line)
