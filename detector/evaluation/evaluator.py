"""``evaluate(model, dataset, cfg)``: inference on every rank, gathering on rank 0,
all metrics, result files.

Used by the trainer for periodic evaluation and by ``tools/eval.py``.
"""

from __future__ import annotations

import collections
import logging
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
from torch import nn

from ..distributed import all_gather_object, amp_dtype as resolve_amp_dtype, get_rank, get_world_size
from .inference import LOSS_NAMES, array_to_detections, compute_val_loss, run_inference
from .results import Detections
from .scoring import ScoreReport, format_table, score_detections, write_outputs

from detector.messages import typed_first_line

logger = logging.getLogger(__name__)


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

    Returns ``[(detections float64 [D_r, 7], image_ids, seconds per batch, loss sums or None)]``
    indexed by rank. A failure on any rank stops every rank: the failing one raises its
    own exception, the others a RuntimeError naming it, instead of waiting in the gather
    until the collective's timeout.
    """
    amp_dtype = resolve_amp_dtype(cfg.train.amp, next(model.parameters()).device)
    progress = rank == 0 and sys.stderr.isatty()  # no bar lines in log files and CI output
    out, loss_part, failure = None, None, None
    try:
        out = run_inference(model, loader, label_to_category_id, amp=cfg.eval.amp, amp_dtype=amp_dtype,
                            progress=progress, skip_unmapped=skip_unmapped)
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
        raise RuntimeError(f"evaluation failed on rank {failed[0][0]} ({failed[0][1]})")
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
    from ..data.loader import build_test_loader  # the data package imports albumentations

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
    report = score_detections(
        dataset.coco_gt(),
        results,
        backend=cfg.eval.backend,
        voc_iou_thresh=cfg.eval.voc_iou_thresh,
        score_thresh=cfg.eval.score_thresh,
        voc07_thresholds=cfg.eval.voc07_thresholds,
    )
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
    if output_dir is not None:
        write_outputs(report, results, output_dir, extra_metrics=timing)
    return EvalMetrics(metrics, report)


def _in_dataset_order(detections: List[np.ndarray], dataset_ids: List[int]) -> Detections:
    """The ranks' ``[D_r, 7]`` detection arrays (image id first) joined in the data set's
    image order, whatever the number of ranks (so results and ties are those of one
    process), each image keeping its own order."""
    position = {image_id: k for k, image_id in enumerate(dataset_ids)}
    joined = np.concatenate(detections)
    keys = np.array([position[int(i)] for i in joined[:, 0]], dtype=np.int64)
    return array_to_detections(joined[np.argsort(keys, kind="stable")])


def _mean_val_losses(parts: List[Dict[str, Any]]) -> Dict[str, float]:
    """``val_<loss>`` (the mean over all images of every rank) and their sum ``val_loss``,
    from each rank's ``{"sum": {loss: total}, "count": images}``."""
    count = sum(p["count"] for p in parts)
    out = {f"val_{k}": sum(p["sum"][k] for p in parts) / max(count, 1) for k in LOSS_NAMES}
    out["val_loss"] = sum(out[f"val_{k}"] for k in LOSS_NAMES)
    return out
