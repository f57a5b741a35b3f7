"""Time the training step, inference, the data loader or COCO scoring.

    python tools/benchmark.py --config configs/demo_shapes.yaml --task train --compare-torchvision
    python tools/benchmark.py --config configs/torchvision_r50_fpn_coco.yaml --task infer \\
        --compare-torchvision --synthetic input.min_size_test=512 input.max_size_test=683
    python tools/benchmark.py --config configs/tiny_cpu.yaml --task data --iters 50 --json out.json
    python tools/benchmark.py --config configs/demo_shapes.yaml --task train --count-ops --no-loader
    python tools/benchmark.py --config configs/demo_shapes.yaml --task eval   # COCO scoring backends
    python tools/benchmark.py --config configs/tiny_cpu.yaml --task data --records-file train118k.json data.num_workers=4
    python tools/benchmark.py --config configs/tiny_cpu.yaml --task data --records-file train118k.json --node-ranks 8
    python tools/benchmark.py --config configs/demo_shapes.yaml --task scaling   # 1 vs 2 ranks, DDP settings
    python tools/benchmark.py --task time-to-accuracy --json tta.json   # vs torchvision's recipe, demo config
    python tools/benchmark.py --config configs/demo_shapes.yaml --task static-check train.static_step=true \\
        "model.canvas_sizes=[[160,160]]" --json static.json   # one graph, no syncs (--iters batches)
    python tools/benchmark.py --config configs/demo_shapes.yaml --task nms   # proposal NMS: torchvision, scan, blocks
    python tools/benchmark.py --config configs/demo_shapes.yaml --task roi-align   # box RoIAlign: torchvision's, ours

Trailing key=value arguments override the config. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from _bootstrap import ROOT  # first: environment and sys.path, see tools/_bootstrap.py

from benchmarks import TASKS, format_summary, run_benchmark  # noqa: E402
from benchmarks.nms_speed import benchmark_nms, format_nms  # noqa: E402
from benchmarks.roi_align_speed import benchmark_roi_align, format_roi_align  # noqa: E402
from benchmarks.scaling import ScalingSweep  # noqa: E402
from benchmarks.static_check import format_static_check, static_check  # noqa: E402
from detector.cli import output_file, run_tool, user_path  # noqa: E402
from detector.config import load_config  # noqa: E402
from detector.files import check_writes_apart, write_text  # noqa: E402

DEMO_CONFIG = ROOT / "configs" / "demo_shapes.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=user_path,
                   help="YAML config (required, except --task time-to-accuracy: default configs/demo_shapes.yaml)")
    p.add_argument("--task", required=True, choices=(*TASKS, "static-check", "nms", "roi-align"))
    p.add_argument("--iters", type=int, default=10, help="timed iterations (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default 3)")
    p.add_argument("--compare-torchvision", action="store_true", help="also time torchvision's FasterRCNN, alternating")
    p.add_argument("--no-loader", action="store_true", help="train: skip the run fed by the real loader")
    p.add_argument("--synthetic", action="store_true", help="random batches at the input size, not the data set")
    p.add_argument("--num-batches", type=int, default=4, help="distinct batches cached in memory (default 4)")
    p.add_argument("--profile", action="store_true", help="train/infer: torch.profiler summary of one step or batch")
    p.add_argument("--count-ops", action="store_true",
                   help="train/infer: aten ops and host syncs per step or batch, ours and torchvision's "
                        "(torch.profiler)")
    p.add_argument("--torchvision-options", action="store_true",
                   help="give torchvision's model our train.* speed options too (default: its defaults)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: PyTorch's choice)")
    p.add_argument("--gt", type=user_path, help="eval: COCO ground-truth JSON (default: a synthetic set)")
    p.add_argument("--results", type=user_path, help="eval: COCO results JSON matching --gt")
    p.add_argument("--eval-images", type=int, default=500, help="eval: images of the generated case (default 500)")
    p.add_argument("--eval-boxes", type=int, default=30, help="eval: objects and detections per image (default 30)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="time-to-accuracy: wall-clock training seconds of each run (default 300)")
    p.add_argument("--world-sizes", default="1,2", help="scaling: world sizes, comma-separated (default 1,2)")
    p.add_argument("--bucket-caps", default="1,25,100", help="scaling: ddp_bucket_cap_mb values swept (default 1,25,100)")
    p.add_argument("--bucket-views", default="false,true",
                   help="scaling: ddp_gradient_as_bucket_view values swept (default false,true)")
    p.add_argument("--compile-backend", default="inductor",
                   help="static-check: torch.compile backend (default inductor; aot_eager: the same graphs, no codegen)")
    p.add_argument("--records-file", type=user_path,
                   help="data: measure the records of this COCO file (images need not exist): "
                                           "parse time and peak memory, a worker's memory reading every record, "
                                           "2 ranks x data.num_workers workers")
    p.add_argument("--node-ranks", type=int, default=0,
                   help="data, with --records-file: N ranks on this machine each parsing it, against one parse "
                        "shared through a memory-mapped record file (data.cache_dir); default 0: not run")
    p.add_argument("--json", type=output_file, dest="json_out", help="write the full result here")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = p.parse_intermixed_args(argv)  # key=value overrides before, between or after the options
    if args.config is None:
        if args.task != "time-to-accuracy":
            p.error("--config is required")
        args.config = str(DEMO_CONFIG)
    if not args.budget_s > 0:
        p.error(f"--budget-s must be > 0, got {args.budget_s}")
    if bool(args.gt) != bool(args.results):
        p.error("--gt and --results go together")
    for option in ("num_batches", "eval_images", "eval_boxes"):  # 0: "the data loader gave no batches (is the
        if getattr(args, option) < 1:                          # split empty?)", an IndexError in pycocotools
            p.error(f"--{option.replace('_', '-')} must be >= 1, got {getattr(args, option)}")
    views = [v.strip().lower() for v in args.bucket_views.split(",")]
    if not set(views) <= {"false", "true"}:
        p.error(f"--bucket-views takes false and/or true, got {args.bucket_views!r}")
    try:
        args.scaling = ScalingSweep(tuple(int(w) for w in args.world_sizes.split(",")),
                                    tuple(float(c) for c in args.bucket_caps.split(",")),
                                    tuple(v == "true" for v in views))
    except ValueError as exc:
        p.error(f"--world-sizes/--bucket-caps: {exc}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    return run_tool(lambda: benchmark(args))


def benchmark(args: argparse.Namespace) -> int:
    """Run the task; print its summary; write the full result to --json if given."""
    if args.json_out:  # before minutes of work: a --json typed as an input would destroy it
        check_writes_apart({"--json": args.json_out}, {"--config": args.config, "--gt": args.gt,
                                                       "--results": args.results, "--records-file": args.records_file})
    if args.task == "static-check":  # --iters batches
        result = static_check(load_config(args.config, args.overrides), args.iters, args.compile_backend)
        print(format_static_check(result))
    elif args.task == "nms":
        result = benchmark_nms(load_config(args.config, args.overrides), args.iters, args.warmup)
        print(format_nms(result))
    elif args.task == "roi-align":
        result = benchmark_roi_align(load_config(args.config, args.overrides), args.iters, args.warmup)
        print(format_roi_align(result))
    else:
        result = _run(args)
        print(format_summary(result))
    if args.json_out:
        write_text(args.json_out, json.dumps(result, indent=2))
    return 0


def _run(args: argparse.Namespace) -> dict:
    cfg = load_config(args.config, args.overrides)
    return run_benchmark(
        cfg,
        args.task,
        iters=args.iters,
        warmup=args.warmup,
        compare_torchvision=args.compare_torchvision,
        loader=not args.no_loader,
        synthetic=args.synthetic,
        num_batches=args.num_batches,
        profile=args.profile,
        count_ops=args.count_ops,
        budget_s=args.budget_s,
        gt_file=args.gt,
        results_file=args.results,
        eval_images=args.eval_images,
        eval_boxes=args.eval_boxes,
        config_path=args.config,
        overrides=args.overrides,
        torchvision_options=args.torchvision_options,
        threads=args.threads,
        scaling=args.scaling,
        records_file=args.records_file,
        node_ranks=args.node_ranks,
    )


if __name__ == "__main__":
    sys.exit(main())
