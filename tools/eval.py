#!/usr/bin/env python
r"""Evaluate a detector, or score a results file.

Run a model (also under torchrun):

    python tools/eval.py --config runs/x/config.yaml --weights runs/x/checkpoints/best.pth \
        [--output-dir runs/x/eval] [eval.backend=faster ...]

Score detections without a model (a COCO results list, or a COCO-format dict whose
images and categories are matched to the ground truth by file and class name):

    python tools/eval.py --predictions dets.json --annotations instances.json [--output-dir O]
    python tools/eval.py --predictions dets.json --voc-root VOCdevkit/VOC2012 --voc-split val

Writes metrics.json, detections.json, per_class.csv, pr_curves.png and
confusion_matrix.png into --output-dir; prints the metrics table. With --analysis, also
the error breakdown (into --output-dir/analysis). Exit status 1
with a one-line message on bad input.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

from detector.cli import run_tool, user_path  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=user_path, help="YAML config of the model and data (model mode)")
    p.add_argument("--weights", type=user_path,
                   help="checkpoint or state dict to evaluate (model mode), or a torchvision weights "
                   "name such as FasterRCNN_ResNet50_FPN_Weights.COCO_V1")
    p.add_argument("--predictions", type=user_path, help="detections JSON to score (file mode)")
    p.add_argument("--annotations", type=user_path, help="COCO-format ground-truth JSON (file mode)")
    p.add_argument("--voc-root", type=user_path,
                   help="VOC year folder as ground truth (file mode), e.g. VOCdevkit/VOC2012")
    p.add_argument("--voc-split", default="val", help="ImageSets/Main list with --voc-root (default: val)")
    p.add_argument("--output-dir", type=user_path,
                   help="where to write metrics.json, detections.json, per_class.csv, plots")
    p.add_argument("--analysis", action="store_true", help="also break the errors down (classification, localisation, "
                   "both, duplicate, background, missed): analysis.json, analysis.csv, analysis.png and the worst "
                   "images drawn under --output-dir/analysis")
    p.add_argument("--analysis-images", type=int, default=10, help="with --analysis: how many worst images to draw "
                   "(default 10)")
    p.add_argument("--image-dir", type=user_path,
                   help="with --analysis: the images' folder, to draw the worst images on them "
                   "(default: a grey canvas in file mode, data.val.root for COCO data in model mode)")
    p.add_argument("overrides", nargs="*", help="config overrides key=value, e.g. eval.backend=faster")
    args = p.parse_intermixed_args(argv)  # key=value overrides before, between or after the options
    model_mode = bool(args.config or args.weights)
    file_mode = bool(args.predictions or args.annotations or args.voc_root)
    if model_mode and file_mode:
        p.error("use either --config/--weights or --predictions with --annotations/--voc-root, not both")
    if model_mode and not (args.config and args.weights):
        p.error("model mode needs both --config and --weights")
    if file_mode:
        if not args.predictions:
            p.error("file mode needs --predictions")
        if bool(args.annotations) == bool(args.voc_root):
            p.error("file mode needs exactly one of --annotations or --voc-root")
    if model_mode and args.analysis and not args.output_dir:
        p.error("--analysis with --config/--weights needs --output-dir (it reads the detections.json written there)")
    if args.analysis_images < 0:
        p.error(f"--analysis-images must be >= 0, got {args.analysis_images}")
    if not (model_mode or file_mode):
        p.error("give --config and --weights, or --predictions with --annotations/--voc-root")
    if args.image_dir is not None and not os.path.isdir(args.image_dir):  # the drawings fell back to grey canvases
        p.error(f"--image-dir {args.image_dir} is not a folder" if os.path.exists(args.image_dir)
                else f"--image-dir {args.image_dir} not found")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    analysis = None
    if args.analysis:
        # (the library's names: imported after parsing, so that --help answers without torch)
        from detector.evaluation.score_command import AnalysisRequest

        analysis = AnalysisRequest(args.analysis_images, args.image_dir)
    if args.predictions:
        from detector.evaluation.score_command import score_command

        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
        return run_tool(lambda: score_command(args.predictions, args.overrides, annotations=args.annotations,
                                              voc_root=args.voc_root, voc_split=args.voc_split,
                                              output_dir=args.output_dir, analysis=analysis))
    from detector.engine.launch import evaluate_command

    return run_tool(lambda: evaluate_command(args.config, args.weights, args.overrides, output_dir=args.output_dir,
                                             analysis=analysis))


if __name__ == "__main__":
    sys.exit(main())
