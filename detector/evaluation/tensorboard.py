"""Evaluation results for TensorBoard: a precision-recall curve per class and the
per-class AP as scalars.

``write_report(writer, report, step)`` takes a ``torch.utils.tensorboard.SummaryWriter``
(or anything with ``add_pr_curve_raw`` and ``add_scalar``) and writes

- ``eval/pr_curve/<class>``: the class's precision and recall (VOC matching at
  ``eval.voc_iou_thresh``) at ``num_thresholds`` score thresholds 0..1; recall counts the
  class's objects that no detection found (false negatives), so it is the real recall;
- ``eval/AP_per_class/<class>``: COCO AP @[.50:.95] of the class (skipped for a class
  without ground truth).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from .scoring import ScoreReport

NUM_THRESHOLDS = 101


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
