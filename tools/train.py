#!/usr/bin/env python
"""Train a detector.

    python tools/train.py --config configs/demo_shapes.yaml
    torchrun --nproc_per_node=8 tools/train.py --config configs/faster_rcnn_r50_fpn_1x_coco.yaml
    python tools/train.py --config C --resume                # continue <output_dir>/checkpoints/last.pth (or start)
    python tools/train.py --config C --overwrite             # start over in a folder that holds a run
    python tools/train.py --config C --weights FasterRCNN_ResNet50_FPN_Weights.COCO_V1 solver.lr=0.01

Trailing key=value arguments override config keys. See docs/training.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

from detector.cli import run_tool, user_path  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=user_path, required=True, help="YAML config file")
    p.add_argument("--output-dir", type=user_path, default=None, help="run folder (overrides train.output_dir)")
    p.add_argument("--resume", type=user_path, nargs="?", const=True, default=None, metavar="CKPT",
                   help="continue a run: from CKPT, or from <output_dir>/checkpoints/last.pth if none is given "
                        "(a folder with no checkpoint yet starts fresh, so the same command serves every restart)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a run folder that holds checkpoints: deletes its checkpoints, metrics.jsonl, "
                        "tb/, eval/ and log.txt")
    p.add_argument("--weights", type=user_path, default=None,
                   help="initial weights (overrides model.weights): a checkpoint file or a torchvision weights name")
    p.add_argument("overrides", nargs="*", help="config overrides key=value, e.g. solver.lr=0.01")
    # Intermixed: overrides may come before or after options, e.g. `--resume CKPT solver.lr=0.1`.
    args = p.parse_intermixed_args(argv)
    # `--resume solver.lr=0.01`: argparse hands the override to --resume as CKPT. A value
    # with "=" that names no file is an override, and --resume means last.pth.
    if isinstance(args.resume, str) and "=" in args.resume and not Path(args.resume).exists():
        args.overrides.insert(0, args.resume)
        args.resume = True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # torch and the engine are imported after parsing, so that --help and a usage error
    # answer in 0.2 s instead of 6-10 s, and before run_tool, so that a signal while they
    # import still gets _bootstrap's one line ("error: interrupted", 130; SIGTERM: "...
    # while starting; nothing was written", 143).
    from detector.engine.launch import SECOND_SIGNAL, train_command

    # Expected failures: one line on stderr, exit status 1, the traceback in log.txt only.
    # Ctrl-C is handled by the training loop (a checkpoint, then a clean stop); a second
    # SIGINT/SIGTERM stops at once, without a checkpoint.
    return run_tool(lambda: train_command(args.config, args.overrides, output_dir=args.output_dir,
                                          weights=args.weights, resume=args.resume, overwrite=args.overwrite),
                    interrupted=SECOND_SIGNAL)


if __name__ == "__main__":
    sys.exit(main())
