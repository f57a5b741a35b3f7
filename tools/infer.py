#!/usr/bin/env python
r"""Run a detector on an image or a folder of images; draw the boxes.

    python tools/infer.py --config runs/x/config.yaml --weights runs/x/checkpoints/best.pth \
        --input photo.jpg_or_folder --output-dir out/ [--score-thresh 0.5] [key=value ...]

Writes <output-dir>/<image stem>.png per input (boxes with class and score) and
<output-dir>/detections.json (boxes [x1, y1, x2, y2] in the image's pixels).
Images that cannot be read are skipped with a warning; the others are still written,
then the tool names the skipped ones and exits with status 1. Exit status 1 with a
one-line message on other bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

from detector.cli import run_tool, user_path  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=user_path, required=True, help="YAML config of the model")
    p.add_argument("--weights", type=user_path, required=True,
                   help="checkpoint or state dict, or a torchvision weights name such as "
                   "FasterRCNN_ResNet50_FPN_Weights.COCO_V1")
    p.add_argument("--input", type=user_path, required=True, help="an image file or a folder of images")
    p.add_argument("--output-dir", type=user_path, required=True,
                   help="where to write annotated images and detections.json")
    p.add_argument("--score-thresh", type=float, default=0.5, help="draw detections with score >= this (default 0.5)")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = p.parse_intermixed_args(argv)  # key=value overrides before, between or after the options
    if not 0.0 <= args.score_thresh <= 1.0:  # NaN too: scores are probabilities
        p.error(f"--score-thresh must be in [0, 1], got {args.score_thresh} (above 1 or NaN would draw nothing)")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    # After parsing (--help without torch's imports), before run_tool (a signal meanwhile
    # gets _bootstrap's one line).
    from detector.evaluation.infer_command import infer_command

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    return run_tool(lambda: infer_command(args.config, args.weights, args.input, args.output_dir, args.overrides,
                                          args.score_thresh))


if __name__ == "__main__":
    sys.exit(main())
