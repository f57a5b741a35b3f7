#!/usr/bin/env python
"""Check a data set: counts per class, empty images, bad boxes, missing or unreadable
image files, duplicate ids, size and aspect histograms. Exit status 1 on errors.

    python tools/check_dataset.py --config configs/my_coco.yaml --split train [key=value ...]
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

from detector.cli import run_tool, user_path  # noqa: E402
from detector.config import load_config  # noqa: E402
from detector.data.check import check_datasets, format_report  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Check a detection data set named by a config.")
    parser.add_argument("--config", type=user_path, required=True, help="YAML config")
    parser.add_argument("--split", default="train", choices=["train", "val"],
                        help="which of data.train / data.val to check (default: train; with data.train_extra: each set)")
    parser.add_argument("--no-decode", action="store_true", help="only check that image files exist")
    parser.add_argument("overrides", nargs="*", help="config overrides key=value")
    return parser.parse_intermixed_args(argv)  # key=value overrides before, between or after the options


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``tools/check_dataset.py --config C [--split train] [key=value ...]``; returns the exit status."""
    args = parse_args(argv)
    return run_tool(lambda: check(args))


def check(args: argparse.Namespace) -> int:
    """Print the report; 1 when it holds errors."""
    cfg = load_config(args.config, args.overrides)
    reports = check_datasets(cfg, args.split, decode=not args.no_decode)  # data.train_extra: one per set
    print("\n\n".join(format_report(report) for report in reports))
    return 0 if all(report.ok for report in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
