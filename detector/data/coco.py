"""COCO instances JSON: parsing (types checked against ``schema.py``'s declared
records, then ids and references checked here; see ``dataset.py`` for the bad-input
policy), the category-id <-> label map, and ``CocoDetection``. The generated
shapes set is written in this format and read by ``CocoDetection`` too."""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import logging
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import msgspec
from pycocotools.coco import COCO

from detector.messages import did_you_mean

from .dataset import (DetectionDataset, ImageRecord, Issues, Transform, check_box, drop_images_without_training_boxes,
                      log_other_classes, rows_to_arrays)
from .files import DataError, path_within
from .record_cache import ParsedRecords, RecordCache, load_or_parse
from .records import RecordStore
from .schema import CocoAnnotation, CocoCategory, CocoFile, CocoImage, read_coco

logger = logging.getLogger(__name__)


def _coco_subset(names_by_id: Dict[Any, str], class_names: Sequence[str], ann_file: str) -> List[Any]:
    """The category ids of ``class_names`` (category names), in that order.

    Raises:
        DataError: a name that is no category of ``ann_file`` (with the nearest one), or
            a name that two categories share.
    """
    ids_by_name: Dict[str, List[Any]] = {}
    for c, name in names_by_id.items():
        ids_by_name.setdefault(name, []).append(c)
    out = []
    for name in class_names:
        ids = ids_by_name.get(name, [])
        if not ids:
            hint = did_you_mean(name, ids_by_name)
            raise DataError(f"data.class_names: {name!r} is not a category name of {ann_file}{hint}")
        if len(ids) > 1:
            raise DataError(f"data.class_names: {name!r} names {len(ids)} categories of {ann_file} (ids {ids})")
        out.append(ids[0])
    return out


def _check_names_given(names_by_id: Dict[Any, str], cat_ids: Sequence[Any], ann_file: str) -> None:
    """Each category in use (``cat_ids``) has a name: labels are known by their names in
    results, per-class metrics, drawn pictures and the class checks. (A name two
    categories share is accepted: the class checks then compare by id order, see
    ``detector.data.classes``.)

    Raises:
        DataError: an empty name (a null one is the id as text).
    """
    for c in cat_ids:
        name = names_by_id[c]
        if not name.strip():
            raise DataError(f"annotation file {ann_file}: category id {c} has an empty name {name!r}; labels are "
                            "known by their names (results, per-class metrics, class checks): name it, or leave "
                            "'name' out to name it by its id")


# data.label_space=category_id: the largest id may exceed both bounds, not just one (COCO:
# 80 ids in use up to 90). Beyond them the id space is sparse (taxonomy or database ids)
# and the predictor would be mostly unused labels, or too big to build (ids near 2**40).
MAX_UNUSED_PER_CATEGORY = 10
# An annotation's 'area' may exceed its box's w * h by this factor (+1 px²) before
# coco_area calls it impossible: a mask's anti-aliased or rounded fringe reaches past the
# box (the shapes generator's by up to ~7 %); twice the box is no object's area.
AREA_SLACK = 2.0
MIN_SPARSE_CATEGORY_ID = 1000


def coco_label_map(
    names_by_id: Dict[Any, str], class_names: Optional[Sequence[str]], label_space: str, ann_file: str
) -> Tuple[List[str], Dict[int, int], List[Any]]:
    """Labels of the COCO categories ``names_by_id`` (category id -> name, sorted by id).

    Returns ``(class_names, label_to_category_id, cat_ids)``: ``class_names[label - 1]``
    names each label, ``cat_ids`` are the ids in use (as in the JSON, in label order):

    - ``contiguous``: the categories (sorted by id, or those of ``class_names`` in that
      order) are labels 1..K;
    - ``category_id``: label = category id, so there are ``max(id)`` labels; ids that are
      no category in use (undefined, or left out of ``class_names``) are named
      ``unused_<id>`` and are not in ``label_to_category_id`` (nor evaluated).

    Raises:
        DataError: a category in use with an empty name (``_check_names_given``);
            with ``category_id``, a category id in use that is not an integer >= 1,
            or ids so sparse that the labels would be mostly unused (the largest id above
            both ``MAX_UNUSED_PER_CATEGORY`` times the ids in use and ``MIN_SPARSE_CATEGORY_ID``).
    """
    cat_ids = _coco_subset(names_by_id, class_names, ann_file) if class_names else list(names_by_id)
    _check_names_given(names_by_id, cat_ids, ann_file)
    if label_space == "contiguous":
        return [names_by_id[c] for c in cat_ids], {i + 1: int(c) for i, c in enumerate(cat_ids)}, cat_ids
    for c in cat_ids:
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise DataError(f"annotation file {ann_file}: category {names_by_id[c]!r} has id {c!r}; "
                            f"data.label_space=category_id needs integer category ids >= 1")
    used = sorted(cat_ids)
    largest = max(used, default=0)
    if largest > max(MAX_UNUSED_PER_CATEGORY * len(used), MIN_SPARSE_CATEGORY_ID):
        raise DataError(f"annotation file {ann_file}: data.label_space=category_id makes one label per id up to the "
                        f"largest, {largest}, for {len(used)} categories in use (a predictor of {largest + 1} classes, "
                        f"mostly unused); use data.label_space=contiguous (labels 1..{len(used)}; results files keep "
                        "the category ids)")
    label_to_category_id = {c: c for c in used}
    names = [names_by_id[i] if i in label_to_category_id else f"unused_{i}" for i in range(1, max(used, default=0) + 1)]
    return names, label_to_category_id, used


def _coco_categories(categories_list: List[CocoCategory], ann_file: str, issues: Issues) -> Dict[int, CocoCategory]:
    """The ``categories`` entries by id (a repeated id: an error in ``issues``; the last wins)."""
    categories: Dict[int, CocoCategory] = {}
    for cat in categories_list:
        if cat.id in categories:
            issues.error(f"annotation file {ann_file}: category id {cat.id} appears twice in 'categories'")
        categories[cat.id] = cat
    return categories


def _coco_images(
    images: List[CocoImage], ann_file: str, image_dir: str | os.PathLike, issues: Issues
) -> Tuple[List[CocoImage], Dict[int, str]]:
    """The valid ``images`` entries (types and sizes already checked by the schema):
    whole-number sizes (``81.0`` is 81), ``file_name`` inside ``image_dir``, unique id (pycocotools would silently keep the
    last one), a file no other entry names (two entries of one image, as merging two
    annotation jobs leaves them, would each train the other's boxes as background).
    Each invalid entry is an error in ``issues`` and left out.

    Returns ``(good_images, seen)``: the valid entries in file order, and their
    ``file_name`` by image id.
    """
    seen: Dict[int, str] = {}
    by_file: Dict[str, int] = {}
    good_images = []
    for img in images:
        if "\x00" in img.file_name:  # no file system takes one (os calls raise ValueError)
            issues.error(f"annotation file {ann_file}: image_id {img.id}: file_name {img.file_name!r} holds a NUL "
                         "byte, which no file name can")
            continue
        path = path_within(str(image_dir), img.file_name)
        if path is None:
            issues.error(f"annotation file {ann_file}: image_id {img.id}: file_name {img.file_name!r} "
                         f"resolves outside the image root {image_dir}")
            continue
        fractional = [f"{k} {v}" for k, v in (("width", img.width), ("height", img.height)) if v != int(v)]
        if fractional:  # int() would cut it: an 81.5 px wide image would pass as 81
            issues.error(f"annotation file {ann_file}: image_id {img.id}: {fractional[0]} is not a whole number "
                         "of pixels")
            continue
        if img.id in seen:
            issues.error(f"annotation file {ann_file}: image_id {img.id} appears twice "
                         f"({seen[img.id]!r} and {img.file_name!r})")
            continue
        # realpath: 'sub/../x.jpg', and a link to x.jpg, are x.jpg too
        first = by_file.setdefault(os.path.realpath(path), img.id)
        if first != img.id:
            other = seen[first]
            named = repr(other) if other == img.file_name else f"{other!r} (as {img.file_name!r})"
            issues.error(f"annotation file {ann_file}: image_ids {first} and {img.id} both name the file "
                         f"{named}: one image takes one entry (each entry's boxes would be background to "
                         "the other); merge their annotations")
            continue
        seen[img.id] = img.file_name
        good_images.append(img)
    return good_images, seen


def _coco_annotations(
    annotations: List[CocoAnnotation],
    ann_file: str,
    seen: Dict[int, str],
    category_id_to_label: Dict[int, int],
    names_by_id: Dict[int, str],
    issues: Issues,
) -> Tuple[Dict[int, list], List[CocoAnnotation]]:
    """The valid ``annotations`` entries (types checked by the schema): a unique ``id``,
    an ``image_id`` of ``seen`` (the valid images) and a ``category_id`` in use. Each
    invalid entry is an error in ``issues`` and left out; an annotation of a category
    left out of ``data.class_names`` is counted by name in ``issues.other_classes`` and
    left out.

    Returns ``(anns_by_image, good_anns)``: the valid entries by image id (every id of
    ``seen``, in its order) and in file order.
    """
    anns_by_image: Dict[int, list] = {image_id: [] for image_id in seen}
    good_anns = []
    ann_ids: set = set()
    for ann in annotations:
        if ann.id in ann_ids:
            issues.error(f"annotation file {ann_file}: annotation id {ann.id} appears twice")
            continue
        ann_ids.add(ann.id)
        if ann.image_id not in seen:  # the keys of anns_by_image
            issues.error(f"annotation file {ann_file}: annotation id {ann.id}: image_id {ann.image_id} is not in 'images'")
            continue
        if ann.category_id not in category_id_to_label:
            if ann.category_id in names_by_id:  # a category left out of data.class_names
                issues.other_classes[names_by_id[ann.category_id]] += 1
            else:
                issues.error(f"annotation file {ann_file}: annotation id {ann.id}: "
                             f"category_id {ann.category_id} is not in 'categories'")
            continue
        anns_by_image[ann.image_id].append(ann)
        good_anns.append(ann)
    return anns_by_image, good_anns


def _coco_records(
    good_images: List[CocoImage],
    anns_by_image: Dict[int, List[CocoAnnotation]],
    category_id_to_label: Dict[int, int],
    image_dir: str | os.PathLike,
    ann_file: str,
    issues: Issues,
) -> List[ImageRecord]:
    """One ``ImageRecord`` per valid image, in order: each ``[x, y, w, h]`` becomes
    ``[x, y, x + w, y + h]`` and goes through :func:`check_box` (skips and clips counted in
    ``issues``); area is the annotation's positive ``area``, else ``w * h``."""
    records, replaced = [], []
    image_dir = str(image_dir)
    for img in good_images:
        width, height = int(img.width), int(img.height)
        rows = []
        for ann in anns_by_image[img.id]:
            x, y, w, h = ann.bbox
            box = check_box((x, y, x + w, y + h), width, height,
                            f"annotation file {ann_file}: annotation id {ann.id} (image_id {img.id})", issues)
            if box is None:
                continue
            area = coco_area(ann.area, w, h)
            if ann.area is not None and area != ann.area:
                replaced.append((ann.id, ann.area, w, h))
            rows.append((box, category_id_to_label[ann.category_id], bool(ann.iscrowd),
                         bool(ann.difficult or ann.ignore and not ann.iscrowd), ann.id, area))
        arrays = rows_to_arrays(rows)
        records.append(ImageRecord(image_id=img.id, path=path_within(image_dir, img.file_name),
                                   width=width, height=height, **arrays))
    if replaced:
        logger.warning("%s", area_warning(ann_file, replaced))
    return records


def coco_area(area: Optional[float], w: float, h: float) -> float:
    """The area COCO evaluation files a box under (its small / medium / large ranges, and
    the "all" range of ``[0, 1e10]`` px²): the annotation's ``area`` where it can be the
    area of an object in a ``w`` x ``h`` box (finite, > 0, at most ``w * h`` with
    ``AREA_SLACK`` for rounding), else ``w * h``. An area of -1 or of 1e11 (another unit)
    would otherwise put the box outside every range: ignored, silently, in every AP."""
    box = float(w) * float(h)
    if area is None or not math.isfinite(area) or area <= 0 or area > box * AREA_SLACK + 1.0:
        return box
    return float(area)


def area_warning(source: str, replaced: Sequence[Tuple[Any, float, float, float]]) -> str:
    """One line for the annotations whose ``area`` ``coco_area`` replaced: ``(id, area,
    w, h)`` each."""
    ann_id, area, w, h = replaced[0]
    return (f"{source}: {len(replaced)} annotation(s) have an 'area' no object in their box can have (annotation "
            f"id {ann_id}: area {area:g} in a {w:g} x {h:g} box); the box area w * h is used in their place")


def parse_coco(
    ann_file: str | os.PathLike,
    image_dir: str | os.PathLike,
    issues: Issues,
    class_names: Optional[Sequence[str]] = None,
    label_space: str = "contiguous",
) -> Tuple[List[ImageRecord], List[str], Dict[int, int], CocoFile]:
    """Parse a COCO instances JSON (checked against ``schema.py``'s types, then its ids
    and references) into image records.

    Returns ``(records, class_names, label_to_category_id, entries)``: labels as
    :func:`coco_label_map` gives them for ``label_space``; ``entries`` the valid images
    and annotations and the categories in use (for :func:`coco_index`, which
    pycocotools would not check: it silently keeps the last of two equal ids).
    ``[x, y, w, h]`` becomes ``[x, y, x + w, y + h]``.

    ``class_names`` (category names, e.g. ``data.class_names``) keeps those categories
    only; annotations of the other categories are dropped and counted by name in
    ``issues.other_classes``.
    """
    ann_file = str(ann_file)
    data = read_coco(ann_file, issues.error)

    # Categories -> labels (see coco_label_map).
    categories = _coco_categories(data.categories, ann_file, issues)
    names_by_id = {c: categories[c].name if categories[c].name is not None else str(c) for c in sorted(categories)}
    class_names, label_to_category_id, cat_ids = coco_label_map(names_by_id, class_names, label_space, ann_file)
    category_id_to_label = {c: lab for lab, c in label_to_category_id.items()}

    good_images, seen = _coco_images(data.images, ann_file, image_dir, issues)
    anns_by_image, good_anns = _coco_annotations(data.annotations, ann_file, seen, category_id_to_label,
                                                 names_by_id, issues)

    entries = CocoFile(images=good_images, categories=[categories[c] for c in cat_ids], annotations=good_anns)
    records = _coco_records(good_images, anns_by_image, category_id_to_label, image_dir, ann_file, issues)
    return records, class_names, label_to_category_id, entries


def coco_index(entries: CocoFile) -> COCO:
    """pycocotools' index over validated entries (:func:`parse_coco`'s), their declared
    fields only; an ``area`` the file leaves out (or null) is left out."""
    coco = COCO()
    coco.dataset = msgspec.to_builtins(entries)
    for ann in coco.dataset["annotations"]:
        if ann["area"] is None:
            del ann["area"]
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def _coco_parsed(ann_file: str, image_dir: str, class_names: Optional[Sequence[str]], label_space: str,
                 filter_empty: bool, use_difficult: bool) -> ParsedRecords:
    """``parse_coco``'s records in a ``RecordStore``, with ``filter_empty`` applied (see
    ``drop_images_without_training_boxes``), and its other results as JSON-able ``meta``:
    ``class_names``, ``label_to_category_id`` and the counts ``skipped`` and
    ``other_classes`` as ``[key, value]`` pairs, ``images_before_filter``."""
    issues = Issues(strict=True)
    records, names, label_to_cat, _ = parse_coco(ann_file, image_dir, issues, class_names, label_space)
    store = RecordStore.from_records(records)
    before = len(store)
    del records
    if filter_empty:
        store = drop_images_without_training_boxes(store, use_difficult)
    meta = {"class_names": names, "label_to_category_id": [[int(k), int(v)] for k, v in label_to_cat.items()],
            "skipped": [[k, n] for k, n in issues.skipped.items()],
            "other_classes": [[k, n] for k, n in issues.other_classes.items()], "images_before_filter": before}
    return ParsedRecords(store, meta)


class CocoDetection(DetectionDataset):
    """A COCO instances JSON plus an image folder.

    Category ids (any, e.g. 1, 7, 90) map to contiguous labels 1..K in id order and back
    (``label_to_category_id``). ``iscrowd`` boxes are kept for evaluation, not trained on.

    Args:
        image_dir: folder holding the ``file_name`` of each image.
        ann_file: the instances JSON.
        transforms: callable applied to (image, boxes, labels); None = no resize.
        filter_empty: drop images without a trainable box.
        class_names: category names to keep, as labels 1..K in this order (a subset;
            the other categories' boxes are dropped and counted in the log); None = all.
        label_space: ``contiguous`` (labels 1..K) or ``category_id`` (label = category
            id; see :func:`coco_label_map`).
        cache: share the parsed records through a record file (``record_cache.py``,
            ``data.cache_dir``); None parses here. With a cache in a distributed run,
            every rank must build the data set (a collective).
    """

    def __init__(
        self,
        image_dir: str | os.PathLike,
        ann_file: str | os.PathLike,
        transforms: Optional[Transform] = None,
        filter_empty: bool = False,
        use_difficult: bool = False,
        class_names: Optional[Sequence[str]] = None,
        label_space: str = "contiguous",
        cache: Optional[RecordCache] = None,
    ) -> None:
        self._class_subset = list(class_names) if class_names else None
        self.label_space = label_space
        self.image_dir = str(image_dir)
        self.ann_file = str(ann_file)
        options = {"dataset": type(self).__name__, "image_dir": self.image_dir, "class_names": self._class_subset,
                   "label_space": label_space, "filter_empty": bool(filter_empty), "use_difficult": bool(use_difficult)}
        parsed = load_or_parse(cache, ann_file, options, lambda: _coco_parsed(
            self.ann_file, self.image_dir, self._class_subset, label_space, filter_empty, use_difficult))
        meta = parsed.meta
        names, skipped = meta["class_names"], collections.Counter(dict(meta["skipped"]))
        label_to_cat = {int(lab): int(cat) for lab, cat in meta["label_to_category_id"]}
        if skipped:
            logger.warning("%s: skipped annotations: %s", ann_file, dict(skipped))
        log_other_classes(self.ann_file, [names[lab - 1] for lab in label_to_cat],
                          collections.Counter(dict(meta["other_classes"])))
        super().__init__(parsed.store, names, label_to_cat, transforms=transforms, use_difficult=use_difficult,
                         filter_empty=filter_empty, skipped=skipped, source=self.ann_file,
                         images_before_filter=meta["images_before_filter"])

    @functools.cached_property
    def coco(self) -> COCO:
        """pycocotools' index over the validated annotations, built on first use (the
        file read again: on COCO train it would cost seconds and GBs that training
        does not need)."""
        issues = Issues(strict=True, log_skips=False)
        return coco_index(parse_coco(self.ann_file, self.image_dir, issues, self._class_subset, self.label_space)[3])
