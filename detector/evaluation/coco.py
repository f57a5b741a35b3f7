"""COCO box metrics through pycocotools (or faster-coco-eval, same numbers).

Input is plain data:

- ground truth: a COCO-format dict (``images``, ``annotations``, ``categories``) in
  original image coordinates, as ``dataset.coco_gt()`` returns or a COCO JSON file holds;
- detections: a list of results ``{"image_id", "category_id", "bbox": [x, y, w, h],
  "score"}`` with the ground truth's image and category ids.

``coco_evaluate`` returns the twelve numbers of ``COCOeval.summarize()`` under their
usual names, the per-class AP, and the precision array for curves. The third-party
libraries print progress to stdout; that output is captured and sent to the debug log,
so a run's console shows our table only.

Detections are scored one group of categories at a time (at most
``CHUNK_DETECTIONS`` detections per group, whole categories): COCO's matching and
accumulation are per category, so the merged precision and recall arrays, and the
twelve numbers, are the ones a single pass gives, with a fraction of the memory.

Semantics follow pycocotools exactly: ``-1`` means "no ground truth in that range"
(e.g. APs when no object is small), crowd boxes (``iscrowd: 1``) are ignored regions,
the ``ignore`` field of an annotation is overridden by ``iscrowd``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from detector.data.coco import area_warning, coco_area

from .results import (  # noqa: F401  (UnknownImageError: part of this module's API)
    Detections,
    UnknownImageError,
    as_detections,
    check_detection_ids,
)
from .eval_files import check_ground_truth

logger = logging.getLogger(__name__)

COCO_METRIC_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")
BACKENDS = ("pycocotools", "faster")
# Detections per COCOeval pass. The COCO libraries hold ~1.4 KB of Python objects per
# detection; 250k keeps a pass near 350 MB.
CHUNK_DETECTIONS = 250_000
# Integers above this lose their last bit in a float64.
SAFE_ID = 2**53


@dataclass
class CocoEvalResult:
    """Output of :func:`coco_evaluate`.

    Attributes:
        metrics: the 12 summary numbers, keys ``COCO_METRIC_NAMES``.
        per_class_ap: category id -> AP@[.5:.95] (all areas, 100 dets); ``-1`` when the
            class has no ground truth.
        per_class_ap50: category id -> AP@0.5.
        precision: ``COCOeval.eval["precision"]``, shape [T=10, R=101, K, A=4, M=3]
            (IoU thresholds x recall thresholds x classes x areas x max dets), ``-1`` where
            undefined; None when there was nothing to evaluate.
        cat_ids: the category ids in the order of the K axis.
        rec_thrs: the 101 recall thresholds (0, 0.01, ..., 1).
    """

    metrics: Dict[str, float]
    per_class_ap: Dict[int, float] = field(default_factory=dict)
    per_class_ap50: Dict[int, float] = field(default_factory=dict)
    precision: Optional[np.ndarray] = None
    cat_ids: List[int] = field(default_factory=list)
    rec_thrs: Optional[np.ndarray] = None


def _backend_classes(backend: str):
    if backend == "pycocotools":
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval

        return COCO, COCOeval
    if backend == "faster":
        try:
            from faster_coco_eval import COCO, COCOeval_faster
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "eval.backend=faster needs the 'faster-coco-eval' package (pip install faster-coco-eval)"
            ) from exc
        return COCO, COCOeval_faster
    raise ValueError(f"eval.backend must be one of {BACKENDS}; got {backend!r}")


def _gt_copy(gt: Dict[str, Any], source: str = "ground truth") -> Dict[str, Any]:
    """A copy the COCO libraries may mutate (they write ``ignore`` into annotations),
    with ``iscrowd`` and ``id`` filled where missing and ``area`` as
    ``detector.data.coco.coco_area`` gives it (missing, null or impossible: ``w * h``,
    with one warning naming ``source``)."""
    anns, replaced = [], []
    for i, ann in enumerate(gt["annotations"]):
        a = dict(ann)
        a["area"] = coco_area(ann.get("area"), a["bbox"][2], a["bbox"][3])
        if ann.get("area") is not None and a["area"] != ann["area"]:
            replaced.append((ann.get("id", i + 1), ann["area"], a["bbox"][2], a["bbox"][3]))
        a.setdefault("iscrowd", 0)
        a.setdefault("id", i + 1)
        anns.append(a)
    if replaced:
        logger.warning("%s", area_warning(source, replaced))
    out = {k: v for k, v in gt.items() if k != "annotations"}
    out["annotations"] = anns
    return out


def build_coco(gt: Dict[str, Any], backend: str = "pycocotools"):
    """A ``COCO`` object of the chosen backend from a gt dict (not mutated)."""
    COCO, _ = _backend_classes(backend)
    coco = COCO()
    coco.dataset = _gt_copy(gt)
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def _results_coco(coco_gt, dets: Detections, ids: np.ndarray, backend: str):
    """A results ``COCO`` object holding ``dets``: what ``coco_gt.loadRes`` builds for
    boxes (``area = w * h``, ``iscrowd = 0``, ``id``: ``ids``, the 1-based positions in
    the whole results list), made directly from the arrays. (pycocotools'
    ``loadRes([])`` crashes; this does not.)"""
    COCO, _ = _backend_classes(backend)
    area = (dets.bbox[:, 2] * dets.bbox[:, 3]).tolist()
    anns = [
        {"image_id": i, "category_id": c, "bbox": b, "score": s, "area": a, "id": k, "iscrowd": 0}
        for i, c, b, s, a, k in zip(
            dets.image_id.tolist(), dets.category_id.tolist(), dets.bbox.tolist(), dets.score.tolist(), area,
            ids.tolist(),
        )
    ]
    dt = COCO()
    dt.dataset = {
        "images": list(coco_gt.dataset["images"]),
        "categories": copy.deepcopy(coco_gt.dataset["categories"]),
        "annotations": anns,
    }
    with contextlib.redirect_stdout(io.StringIO()):
        dt.createIndex()
    return dt


def category_chunks(category_id: np.ndarray, cat_ids: Sequence[int], limit: int = CHUNK_DETECTIONS) -> List[List[int]]:
    """``cat_ids`` (sorted) cut into consecutive groups of at most ``limit`` detections
    (a category with more forms a group of its own)."""
    counts = dict(zip(*np.unique(category_id, return_counts=True)))
    chunks: List[List[int]] = [[]]
    total = 0
    for c in cat_ids:
        n = int(counts.get(c, 0))
        if chunks[-1] and total + n > limit:
            chunks.append([])
            total = 0
        chunks[-1].append(int(c))
        total += n
    return chunks


def _mean_valid(values: np.ndarray) -> float:
    valid = values[values > -1]
    return float(np.mean(valid)) if valid.size else -1.0


def _run_cocoeval(coco_gt, dets: Detections, ids: np.ndarray, cat_ids: List[int], backend: str):
    """One ``COCOeval`` pass (evaluate + accumulate) restricted to ``cat_ids``."""
    _, COCOeval = _backend_classes(backend)
    coco_dt = _results_coco(coco_gt, dets, ids, backend)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        if backend == "faster":
            evaluator = COCOeval(coco_gt, coco_dt, "bbox", print_function=logger.debug)
        else:
            evaluator = COCOeval(coco_gt, coco_dt, "bbox")
        evaluator.params.catIds = list(cat_ids)
        evaluator.evaluate()
        evaluator.accumulate()
    if log.getvalue():
        logger.debug("%s output:\n%s", backend, log.getvalue().rstrip())
    evaluator.eval.pop("matched", None)  # faster-coco-eval's per-match dict: not needed
    return evaluator


def _merge_evals(evals: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Concatenate per-category-group ``COCOeval.eval`` dicts along the category axis."""
    if len(evals) == 1:
        return evals[0]
    out = dict(evals[-1])
    out["precision"] = np.concatenate([e["precision"] for e in evals], axis=2)
    out["scores"] = np.concatenate([e["scores"] for e in evals], axis=2)
    out["recall"] = np.concatenate([e["recall"] for e in evals], axis=1)
    out["counts"] = list(out["precision"].shape)
    return out


def _exact_ids(gt: Dict[str, Any], dets: Detections) -> tuple[Dict[str, Any], Detections]:
    """``gt`` and ``dets`` with ids the COCO libraries keep exact.

    faster-coco-eval (1.8) holds ids as float64, so two image ids past 2**53 can become
    one (an odd id merges into its even neighbour). When an image or annotation id lies
    beyond +-2**53, image ids are replaced by their rank among the sorted image ids (the
    order is kept, so COCOeval's image order and its ties are the same) and annotation
    ids by their rank + 1; the twelve numbers do not depend on the id values. Otherwise
    both are returned as they are."""
    img_ids = np.array([img["id"] for img in gt["images"]], dtype=np.int64)
    ann_ids = np.array([a.get("id", 1) for a in gt["annotations"]], dtype=np.int64)
    if not any(((ids > SAFE_ID) | (ids < -SAFE_ID)).any() for ids in (img_ids, ann_ids)):
        return gt, dets
    uniq = np.unique(img_ids)
    images = [dict(img, id=int(r)) for img, r in zip(gt["images"], np.searchsorted(uniq, img_ids))]
    ann_img = np.array([a["image_id"] for a in gt["annotations"]], dtype=np.int64)
    ann_rank = np.searchsorted(np.unique(ann_ids), ann_ids) + 1
    anns = [dict(a, image_id=int(r), id=int(k))
            for a, r, k in zip(gt["annotations"], np.searchsorted(uniq, ann_img), ann_rank)]
    ranked = Detections(np.searchsorted(uniq, dets.image_id).astype(np.int64), dets.category_id, dets.bbox, dets.score)
    return dict(gt, images=images, annotations=anns), ranked


def coco_evaluate(
    gt: Dict[str, Any],
    results: Any,
    backend: str = "pycocotools",
    check: bool = True,
    chunk_detections: Optional[int] = None,
) -> CocoEvalResult:
    """Run ``COCOeval`` on boxes and return the 12 numbers and per-class AP.

    Args:
        gt: COCO-format ground-truth dict (not mutated).
        results: COCO results list, bbox ``[x, y, w, h]`` in original pixels, or
            :class:`Detections` (not mutated).
        backend: ``"pycocotools"`` or ``"faster"`` (faster-coco-eval).
        check: check ``results`` against ``gt`` first (fields, and ids that ``gt``
            has; see :mod:`detector.evaluation.results`).
        chunk_detections: detections per ``COCOeval`` pass (whole categories);
            None: ``CHUNK_DETECTIONS``.

    Returns:
        CocoEvalResult. Empty ``results`` give AP/AR 0 (or -1 where there is no ground
        truth) instead of pycocotools' crash.
    """
    _backend_classes(backend)
    image_ids, gt_cat_ids = check_ground_truth(gt)
    dets = as_detections(results)
    if check:
        check_detection_ids(dets, image_ids, gt_cat_ids)
    gt, dets = _exact_ids(gt, dets)
    coco_gt = build_coco(gt, backend)
    cat_ids = sorted(int(c) for c in coco_gt.getCatIds())
    evals, evaluator = [], None
    for chunk in category_chunks(dets.category_id, cat_ids, chunk_detections or CHUNK_DETECTIONS):
        index = np.flatnonzero(np.isin(dets.category_id, chunk))  # file order kept: the same ties
        part = dets.take(index)
        evaluator = _run_cocoeval(coco_gt, part, index + 1, chunk, backend)
        evals.append(evaluator.eval)
        del part
    assert evaluator is not None
    evaluator.eval = _merge_evals(evals)
    evaluator.params.catIds = cat_ids
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        evaluator.summarize()
    if log.getvalue():
        logger.debug("%s output:\n%s", backend, log.getvalue().rstrip())

    stats = [float(v) for v in np.asarray(evaluator.stats)[: len(COCO_METRIC_NAMES)]]
    return _result(stats, np.asarray(evaluator.eval["precision"]), np.asarray(evaluator.params.iouThrs),
                   cat_ids, np.asarray(evaluator.params.recThrs))


def _result(stats: List[float], precision: np.ndarray, iou_thrs: np.ndarray, cat_ids: List[int],
            rec_thrs: np.ndarray) -> CocoEvalResult:
    """The 12 numbers, the per-class AP and AP50 from ``precision`` [T, R, K, A, M]."""
    metrics = dict(zip(COCO_METRIC_NAMES, stats))
    i50 = int(np.argmin(np.abs(iou_thrs - 0.5)))
    per_class_ap = {}
    per_class_ap50 = {}
    for k, cat in enumerate(cat_ids):
        # all areas (index 0), the largest max-dets setting (index -1): summarize()'s AP.
        per_class_ap[cat] = _mean_valid(precision[:, :, k, 0, -1])
        per_class_ap50[cat] = _mean_valid(precision[i50, :, k, 0, -1])
    return CocoEvalResult(
        metrics=metrics,
        per_class_ap=per_class_ap,
        per_class_ap50=per_class_ap50,
        precision=precision,
        cat_ids=cat_ids,
        rec_thrs=rec_thrs,
    )
