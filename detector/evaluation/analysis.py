"""Error analysis of detections against COCO-format ground truth, in the style of TIDE
(Bolya et al. 2020) and pycocotools' ``analyze()``: every detection with score >=
``score_thresh`` is a true positive or exactly one kind of error, and every object no
detection found is a miss.

Per image, detections are matched to the ground truth with the project's greedy matching
(:func:`detector.evaluation.iou.greedy_match`, per class, IoU >= ``fg_iou``); a detection
on a crowd / difficult box counts neither way. Each false positive is then, in this
order (IoU with the non-ignored ground-truth boxes of the image):

- ``duplicate``: IoU >= ``fg_iou`` with a box of its class that a higher-scoring
  detection already took;
- ``classification``: IoU >= ``fg_iou`` with a box of another class;
- ``localisation``: ``bg_iou`` <= IoU < ``fg_iou`` with a box of its class;
- ``both``: ``bg_iou`` <= IoU < ``fg_iou`` with a box of another class only;
- ``background``: IoU < ``bg_iou`` with every box.

``missed``: a non-ignored object that no detection matched and that no classification,
localisation or both error points at (such an object is counted by that error).
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from torchvision.ops import box_iou  # noqa: E402

from detector.data.files import DataError, load_image  # noqa: E402
from detector.messages import first_line  # noqa: E402

from .iou import EvalImage, greedy_match, group_by_image  # noqa: E402
from .mpl import pyplot  # noqa: E402
from .plots import render  # noqa: E402
from .report import write_json  # noqa: E402

logger = logging.getLogger(__name__)

ERROR_TYPES = ("classification", "localisation", "both", "duplicate", "background", "missed")
FG_IOU = 0.5  # TIDE's foreground threshold
BG_IOU = 0.1  # TIDE's background threshold
GREY = 128


@dataclass
class ImageErrors:
    """One image's verdicts.

    Attributes:
        dt_kind: per detection (score >= the threshold, in the image's detection order)
            ``tp``, ``ignored`` or one of ``ERROR_TYPES``; dt_index: their indices in
            the image's detections.
        missed: indices of the missed ground-truth boxes.
    """

    dt_kind: List[str]
    dt_index: List[int]
    missed: List[int]

    @property
    def num_errors(self) -> int:
        return sum(k in ERROR_TYPES for k in self.dt_kind) + len(self.missed)


@dataclass
class ErrorAnalysis:
    """The breakdown: ``counts`` (error type -> number, plus ``tp``), ``per_class``
    (category id -> the same counts, by the detection's class; misses by the object's),
    ``images`` (image id -> :class:`ImageErrors`) and the thresholds used."""

    counts: Dict[str, int]
    per_class: Dict[int, Dict[str, int]]
    images: Dict[int, ImageErrors]
    score_thresh: float
    fg_iou: float
    bg_iou: float
    extras: Dict[str, Any] = field(default_factory=dict)

    def worst_images(self, n: int) -> List[int]:
        """The ``n`` image ids with the most errors (ties: the order of the ground truth)."""
        ranked = sorted(self.images, key=lambda i: -self.images[i].num_errors)
        return [i for i in ranked[:n] if self.images[i].num_errors > 0]


def _kind_of_false_positive(row: np.ndarray, same: np.ndarray, taken: np.ndarray, fg: float, bg: float):
    """(kind, target ground-truth index or -1) of one false positive, from its IoU
    ``row`` ``[N]`` with the non-ignored boxes, ``same`` ``[N]`` (same class) and
    ``taken`` ``[N]`` (already matched)."""
    def best(mask):
        vals = np.where(mask, row, -1.0)
        return int(vals.argmax()) if len(vals) else -1, (float(vals.max()) if len(vals) else -1.0)

    j, v = best(same & taken)
    if v >= fg:
        return "duplicate", -1
    j, v = best(~same)
    if v >= fg:
        return "classification", j
    j, v = best(same)
    if v >= bg:
        return "localisation", j
    j, v = best(~same)
    if v >= bg:
        return "both", j
    return "background", -1


def analyse_image(rec: EvalImage, score_thresh: float, fg: float = FG_IOU, bg: float = BG_IOU) -> ImageErrors:
    """The verdicts of one image (see the module docstring)."""
    keep = np.where(rec.dt_scores >= score_thresh)[0]
    boxes, cats = rec.dt_boxes[keep], rec.dt_cats[keep]
    match = greedy_match(torch.from_numpy(boxes), torch.from_numpy(rec.dt_scores[keep]), torch.from_numpy(cats),
                         torch.from_numpy(rec.gt_boxes), torch.from_numpy(rec.gt_cats), fg,
                         torch.from_numpy(rec.gt_ignore))
    d2g, taken = match.det_to_gt.numpy(), match.gt_matched.numpy()
    free = ~rec.gt_ignore
    ious = box_iou(torch.from_numpy(boxes), torch.from_numpy(rec.gt_boxes)).numpy()
    ious = np.where(free[None, :], ious, -1.0)
    kinds: List[str] = []
    explained = np.zeros(len(rec.gt_boxes), dtype=bool)
    for i in range(len(keep)):
        if d2g[i] >= 0 or d2g[i] == -2:
            kinds.append("tp" if d2g[i] >= 0 else "ignored")
            continue
        kind, j = _kind_of_false_positive(ious[i], rec.gt_cats == cats[i], taken, fg, bg)
        kinds.append(kind)
        if j >= 0:
            explained[j] = True
    missed = np.where(free & ~taken & ~explained)[0]
    return ImageErrors(dt_kind=kinds, dt_index=keep.tolist(), missed=missed.tolist())


def analyse_errors(gt: Dict[str, Any], results: Any, score_thresh: float = 0.5, fg_iou: float = FG_IOU,
                   bg_iou: float = BG_IOU) -> ErrorAnalysis:
    """The error breakdown of ``results`` (COCO results list or ``Detections``) against
    COCO-format ``gt``, counting detections with score >= ``score_thresh``."""
    if not 0.0 <= bg_iou <= fg_iou <= 1.0:
        raise ValueError(f"error analysis needs 0 <= bg_iou <= fg_iou <= 1, got bg_iou={bg_iou}, fg_iou={fg_iou}")
    records = group_by_image(gt, results)
    counts = {k: 0 for k in ("tp", *ERROR_TYPES)}
    per_class: Dict[int, Dict[str, int]] = {int(c["id"]): dict.fromkeys(counts, 0) for c in gt["categories"]}
    images: Dict[int, ImageErrors] = {}
    for image_id, rec in records.items():
        verdict = analyse_image(rec, score_thresh, fg_iou, bg_iou)
        images[image_id] = verdict
        for kind, idx in zip(verdict.dt_kind, verdict.dt_index):
            if kind != "ignored":
                counts[kind] += 1
                per_class.setdefault(int(rec.dt_cats[idx]), dict.fromkeys(counts, 0))[kind] += 1
        for j in verdict.missed:
            counts["missed"] += 1
            per_class.setdefault(int(rec.gt_cats[j]), dict.fromkeys(counts, 0))["missed"] += 1
    return ErrorAnalysis(counts, per_class, images, score_thresh, fg_iou, bg_iou)


# --------------------------------------------------------------------------- outputs


def plot_error_breakdown(analysis: ErrorAnalysis, path: str | Path, title: str = "Error breakdown") -> Path:
    """A horizontal bar per error type (count and share of all errors) and the number of
    true positives in the title; PNG at ``path``."""
    path = Path(path)
    values = [analysis.counts[k] for k in ERROR_TYPES]
    total = max(1, sum(values))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 3.2), dpi=80)
    colors = ["#4477aa", "#66ccee", "#228833", "#ccbb44", "#ee6677", "#aa3377"]
    ax.barh(range(len(values)), values, color=colors)
    ax.set_yticks(range(len(values)))
    ax.set_yticklabels(ERROR_TYPES)
    ax.invert_yaxis()
    for k, v in enumerate(values):
        ax.text(v, k, f" {v} ({100.0 * v / total:.0f}%)", va="center", fontsize=8)
    ax.set_xlim(0, max(values + [1]) * 1.25)
    ax.set_xlabel("count")
    ax.set_title(f"{title}\n{analysis.counts['tp']} true positives, score >= {analysis.score_thresh:g}, "
                 f"IoU fg {analysis.fg_iou:g} / bg {analysis.bg_iou:g}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _image_array(info: Dict[str, Any], image_dir: Optional[str | Path]) -> Tuple[np.ndarray, Optional[str]]:
    """The image of a ground-truth ``images`` entry from ``image_dir``, or a grey canvas
    of its ``height x width`` when there is no folder, no readable file, or a file of
    another size (another picture: its boxes would be drawn on the wrong one); with the
    reason for the canvas (None: the image itself, or no folder given)."""
    h, w = int(info.get("height") or 0), int(info.get("width") or 0)
    canvas = np.full((max(h, 1), max(w, 1), 3), GREY, dtype=np.uint8)
    if image_dir is None:
        return canvas, None
    path = Path(image_dir) / str(info.get("file_name", ""))
    try:
        image = load_image(str(path))
    except (FileNotFoundError, DataError, OSError) as exc:
        return canvas, first_line(exc)
    if image.shape[:2] != (h, w):
        return canvas, f"{path} is {image.shape[1]}x{image.shape[0]}, the annotation {w}x{h}"
    return image, None


def draw_worst_images(analysis: ErrorAnalysis, gt: Dict[str, Any], results: Any, output_dir: str | Path, n: int,
                      image_dir: Optional[str | Path] = None) -> List[Path]:
    """Draw the ``n`` images with the most errors to ``output_dir/<image id>.png``: the
    ground truth (green, ``missed <class>`` on misses) and the erroneous detections
    (captioned ``<error> <class> <score>``)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = {int(c["id"]): str(c.get("name", c["id"])) for c in gt["categories"]}
    infos = {int(img["id"]): img for img in gt["images"]}
    records = group_by_image(gt, results)
    paths, canvases = [], []
    for image_id in analysis.worst_images(n):
        rec, verdict = records[image_id], analysis.images[image_id]
        wrong = [(k, i) for k, i in zip(verdict.dt_kind, verdict.dt_index) if k in ERROR_TYPES]
        captions = [f"{k} {names.get(int(rec.dt_cats[i]), rec.dt_cats[i])} {rec.dt_scores[i]:.2f}" for k, i in wrong]
        missed = set(verdict.missed)
        gt_captions = [f"missed {names.get(int(c), c)}" if j in missed else "" for j, c in enumerate(rec.gt_cats)]
        image, why_canvas = _image_array(infos[image_id], image_dir)
        canvases += [why_canvas] if why_canvas else []
        drawing = render(image, rec.dt_boxes[[i for _, i in wrong]].reshape(-1, 4),
                         captions, gt_boxes=rec.gt_boxes, gt_labels=gt_captions)
        path = out / f"{image_id}.png"
        Image.fromarray(drawing.image.permute(1, 2, 0).numpy()).save(path)
        paths.append(path)
    if canvases:
        logger.warning("--image-dir %s: %d of the %d worst images drawn on a grey canvas instead (first: %s)",
                       image_dir, len(canvases), len(paths), canvases[0])
    return paths


def analysis_summary(analysis: ErrorAnalysis, class_names: Dict[int, str]) -> Dict[str, Any]:
    """JSON-ready summary: thresholds, counts, per class, and the worst images."""
    return {
        "score_thresh": analysis.score_thresh,
        "fg_iou": analysis.fg_iou,
        "bg_iou": analysis.bg_iou,
        "counts": analysis.counts,
        "per_class": [{"category_id": c, "name": class_names.get(c, str(c)), **v}
                      for c, v in sorted(analysis.per_class.items())],
        "worst_images": [{"image_id": i, "errors": analysis.images[i].num_errors} for i in analysis.worst_images(20)],
    }


# The files write_analysis writes (beside the worst_images/ folder).
ANALYSIS_FILES = ("analysis.json", "analysis.csv", "analysis.png")


def write_analysis(analysis: ErrorAnalysis, gt: Dict[str, Any], results: Any, output_dir: str | Path,
                   num_images: int = 10, image_dir: Optional[str | Path] = None) -> Dict[str, Path]:
    """Write ``analysis.json``, ``analysis.csv`` (one row per class), ``analysis.png``
    (:func:`plot_error_breakdown`) and ``worst_images/<image id>.png`` (the
    ``num_images`` images with the most errors; drawn on the files of ``image_dir``
    named by the ground truth's ``file_name``, else on a grey canvas) under ``output_dir``."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = {int(c["id"]): str(c.get("name", c["id"])) for c in gt["categories"]}
    summary = analysis_summary(analysis, names)
    json_path, csv_path, plot_path = (out / name for name in ANALYSIS_FILES)
    write_json(json_path, summary)
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["category_id", "name", "tp", *ERROR_TYPES])
        writer.writeheader()
        writer.writerow({"category_id": "all", "name": "all", **analysis.counts})
        for row in summary["per_class"]:
            writer.writerow(row)
    paths = {"analysis_json": json_path, "analysis_csv": csv_path,
             "analysis_plot": plot_error_breakdown(analysis, plot_path)}
    draw_worst_images(analysis, gt, results, out / "worst_images", num_images, image_dir)
    paths["worst_images"] = out / "worst_images"
    return paths


def format_analysis(analysis: ErrorAnalysis) -> str:
    """One console line per error type, and the true positives."""
    total = max(1, sum(analysis.counts[k] for k in ERROR_TYPES))
    lines = [f"error analysis (score >= {analysis.score_thresh:g}): {analysis.counts['tp']} true positives"]
    lines += [f"  {k:<15s}{analysis.counts[k]:>8d}  {100.0 * analysis.counts[k] / total:5.1f}%" for k in ERROR_TYPES]
    return "\n".join(lines)


def run_analysis(gt: Dict[str, Any], results: Any, output_dir: Optional[str | Path], score_thresh: float = 0.5,
                 num_images: int = 10, image_dir: Optional[str | Path] = None) -> ErrorAnalysis:
    """:func:`analyse_errors`, then (with an ``output_dir``) :func:`write_analysis`."""
    analysis = analyse_errors(gt, results, score_thresh)
    if output_dir is not None:
        write_analysis(analysis, gt, results, output_dir, num_images, image_dir)
    return analysis
