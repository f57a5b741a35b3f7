"""From detections to the evaluation report: :func:`evaluate` (inference on every rank,
gathered on rank 0, scored), :func:`score_detections` (every metric of a results list
against COCO-format ground truth, no model), and the report's outputs: the files
(:func:`write_outputs`: ``metrics.json``, ``detections.json``, ``per_class.csv``,
``pr_curves.png``, ``confusion_matrix.png``), the console table (:func:`format_table`)
and TensorBoard (:func:`write_report`).

``evaluate`` is used by the trainer for periodic evaluation and by ``tools/eval.py``;
``score_detections`` also by the file mode of ``tools/eval.py``.

TensorBoard: ``write_report(writer, report, step)`` takes a
``torch.utils.tensorboard.SummaryWriter`` (or anything with ``add_pr_curve_raw`` and
``add_scalar``) and writes

- ``eval/pr_curve/<class>``: the class's precision and recall (VOC matching at
  ``eval.voc_iou_thresh``) at ``num_thresholds`` score thresholds 0..1; recall counts the
  class's objects that no detection found (false negatives), so it is the real recall;
- ``eval/AP_per_class/<class>``: COCO AP @[.50:.95] of the class (skipped for a class
  without ground truth).
"""

from __future__ import annotations

import collections
import csv
import json
import logging
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from torch import nn

from detector.data.loader import build_test_loader
from detector.files import atomic_write, json_safe, output_folder, write_text
from detector.messages import DetectorError, typed_first_line

from ..distributed import all_gather_object, amp_dtype as resolve_amp_dtype, get_rank, get_world_size
from .coco import COCO_METRIC_NAMES, coco_evaluate
from .inference import LOSS_NAMES, compute_val_loss, run_inference
from .iou import confusion_matrix, group_by_image, iou_metrics
from .plots import plot_confusion_matrix, plot_pr_curves
from .eval_files import check_ground_truth
from .results import Detections, as_detections, check_detection_ids, write_results_file
from .static_inference import static_settings
from .tta import tta_settings
from .voc import VOCClassResult, mean_ap, voc_evaluate


class RankFailedError(DetectorError, RuntimeError):
    """Another rank's evaluation failed: one line naming the rank and its error."""


logger = logging.getLogger(__name__)

NUM_THRESHOLDS = 101  # score thresholds of a TensorBoard PR curve


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
    source: str = "the ground truth",
) -> ScoreReport:
    """COCO, VOC and IoU metrics of COCO-format ``results`` against a COCO-format ``gt``.
    Where ``gt`` holds no box that COCO scores (none, or crowd ones only), every COCO
    metric is -1: one warning, naming ``source``, says so.

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
    if all(a.get("iscrowd", 0) for a in gt["annotations"]):
        logger.warning("%s holds no box to score (none, or crowd ones only): every COCO metric and the VOC mAPs "
                       "are -1 (no ground truth)", source)
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
    return ScoreReport(metrics, _per_class_rows(cat_ids, names, dets, coco, voc), voc, confusion, cat_ids, names)


def _per_class_rows(cat_ids: List[int], names: List[str], dets: Detections, coco: Any,
                    voc: Dict[int, VOCClassResult]) -> List[Dict[str, Any]]:
    """One row per category: id, name, ground-truth and detection counts, COCO AP and
    AP50 (-1 without ground truth), VOC07 and VOC area AP."""
    ids, counts = np.unique(dets.category_id, return_counts=True)
    num_det = {c: 0 for c in cat_ids}
    num_det.update(zip(ids.tolist(), counts.tolist()))
    return [{"category_id": cat, "name": name, "num_gt": voc[cat].num_gt, "num_det": num_det[cat],
             "AP": coco.per_class_ap.get(cat, -1.0), "AP50": coco.per_class_ap50.get(cat, -1.0),
             "AP_voc07": voc[cat].ap_voc07, "AP_voc_area": voc[cat].ap_area}
            for cat, name in zip(cat_ids, names)]


# --------------------------------------------------------------------------- output


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as JSON (nan/inf as null) through ``detector.files.write_text``:
    atomic, and a failure is an ``OutputError`` naming the path."""
    return write_text(path, json.dumps(json_safe(data), indent=1, allow_nan=False))


# The files write_outputs writes into an evaluation's output folder.
OUTPUT_FILES = ("metrics.json", "detections.json", "per_class.csv", "pr_curves.png", "confusion_matrix.png")


def write_outputs(
    report: ScoreReport,
    results: Any,
    output_dir: str | Path,
    extra_metrics: Optional[Dict[str, float]] = None,
) -> Dict[str, Path]:
    """Write ``metrics.json`` (the flat metrics dict), ``detections.json`` (COCO
    results; ``results`` a list or Detections), ``per_class.csv``, ``pr_curves.png``
    and ``confusion_matrix.png`` (``OUTPUT_FILES``)."""
    out = output_folder(output_dir)
    metrics_file, detections_file, csv_file, curves_file, confusion_file = (out / name for name in OUTPUT_FILES)
    metrics = dict(report.metrics)
    metrics.update(extra_metrics or {})
    paths = {
        "metrics": write_json(metrics_file, metrics),
        "detections": write_results_file(detections_file, as_detections(results)),
    }
    def write_csv(f: Any) -> None:
        fields = ["category_id", "name", "num_gt", "num_det", "AP", "AP50", "AP_voc07", "AP_voc_area"]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in report.per_class:
            writer.writerow({k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in row.items()})

    paths["per_class"] = atomic_write(csv_file, write_csv, mode="w")
    curves = {
        name: (report.voc[c].recall, report.voc[c].precision, report.voc[c].ap_area)
        for c, name in zip(report.cat_ids, report.class_names)
    }
    paths["pr_curves"] = plot_pr_curves(curves, curves_file, title="Precision-recall per class (VOC matching)",
                                         ap_kind="VOC area AP")
    paths["confusion_matrix"] = plot_confusion_matrix(report.confusion, report.class_names, confusion_file)
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


# --------------------------------------------------------------------------- evaluate


class EvalMetrics(dict):
    """The flat metrics dict, with the full :class:`ScoreReport` as ``.report`` (per-class
    curves, for TensorBoard)."""

    def __init__(self, metrics: Dict[str, float], report: Optional[ScoreReport] = None) -> None:
        super().__init__(metrics)
        self.report = report


def _check_coverage(dataset_ids: List[int], gathered_ids: List[int]) -> None:
    """Every dataset image scored exactly once, or a RuntimeError saying which not."""
    counts = collections.Counter(gathered_ids)
    dup = sorted(i for i, n in counts.items() if n > 1)
    if dup:
        raise RuntimeError(f"evaluation ran {len(dup)} image(s) more than once, e.g. image_id {dup[:5]}")
    missing = sorted(set(dataset_ids) - set(counts))
    if missing:
        raise RuntimeError(f"evaluation missed {len(missing)} image(s), e.g. image_id {missing[:5]}")


def _infer_and_gather(model: nn.Module, loader: Any, label_to_category_id: Dict[int, int], cfg: Any,
                      rank: int, world_size: int, skip_unmapped: bool = False) -> List[tuple]:
    """This rank's inference (and validation loss), gathered from every rank.

    Returns ``[(Detections of rank r, image_ids, seconds per batch, loss sums or None)]``
    indexed by rank. A failure on any rank stops every rank: the failing one raises its
    own exception, the others a RuntimeError naming it, instead of waiting in the gather
    until the collective's timeout.
    """
    amp_dtype = resolve_amp_dtype(cfg.train.amp, next(model.parameters()).device)
    progress = rank == 0 and sys.stderr.isatty()  # no bar lines in log files and CI output
    out, loss_part, failure = None, None, None
    try:
        out = run_inference(model, loader, label_to_category_id, amp=cfg.eval.amp, amp_dtype=amp_dtype,
                            progress=progress, skip_unmapped=skip_unmapped, tta=tta_settings(cfg),
                            static=static_settings(cfg))
        if cfg.eval.compute_val_loss:
            loss_part = compute_val_loss(model, loader, amp=cfg.eval.amp, amp_dtype=amp_dtype, progress=progress)
    except Exception as exc:
        if world_size == 1:
            raise
        failure = exc  # the other ranks wait in the gather below: send them the failure
    if failure is not None:
        mine = (typed_first_line(failure), None, None, None, None)
    else:
        mine = (None, out.detections, out.image_ids, out.seconds, loss_part)
    gathered = all_gather_object(mine)
    if failure is not None:
        raise failure
    failed = [(r, g[0]) for r, g in enumerate(gathered) if g[0] is not None]
    if failed:
        raise RankFailedError(f"evaluation failed on rank {failed[0][0]} ({failed[0][1]})")
    return [g[1:] for g in gathered]


def evaluate(
    model: nn.Module,
    dataset: Any,
    cfg: Any,
    output_dir: Optional[str | Path] = None,
) -> Dict[str, float]:
    """Evaluate ``model`` on ``dataset`` (distributed-aware).

    Args:
        model: a detector (or its DDP wrapper); its train/eval mode is restored.
        dataset: a dataset with eval transforms exposing ``coco_gt()``,
            ``label_to_category_id`` and ``image_ids`` (see the dataset contract).
        cfg: the full Config (``eval.*``, ``train.amp.dtype`` are read).
        output_dir: where rank 0 writes ``metrics.json``, ``detections.json``,
            ``per_class.csv``, ``pr_curves.png``, ``confusion_matrix.png``.

    Returns:
        On rank 0 the flat metrics dict: the 12 COCO numbers (``AP`` ... ``ARl``),
        ``mAP_voc07``, ``mAP_voc_area``, the IoU metrics (``mean_iou``,
        ``precision_50`` ...), and with ``eval.compute_val_loss`` the four
        ``val_loss_*`` values and ``val_loss``. Other ranks get ``{}``.
    """
    rank, world_size = get_rank(), get_world_size()
    loader = build_test_loader(cfg, dataset, rank, world_size)
    # Labels = category ids: predictions in unused id slots match no category and are left out.
    skip_unmapped = getattr(dataset, "label_space", "contiguous") == "category_id"
    gathered = _infer_and_gather(model, loader, dataset.label_to_category_id, cfg, rank, world_size, skip_unmapped)
    if rank != 0:
        return {}

    image_ids = [i for g in gathered for i in g[1]]
    logger.info("images per rank: %s", [len(g[1]) for g in gathered])
    _check_coverage(list(dataset.image_ids), image_ids)
    results = _in_dataset_order([g[0] for g in gathered], list(dataset.image_ids))
    report = score_detections(dataset.coco_gt(), results, backend=cfg.eval.backend,
                              voc_iou_thresh=cfg.eval.voc_iou_thresh, score_thresh=cfg.eval.score_thresh,
                              voc07_thresholds=cfg.eval.voc07_thresholds, source=getattr(dataset, "source", "the val set"))
    metrics = dict(report.metrics)
    if cfg.eval.compute_val_loss:
        metrics.update(_mean_val_losses([g[3] for g in gathered]))
    seconds = [s for g in gathered for s in g[2]]
    timing = {
        "num_images": float(len(image_ids)),
        "num_detections": float(len(results)),
        "time_per_image_ms": 1000.0 * float(np.mean(seconds)) if seconds else 0.0,
    }
    logger.info(
        "evaluated %d images on %d rank(s), %d detections, %.1f ms/image (model only)\n%s",
        len(image_ids), world_size, len(results), timing["time_per_image_ms"], format_table(metrics, report.per_class),
    )  # fmt: skip
    if not len(results) and len(image_ids):  # every metric 0: say where to look
        logger.warning("no detections on any of the %d images, so every metric is 0: a model early in training, or "
                       "roi_heads.score_thresh=%g, input.min_size_test=%d or the weights", len(image_ids),
                       cfg.roi_heads.score_thresh, cfg.input.min_size_test)
    if output_dir is not None:
        write_outputs(report, results, output_dir, extra_metrics=timing)
    return EvalMetrics(metrics, report)


def _in_dataset_order(detections: List[Detections], dataset_ids: List[int]) -> Detections:
    """The ranks' detections joined in the data set's image order, whatever the number
    of ranks (so results and ties are those of one process), each image keeping its own
    order. Image ids are compared as integers (int64), never as floats."""
    position = {image_id: k for k, image_id in enumerate(dataset_ids)}
    joined = Detections.concatenate(detections)
    keys = np.array([position[i] for i in joined.image_id.tolist()], dtype=np.int64)
    return joined.take(np.argsort(keys, kind="stable"))


# The flat metrics ``evaluate`` writes, by the way each one improves (train.best_metric).
HIGHER_IS_BETTER = (*COCO_METRIC_NAMES, "mAP_voc07", "mAP_voc_area", "mean_iou", "precision_50", "recall_50", "f1_50",
                    "precision_75", "recall_75", "f1_75", "count_pearson")
LOWER_IS_BETTER = ("count_mae", "val_loss", *(f"val_{k}" for k in LOSS_NAMES))  # the last five with compute_val_loss


def _mean_val_losses(parts: List[Dict[str, Any]]) -> Dict[str, float]:
    """``val_<loss>`` (the mean over all images of every rank) and their sum ``val_loss``,
    from each rank's ``{"sum": {loss: total}, "count": images}``."""
    count = sum(p["count"] for p in parts)
    out = {f"val_{k}": sum(p["sum"][k] for p in parts) / max(count, 1) for k in LOSS_NAMES}
    out["val_loss"] = sum(out[f"val_{k}"] for k in LOSS_NAMES)
    return out


# --------------------------------------------------------------------------- TensorBoard


def _tag(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", str(name)) or "_"


def pr_counts(scores: np.ndarray, flags: np.ndarray, num_gt: int, num_thresholds: int = NUM_THRESHOLDS):
    """TP, FP, TN, FN, precision, recall at thresholds ``linspace(0, 1, num_thresholds)``
    (a detection counts at threshold t when its score >= t; flags 1 TP, 0 FP, -1 ignored)."""
    thresholds = np.linspace(0.0, 1.0, num_thresholds)
    tp_scores = np.sort(np.asarray(scores)[np.asarray(flags) == 1])
    fp_scores = np.sort(np.asarray(scores)[np.asarray(flags) == 0])
    tp = (len(tp_scores) - np.searchsorted(tp_scores, thresholds, side="left")).astype(np.float64)
    fp = (len(fp_scores) - np.searchsorted(fp_scores, thresholds, side="left")).astype(np.float64)
    fn = np.maximum(num_gt - tp, 0.0)
    tn = np.zeros_like(tp)
    precision = np.divide(tp, tp + fp, out=np.zeros_like(tp), where=(tp + fp) > 0)
    recall = np.divide(tp, tp + fn, out=np.zeros_like(tp), where=(tp + fn) > 0)
    return tp, fp, tn, fn, precision, recall


def write_report(writer: Any, report: ScoreReport, step: int, num_thresholds: int = NUM_THRESHOLDS) -> None:
    """PR curves and per-class AP of ``report`` at ``step`` (see the module docstring)."""
    for row, cat in zip(report.per_class, report.cat_ids):
        name = _tag(row["name"])
        voc = report.voc[cat]
        tp, fp, tn, fn, precision, recall = pr_counts(voc.scores, voc.flags, voc.num_gt, num_thresholds)
        writer.add_pr_curve_raw(f"eval/pr_curve/{name}", tp, fp, tn, fn, precision, recall, step,
                                num_thresholds=num_thresholds)
        ap = float(row["AP"])
        if math.isfinite(ap) and ap >= 0:
            writer.add_scalar(f"eval/AP_per_class/{name}", ap, step)
