"""Loader throughput benchmark (not a test): images per second delivered by
``build_train_loader`` for a config, with 0, 1 and 2 workers.

    python -m detector.benchmark.loader_sweep --workers 0 1 2 --batches 100 --repeats 3

measures two cases: the demo's shapes set (``configs/demo_shapes.yaml`` input
settings) and a COCO-format set of 640x480 JPEGs through the COCO-style train pipeline
(shorter side 800, longer side at most 1333, flip), batch 2. Data go under ``--workdir``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import cv2
import numpy as np
from PIL import Image

from detector.config import Config, load_config
from detector.data import build_dataset
from detector.data.loader import build_train_loader, measure_loader_throughput
from detector.data.shapes import generate_image


def make_jpeg_coco_set(out: str | os.PathLike, num_images: int = 48, width: int = 640, height: int = 480,
                       seed: int = 0, quality: int = 90) -> Path:
    """A COCO-format set of ``width`` x ``height`` JPEGs (textured backgrounds with shapes)
    at ``out/images`` + ``out/instances.json``; returns ``out``."""
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    images, anns = [], []
    for i in range(num_images):
        rng = np.random.default_rng([seed, 7, i])
        array, objects = generate_image(rng, min(width, height) // 2, max(width, height) // 2)
        h0, w0 = array.shape[:2]
        array = cv2.resize(array, (width, height), interpolation=cv2.INTER_LINEAR)
        sx, sy = width / w0, height / h0
        name = f"{i + 1:06d}.jpg"
        Image.fromarray(array).save(out / "images" / name, quality=quality)
        images.append({"id": i + 1, "file_name": name, "width": width, "height": height})
        for obj in objects:
            x, y, w, h = obj["bbox"]
            anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": obj["category_id"], "iscrowd": 0,
                         "bbox": [x * sx, y * sy, w * sx, h * sy], "area": w * h * sx * sy})
    categories = [{"id": 1, "name": "circle"}, {"id": 2, "name": "rectangle"}, {"id": 3, "name": "triangle"}]
    (out / "instances.json").write_text(json.dumps({"images": images, "annotations": anns, "categories": categories}))
    return out


def loader_throughput(cfg: Config, workers: Sequence[int], num_batches: int, warmup_batches: int = 3,
                      repeats: int = 3) -> List[Dict[str, float]]:
    """``measure_loader_throughput`` of ``build_train_loader(cfg)`` for each worker count:
    the best of ``repeats`` runs (on a shared machine the best run is the one least
    disturbed by other processes), with the median alongside."""
    dataset = build_dataset(cfg, "train", is_train=True)
    rows = []
    for n in workers:
        loader = build_train_loader(cfg, dataset, 0, 1, num_workers=n)
        runs = [measure_loader_throughput(loader, num_batches, warmup_batches) for _ in range(repeats)]
        best = max(runs, key=lambda r: r["images_per_s"])
        median = sorted(r["images_per_s"] for r in runs)[len(runs) // 2]
        rows.append({"num_workers": n, "batch": cfg.solver.images_per_gpu, **best, "median_images_per_s": median})
        del loader
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Data loader throughput (images/s).")
    parser.add_argument("--workdir", default="runs/loader_bench")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batches", type=int, default=40, help="timed batches per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the best is reported")
    parser.add_argument("--demo-config", default="configs/demo_shapes.yaml")
    args = parser.parse_args(argv)
    work = Path(args.workdir)
    shapes_root = work / "shapes"
    coco_root = work / "jpeg640x480"
    if not (coco_root / "instances.json").exists():
        make_jpeg_coco_set(coco_root)
    cases = {
        "shapes (demo input: short side 112-144, max 224, batch 4)": load_config(args.demo_config, [
            f"data.train.root={shapes_root}", f"data.val.root={shapes_root}", "data.persistent_workers=true"]),
        "640x480 JPEG, COCO pipeline (short 800, max 1333, flip, batch 2)": load_config(None, [
            "data.format=coco", f"data.train.root={coco_root / 'images'}",
            f"data.train.ann_file={coco_root / 'instances.json'}", "input.min_size_train=[800]",
            "input.max_size_train=1333", "input.hflip_prob=0.5", "solver.images_per_gpu=2", "train.device=cpu",
            "data.persistent_workers=true"]),
    }
    results = {}
    for name, cfg in cases.items():
        results[name] = loader_throughput(cfg, args.workers, args.batches, repeats=args.repeats)
        for row in results[name]:
            print(f"{name}: workers={row['num_workers']} best {row['images_per_s']:.1f} images/s, median "
                  f"{row['median_images_per_s']:.1f} ({row['images']:.0f} images per run), main process CPU "
                  f"{row['main_cpu_ms_per_image']:.2f} ms/image", flush=True)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
