#!/usr/bin/env python
r"""Evaluate a detector, or score a results file.

Run a model (also under torchrun):

    python tools/eval.py --config runs/x/config.yaml --weights runs/x/checkpoints/best.pth \
        [--output-dir runs/x/eval] [eval.backend=faster ...]

Score detections without a model (a COCO results list, or a COCO-format dict whose
images and categories are matched to the ground truth by file and class name):

    python tools/eval.py --predictions dets.json --annotations instances.json [--output-dir O]
    python tools/eval.py --predictions dets.json --voc-root VOCdevkit/VOC2012 --voc-split val

Writes metrics.json, detections.json, per_class.csv, pr_curves.png and
confusion_matrix.png into --output-dir; prints the metrics table. With --analysis, also
the error breakdown (into --output-dir/analysis). Exit status 1
with a one-line message on bad input.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

from detector.cli import Terminated, run_tool, user_path  # noqa: E402
from detector.config import load_config  # noqa: E402
from detector.files import check_writes_apart, output_folder  # noqa: E402

logger = logging.getLogger("detector.tools.eval")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=user_path, help="YAML config of the model and data (model mode)")
    p.add_argument("--weights", type=user_path,
                   help="checkpoint or state dict to evaluate (model mode), or a torchvision weights "
                   "name such as FasterRCNN_ResNet50_FPN_Weights.COCO_V1")
    p.add_argument("--predictions", type=user_path, help="detections JSON to score (file mode)")
    p.add_argument("--annotations", type=user_path, help="COCO-format ground-truth JSON (file mode)")
    p.add_argument("--voc-root", type=user_path,
                   help="VOC year folder as ground truth (file mode), e.g. VOCdevkit/VOC2012")
    p.add_argument("--voc-split", default="val", help="ImageSets/Main list with --voc-root (default: val)")
    p.add_argument("--output-dir", type=user_path,
                   help="where to write metrics.json, detections.json, per_class.csv, plots")
    p.add_argument("--analysis", action="store_true", help="also break the errors down (classification, localisation, "
                   "both, duplicate, background, missed): analysis.json, analysis.csv, analysis.png and the worst "
                   "images drawn under --output-dir/analysis")
    p.add_argument("--analysis-images", type=int, default=10, help="with --analysis: how many worst images to draw "
                   "(default 10)")
    p.add_argument("--image-dir", type=user_path,
                   help="with --analysis: the images' folder, to draw the worst images on them "
                   "(default: a grey canvas in file mode, data.val.root for COCO data in model mode)")
    p.add_argument("overrides", nargs="*", help="config overrides key=value, e.g. eval.backend=faster")
    args = p.parse_intermixed_args(argv)  # key=value overrides before, between or after the options
    model_mode = bool(args.config or args.weights)
    file_mode = bool(args.predictions or args.annotations or args.voc_root)
    if model_mode and file_mode:
        p.error("use either --config/--weights or --predictions with --annotations/--voc-root, not both")
    if model_mode and not (args.config and args.weights):
        p.error("model mode needs both --config and --weights")
    if file_mode:
        if not args.predictions:
            p.error("file mode needs --predictions")
        if bool(args.annotations) == bool(args.voc_root):
            p.error("file mode needs exactly one of --annotations or --voc-root")
    if model_mode and args.analysis and not args.output_dir:
        p.error("--analysis with --config/--weights needs --output-dir (it reads the detections.json written there)")
    if args.analysis_images < 0:
        p.error(f"--analysis-images must be >= 0, got {args.analysis_images}")
    if not (model_mode or file_mode):
        p.error("give --config and --weights, or --predictions with --annotations/--voc-root")
    if args.image_dir is not None and not os.path.isdir(args.image_dir):  # the drawings fell back to grey canvases
        p.error(f"--image-dir {args.image_dir} is not a folder" if os.path.exists(args.image_dir)
                else f"--image-dir {args.image_dir} not found")
    return args


def check_outputs_apart(args: argparse.Namespace, written: Sequence[str]) -> None:
    """Refuse an --output-dir whose files this run rewrites (``written``, and the error
    analysis's under ``analysis/``) where one of them is an input: re-scoring an earlier
    evaluation's ``detections.json`` into its own folder replaced the file being scored."""
    if not args.output_dir:
        return
    from detector.evaluation.analysis import ANALYSIS_FILES

    names = [*written, *(f"analysis/{n}" for n in ANALYSIS_FILES if args.analysis)]
    check_writes_apart({f"--output-dir's {name}": Path(args.output_dir) / name for name in names},
                       {"--predictions": args.predictions, "--annotations": args.annotations,
                        "--weights": args.weights, "--config": args.config})


def score_file(args: argparse.Namespace) -> int:
    """File mode: score a results file against COCO JSON or VOC XML ground truth."""
    from detector.evaluation import (
        OUTPUT_FILES,
        format_table,
        load_ground_truth,
        load_predictions,
        score_detections,
        write_outputs,
    )

    check_outputs_apart(args, OUTPUT_FILES)
    cfg = load_config(None, args.overrides)
    if args.voc_root:
        from detector.data import VOCDetection

        gt = VOCDetection(args.voc_root, args.voc_split, class_names=cfg.data.class_names or None).coco_gt()
    else:
        gt = load_ground_truth(args.annotations)
    results = load_predictions(args.predictions, gt)
    report = score_detections(
        gt,
        results,
        backend=cfg.eval.backend,
        voc_iou_thresh=cfg.eval.voc_iou_thresh,
        score_thresh=cfg.eval.score_thresh,
        voc07_thresholds=cfg.eval.voc07_thresholds,
        source=args.annotations or args.voc_root,
    )
    print(format_table(report.metrics, report.per_class))
    if args.output_dir:
        write_outputs(report, results, args.output_dir)
        print(f"results written to {args.output_dir}")
    if args.analysis:
        analyse(args, gt, results, cfg.eval.score_thresh, args.image_dir)
    return 0


def analyse(args: argparse.Namespace, gt, results, score_thresh: float, image_dir: Optional[str]) -> None:
    """``--analysis``: the error breakdown printed, and written under --output-dir/analysis."""
    from detector.evaluation.analysis import format_analysis, run_analysis

    out = Path(args.output_dir) / "analysis" if args.output_dir else None
    print(format_analysis(run_analysis(gt, results, out, score_thresh, args.analysis_images, image_dir)))
    if out is not None:
        print(f"error analysis written to {out}")


def run_model(args: argparse.Namespace) -> int:
    """Model mode: build the model and the val set, run ``detector.evaluation.evaluate``."""
    from detector.data import build_dataset, cache_in, resolve_num_classes
    from detector.distributed import cleanup, init_distributed, report_lost_rank
    from detector.engine.log import setup_logging
    from detector.evaluation import OUTPUT_FILES, evaluate, load_trained_weights
    from detector.modeling import build_model

    check_outputs_apart(args, [*OUTPUT_FILES, "log.txt"])
    cfg = load_config(args.config, args.overrides)
    if args.output_dir:
        output_folder(args.output_dir, "--output-dir")  # a file or a read-only folder: one line, before any work
    info = init_distributed(cfg.train.device, backend=cfg.train.dist_backend, timeout_s=cfg.train.dist_timeout_s)
    if args.output_dir:  # several ranks share the parsed records there, not in the config's run folder
        cfg = cache_in(cfg, args.output_dir)
    try:
        setup_logging(args.output_dir, rank=info.rank)
        dataset = build_dataset(cfg, "val", is_train=False)
        if cfg.model.num_classes is None:  # auto: the run's config.yaml holds the number; else the data's
            cfg = resolve_num_classes(cfg, dataset, split="val")
        model = build_model(cfg)
        load_trained_weights(model, cfg, args.weights, dataset.class_names)
        model.to(info.device)
        evaluate(model, dataset, cfg, output_dir=args.output_dir)
        if info.rank == 0 and args.output_dir:
            print(f"results written to {args.output_dir}")
        if info.rank == 0 and args.analysis:
            analyse_model_run(args, cfg, dataset)
    except (RuntimeError, Terminated) as exc:
        # Another rank ended (a collective failed, or torchrun's SIGTERM came after it), or
        # did not answer within train.dist_timeout_s: one line naming it, as tools/train.py
        # does. Anything else goes on up.
        status = report_lost_rank(exc, info, advice="run the evaluation again")  # (no --resume here)
        if status is None:
            raise
        return status
    finally:
        cleanup()
    return 0


def analyse_model_run(args: argparse.Namespace, cfg, dataset) -> None:
    """``--analysis`` in model mode: the detections evaluate() wrote, against the val set."""
    from detector.evaluation import load_predictions

    gt = dataset.coco_gt()
    results = load_predictions(Path(args.output_dir) / "detections.json", gt)
    image_dir = args.image_dir or (cfg.data.val.root if cfg.data.format == "coco" else None)
    analyse(args, gt, results, cfg.eval.score_thresh, image_dir)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.predictions:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    return run_tool(lambda: score_file(args) if args.predictions else run_model(args))


if __name__ == "__main__":
    sys.exit(main())
