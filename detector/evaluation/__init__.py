"""Evaluation: COCO (pycocotools / faster-coco-eval), VOC AP, IoU metrics, the
distributed inference loop, reports, plots and result files.

Modules: ``inference`` (the model over a loader or image files), ``report``
(``evaluate``, ``score_detections``, the output files, the table, TensorBoard),
``results`` (results and ground-truth files: read, check, write), ``coco``, ``voc``,
``iou`` (IoU metrics on per-image :class:`EvalImage`), ``plots`` (PNG plots, drawing),
``trained_weights`` (``load_trained_weights``: the weights eval, infer and export load).

``evaluate(model, dataset, cfg, output_dir=None) -> dict[str, float]`` is the entry
point used by the trainer and ``tools/eval.py``; ``score_detections`` scores a results
list against COCO-format ground truth without a model.
"""

from .coco import COCO_METRIC_NAMES, CocoEvalResult, coco_evaluate
from .inference import predict_files
from .input_files import list_images
from .plots import draw_detections
from .report import (OUTPUT_FILES, ScoreReport, evaluate, format_table, score_detections, write_json, write_outputs,
                     write_report)
from .eval_files import load_ground_truth, load_predictions
from .results import ResultsError, UnknownImageError
from .trained_weights import load_trained_weights
from .voc import ap_area, ap_voc07, voc_evaluate

__all__ = [
    "COCO_METRIC_NAMES",
    "CocoEvalResult",
    "ResultsError",
    "ScoreReport",
    "UnknownImageError",
    "ap_area",
    "ap_voc07",
    "coco_evaluate",
    "draw_detections",
    "evaluate",
    "format_table",
    "list_images",
    "load_trained_weights",
    "load_ground_truth",
    "load_predictions",
    "predict_files",
    "score_detections",
    "voc_evaluate",
    "write_json",
    "write_outputs",
    "OUTPUT_FILES",
    "write_report",
]
