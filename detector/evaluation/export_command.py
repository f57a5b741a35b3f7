"""``tools/export.py``'s work: export a trained detector to TorchScript or ONNX and check
the file against the eager model on two test images (``export_command``).

The test images (``test_images``) are the given image and its top-left 3/4 crop, or two
generated shapes scenes of different sizes and aspect ratios, so that every level's
anchor count differs between them. Timing the file (``--time``) is a measurement and
stays with the benchmarks (``benchmarks.tasks.benchmark_exported``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from detector.config import load_config
from detector.data import class_names_for
from detector.data.files import load_image
from detector.data.shapes import generate_image
from detector.files import check_writes_apart
from detector.modeling import FasterRCNN, build_model
from detector.modeling.export import (BOX_RTOL, BOX_TOL, DEFAULT_OPSET, SCORE_TOL, ExportError, export_metadata,
                                      export_model, verify_export)
from detector.modeling.summary import default_image_size

from .trained_weights import load_trained_weights


def test_images(size: Tuple[int, int], image_path: Optional[str]) -> List[Tensor]:
    """Two uint8 ``[3, H, W]`` images of different sizes: ``image_path`` and its top-left
    3/4 crop, or generated shapes scenes of ``size`` ``(H, W)`` and ``(3W/4, 3H/4)``
    (another aspect ratio and area, so every level's anchor count differs)."""
    if image_path:
        image = torch.from_numpy(np.array(load_image(image_path))).permute(2, 0, 1).contiguous()  # a writable copy
        h, w = image.shape[1:]
        return [image, image[:, : max(1, 3 * h // 4), : max(1, 3 * w // 4)].contiguous()]
    h, w = size
    if h < 1 or w < 1:
        raise ValueError(f"--image-size must be positive, got {h} {w}")
    second = (max(1, 3 * w // 4), max(1, 3 * h // 4))
    images = []
    for i, (height, width) in enumerate((size, second)):
        side = min(max(height, width), 256)  # generate small, then resize: fast at any size
        scene, _ = generate_image(np.random.default_rng(i), side, side)
        scene = torch.from_numpy(scene).permute(2, 0, 1)[None].float()
        scene = F.interpolate(scene, size=(height, width), mode="bilinear", align_corners=False)
        images.append(scene[0].round().clamp(0, 255).to(torch.uint8))
    return images


@dataclass
class CheckedExport:
    """What ``export_command`` checked: the eager ``model`` (eval mode) and the first test
    ``image`` (uint8 ``[3, H, W]``), which ``--time`` times the file on."""

    model: FasterRCNN
    image: Tensor


def export_command(config_file: str, weights: str, fmt: str, output: str, overrides: Sequence[str] = (), *,
                   image_size: Optional[Tuple[int, int]] = None, image: Optional[str] = None,
                   opset: int = DEFAULT_OPSET, verify_only: bool = False, box_tol: float = BOX_TOL,
                   box_rtol: float = BOX_RTOL, score_tol: float = SCORE_TOL) -> CheckedExport:
    """Export the config's model with ``weights`` to ``output`` in ``fmt`` (``torchscript``
    or ``onnx``; ``verify_only``: check an existing file), then run the file on the test
    images (``test_images``: ``image``, or scenes of ``image_size``, default
    ``default_image_size``) against the eager model: boxes within ``box_tol`` px +
    ``box_rtol`` x the longer image side, scores within ``score_tol``, the same labels.
    Prints one line per image. Raises ``ExportError`` on a mismatch, or where neither
    model detects anything (the check would compare nothing)."""
    if not verify_only:  # before the work: an output typed as an input would destroy it
        check_writes_apart({"--output": output}, {"--weights": weights, "--config": config_file, "--image": image})
    # The weights file holds every weight: build without initial weights (nothing to download).
    cfg = load_config(config_file, [*overrides, "model.weights=", "model.backbone_weights="])
    model = build_model(cfg)
    class_names = None if verify_only else class_names_for(cfg)  # the file's metadata
    load_trained_weights(model, cfg, weights, class_names)
    model.eval()
    images = test_images(tuple(image_size or default_image_size(cfg)), image)
    path = Path(output)
    if class_names is not None:
        metadata = export_metadata(class_names, cfg.input.min_size_test, cfg.input.max_size_test)
        export_model(model, fmt, path, images[0], opset=opset, metadata=metadata)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {fmt})")
    print(f"parity check: boxes within {box_tol:g} px + {box_rtol:g} x the longer image side, "
          f"scores within {score_tol:g}, same labels")
    reports = verify_export(model, fmt, path, images, box_tol, score_tol, box_rtol)
    for report in reports:
        print(report.line())
    bad = [r for r in reports if not r.ok]
    if bad:
        raise ExportError(f"{path} does not match the eager model: {bad[0].line()}")
    if not any(r.num_eager or r.num_exported for r in reports):  # 'parity ok' would say nothing
        raise ExportError(f"{path}: no detections on the test images, so the parity check compared nothing: give "
                          "--image a picture with objects the model finds, or a larger --image-size")
    print(f"parity ok: {fmt} file matches the eager model on {len(reports)} images")
    return CheckedExport(model, images[0])
