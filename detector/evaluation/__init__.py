"""Evaluation: COCO (pycocotools / faster-coco-eval), VOC AP, IoU metrics, the
distributed inference loop, plots and result files.

``evaluate(model, dataset, cfg, output_dir=None) -> dict[str, float]`` is the entry
point used by the trainer and ``tools/eval.py``; ``score_detections`` scores a results
list against COCO-format ground truth without a model.
"""

from .coco import COCO_METRIC_NAMES, CocoEvalResult, UnknownImageError, coco_evaluate
from .evaluator import evaluate
from .scoring import ScoreReport, format_table, load_ground_truth, load_predictions, score_detections, write_outputs
from .voc import ap_area, ap_voc07, voc_evaluate

__all__ = [
    "COCO_METRIC_NAMES",
    "CocoEvalResult",
    "ScoreReport",
    "UnknownImageError",
    "ap_area",
    "ap_voc07",
    "coco_evaluate",
    "evaluate",
    "format_table",
    "load_ground_truth",
    "load_predictions",
    "score_detections",
    "voc_evaluate",
    "write_outputs",
]
