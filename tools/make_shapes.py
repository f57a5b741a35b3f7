#!/usr/bin/env python
"""Write the generated shapes detection set (COCO format): train.json, val.json, and the
train/ and val/ JPEGs; the same seed gives byte-identical files.

    python tools/make_shapes.py --out data/shapes --train 600 --val 100 --seed 0 [--min-side 96 --max-side 224]

(Training with data.format: shapes generates the set itself when its folder is missing.)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional, Sequence

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

from detector.cli import run_tool, user_path  # noqa: E402
from detector.config.schema import ShapesConfig  # noqa: E402
from detector.data.shapes import ensure_shapes, folder_state, shapes_params  # noqa: E402
from detector.files import OutputError, output_folder  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=user_path, required=True, help="output folder")
    parser.add_argument("--train", type=int, default=600, help="number of training images")
    parser.add_argument("--val", type=int, default=100, help="number of validation images")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-side", type=int, default=96)
    parser.add_argument("--max-side", type=int, default=224)
    args = parser.parse_args(argv)
    # The bounds of the config's data.shapes keys, read from the schema (a -1 wrote an empty
    # train.json; a side of 100000 ran out of memory); --max-side also from --min-side.
    bounds = {f.name: (f.metadata["ge"], f.metadata["le"]) for f in dataclasses.fields(ShapesConfig)}
    for option, key in (("--train", "num_train"), ("--val", "num_val"), ("--seed", "seed"),
                        ("--min-side", "min_side"), ("--max-side", "max_side")):
        value = getattr(args, option[2:].replace("-", "_"))
        low, high = bounds[key]
        low = max(low, args.min_side) if key == "max_side" else low
        if not low <= value <= high:
            parser.error(f"{option} must be in {low}..{high}, got {value}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    return run_tool(lambda: make(args))


def make(args: argparse.Namespace) -> int:
    out = output_folder(args.out, "--out")  # (a file there was "[Errno 17] File exists")
    settings = shapes_params(args.train, args.val, args.seed, args.min_side, args.max_side)
    state, reason = folder_state(out, settings)
    if state == "foreign":  # someone's own annotations: written over before, without a word
        raise OutputError(f"--out {out}: {reason}; the shapes set would replace it: choose a new or empty folder")
    if state == "current":
        print(f"{out} holds the shapes set of these settings already ({args.train} train and {args.val} val images)")
        return 0
    ensure_shapes(out, args.train, args.val, args.seed, args.min_side, args.max_side)
    print(f"wrote {args.train} train and {args.val} val images to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
