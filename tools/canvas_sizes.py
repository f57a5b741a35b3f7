#!/usr/bin/env python
"""Choose model.canvas_sizes for a training set: the canvases that hold every batch the
loader can form, a few more where they cut the padding, and what this config's cost.

    python tools/canvas_sizes.py --config configs/my_coco.yaml [--max-canvases 4] [key=value ...]

Read from the annotations' image sizes (no image is decoded), with the config's
input.min_size_train / max_size_train (or input.lsj), solver.images_per_gpu and
data.aspect_ratio_grouping. See docs/training.md, "The static step".
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

from detector.cli import run_tool, user_path  # noqa: E402


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=user_path, required=True, help="YAML config of the training run")
    p.add_argument("--max-canvases", type=positive, default=4,
                   help="the most canvases to suggest (default 4; fewer where one more cuts no padding)")
    p.add_argument("--batches", type=positive, default=20000, help="batches drawn to measure padding (default 20000)")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    return p.parse_intermixed_args(argv)  # overrides before or after the options


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    # After parsing (--help without torch's imports), before run_tool (a signal meanwhile
    # gets _bootstrap's one line).
    from detector.data.canvas_choice import canvas_sizes_command

    return run_tool(lambda: canvas_sizes_command(args.config, args.overrides, args.max_canvases, args.batches))


if __name__ == "__main__":
    sys.exit(main())
