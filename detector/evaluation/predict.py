"""Run a detector on image files and draw its detections (``tools/infer.py``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image
from torch import nn

from detector.data.files import DataError, load_image

from .draw import render
from .inference import model_device, to_original_boxes, unwrap

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def list_images(path: str | Path) -> List[Path]:
    """One image file, or the image files of a folder (sorted, not recursive).

    Raises:
        FileNotFoundError: no such path, or a folder without images (named).
    """
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"no image files ({', '.join(IMAGE_SUFFIXES)}) in {path}")
        return files
    raise FileNotFoundError(f"input not found: {path}")


def read_rgb(path: str | Path) -> np.ndarray:
    """uint8 [H, W, 3] RGB, any bit depth scaled as ``detector.data.files.to_rgb8`` does.

    Raises:
        FileNotFoundError: no such file.
        DataError: the file is unreadable or its pixel type has no 8-bit scale (named).
    """
    return load_image(str(path))


@torch.inference_mode()
def predict_image(
    model: nn.Module,
    image: np.ndarray,
    transform: Optional[Callable] = None,
    score_thresh: float = 0.5,
) -> Dict[str, torch.Tensor]:
    """Detections of one image, in its own pixel coordinates.

    Args:
        model: a detector in eval mode (or its DDP wrapper).
        image: uint8 [H, W, 3] RGB.
        transform: the eval transform (``build_transforms(cfg, is_train=False)``) to
            resize the image like the evaluation does; None = the image as is.
        score_thresh: detections below it are dropped.

    Returns:
        ``boxes`` float32 [M, 4] xyxy original pixels, ``scores`` [M], ``labels`` [M].
    """
    net = unwrap(model)
    h, w = image.shape[:2]
    if transform is not None:
        tensor, _, _ = transform(image, np.zeros((0, 4), np.float32), np.zeros((0,), np.int64))
    else:
        tensor = torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))
    new_h, new_w = tensor.shape[-2:]
    target = {
        "scale": torch.tensor([new_w / w, new_h / h], dtype=torch.float32),
        "orig_size": torch.tensor([h, w]),
    }
    out = net([tensor.to(model_device(net))])[0]
    keep = out["scores"] >= score_thresh
    return {
        "boxes": to_original_boxes(out["boxes"][keep], target),
        "scores": out["scores"][keep].float().cpu(),
        "labels": out["labels"][keep].cpu(),
    }


def draw_detections(image: np.ndarray, det: Dict[str, torch.Tensor], class_names: Sequence[str]) -> torch.Tensor:
    """uint8 [3, H', W'] with boxes and ``name score`` captions drawn on ``image``
    (uint8 [H, W, 3]); small images scaled up (see :func:`detector.evaluation.draw.render`)."""
    captions = [
        f"{class_names[int(lab) - 1] if 0 < int(lab) <= len(class_names) else lab} {float(s):.2f}"
        for lab, s in zip(det["labels"], det["scores"])
    ]
    return render(image, det["boxes"], captions).image


def predict_files(
    model: nn.Module,
    paths: Sequence[Path],
    output_dir: str | Path,
    class_names: Sequence[str],
    transform: Optional[Callable] = None,
    score_thresh: float = 0.5,
) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Detect on each file, write ``<output_dir>/<stem>.png`` with the boxes drawn.

    A file that cannot be read (missing, corrupt, unsupported pixel type) is skipped with
    a warning naming it; the others are still processed.

    Returns:
        ``(records, skipped)``: one JSON-ready record per readable file (``file``,
        ``height``, ``width``, ``boxes`` xyxy, ``scores``, ``labels``, ``names``), and one
        message per skipped file.
    """
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    net = unwrap(model)
    was_training = net.training
    net.eval()
    records: List[Dict[str, Any]] = []
    skipped: List[str] = []
    try:
        for path in paths:
            try:
                image = read_rgb(path)
            except (FileNotFoundError, DataError) as exc:
                logger.warning("skipped: %s", exc)
                skipped.append(str(exc))
                continue
            det = predict_image(net, image, transform, score_thresh)
            drawn = draw_detections(image, det, class_names)
            Image.fromarray(drawn.permute(1, 2, 0).numpy()).save(out_dir / f"{Path(path).stem}.png")
            labels = det["labels"].tolist()
            records.append(
                {
                    "file": str(path),
                    "height": int(image.shape[0]),
                    "width": int(image.shape[1]),
                    "boxes": [[round(v, 2) for v in b] for b in det["boxes"].tolist()],
                    "scores": [round(s, 4) for s in det["scores"].tolist()],
                    "labels": labels,
                    "names": [class_names[lab - 1] if 0 < lab <= len(class_names) else str(lab) for lab in labels],
                }
            )
            logger.info("%s: %d detections", path, len(labels))
    finally:
        net.train(was_training)
    return records, skipped
