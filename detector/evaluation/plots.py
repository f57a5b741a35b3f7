"""Pictures of evaluation results: PNG plots (precision-recall curves, confusion
matrix; matplotlib, Agg backend: no display needed), and detections drawn on images
(PIL; ``tools/infer.py`` and TensorBoard).

Detections are drawn so that people can read them:

- Small images are scaled up (nearest neighbour, an integer factor) until the shorter
  side is at least ``min_side`` pixels, so the captions can be read on the demo's
  64-128 px images.
- Every caption sits on a filled rectangle of its box's colour and is kept inside the
  image: above the box where there is room, else inside it, shifted left at the right
  edge and down at the top edge.
- Ground truth (green) and predictions (orange-red) are told apart by colour, and a
  legend band under the image says which is which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")  # headless; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageDraw, ImageFont  # noqa: E402

from detector.files import atomic_write  # noqa: E402


def _step(ax, recall: np.ndarray, precision: np.ndarray, **kwargs) -> bool:
    """Draw one step curve from (0, p0); False when there is nothing to draw."""
    recall = np.asarray(recall, dtype=np.float64)
    precision = np.asarray(precision, dtype=np.float64)
    if recall.size == 0 or not np.isfinite(recall).all():
        return False
    ax.step(np.concatenate([[0.0], recall]), np.concatenate([[precision[0]], precision]), where="post", **kwargs)
    return True


def _save_png(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` as a PNG through ``detector.files.atomic_write``, then close it."""
    try:
        return atomic_write(path, lambda f: fig.savefig(f, format="png"))
    finally:
        plt.close(fig)


def plot_pr_curves(
    curves: Dict[str, Tuple[np.ndarray, np.ndarray, float]],
    path: str | Path,
    title: str = "Precision-recall per class",
    ap_kind: str = "VOC area AP",
    max_single: int = 10,
) -> Path:
    """Precision-recall curves per class, readable at 3, 20 or 80 classes.

    Up to ``max_single`` classes: one plot, one line per class, the legend beside it.
    More: small multiples, one panel per class (titled with its name and AP), classes in
    decreasing AP, so the best and the worst are the first and the last panels.

    Args:
        curves: class name -> (recall [P], precision [P], AP), the points in decreasing
            score order (as :class:`detector.evaluation.voc.VOCClassResult` holds them).
        path: the PNG to write.
        ap_kind: what the AP is, written wherever an AP is shown.
    """
    fig = (_one_plot if len(curves) <= max_single else _small_multiples)(curves, title, ap_kind)
    fig.tight_layout()
    return _save_png(fig, path)


def _one_plot(curves: Dict[str, Tuple[np.ndarray, np.ndarray, float]], title: str, ap_kind: str):
    """One axes, one line per class, the legend beside it."""
    fig, ax = plt.subplots(figsize=(9, 6), dpi=100)
    cmap = plt.get_cmap("tab10")
    drawn = 0
    for i, (name, (recall, precision, ap)) in enumerate(curves.items()):
        drawn += _step(ax, recall, precision, color=cmap(i % 10), linewidth=1.5, label=f"{name} ({ap_kind} {ap:.3f})")
    if drawn == 0:
        ax.text(0.5, 0.5, "no detections", ha="center", va="center", fontsize=14, transform=ax.transAxes)
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, borderaxespad=0.0)
    return fig


def _small_multiples(curves: Dict[str, Tuple[np.ndarray, np.ndarray, float]], title: str, ap_kind: str):
    """One panel per class, classes in decreasing AP."""
    order = sorted(curves, key=lambda n: -(curves[n][2] if np.isfinite(curves[n][2]) else -1.0))
    cols = int(np.ceil(np.sqrt(len(order))))
    rows = int(np.ceil(len(order) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(2.1 * cols, 1.9 * rows + 0.6), dpi=100, sharex=True, sharey=True,
                             squeeze=False)
    for ax, name in zip(axes.flat, order):
        recall, precision, ap = curves[name]
        if not _step(ax, recall, precision, color="tab:blue", linewidth=1.2):
            ax.text(0.5, 0.5, "no detections", ha="center", va="center", fontsize=7, transform=ax.transAxes)
        ax.set_title(f"{name}\n{ap_kind} {ap:.3f}", fontsize=8)
        ax.set_xlim(0.0, 1.0)
        ax.set_ylim(0.0, 1.02)
        ax.tick_params(labelsize=6)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(order):]:
        ax.axis("off")
    fig.suptitle(f"{title}: x recall, y precision; classes by decreasing {ap_kind}", fontsize=11)
    return fig


def plot_confusion_matrix(
    matrix: np.ndarray,
    class_names: Sequence[str],
    path: str | Path,
    title: str = "Confusion matrix",
) -> Path:
    """Heat map of a ``[K+1, K+1]`` confusion matrix (index 0 = background), rows
    normalised to 1 (colour) with the raw counts written in cells when K <= 30."""
    path = Path(path)
    matrix = np.asarray(matrix)
    names = ["background", *class_names]
    if matrix.shape != (len(names), len(names)):
        raise ValueError(f"confusion matrix shape {matrix.shape} does not fit {len(class_names)} classes + background")
    rows = matrix.sum(axis=1, keepdims=True)
    norm = np.divide(matrix, rows, out=np.zeros(matrix.shape, dtype=np.float64), where=rows > 0)
    size = max(5.0, 0.45 * len(names) + 2.5)
    fig, ax = plt.subplots(figsize=(size, size * 0.85), dpi=100)
    im = ax.imshow(norm, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="fraction of the row")
    ax.set_xticks(range(len(names)))
    ax.set_yticks(range(len(names)))
    ax.set_xticklabels(names, rotation=90, fontsize=7)
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title)
    if len(names) <= 31:
        for i in range(len(names)):
            for j in range(len(names)):
                if matrix[i, j]:
                    color = "white" if norm[i, j] > 0.5 else "black"
                    ax.text(j, i, str(int(matrix[i, j])), ha="center", va="center", fontsize=7, color=color)
    fig.tight_layout()
    return _save_png(fig, path)


# --------------------------------------------------------------------------- drawing

GT_COLOR = (0, 200, 0)
PRED_COLOR = (255, 64, 0)
TEXT_COLOR = (0, 0, 0)
FONT_SIZE = 13


@dataclass
class Drawing:
    """A drawn image and where its captions went.

    Attributes:
        image: uint8 [3, H', W'] (the scaled image plus the legend band at the bottom).
        scale: the integer factor the input was scaled by.
        image_height: H' without the legend band.
        label_boxes: per caption ``(x1, y1, x2, y2)``, the filled rectangle in drawn pixels.
    """

    image: torch.Tensor
    scale: int
    image_height: int
    label_boxes: List[Tuple[int, int, int, int]] = field(default_factory=list)


def _to_pil(image: torch.Tensor | np.ndarray) -> Image.Image:
    """uint8 [3, H, W] tensor or [H, W, 3] array -> RGB PIL image."""
    if isinstance(image, torch.Tensor):
        array = image.detach().to(torch.uint8).cpu().permute(1, 2, 0).numpy()
    else:
        array = np.asarray(image, dtype=np.uint8)
    return Image.fromarray(np.ascontiguousarray(array), "RGB")


def _place(text_w: int, text_h: int, box: Sequence[float], width: int, height: int) -> Tuple[int, int, int, int]:
    """The caption rectangle for a box: above its top-left corner, or inside it when
    there is no room above; clamped to the ``width x height`` image."""
    w, h = min(text_w, width), min(text_h, height)
    x1 = int(round(box[0]))
    y1 = int(round(box[1])) - h
    if y1 < 0:
        y1 = max(0, int(round(box[1])))
    x1 = max(0, min(x1, width - w))
    y1 = max(0, min(y1, height - h))
    return x1, y1, x1 + w, y1 + h


def render(
    image: torch.Tensor | np.ndarray,
    pred_boxes: torch.Tensor | np.ndarray,
    pred_labels: Sequence[str] = (),
    gt_boxes: Optional[torch.Tensor | np.ndarray] = None,
    gt_labels: Sequence[str] = (),
    min_side: int = 320,
) -> Drawing:
    """Draw ground truth and predictions with their captions.

    Args:
        image: uint8 ``[3, H, W]`` tensor or ``[H, W, 3]`` array.
        pred_boxes, gt_boxes: ``[N, 4]`` xyxy in the pixels of ``image``.
        pred_labels, gt_labels: one caption per box (empty: boxes without captions).
        min_side: scale up by an integer factor until the shorter side reaches this.
    """
    pil = _to_pil(image)
    scale = max(1, int(np.ceil(min_side / max(1, min(pil.size)))))
    if scale > 1:
        pil = pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST)
    font = ImageFont.load_default(size=FONT_SIZE)
    legend_h = FONT_SIZE + 8
    canvas = Image.new("RGB", (pil.width, pil.height + legend_h), (255, 255, 255))
    canvas.paste(pil, (0, 0))
    draw = ImageDraw.Draw(canvas)
    width, height = pil.width, pil.height
    line = max(1, round(max(width, height) / 300))
    rects: List[Tuple[int, int, int, int]] = []
    groups = [(gt_boxes, gt_labels, GT_COLOR), (pred_boxes, pred_labels, PRED_COLOR)]
    for boxes, labels, color in groups:
        if boxes is None:
            continue
        boxes = np.asarray(torch.as_tensor(boxes).detach().float().cpu(), dtype=np.float64).reshape(-1, 4) * scale
        for k, box in enumerate(boxes):
            x1, y1 = np.clip(box[[0, 1]], 0, [width - 1, height - 1])
            x2, y2 = np.clip(box[[2, 3]], 0, [width - 1, height - 1])
            draw.rectangle([x1, y1, x2, y2], outline=color, width=line)
            if k < len(labels) and labels[k]:
                left, top, right, bottom = draw.textbbox((0, 0), str(labels[k]), font=font)
                rect = _place(right - left + 4, bottom - top + 4, box, width, height)
                draw.rectangle([rect[0], rect[1], rect[2] - 1, rect[3] - 1], fill=color)
                draw.text((rect[0] + 2 - left, rect[1] + 2 - top), str(labels[k]), fill=TEXT_COLOR, font=font)
                rects.append(rect)
    # Legend band under the image.
    x = 4
    for name, color in (("ground truth", GT_COLOR), ("prediction", PRED_COLOR)):
        draw.rectangle([x, height + 5, x + 12, height + 5 + FONT_SIZE - 2], fill=color)
        draw.text((x + 16, height + 4), name, fill=TEXT_COLOR, font=font)
        x += 16 + int(draw.textlength(name, font=font)) + 14
    tensor = torch.from_numpy(np.asarray(canvas).copy()).permute(2, 0, 1).contiguous()
    return Drawing(image=tensor, scale=scale, image_height=height, label_boxes=rects)


def draw_detections(
    image: torch.Tensor,
    gt_boxes: torch.Tensor,
    pred_boxes: torch.Tensor,
    pred_labels: List[str],
) -> torch.Tensor:
    """Ground truth and captioned predictions on a uint8 ``[3, H, W]`` image (boxes
    ``[N, 4]`` xyxy pixels of that image): uint8 ``[3, H', W']`` (see :func:`render`)."""
    return render(image, pred_boxes, pred_labels, gt_boxes=gt_boxes).image
