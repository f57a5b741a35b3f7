"""``tools/infer.py``'s work: the detector of a config with its trained weights on every
image of a file or folder, drawn, and all detections in one JSON file
(``infer_command``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from detector.config import load_config
from detector.data import class_names_for
from detector.data.transforms import build_transforms
from detector.distributed import resolve_device
from detector.modeling import build_model

from .inference import predict_files
from .input_files import list_images
from .report import write_json
from .trained_weights import load_trained_weights
from .tta import tta_settings


def infer_command(config_file: str, weights: str, source: str, output_dir: str, overrides: Sequence[str] = (),
                  score_thresh: float = 0.5) -> int:
    """Detect on the image ``source`` or every image of the folder ``source``; write one
    drawing per image (detections with score >= ``score_thresh``) and
    ``detections.json`` (all of them) into ``output_dir``. Returns 0, or 1 where some
    image could not be read (one line naming them on stderr; the others are written)."""
    cfg = load_config(config_file, list(overrides))
    paths = list_images(source)
    device = resolve_device(cfg.train.device)
    model = build_model(cfg)
    class_names = class_names_for(cfg)
    load_trained_weights(model, cfg, weights, class_names)
    model.to(device).eval()
    records, skipped = predict_files(
        model,
        paths,
        output_dir,
        class_names,
        transform=build_transforms(cfg, is_train=False, seed=0),
        score_thresh=score_thresh,
        tta=tta_settings(cfg),
        apply_exif=cfg.data.apply_exif,  # read as training and evaluation read images
    )
    write_json(Path(output_dir) / "detections.json", records)
    print(f"{len(records)} image(s) written to {output_dir}")
    if skipped:
        print(f"error: skipped {len(skipped)} unreadable image(s): {'; '.join(skipped)}", file=sys.stderr)
        return 1
    return 0
