#!/usr/bin/env python
r"""Export a trained detector to TorchScript or ONNX and check the file against the model.

    python tools/export.py --config runs/x/config.yaml --weights runs/x/checkpoints/best.pth \
        --format torchscript|onnx --output model.pt|model.onnx [--image-size H W] [--opset N] \
        [--image photo.jpg] [--verify-only] [key=value ...]

The file holds the eval-mode model for one RGB image [3, H, W] (TorchScript: uint8
0..255 or float 0..1; ONNX: uint8, input image) with normalisation, padding,
post-processing and NMS inside; it returns boxes [M, 4] (x1, y1, x2, y2 in the
image's pixels), scores [M] and labels [M] (1..K). Any image size works;
give it images resized as in training (input.min_size_test/max_size_test).

After writing, the file is run (TorchScript in torch, ONNX in onnxruntime) on two test
images of different sizes (a generated shapes scene at --image-size H W, default
input.min_size_test x input.max_size_test, and one of 3W/4 x 3H/4; or
--image and its top-left 3/4 crop) and compared with the eager model: boxes within
1e-3 px + 2e-5 x the longer image side (float32 noise of other kernels on large images),
scores within 1e-4, the same labels. A mismatch exits with status 1.
--time N then times the eager model and the file on the first test image.
--verify-only checks an existing file without exporting. ONNX needs the optional
extra: pip install -e ".[export]". See docs/deploy.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.tasks import benchmark_exported  # noqa: E402
from detector.cli import output_file, run_tool, user_path  # noqa: E402
from detector.config import load_config  # noqa: E402
from detector.config.schema import MAX_IMAGE_SIDE  # noqa: E402
from detector.data import class_names_for  # noqa: E402
from detector.data.files import load_image  # noqa: E402
from detector.data.shapes import generate_image  # noqa: E402
from detector.files import check_writes_apart  # noqa: E402
from detector.evaluation.trained_weights import load_trained_weights  # noqa: E402
from detector.modeling import build_model  # noqa: E402
from detector.modeling.export import (  # noqa: E402
    BOX_RTOL,
    BOX_TOL,
    DEFAULT_OPSET,
    FORMATS,
    SCORE_TOL,
    ExportError,
    export_metadata,
    export_model,
    verify_export,
)
from detector.modeling.summary import default_image_size  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=user_path, required=True,
                   help="YAML config of the model (e.g. the run's config.yaml)")
    p.add_argument("--weights", type=user_path, required=True, help="checkpoint or state dict")
    p.add_argument("--format", required=True, choices=FORMATS, help="torchscript or onnx")
    p.add_argument("--output", type=output_file, required=True, help="file to write (or to check with --verify-only)")
    p.add_argument("--image-size", type=int, nargs=2, metavar=("H", "W"),
                   help="test image size (default: input.min_size_test x input.max_size_test)")
    p.add_argument("--image", type=user_path, help="an image file to test on instead of a generated scene")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    p.add_argument("--verify-only", action="store_true", help="check --output against the model, do not export")
    p.add_argument("--box-tol", type=float, default=BOX_TOL, help=f"box tolerance, pixels (default {BOX_TOL})")
    p.add_argument("--box-rtol", type=float, default=BOX_RTOL,
                   help=f"box tolerance, fraction of the longer image side, added to --box-tol (default {BOX_RTOL})")
    p.add_argument("--score-tol", type=float, default=SCORE_TOL, help=f"score tolerance (default {SCORE_TOL})")
    p.add_argument("--time", type=int, default=0, metavar="N",
                   help="then time N runs of the eager model and of the file on the first test image (CPU)")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = p.parse_intermixed_args(argv)  # key=value overrides before, between or after the options
    if args.image_size and not all(1 <= side <= MAX_IMAGE_SIDE for side in args.image_size):
        p.error(f"--image-size takes two sides in 1..{MAX_IMAGE_SIDE} pixels (as the input.* sizes), got "
                f"{args.image_size[0]} {args.image_size[1]}")
    if args.time < 0:  # checked before the export, not after it
        p.error(f"--time must be >= 0, got {args.time}")
    for option in ("box_tol", "box_rtol", "score_tol"):  # (-1 or nan called a correct file a MISMATCH)
        value = getattr(args, option)
        if not math.isfinite(value) or value < 0:
            p.error(f"--{option.replace('_', '-')} must be a finite number >= 0, got {value:g}")
    return args


def test_images(size: Tuple[int, int], image_path: Optional[str]) -> List[torch.Tensor]:
    """Two uint8 [3, H, W] images of different sizes: image_path and its top-left 3/4
    crop, or generated shapes scenes of size (H, W) and (3W/4, 3H/4) (another aspect
    ratio and area, so every level's anchor count differs)."""
    if image_path:
        image = torch.from_numpy(np.array(load_image(image_path))).permute(2, 0, 1).contiguous()  # a writable copy
        h, w = image.shape[1:]
        return [image, image[:, : max(1, 3 * h // 4), : max(1, 3 * w // 4)].contiguous()]
    h, w = size
    if h < 1 or w < 1:
        raise ValueError(f"--image-size must be positive, got {h} {w}")
    second = (max(1, 3 * w // 4), max(1, 3 * h // 4))
    images = []
    for i, (height, width) in enumerate((size, second)):
        side = min(max(height, width), 256)  # generate small, then resize: fast at any size
        scene, _ = generate_image(np.random.default_rng(i), side, side)
        scene = torch.from_numpy(scene).permute(2, 0, 1)[None].float()
        scene = F.interpolate(scene, size=(height, width), mode="bilinear", align_corners=False)
        images.append(scene[0].round().clamp(0, 255).to(torch.uint8))
    return images


def format_timing(result: dict) -> str:
    """One line per run (median and CPU time per image) and the speed ratio."""
    h, w = result["image_size"]
    lines = [f"{name}: median {r['median_s'] * 1e3:.1f} ms/image ({r['iters']} runs, "
             f"CPU {r['cpu_median_s'] * 1e3:.1f} ms)" for name, r in result["runs"].items()]
    lines.append(f"eager / exported time: {result['ratio']:.2f} (CPU time {result['ratio_cpu_time']:.2f}) "
                 f"on one {h}x{w} image, {result['machine']['torch_threads']} threads, "
                 f"load average {result['machine'].get('loadavg')}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    return run_tool(lambda: export(args))


def export(args: argparse.Namespace) -> int:
    """Export (unless --verify-only), check the file against the eager model, time it."""
    if not args.verify_only:  # before the work: an --output typed as an input would destroy it
        check_writes_apart({"--output": args.output},
                           {"--weights": args.weights, "--config": args.config, "--image": args.image})
    # --weights holds every weight: build without initial weights (nothing to download).
    cfg = load_config(args.config, [*args.overrides, "model.weights=", "model.backbone_weights="])
    model = build_model(cfg)
    class_names = None if args.verify_only else class_names_for(cfg)  # the file's metadata
    load_trained_weights(model, cfg, args.weights, class_names)
    model.eval()
    images = test_images(tuple(args.image_size or default_image_size(cfg)), args.image)
    output = Path(args.output)
    if class_names is not None:
        metadata = export_metadata(class_names, cfg.input.min_size_test, cfg.input.max_size_test)
        export_model(model, args.format, output, images[0], opset=args.opset, metadata=metadata)
        print(f"wrote {output} ({output.stat().st_size / 2**20:.1f} MiB, {args.format})")
    print(f"parity check: boxes within {args.box_tol:g} px + {args.box_rtol:g} x the longer image side, "
          f"scores within {args.score_tol:g}, same labels")
    reports = verify_export(model, args.format, output, images, args.box_tol, args.score_tol, args.box_rtol)
    for report in reports:
        print(report.line())
    bad = [r for r in reports if not r.ok]
    if bad:
        raise ExportError(f"{output} does not match the eager model: {bad[0].line()}")
    if not any(r.num_eager or r.num_exported for r in reports):  # 'parity ok' would say nothing
        raise ExportError(f"{output}: no detections on the test images, so the parity check compared nothing: give "
                          "--image a picture with objects the model finds, or a larger --image-size")
    print(f"parity ok: {args.format} file matches the eager model on {len(reports)} images")
    if args.time:
        print(format_timing(benchmark_exported(model, args.format, output, images[0], args.time)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
