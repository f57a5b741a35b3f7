"""Pictures of evaluation results: PNG plots (precision-recall curves, confusion
matrix; matplotlib, Agg backend: no display needed), and detections drawn on images
(PIL; ``tools/infer.py`` and TensorBoard).

Detections are drawn so that people can read them:

- Small images are scaled up (nearest neighbour, an integer factor) until the shorter
  side is at least ``min_side`` pixels, so the captions can be read on the demo's
  64-128 px images.
- Every caption sits on a filled rectangle of its box's colour and is kept inside the
  image: above the box where there is room, else inside it, shifted left at the right
  edge and down at the top edge, and moved (below the box, or further down) where it
  would cover a caption drawn before it (``palette.place_caption``).
- Without class labels, ground truth (green) and predictions (orange-red) are told apart
  by colour; with them, each class has its own colour (``palette.class_color``, stable
  across images, distinct at 80 classes) and ground truth is dashed when predictions are
  drawn too. A legend band under the image names only what is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

from .fonts import image_font, plot_font  # noqa: E402
from .mpl import pyplot  # noqa: E402
from .palette import class_color, place_caption, text_color  # noqa: E402
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
        pyplot().close(fig)


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
    with plot_font(curves):  # the class names' characters (fonts.py)
        fig = (_one_plot if len(curves) <= max_single else _small_multiples)(curves, title, ap_kind)
        return _save_png(fig, path)


def _one_plot(curves: Dict[str, Tuple[np.ndarray, np.ndarray, float]], title: str, ap_kind: str):
    """One axes, one line per class, the legend beside it."""
    plt = pyplot()
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
    fig.tight_layout()
    return fig


# Small multiples, in inches: a panel's cell, and the margins around the grid. The panels
# have the same axes and ticks, so only the outer ones show tick labels, and
# the layout is fixed: no shared axes and no tight_layout, whose cost grows with the square
# of the panel count (12.6 s for 81 panels, 2.7 s like this; docs/evaluation.md, "Outputs").
PANEL_W, PANEL_H = 2.1, 1.9
LEFT, RIGHT, BOTTOM, TOP = 0.45, 0.15, 0.35, 0.8  # tick labels; the figure's title and the first row's
GAP_W, GAP_H = 0.25, 0.45  # between panels: none of their tick labels; two lines of panel title
TICKS, TICK_LABELS = (0.0, 0.5, 1.0), ("0", "0.5", "1")


def _small_multiples(curves: Dict[str, Tuple[np.ndarray, np.ndarray, float]], title: str, ap_kind: str):
    """One panel per class, classes in decreasing AP (``PANEL_W`` x ``PANEL_H`` inches each)."""
    order = sorted(curves, key=lambda n: -(curves[n][2] if np.isfinite(curves[n][2]) else -1.0))
    cols = int(np.ceil(np.sqrt(len(order))))
    rows = int(np.ceil(len(order) / cols))
    width, height = PANEL_W * cols, PANEL_H * rows + 0.6
    fig, axes = pyplot().subplots(rows, cols, figsize=(width, height), dpi=100, squeeze=False)
    axes_w = (width - LEFT - RIGHT - (cols - 1) * GAP_W) / cols
    axes_h = (height - BOTTOM - TOP - (rows - 1) * GAP_H) / rows
    fig.subplots_adjust(left=LEFT / width, right=1 - RIGHT / width, bottom=BOTTOM / height, top=1 - TOP / height,
                        wspace=GAP_W / axes_w, hspace=GAP_H / axes_h)
    for i, (ax, name) in enumerate(zip(axes.flat, order)):
        recall, precision, ap = curves[name]
        if not _step(ax, recall, precision, color="tab:blue", linewidth=1.2):
            ax.text(0.5, 0.5, "no detections", ha="center", va="center", fontsize=7, transform=ax.transAxes)
        ax.set_title(f"{name}\n{ap_kind} {ap:.3f}", fontsize=8)
        ax.set_xlim(0.0, 1.0)
        ax.set_ylim(0.0, 1.02)
        ax.set_xticks(TICKS, TICK_LABELS)
        ax.set_yticks(TICKS, TICK_LABELS)
        # Tick labels on the left column, and under the last panel of each column.
        ax.tick_params(labelsize=6, labelleft=i % cols == 0, labelbottom=i + cols >= len(order))
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(order):]:
        ax.axis("off")
    fig.suptitle(f"{title}: x recall, y precision; classes by decreasing {ap_kind}", fontsize=11,
                 y=1 - 0.1 / height, va="top")
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
    with plot_font(names):  # the class names' characters (fonts.py)
        return _save_png(_confusion_figure(matrix, norm, names, title), path)


def _confusion_figure(matrix: np.ndarray, norm: np.ndarray, names: Sequence[str], title: str) -> Any:
    """The figure of :func:`plot_confusion_matrix`: ``norm`` in colour, ``matrix``'s counts in cells."""
    size = max(5.0, 0.45 * len(names) + 2.5)
    fig, ax = pyplot().subplots(figsize=(size, size * 0.85), dpi=100)
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
    return fig


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
        legend: the legend's entries, left to right (empty: no legend band).
    """

    image: torch.Tensor
    scale: int
    image_height: int
    label_boxes: List[Tuple[int, int, int, int]] = field(default_factory=list)
    legend: List[str] = field(default_factory=list)


@dataclass
class _Group:
    """Boxes of one kind (ground truth or predictions) to draw."""

    name: str
    boxes: np.ndarray  # [N, 4] xyxy, drawn pixels
    captions: Sequence[str]
    classes: Optional[List[int]]  # class label per box, or None: the group's colour
    color: Tuple[int, int, int]
    dashed: bool = False

    def box_color(self, k: int) -> Tuple[int, int, int]:
        return class_color(self.classes[k]) if self.classes is not None else self.color


def _to_pil(image: torch.Tensor | np.ndarray) -> Image.Image:
    """uint8 [3, H, W] tensor or [H, W, 3] array -> RGB PIL image."""
    if isinstance(image, torch.Tensor):
        array = image.detach().to(torch.uint8).cpu().permute(1, 2, 0).numpy()
    else:
        array = np.asarray(image, dtype=np.uint8)
    return Image.fromarray(np.ascontiguousarray(array), "RGB")


def _place(text_w: int, text_h: int, box: Sequence[float], width: int, height: int) -> Tuple[int, int, int, int]:
    """The caption rectangle for a box with no other captions around (see ``place_caption``)."""
    return place_caption(text_w, text_h, box, width, height)


def _group(name: str, boxes, captions: Sequence[str], classes, color: Tuple[int, int, int], scale: int) -> _Group:
    array = np.zeros((0, 4)) if boxes is None else np.asarray(
        torch.as_tensor(boxes).detach().float().cpu(), dtype=np.float64).reshape(-1, 4)
    labels = None if classes is None else [int(c) for c in torch.as_tensor(classes).reshape(-1).tolist()]
    if labels is not None and len(labels) != len(array):
        raise ValueError(f"render: {len(labels)} {name} classes for {len(array)} boxes")
    return _Group(name, array * scale, list(captions), labels, color)


def _dashed_rectangle(draw: ImageDraw.ImageDraw, xy: Sequence[float], color, width: int) -> None:
    """A rectangle outline of dashes (3 line widths on, 2 off)."""
    x1, y1, x2, y2 = xy
    on, period = 3 * width + 2, 5 * width + 3
    for a in np.arange(x1, x2, period):
        b = min(a + on, x2)
        draw.line([(a, y1), (b, y1)], fill=color, width=width)
        draw.line([(a, y2), (b, y2)], fill=color, width=width)
    for a in np.arange(y1, y2, period):
        b = min(a + on, y2)
        draw.line([(x1, a), (x1, b)], fill=color, width=width)
        draw.line([(x2, a), (x2, b)], fill=color, width=width)


def _draw_groups(draw: ImageDraw.ImageDraw, groups: List[_Group], width: int, height: int, font) -> List[Tuple[int, int, int, int]]:
    """Outlines and captions; a caption avoids those placed before it (``place_caption``)."""
    line = max(1, round(max(width, height) / 300))
    rects: List[Tuple[int, int, int, int]] = []
    for g in groups:
        for k, box in enumerate(g.boxes):
            color = g.box_color(k)
            x1, y1 = np.clip(box[[0, 1]], 0, [width - 1, height - 1])
            x2, y2 = np.clip(box[[2, 3]], 0, [width - 1, height - 1])
            if g.dashed:
                _dashed_rectangle(draw, (x1, y1, x2, y2), color, line)
            else:
                draw.rectangle([x1, y1, x2, y2], outline=color, width=line)
            if k < len(g.captions) and g.captions[k]:
                left, top, right, bottom = draw.textbbox((0, 0), str(g.captions[k]), font=font)
                rect = place_caption(right - left + 4, bottom - top + 4, box, width, height, rects)
                draw.rectangle([rect[0], rect[1], rect[2] - 1, rect[3] - 1], fill=color)
                text = TEXT_COLOR if g.classes is None else text_color(color)
                draw.text((rect[0] + 2 - left, rect[1] + 2 - top), str(g.captions[k]), fill=text, font=font)
                rects.append(rect)
    return rects


def _legend_entries(groups: List[_Group], class_names: Sequence[str]) -> List[Tuple[str, Optional[Tuple[int, int, int]]]]:
    """What the legend says: the kinds drawn in their colours; with class colours, the
    classes drawn, plus which outline is which kind when both kinds are drawn."""
    if not any(g.classes is not None for g in groups):
        return [(g.name, g.color) for g in groups]
    labels = sorted({c for g in groups if g.classes is not None for c in g.classes})
    entries: List[Tuple[str, Optional[Tuple[int, int, int]]]] = [
        (class_names[c - 1] if 0 < c <= len(class_names) else str(c), class_color(c)) for c in labels]
    if len(groups) == 2:
        entries += [("dashed: ground truth", None), ("solid: prediction", None)]
    return entries


def _legend_rows(entries, width: int, font) -> List[List[Tuple[int, str, Optional[Tuple[int, int, int]]]]]:
    """The entries wrapped into rows that fit ``width``: per row ``(x, text, swatch colour)``."""
    rows: List[List[Tuple[int, str, Optional[Tuple[int, int, int]]]]] = []
    x = width
    for text, color in entries:
        w = (16 if color is not None else 0) + int(font.getlength(text)) + 14
        if x + w > width and (not rows or rows[-1]):
            rows.append([])
            x = 4
        rows[-1].append((x, text, color))
        x += w
    return rows


MAX_DRAWN_SIDE = 4096  # pixels: render() scales small images up, never past this side


def render(
    image: torch.Tensor | np.ndarray,
    pred_boxes: Optional[torch.Tensor | np.ndarray] = None,
    pred_labels: Sequence[str] = (),
    gt_boxes: Optional[torch.Tensor | np.ndarray] = None,
    gt_labels: Sequence[str] = (),
    min_side: int = 320,
    pred_classes: Optional[Sequence[int] | torch.Tensor] = None,
    gt_classes: Optional[Sequence[int] | torch.Tensor] = None,
    class_names: Sequence[str] = (),
) -> Drawing:
    """Draw ground truth and predictions with their captions.

    Without classes, ground truth is green and predictions orange-red. With
    ``pred_classes`` / ``gt_classes`` (label 1..K per box) every box and caption takes its
    class's colour (``palette.class_color``); when both kinds are drawn, ground truth is
    dashed. Captions do not overlap one another where a free place exists
    (``palette.place_caption``). The legend under the image names only what is drawn
    (no "ground truth" entry without ground-truth boxes; with classes, the classes drawn,
    ``class_names[label - 1]``); nothing drawn, no legend band.

    Args:
        image: uint8 ``[3, H, W]`` tensor or ``[H, W, 3]`` array.
        pred_boxes, gt_boxes: ``[N, 4]`` xyxy in the pixels of ``image``, or None.
        pred_labels, gt_labels: one caption per box (empty: boxes without captions).
        min_side: scale up by an integer factor until the shorter side reaches this, as
            far as the longer side stays within ``MAX_DRAWN_SIDE`` (a 1 x 60000 image
            would have become 320 x 19,200,000 pixels).
    """
    pil = _to_pil(image)
    scale = max(1, min(int(np.ceil(min_side / max(1, min(pil.size)))), MAX_DRAWN_SIDE // max(pil.size)))
    if scale > 1:
        pil = pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST)
    groups = [g for g in (_group("ground truth", gt_boxes, gt_labels, gt_classes, GT_COLOR, scale),
                          _group("prediction", pred_boxes, pred_labels, pred_classes, PRED_COLOR, scale)) if len(g.boxes)]
    if len(groups) == 2 and groups[0].classes is not None:
        groups[0].dashed = True
    entries = _legend_entries(groups, class_names)
    # All class names, not only those drawn here: one font, and one warning, for every image of a run.
    font = image_font([*(c for g in groups for c in g.captions), *(text for text, _ in entries), *class_names],
                      FONT_SIZE)
    rows = _legend_rows(entries, pil.width, font)
    row_h = FONT_SIZE + 8
    canvas = Image.new("RGB", (pil.width, pil.height + row_h * len(rows)), (255, 255, 255))
    canvas.paste(pil, (0, 0))
    draw = ImageDraw.Draw(canvas)
    rects = _draw_groups(draw, groups, pil.width, pil.height, font)
    for r, row in enumerate(rows):
        top = pil.height + r * row_h
        for x, text, color in row:
            if color is not None:
                draw.rectangle([x, top + 5, x + 12, top + 5 + FONT_SIZE - 2], fill=color)
                x += 16
            draw.text((x, top + 4), text, fill=TEXT_COLOR, font=font)
    tensor = torch.from_numpy(np.asarray(canvas).copy()).permute(2, 0, 1).contiguous()
    return Drawing(image=tensor, scale=scale, image_height=pil.height, label_boxes=rects,
                   legend=[text for text, _ in entries])


def draw_detections(
    image: torch.Tensor,
    gt_boxes: Optional[torch.Tensor],
    pred_boxes: torch.Tensor,
    pred_labels: List[str],
    gt_classes: Optional[torch.Tensor] = None,
    pred_classes: Optional[torch.Tensor] = None,
    class_names: Sequence[str] = (),
) -> torch.Tensor:
    """Ground truth and captioned predictions on a uint8 ``[3, H, W]`` image (boxes
    ``[N, 4]`` xyxy pixels of that image): uint8 ``[3, H', W']``; with classes, in their
    class colours (see :func:`render`)."""
    return render(image, pred_boxes, pred_labels, gt_boxes=gt_boxes, pred_classes=pred_classes,
                  gt_classes=gt_classes, class_names=class_names).image
