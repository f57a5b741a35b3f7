#!/usr/bin/env python
r"""Look at training samples after augmentation, drawn with their boxes and class names.

    python tools/browse_dataset.py --config C --output-dir D [--num 8] [--grid] [--epoch 0] [key=value ...]

Writes D/sample_000.png ... (one per sample), or D/grid.png with --grid: the first
--num samples of --epoch in training order, after the training transforms of the config
(resize or large-scale jitter, flip, colour jitter, copy-paste), exactly as training
draws them. Exit status 1 with a one-line message on bad input.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

from detector.cli import run_tool, user_path  # noqa: E402
from detector.config import load_config  # noqa: E402
from detector.evaluation.browse import browse_dataset  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=user_path, required=True, help="YAML config")
    p.add_argument("--output-dir", type=user_path, required=True, help="where to write the PNGs")
    p.add_argument("--num", type=int, default=8, help="how many samples (default 8)")
    p.add_argument("--grid", action="store_true", help="one grid.png instead of one file per sample")
    p.add_argument("--epoch", type=int, default=0, help="the epoch whose samples to draw (default 0)")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    return p.parse_intermixed_args(argv)  # key=value overrides before, between or after the options


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    return run_tool(lambda: browse(args))


def browse(args: argparse.Namespace) -> int:
    """Draw the samples; print where they went."""
    cfg = load_config(args.config, args.overrides)
    paths = browse_dataset(cfg, args.output_dir, num=args.num, grid=args.grid, epoch=args.epoch)
    print(f"{len(paths)} file(s) written to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
