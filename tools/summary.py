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
import json
import sys
from typing import List, Optional

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

import torch  # noqa: E402

from detector.cli import output_file, run_tool, user_path  # noqa: E402
from detector.config import load_config  # noqa: E402
from detector.config.schema import MAX_IMAGE_SIDE  # noqa: E402
from detector.files import check_writes_apart, write_text  # noqa: E402
from detector.modeling import build_model  # noqa: E402
from detector.modeling.summary import default_image_size, format_summary, model_summary  # noqa: E402


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
    return run_tool(lambda: summarize(args))


def summarize(args: argparse.Namespace) -> int:
    """Print the summary; write it to --json if given."""
    if args.json:
        check_writes_apart({"--json": args.json}, {"--config": args.config})
    cfg = load_config(args.config, [*args.overrides, "model.weights=", "model.backbone_weights="])
    size = tuple(args.image_size) if args.image_size else default_image_size(cfg)
    torch.manual_seed(0)  # random init: the RPN's proposal count (the RoI heads' FLOPs) repeats
    summary = model_summary(build_model(cfg), size)
    print(format_summary(summary))
    if args.json:
        write_text(args.json, json.dumps(summary.to_dict(), indent=2) + "\n")
        print(f"summary written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
