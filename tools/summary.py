#!/usr/bin/env python
r"""What a detector costs: parameters per module (total, trainable, frozen), FLOPs of one
image, and the size of its weights file.

    python tools/summary.py --config configs/faster_rcnn_r50_fpn_1x_coco.yaml \
        [--image-size H W] [--json summary.json] [key=value ...]

Parameters are counted after model.freeze_at and the norm policy; FLOPs with
torch.utils.flop_counter on one H x W image (default: input.min_size_test x
input.max_size_test) in eval mode, 2 per multiply-add. The model is built without
model.weights/model.backbone_weights (the counts do not depend on them, and
nothing is downloaded). --json holds params_total, params_trainable, params_frozen,
gflops, checkpoint_bytes and the same per module.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

from detector.cli import output_file, run_tool, user_path  # noqa: E402
from detector.config.schema import MAX_IMAGE_SIDE  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=user_path, required=True, help="YAML config of the model")
    p.add_argument("--image-size", type=int, nargs=2, metavar=("H", "W"),
                   help="image size for the FLOPs (default: input.min_size_test x input.max_size_test)")
    p.add_argument("--json", type=output_file, help="also write the summary to this JSON file")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = p.parse_intermixed_args(argv)  # key=value overrides before, between or after the options
    if args.image_size and not all(1 <= side <= MAX_IMAGE_SIDE for side in args.image_size):
        p.error(f"--image-size takes two sides in 1..{MAX_IMAGE_SIDE} pixels (as the input.* sizes), got "
                f"{args.image_size[0]} {args.image_size[1]}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    # After parsing (--help and usage errors without torch's 6 s of imports), before
    # run_tool (a signal meanwhile gets _bootstrap's one line).
    from detector.modeling.summary import summary_command

    return run_tool(lambda: summary_command(args.config, args.overrides, args.image_size, args.json))


if __name__ == "__main__":
    sys.exit(main())
