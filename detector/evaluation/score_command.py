"""``tools/eval.py``'s file mode, scoring a results file against ground truth
(``score_command``), and what its model mode shares with it: the error analysis
(``print_analysis``) and the check that no output overwrites an input
(``check_outputs_apart``). The model mode runs as one process of a launch:
``detector.engine.launch.evaluate_command``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from detector.config import load_config
from detector.data import VOCDetection
from detector.files import check_writes_apart

from .analysis import ANALYSIS_FILES, format_analysis, run_analysis
from .report import OUTPUT_FILES, format_table, score_detections, write_outputs
from .eval_files import load_ground_truth, load_predictions


@dataclass(frozen=True)
class AnalysisRequest:
    """``--analysis``: the error breakdown, with the ``images`` worst images drawn on the
    files of ``image_dir`` (None: grey canvases, or the val set's folder in model mode)."""

    images: int = 10
    image_dir: Optional[str] = None


def check_outputs_apart(output_dir: Optional[str], written: Sequence[str], analysis: bool,
                        inputs: Mapping[str, "Optional[str | os.PathLike]"]) -> None:
    """Refuse an ``output_dir`` whose files this run rewrites (``written``, and the error
    analysis's under ``analysis/``) where one of them is an input (``inputs``: option ->
    path): re-scoring an earlier evaluation's ``detections.json`` into its own folder
    replaced the file being scored. Raises ``OutputError`` naming both."""
    if not output_dir:
        return
    names = [*written, *(f"analysis/{n}" for n in ANALYSIS_FILES if analysis)]
    check_writes_apart({f"--output-dir's {name}": Path(output_dir) / name for name in names}, inputs)


def print_analysis(gt: Dict[str, Any], results: List[Dict[str, Any]], output_dir: Optional[str],
                   score_thresh: float, request: AnalysisRequest, image_dir: Optional[str] = None) -> None:
    """The error breakdown of ``results`` against ``gt`` (COCO dicts), printed, and written
    under ``output_dir/analysis`` where given; ``image_dir``: the images' folder when the
    request names none."""
    out = Path(output_dir) / "analysis" if output_dir else None
    print(format_analysis(run_analysis(gt, results, out, score_thresh, request.images,
                                       request.image_dir or image_dir)))
    if out is not None:
        print(f"error analysis written to {out}")


def score_command(predictions: str, overrides: Sequence[str] = (), *, annotations: Optional[str] = None,
                  voc_root: Optional[str] = None, voc_split: str = "val", output_dir: Optional[str] = None,
                  analysis: Optional[AnalysisRequest] = None) -> int:
    """Score the results file ``predictions`` against COCO JSON ``annotations`` or the VOC
    year folder ``voc_root`` (its ``voc_split`` list), with the ``eval.*`` settings of the
    default config and ``overrides``: print the metrics table, write the outputs into
    ``output_dir`` and, with ``analysis``, the error breakdown. Returns 0; bad input raises
    an expected error (one line through ``run_tool``)."""
    check_outputs_apart(output_dir, OUTPUT_FILES, analysis is not None,
                        {"--predictions": predictions, "--annotations": annotations})
    cfg = load_config(None, list(overrides))
    if voc_root:
        gt = VOCDetection(voc_root, voc_split, class_names=cfg.data.class_names or None).coco_gt()
    else:
        gt = load_ground_truth(annotations)
    results = load_predictions(predictions, gt)
    ev = cfg.eval
    report = score_detections(gt, results, backend=ev.backend, voc_iou_thresh=ev.voc_iou_thresh,
                              score_thresh=ev.score_thresh, voc07_thresholds=ev.voc07_thresholds,
                              source=annotations or voc_root)
    print(format_table(report.metrics, report.per_class))
    if output_dir:
        write_outputs(report, results, output_dir)
        print(f"results written to {output_dir}")
    if analysis is not None:
        print_analysis(gt, results, output_dir, ev.score_thresh, analysis)
    return 0
