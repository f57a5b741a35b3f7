#!/usr/bin/env python
r"""Split a COCO JSON or a VOC image set into train/val(/test) or k folds, stratified so
that each class's share of boxes is about the same in every split (rarest classes placed
first), and print the boxes per class per split.

    python tools/split_dataset.py --annotations instances.json --out splits/ --fractions 0.8 0.2
    python tools/split_dataset.py --voc-root VOCdevkit/VOC2012 --voc-split trainval \
        --out VOCdevkit/VOC2012/ImageSets/Main --fractions 0.7 0.2 0.1 --seed 1
    python tools/split_dataset.py --annotations instances.json --out folds/ --folds 5

COCO: writes train.json, val.json (, test.json), or train_fold{j}.json and val_fold{j}.json,
each with the original info, licenses and categories. VOC: the same names as .txt id
lists (ImageSets/Main format). The same --seed gives the same files. Exit status 1 with a
one-line message on bad input.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

from detector.cli import run_tool, user_path  # noqa: E402
from detector.data.split import split_dataset  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--annotations", type=user_path, help="COCO instances JSON to split")
    src.add_argument("--voc-root", type=user_path, help="VOC year folder (Annotations/, ImageSets/Main/) to split")
    p.add_argument("--voc-split", help="with --voc-root: split only the ids of ImageSets/Main/<name>.txt "
                                       "(default: every Annotations/*.xml)")
    p.add_argument("--out", type=user_path, required=True, help="folder for the split files")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--fractions", type=float, nargs="+", metavar="F",
                     help="train val [test] shares of the images, summing to 1, e.g. 0.8 0.2")
    how.add_argument("--folds", type=int, metavar="K", help="K stratified folds (train_fold{j} / val_fold{j})")
    p.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace split files that exist")
    args = p.parse_args(argv)
    if args.seed < 0:  # numpy's generator takes seeds >= 0 ("expected non-negative integer", no name)
        p.error(f"--seed must be >= 0, got {args.seed}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    return run_tool(lambda: split(args))


def split(args: argparse.Namespace) -> int:
    """Write the split files; print the boxes per class per split."""
    paths, table = split_dataset(args.out, annotations=args.annotations, voc_root=args.voc_root,
                                 voc_split=args.voc_split, fractions=args.fractions, folds=args.folds,
                                 seed=args.seed, overwrite=args.overwrite)
    print(table)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
