"""PNG plots of evaluation results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")  # headless; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _step(ax, recall: np.ndarray, precision: np.ndarray, **kwargs) -> bool:
    """Draw one step curve from (0, p0); False when there is nothing to draw."""
    recall = np.asarray(recall, dtype=np.float64)
    precision = np.asarray(precision, dtype=np.float64)
    if recall.size == 0 or not np.isfinite(recall).all():
        return False
    ax.step(np.concatenate([[0.0], recall]), np.concatenate([[precision[0]], precision]), where="post", **kwargs)
    return True


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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if len(curves) <= max_single:
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
        fig.savefig(path)
        plt.close(fig)
        return path
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
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
