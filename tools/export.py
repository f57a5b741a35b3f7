#!/usr/bin/env python
r"""Export a trained detector to TorchScript or ONNX and check the file against the model.

    python tools/export.py --config runs/x/config.yaml --weights runs/x/checkpoints/best.pth \
        --format torchscript|onnx --output model.pt|model.onnx [--image-size H W] [--opset N] \
        [--image photo.jpg] [--verify-only] [key=value ...]

The file holds the eval-mode model for one RGB image [3, H, W] (TorchScript: uint8
0..255 or float 0..1; ONNX: uint8, input image) with normalisation, padding,
post-processing and NMS inside; it returns boxes [M, 4] (x1, y1, x2, y2 in the
image's pixels), scores [M] and labels [M] (1..K). Any image size works;
give it images resized as in training (input.min_size_test/max_size_test).

After writing, the file is run (TorchScript in torch, ONNX in onnxruntime) on two test
images of different sizes (a generated shapes scene at --image-size H W, default
input.min_size_test x input.max_size_test, and one of 3W/4 x 3H/4; or
--image and its top-left 3/4 crop) and compared with the eager model: boxes within
1e-3 px + 2e-5 x the longer image side (float32 noise of other kernels on large images),
scores within 1e-4, the same labels. A mismatch exits with status 1.
--time N then times the eager model and the file on the first test image.
--verify-only checks an existing file without exporting. ONNX needs the optional
extra: pip install -e ".[export]". See docs/deploy.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import List, Optional

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

from benchmarks.tasks import benchmark_exported, format_timing  # noqa: E402
from detector.cli import output_file, run_tool, user_path  # noqa: E402
from detector.config.schema import MAX_IMAGE_SIDE  # noqa: E402
from detector.evaluation.export_command import export_command  # noqa: E402
from detector.modeling.export import BOX_RTOL, BOX_TOL, DEFAULT_OPSET, FORMATS, SCORE_TOL  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=user_path, required=True,
                   help="YAML config of the model (e.g. the run's config.yaml)")
    p.add_argument("--weights", type=user_path, required=True, help="checkpoint or state dict")
    p.add_argument("--format", required=True, choices=FORMATS, help="torchscript or onnx")
    p.add_argument("--output", type=output_file, required=True, help="file to write (or to check with --verify-only)")
    p.add_argument("--image-size", type=int, nargs=2, metavar=("H", "W"),
                   help="test image size (default: input.min_size_test x input.max_size_test)")
    p.add_argument("--image", type=user_path, help="an image file to test on instead of a generated scene")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    p.add_argument("--verify-only", action="store_true", help="check --output against the model, do not export")
    p.add_argument("--box-tol", type=float, default=BOX_TOL, help=f"box tolerance, pixels (default {BOX_TOL})")
    p.add_argument("--box-rtol", type=float, default=BOX_RTOL,
                   help=f"box tolerance, fraction of the longer image side, added to --box-tol (default {BOX_RTOL})")
    p.add_argument("--score-tol", type=float, default=SCORE_TOL, help=f"score tolerance (default {SCORE_TOL})")
    p.add_argument("--time", type=int, default=0, metavar="N",
                   help="then time N runs of the eager model and of the file on the first test image (CPU)")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = p.parse_intermixed_args(argv)  # key=value overrides before, between or after the options
    if args.image_size and not all(1 <= side <= MAX_IMAGE_SIDE for side in args.image_size):
        p.error(f"--image-size takes two sides in 1..{MAX_IMAGE_SIDE} pixels (as the input.* sizes), got "
                f"{args.image_size[0]} {args.image_size[1]}")
    if args.time < 0:  # checked before the export, not after it
        p.error(f"--time must be >= 0, got {args.time}")
    for option in ("box_tol", "box_rtol", "score_tol"):  # (-1 or nan called a correct file a MISMATCH)
        value = getattr(args, option)
        if not math.isfinite(value) or value < 0:
            p.error(f"--{option.replace('_', '-')} must be a finite number >= 0, got {value:g}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    return run_tool(lambda: export(args))


def export(args: argparse.Namespace) -> int:
    """Export (unless --verify-only), check the file against the eager model, time it."""
    checked = export_command(args.config, args.weights, args.format, args.output, args.overrides,
                             image_size=args.image_size, image=args.image, opset=args.opset,
                             verify_only=args.verify_only, box_tol=args.box_tol, box_rtol=args.box_rtol,
                             score_tol=args.score_tol)
    if args.time:
        print(format_timing(benchmark_exported(checked.model, args.format, Path(args.output), checked.image,
                                               args.time)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
