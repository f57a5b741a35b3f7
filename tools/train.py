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
import logging
import signal
import sys
from pathlib import Path

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

from detector.cli import Terminated, run_tool, user_path  # noqa: E402
from detector.config import load_config  # noqa: E402

logger = logging.getLogger("detector.tools.train")


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


def import_engine() -> None:
    """Import torch and the engine: after the arguments are parsed, so that ``--help`` and
    a usage error answer in 0.2 s instead of the imports' 6-10 s, and before ``run_tool``,
    so that a signal meanwhile still gets ``_bootstrap``'s one line ("error: interrupted",
    130; SIGTERM: "... while starting; nothing was written", 143)."""
    import detector.distributed  # noqa: F401
    import detector.engine.log  # noqa: F401
    import detector.engine.run_folder  # noqa: F401
    import detector.engine.trainer  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import_engine()
    # Expected failures: one line on stderr, exit status 1, the traceback in log.txt only.
    # Ctrl-C is handled by the training loop (a checkpoint, then a clean stop); a second
    # SIGINT/SIGTERM stops at once, without a checkpoint.
    return run_tool(lambda: run(args),
                    interrupted="interrupted by a second signal; resume from the last checkpoint written")


def interrupted_exit_status(signal_name: str | None) -> int:
    """128 + the signal's number (SIGTERM 143, SIGINT 130); 143 when another rank got it."""
    try:
        return 128 + int(signal.Signals[signal_name or "SIGTERM"])
    except KeyError:
        return 128 + int(signal.SIGTERM)


def run(args: argparse.Namespace) -> int:
    """Train in the run folder (one process of a distributed launch); rank 0 prints the
    final metrics. A collective that fails because a peer process died: one line naming it."""
    from detector import distributed  # (imported by import_engine already)
    from detector.engine.log import setup_logging
    from detector.engine.run_folder import (RunFolder, check_output_dir, check_overwrite_keeps_weights,
                                            check_run_folder_apart_from_data)
    from detector.engine.trainer import train

    overrides = list(args.overrides)
    if args.output_dir is not None:
        overrides.append(f"train.output_dir={args.output_dir}")
    if args.weights is not None:
        overrides.append(f"model.weights={args.weights}")
    rank = 0
    info = None
    try:
        cfg = load_config(args.config, overrides)
        check_output_dir(cfg.train.output_dir)
        check_run_folder_apart_from_data(cfg)
        check_overwrite_keeps_weights(cfg, args.overwrite)
        info = distributed.init_distributed(cfg.train.device, backend=cfg.train.dist_backend,
                                            timeout_s=cfg.train.dist_timeout_s)
        rank = info.rank
        setup_logging(None, rank)  # console only until the run folder is ours
        with RunFolder.open(cfg.train.output_dir, args.resume, args.overwrite, rank == 0, info.world_size) as folder:
            setup_logging(cfg.train.output_dir, rank)
            logger.info("process: %s", info.describe())
            result = train(cfg, resume=args.resume, dist_info=info, run_folder=folder)
    except (RuntimeError, Terminated) as exc:
        # A peer process died (a collective failed, or torchrun's SIGTERM came after it):
        # one line naming it. Anything else goes on up.
        status = distributed.report_lost_rank(exc, info)
        if status is None:
            raise
        return status
    finally:
        distributed.cleanup()
    if result.status == "interrupted":  # not finished: non-zero, as `timeout` and shells expect
        if rank == 0:
            print(f"interrupted by {result.stop_reason or 'a signal'} at iteration {result.iteration}: the run is not "
                  f"finished; continue it with --resume (run folder: {result.output_dir})", file=sys.stderr)
        return interrupted_exit_status(result.stop_reason)
    if rank == 0:  # (the final metrics were logged once, as the evaluator's table)
        print(f"{result.status} at iteration {result.iteration}; run folder: {result.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
