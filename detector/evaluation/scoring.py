"""Score detections against ground truth with every metric, and write the results.

:func:`score_detections` is the model-free core shared by :func:`detector.evaluation.evaluate`
(after inference) and the file mode of ``tools/eval.py``; :func:`write_outputs` writes
``metrics.json``, ``detections.json``, ``per_class.csv``, ``pr_curves.png`` and
``confusion_matrix.png``; :func:`format_table` renders the console table.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .coco import COCO_METRIC_NAMES, coco_evaluate
from .iou import confusion_matrix, iou_metrics
from .plots import plot_confusion_matrix, plot_pr_curves
from .records import group_by_image
from .results import (
    Detections,
    ResultsError,
    as_detections,
    check_detection_ids,
    check_ground_truth,
    detections_from_records,
    read_json_text,
    read_results_file,
    write_results_file,
)
from .voc import VOCClassResult, mean_ap, voc_evaluate

logger = logging.getLogger(__name__)


@dataclass
class ScoreReport:
    """Everything :func:`score_detections` measured.

    Attributes:
        metrics: flat name -> value: the 12 COCO numbers, ``mAP_voc07``, ``mAP_voc_area``,
            the IoU metrics of :func:`detector.evaluation.iou.iou_metrics`.
        per_class: one row per category: ``category_id, name, num_gt, num_det, AP, AP50,
            AP_voc07, AP_voc_area``.
        voc: category id -> VOC result (precision-recall curve).
        confusion: [K+1, K+1] counts, index 0 background.
        cat_ids, class_names: category order (sorted ids) and their names.
    """

    metrics: Dict[str, float]
    per_class: List[Dict[str, Any]]
    voc: Dict[int, VOCClassResult]
    confusion: np.ndarray
    cat_ids: List[int]
    class_names: List[str]
    extras: Dict[str, Any] = field(default_factory=dict)


def score_detections(
    gt: Dict[str, Any],
    results: Any,
    backend: str = "pycocotools",
    voc_iou_thresh: float = 0.5,
    score_thresh: float = 0.5,
    voc07_thresholds: str = "exact",
) -> ScoreReport:
    """COCO, VOC and IoU metrics of COCO-format ``results`` against a COCO-format ``gt``.

    Args:
        gt: ground truth in original coordinates (``difficult``/``ignore`` flags used by
            the VOC and IoU metrics; COCO metrics follow pycocotools, which only ignores
            ``iscrowd``).
        results: COCO results list (image and category ids of ``gt``), or
            :class:`~detector.evaluation.results.Detections`.
        backend: COCO backend, ``pycocotools`` or ``faster``.
        voc_iou_thresh: IoU threshold of VOC AP.
        score_thresh: detections below it are left out of the IoU metrics and the
            confusion matrix (all detections count for AP).
        voc07_thresholds: recall levels of the VOC07 11-point AP, ``exact`` or
            ``numpy_arange`` (the peers'; see :func:`detector.evaluation.voc.voc07_recall_levels`).

    Raises:
        ResultsError (a ValueError): a malformed gt or results record, named by index
            and field; ``UnknownImageError`` for a result whose image id the ground
            truth lacks.
    """
    image_ids, gt_cat_ids = check_ground_truth(gt)
    dets = as_detections(results)
    check_detection_ids(dets, image_ids, gt_cat_ids)
    coco = coco_evaluate(gt, dets, backend=backend, check=False)
    cats = sorted(gt["categories"], key=lambda c: c["id"])
    cat_ids = [int(c["id"]) for c in cats]
    names = [str(c.get("name", c["id"])) for c in cats]
    voc = voc_evaluate(gt, dets, voc_iou_thresh, voc07_thresholds)
    records = group_by_image(gt, dets)
    metrics: Dict[str, float] = dict(coco.metrics)
    metrics["mAP_voc07"] = mean_ap(voc, "voc07")
    metrics["mAP_voc_area"] = mean_ap(voc, "area")
    metrics.update(iou_metrics(records.values(), score_thresh=score_thresh))
    confusion = confusion_matrix(records.values(), cat_ids, score_thresh=score_thresh, iou_thresh=0.5)
    ids, counts = np.unique(dets.category_id, return_counts=True)
    num_det = {c: 0 for c in cat_ids}
    num_det.update(zip(ids.tolist(), counts.tolist()))
    per_class = []
    for cat, name in zip(cat_ids, names):
        per_class.append(
            {
                "category_id": cat,
                "name": name,
                "num_gt": voc[cat].num_gt,
                "num_det": num_det[cat],
                "AP": coco.per_class_ap.get(cat, -1.0),
                "AP50": coco.per_class_ap50.get(cat, -1.0),
                "AP_voc07": voc[cat].ap_voc07,
                "AP_voc_area": voc[cat].ap_area,
            }
        )
    return ScoreReport(metrics, per_class, voc, confusion, cat_ids, names)


# --------------------------------------------------------------------------- output


def _json_safe(value: Any) -> Any:
    """nan/inf -> None (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: str | Path, data: Any) -> Path:
    """Write JSON atomically-enough for results (temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_json_safe(data), indent=1, allow_nan=False))
    tmp.replace(path)
    return path


def write_outputs(
    report: ScoreReport,
    results: Any,
    output_dir: str | Path,
    extra_metrics: Optional[Dict[str, float]] = None,
) -> Dict[str, Path]:
    """Write ``metrics.json`` (the flat metrics dict), ``detections.json`` (COCO
    results; ``results`` a list or Detections), ``per_class.csv``, ``pr_curves.png``
    and ``confusion_matrix.png``."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics = dict(report.metrics)
    metrics.update(extra_metrics or {})
    paths = {
        "metrics": write_json(out / "metrics.json", metrics),
        "detections": write_results_file(out / "detections.json", as_detections(results)),
    }
    csv_path = out / "per_class.csv"
    with csv_path.open("w", newline="") as f:
        fields = ["category_id", "name", "num_gt", "num_det", "AP", "AP50", "AP_voc07", "AP_voc_area"]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in report.per_class:
            writer.writerow({k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in row.items()})
    paths["per_class"] = csv_path
    curves = {
        name: (report.voc[c].recall, report.voc[c].precision, report.voc[c].ap_area)
        for c, name in zip(report.cat_ids, report.class_names)
    }
    paths["pr_curves"] = plot_pr_curves(curves, out / "pr_curves.png", title="Precision-recall per class (VOC matching)",
                                         ap_kind="VOC area AP")
    paths["confusion_matrix"] = plot_confusion_matrix(report.confusion, report.class_names, out / "confusion_matrix.png")
    return paths


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "   nan" if math.isnan(v) else f"{v:6.3f}"
    return str(v)


def format_table(metrics: Dict[str, float], per_class: Sequence[Dict[str, Any]] = ()) -> str:
    """A readable multi-line table of the metrics and the per-class AP."""
    lines = ["COCO bbox (IoU 0.50:0.95 unless noted; -1 = no ground truth in range)"]
    labels = {
        "AP": "AP      @[.50:.95] all   maxDets=100",
        "AP50": "AP      @[.50]     all   maxDets=100",
        "AP75": "AP      @[.75]     all   maxDets=100",
        "APs": "AP      @[.50:.95] small maxDets=100",
        "APm": "AP      @[.50:.95] med.  maxDets=100",
        "APl": "AP      @[.50:.95] large maxDets=100",
        "AR1": "AR      @[.50:.95] all   maxDets=1",
        "AR10": "AR      @[.50:.95] all   maxDets=10",
        "AR100": "AR      @[.50:.95] all   maxDets=100",
        "ARs": "AR      @[.50:.95] small maxDets=100",
        "ARm": "AR      @[.50:.95] med.  maxDets=100",
        "ARl": "AR      @[.50:.95] large maxDets=100",
    }
    for name in COCO_METRIC_NAMES:
        if name in metrics:
            lines.append(f"  {name:<6} {labels[name]:<38} {metrics[name]:.10f}")
    rest = [k for k in metrics if k not in COCO_METRIC_NAMES]
    if rest:
        lines.append("Other metrics")
        for k in rest:
            lines.append(f"  {k:<22} {_fmt(metrics[k]).strip()}")
    if per_class:
        width = max(8, max(len(str(r["name"])) for r in per_class))
        lines.append("Per class (AP, AP50: COCO AP @[.50:.95] and @.50; VOC07: 11-point; VOCarea: VOC area AP)")
        head = f"  {'class':<{width}} {'id':>5} {'gt':>6} {'dets':>7} {'AP':>6} {'AP50':>6} {'VOC07':>6} {'VOCarea':>7}"
        lines.append(head)
        for r in per_class:
            lines.append(
                f"  {str(r['name']):<{width}} {r['category_id']:>5} {r['num_gt']:>6} {r['num_det']:>7} "
                f"{_fmt(r['AP'])} {_fmt(r['AP50'])} {_fmt(r['AP_voc07'])} {_fmt(r['AP_voc_area']):>7}"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------- files


def load_json_file(path: str | Path, what: str) -> Any:
    try:
        return json.loads(read_json_text(path, what))
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not valid JSON ({exc})") from None


def load_ground_truth(path: str | Path) -> Dict[str, Any]:
    """A COCO-format ground-truth JSON file, checked (errors name the file, the
    section, the index and the field)."""
    gt = load_json_file(path, "annotations")
    check_ground_truth(gt, source=str(path))
    return gt


def load_predictions(path: str | Path, gt: Dict[str, Any]) -> Detections:
    """Detections from a JSON file, checked against ``gt`` (every record: see
    :mod:`detector.evaluation.results`), as arrays read in one pass.

    Accepted forms: a COCO results list (ids must be ``gt``'s), or a COCO-format dict
    whose ``annotations`` carry a ``score``; its ``images`` (by ``file_name``) and
    ``categories`` (by ``name``), when present, map its own ids onto ``gt``'s.

    Raises:
        ResultsError (a ValueError): a form not understood, a bad record (index and
        field), or a file/category name ``gt`` lacks (named).
    """
    image_ids, cat_ids = check_ground_truth(gt)
    data = read_results_file(path)
    if isinstance(data, Detections):
        check_detection_ids(data, image_ids, cat_ids, source=str(path))
        return data
    if not isinstance(data, dict) or "annotations" not in data:
        raise ResultsError(f"{path}: expected a list of COCO results or a dict with 'annotations'")
    image_map: Optional[Dict[Any, Any]] = None
    cat_map: Optional[Dict[Any, Any]] = None
    if data.get("images") and all("file_name" in img for img in data["images"]):
        gt_by_name = {Path(img["file_name"]).name: img["id"] for img in gt["images"] if "file_name" in img}
        image_map = {}
        for img in data["images"]:
            name = Path(img["file_name"]).name
            if name not in gt_by_name:
                raise ResultsError(f"{path}: image {img.get('id')!r} ({name}) is not in the ground truth")
            image_map[img.get("id")] = gt_by_name[name]
    if data.get("categories") and all("name" in c for c in data["categories"]):
        gt_cats = {c["name"]: c["id"] for c in gt["categories"]}
        cat_map = {}
        for cat in data["categories"]:
            if cat["name"] not in gt_cats:
                raise ResultsError(f"{path}: category {cat['name']!r} is not in the ground-truth categories")
            cat_map[cat.get("id")] = gt_cats[cat["name"]]
    results = []
    for i, ann in enumerate(data["annotations"]):
        if not isinstance(ann, dict):
            raise ResultsError(f"{path}: annotations[{i}] is not an object")
        if "score" not in ann:
            raise ResultsError(f"{path}: annotations[{i}] has no 'score' (is this a ground-truth file?)")
        res = {k: ann[k] for k in ("image_id", "category_id", "bbox", "score") if k in ann}
        if image_map is not None:
            if ann.get("image_id") not in image_map:
                raise ResultsError(f"{path}: annotations[{i}] has image_id {ann.get('image_id')!r}, not in its 'images'")
            res["image_id"] = image_map[ann["image_id"]]
        if cat_map is not None:
            if ann.get("category_id") not in cat_map:
                raise ResultsError(f"{path}: annotations[{i}] has category_id {ann.get('category_id')!r}, not in its 'categories'")
            res["category_id"] = cat_map[ann["category_id"]]
        results.append(res)
    dets = detections_from_records(results, source=f"{path}: annotations")
    check_detection_ids(dets, image_ids, cat_ids, source=f"{path}: annotations")
    return dets
