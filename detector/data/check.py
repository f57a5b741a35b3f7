"""Data set checker (``tools/check_dataset.py``): reads annotations without stopping at the
first problem, decodes every image, and reports counts and findings.

Errors (exit status 1): an unreadable annotation file, duplicate image ids, unknown
image or category ids, malformed boxes, boxes with non-positive size, wholly outside
their image or extending more than ``PAST_EDGE_TOLERANCE`` px past its edge, missing or
undecodable image files, and images whose decoded size differs from the annotation.
Information only: images without annotations, crowd and difficult counts, histograms.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from detector.config import Config, ConfigError
from detector.files import missing_file_state
from detector.messages import first_line

from .build import build_dataset, check_data_paths, split_sources
from .concat import file_in_two_sets
from .classes import check_val_classes, resolve_class_names
from .coco import parse_coco
from .dataset import (ImageRecord, Issues, fraction_coordinates_problem, missing_class_line, other_classes_text,
                      record_boxes)
from .files import DataError, decode_image
from .voc import VOC_CLASSES, parse_voc

logger = logging.getLogger(__name__)

SIZE_BINS = (0, 128, 256, 384, 512, 640, 800, 1024, 1333)  # sqrt(w * h) of images, pixels
ASPECT_BINS = (0.0, 0.5, 0.75, 1.0, 1.333, 2.0)  # w / h
MAX_LISTED = 20  # findings printed per kind


@dataclass
class CheckReport:
    source: str
    num_images: int = 0
    num_boxes: int = 0
    per_class: Dict[str, int] = field(default_factory=dict)
    num_crowd: int = 0
    num_difficult: int = 0
    images_without_annotations: int = 0
    degenerate_boxes: int = 0
    outside_boxes: int = 0
    past_edge_boxes: int = 0
    non_integer_boxes: int = 0  # VOC boxes with fractional coordinates: accepted, reported
    non_integer_examples: List[str] = field(default_factory=list)
    exif_rotated: List[str] = field(default_factory=list)  # EXIF orientation 2..8, read as stored (warning)
    multi_frame: List[str] = field(default_factory=list)  # animations, multi-page files: the first frame read (warning)
    apply_exif: bool = False
    classes_from: str = ""  # --split val: whose class names label the boxes (the training set's, as in training)
    other_classes: Dict[str, int] = field(default_factory=dict)  # boxes outside data.class_names, dropped
    missing_files: List[str] = field(default_factory=list)
    unreadable_files: List[str] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)  # every error message, in order found
    size_hist: Dict[str, int] = field(default_factory=dict)
    aspect_hist: Dict[str, int] = field(default_factory=dict)
    box_size_hist: Dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors


def _histogram(values: Sequence[float], edges: Sequence[float], fmt: str = "{:g}") -> Dict[str, int]:
    labels = [f"[{fmt.format(a)}, {fmt.format(b)})" for a, b in zip(edges[:-1], edges[1:])] + [f">= {fmt.format(edges[-1])}"]
    counts = Counter()
    for v in values:
        i = sum(1 for e in edges[1:] if v >= e)
        counts[labels[i]] += 1
    return {lab: counts.get(lab, 0) for lab in labels}


def describe_source(cfg: Config, split: str) -> str:
    """The files the checker reads for ``cfg.data.<split>``, for the report's header."""
    data = cfg.data
    sc = getattr(data, split)
    if data.format == "coco":
        return f"COCO {sc.ann_file}, images in {sc.root}"
    if data.format == "voc":
        return (f"VOC year folder {sc.root}: ImageSets/Main/{sc.split or split}.txt, Annotations/*.xml, "
                f"JPEGImages/")
    if data.format == "shapes":
        name = sc.split or split
        return f"shapes {os.path.join(sc.root, f'{name}.json')}, images in {os.path.join(sc.root, name)}"
    return f"data.format {data.format!r}"


def _records_for(cfg: Config, split: str, issues: Issues) -> Tuple[List[ImageRecord], Dict[int, str]]:
    """The records of ``cfg.data.<split>`` and the name of each label in use, as training reads them."""
    data = cfg.data
    sc = getattr(data, split)
    subset = list(data.class_names) or None  # a class subset: other classes are dropped, as in training
    if data.format == "coco":
        records, names, label_to_cat, _ = parse_coco(sc.ann_file, sc.root, issues, subset, data.label_space)
        return records, {lab: names[lab - 1] for lab in label_to_cat}
    if data.format == "voc":
        names = subset or list(VOC_CLASSES)
        records = parse_voc(sc.root, sc.split or split, names, issues, drop_other_classes=bool(subset))
        return records, dict(enumerate(names, start=1))
    if data.format == "shapes":
        name = sc.split or split
        ann_file = os.path.join(sc.root, f"{name}.json")  # data.<split>.ann_file is COCO's key, not read here
        records, names, label_to_cat, _ = parse_coco(ann_file, os.path.join(sc.root, name), issues, subset,
                                                     data.label_space)
        return records, {lab: names[lab - 1] for lab in label_to_cat}
    raise ValueError(f"data.format must be coco, voc or shapes, got {data.format!r}")


def val_as_in_training(cfg: Config) -> Tuple[Config, List[str], str]:
    """How training reads the val set of COCO-format data (coco, shapes): by the training
    set's class names (``resolve_class_names``), once the val file has each of them
    (``check_val_classes``). Returns ``(cfg to read the val set with, errors found, a line
    saying whose classes label its boxes)``. Where the training set cannot be read, or
    the val file fails the check, the val set is read by its own categories."""
    if cfg.data.format not in ("coco", "shapes"):
        return cfg, [], ""
    try:
        check_data_paths(cfg, "val")
    except (DataError, ConfigError):
        return cfg, [], ""  # check_dataset reports it
    no_cache = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_dir=""))
    try:
        train_set = build_dataset(no_cache, "train", True)
    except (DataError, ConfigError, FileNotFoundError, OSError) as exc:
        return cfg, [], (f"this file's own categories (the training set could not be read, so training's class "
                         f"check was not made: {first_line(exc)})")
    as_trained = resolve_class_names(no_cache, train_set)
    try:
        check_val_classes(as_trained, train_set)
    except DataError as exc:
        return cfg, [str(exc)], "this file's own categories (it fails training's class check: see ERRORS)"
    pinned = "" if cfg.data.class_names else " (as training pins them in data.class_names)"
    return (dataclasses.replace(cfg, data=as_trained.data), [],
            f"the training set's ({train_set.source}), by name{pinned}")


def _check_image_file(report: CheckReport, r: ImageRecord, decode: bool, apply_exif: bool) -> None:
    """The image file of ``r`` exists (and, with ``decode``, decodes to the annotated size);
    findings go into ``report``."""
    if not decode:
        if not os.path.isfile(r.path):
            report.missing_files.append(r.path)
            report.errors.append(f"image file {r.path} (image_id {r.image_id}) {missing_file_state(r.path)}")
        return
    try:
        image, orientation, frames = decode_image(r.path, r.image_id, apply_exif)
    except FileNotFoundError as exc:
        report.missing_files.append(r.path)
        report.errors.append(str(exc))
        return
    except DataError as exc:
        report.unreadable_files.append(r.path)
        report.errors.append(str(exc))
        return
    if orientation not in (0, 1):
        report.exif_rotated.append(f"{r.path} (orientation {orientation})")
    if frames > 1:
        report.multi_frame.append(f"{r.path} ({frames} frames)")
    if image.shape[:2] != (r.height, r.width):
        report.errors.append(f"image file {r.path} (image_id {r.image_id}) is {image.shape[1]}x{image.shape[0]} "
                             f"but its annotation says {r.width}x{r.height}")


def check_dataset(cfg: Config, split: str = "train", decode: bool = True) -> CheckReport:
    """Check ``cfg.data.<split>``; never raises on bad data, reports it instead. The val
    set is read as training reads it (``val_as_in_training``)."""
    report, records = _check_one(cfg, split, decode)
    if split == "train":
        _check_every_class(report, cfg, records, report.source)
    return report


def _check_one(cfg: Config, split: str, decode: bool) -> Tuple[CheckReport, List[ImageRecord]]:
    """``check_dataset``'s report (without ``_check_every_class``), and the records read."""
    issues = Issues(strict=False, log_skips=False)
    source = describe_source(cfg, split)
    class_errors: List[str] = []
    classes_from = ""
    if split == "val":
        cfg, class_errors, classes_from = val_as_in_training(cfg)
    try:
        check_data_paths(cfg, split)  # an empty or missing path: one line naming its key
        records, class_names = _records_for(cfg, split, issues)
    except (DataError, FileNotFoundError, OSError) as exc:
        return CheckReport(source=source, classes_from=classes_from, errors=class_errors + [str(exc)]), []
    report = CheckReport(source=source, num_images=len(records), apply_exif=cfg.data.apply_exif,
                         classes_from=classes_from, errors=list(class_errors))
    report.errors.extend(issues.errors)
    problem = fraction_coordinates_problem(records, source)
    if problem is not None:
        report.errors.append(problem)
    report.degenerate_boxes = issues.skipped.get("degenerate", 0)
    report.outside_boxes = issues.skipped.get("outside", 0)
    report.past_edge_boxes = len(issues.past_edge)
    report.non_integer_boxes = len(issues.non_integer)
    report.non_integer_examples = issues.non_integer[:MAX_LISTED]
    report.other_classes = dict(issues.other_classes.most_common())
    report.errors.extend(m for m in issues.skip_messages)
    report.errors.extend(issues.past_edge)

    per_class: Counter = Counter()
    box_sizes = []
    for r in records:
        report.num_boxes += len(r.labels)
        report.num_crowd += int(r.iscrowd.sum())
        report.num_difficult += int(r.difficult.sum())
        if len(r.labels) == 0:
            report.images_without_annotations += 1
        for lab in r.labels.tolist():
            per_class[class_names[lab]] += 1
        box_sizes.extend(((r.boxes[:, 2] - r.boxes[:, 0]) * (r.boxes[:, 3] - r.boxes[:, 1])).tolist())
        _check_image_file(report, r, decode, cfg.data.apply_exif)
    report.per_class = {name: per_class.get(name, 0) for name in class_names.values()}
    report.size_hist = _histogram([math.sqrt(r.width * r.height) for r in records], SIZE_BINS)
    report.aspect_hist = _histogram([r.width / r.height for r in records], ASPECT_BINS)
    report.box_size_hist = {
        "small (< 32^2)": sum(1 for a in box_sizes if a < 32**2),
        "medium": sum(1 for a in box_sizes if 32**2 <= a < 96**2),
        "large (>= 96^2)": sum(1 for a in box_sizes if a >= 96**2),
    }
    return report, records


def check_datasets(cfg: Config, split: str = "train", decode: bool = True) -> List[CheckReport]:
    """``check_dataset`` of each set that ``split`` reads, one report each: ``data.val``;
    ``data.train`` and each ``data.train_extra`` entry, whose source line names its key;
    an extra set whose classes differ from ``data.train``'s (training refuses it) holds
    that error, and so does the second set holding an image file of an earlier one (the
    same set listed twice). A missing path of any set: one report holding that error."""
    if split == "val" or not cfg.data.train_extra:
        return [check_dataset(cfg, split, decode)]
    try:
        check_data_paths(cfg, split)
    except (DataError, ConfigError) as exc:
        return [CheckReport(source=describe_source(cfg, split), errors=[str(exc)])]
    sources = split_sources(cfg, split)
    checked = [_check_one(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train=sc, train_extra=[])),
                          split, decode) for _, sc in sources]
    reports = [report for report, _ in checked]
    first = list(reports[0].per_class)
    for (key, _), report in zip(sources, reports):
        report.source = f"{key}: {report.source}"
        if list(report.per_class) != first:
            report.errors.append(f"{key}: its classes {list(report.per_class)} are not data.train's {first} (one "
                                 "label, one class: training refuses them); set data.class_names")
    twice = file_in_two_sets([(key, [r.path for r in records]) for (key, _), (_, records) in zip(sources, checked)])
    if twice is not None:
        reports[[key for key, _ in sources].index(twice[0])].errors.append(twice[1])
    _check_every_class(reports[0], cfg, [r for _, records in checked for r in records],
                       f"the training sets ({', '.join(key for key, _ in sources)})")
    return reports


def _check_every_class(report: CheckReport, cfg: Config, records: Sequence[ImageRecord], where: str) -> None:
    """Training's rule for a VOC class subset (``data.class_names``): each class has a
    training box in the training set, or, joined, in the training sets; else the error
    training raises goes into ``report``."""
    if cfg.data.format != "voc" or not cfg.data.class_names:
        return
    line = missing_class_line(*record_boxes(records), cfg.data.class_names, cfg.data.use_difficult, where,
                              report.other_classes)
    if line is not None:
        report.errors.append(line)


def format_report(report: CheckReport) -> str:
    """Human-readable report text."""
    lines = [f"data set: {report.source}",
             f"images: {report.num_images}   boxes: {report.num_boxes} (crowd {report.num_crowd}, "
             f"difficult {report.num_difficult})   images without annotations: {report.images_without_annotations}"]
    if report.classes_from:
        lines.append(f"classes: {report.classes_from}")
    if report.per_class:
        lines.append("boxes per class:")
        width = max(len(n) for n in report.per_class)
        lines += [f"  {name:<{width}}  {count}" for name, count in report.per_class.items()]
    if report.other_classes:
        lines.append(f"boxes of classes outside data.class_names (dropped in training): "
                     f"{sum(report.other_classes.values())} ("
                     f"{other_classes_text(list(report.per_class), Counter(report.other_classes))})")
    for title, hist in (("image size sqrt(w*h)", report.size_hist), ("aspect ratio w/h", report.aspect_hist),
                        ("box area", report.box_size_hist)):
        if hist:
            lines.append(f"{title}: " + ", ".join(f"{k}: {v}" for k, v in hist.items()))
    lines.append(f"degenerate boxes: {report.degenerate_boxes}   boxes outside the image: {report.outside_boxes}   "
                 f"boxes past the edge: {report.past_edge_boxes}")
    if report.non_integer_boxes:
        lines.append(f"boxes with non-integer coordinates (accepted as floats): {report.non_integer_boxes}")
        lines += [f"  {m}" for m in report.non_integer_examples[:3]]
    if report.exif_rotated:
        how = ("turned as displayed (data.apply_exif=true)" if report.apply_exif else
               "WARNING: read as stored, so boxes drawn on the displayed image are wrong; set data.apply_exif=true "
               "if they were")
        lines.append(f"images with an EXIF orientation: {len(report.exif_rotated)}, {how}")
        lines += [f"  {m}" for m in report.exif_rotated[:3]]
    if report.multi_frame:
        lines.append(f"WARNING: image files of several frames (animations, multi-page files), of which the first is "
                     f"read: {len(report.multi_frame)}")
        lines += [f"  {m}" for m in report.multi_frame[:3]]
    lines.append(f"missing image files: {len(report.missing_files)}   unreadable image files: {len(report.unreadable_files)}")
    if report.errors:
        lines.append(f"ERRORS: {len(report.errors)}")
        lines += [f"  {m}" for m in report.errors[:MAX_LISTED]]
        if len(report.errors) > MAX_LISTED:
            lines.append(f"  ... and {len(report.errors) - MAX_LISTED} more")
    else:
        lines.append("OK: no errors found")
    return "\n".join(lines)
