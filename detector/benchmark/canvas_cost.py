"""What fixed batch canvases (``model.canvas_sizes``) cost in padded pixels (not a test).

    python -m detector.benchmark.canvas_cost --config configs/faster_rcnn_r50_fpn_1x_coco.yaml \\
        --annotations ../shared/data/real/coco2017_16/annotations.json \\
        --canvases "[[800, 1344], [1344, 800]]"

Each image is resized as training resizes it (the largest ``input.min_size_train``,
capped by ``input.max_size_train``), grouped by aspect ratio as
``data.aspect_ratio_grouping`` groups it (portrait, landscape), and batched
``solver.images_per_gpu`` at a time in file order. Reported: the image pixels, the
pixels after padding each batch to a multiple of ``model.size_divisibility`` (today's
default), and after padding to the smallest canvas that holds the batch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import List, Sequence, Tuple

from ..config import load_config
from ..data.samplers import aspect_ratio_group_ids
from ..data.transforms import resized_shape
from ..modeling.faster_rcnn import batch_shape


@dataclass
class PaddingCost:
    """Pixels of one pass over the images, in megapixels (1e6 pixels)."""

    images: int
    image_mp: float  # the resized images themselves
    padded_mp: float  # batches padded to a multiple of size_divisibility
    canvas_mp: float  # batches padded to a canvas

    @property
    def canvas_over_padded(self) -> float:
        """Extra pixels of the canvases over today's padding (0.105: +10.5 %)."""
        return self.canvas_mp / self.padded_mp - 1.0


def padding_cost(sizes: Sequence[Tuple[int, int]], images_per_batch: int, size_divisibility: int,
                 canvases: Sequence[Sequence[int]]) -> PaddingCost:
    """Pixels of the resized ``sizes`` ``[(H, W), ...]`` batched within the training
    sampler's aspect groups (:func:`aspect_ratio_group_ids`), in the given order."""
    group_ids = aspect_ratio_group_ids([w / h for h, w in sizes])
    groups: List[List[Tuple[int, int]]] = [[s for s, g in zip(sizes, group_ids) if g == k] for k in (0, 1)]
    image = padded = canvas = 0
    for group in groups:
        for start in range(0, len(group), images_per_batch):
            batch = group[start:start + images_per_batch]
            h, w = batch_shape(batch, size_divisibility)
            ch, cw = batch_shape(batch, size_divisibility, canvases)
            image += sum(bh * bw for bh, bw in batch)
            padded += len(batch) * h * w
            canvas += len(batch) * ch * cw
    return PaddingCost(len(sizes), image / 1e6, padded / 1e6, canvas / 1e6)


def main(argv: Sequence[str] | None = None) -> PaddingCost:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config (input sizes, images per batch, divisibility)")
    p.add_argument("--annotations", required=True, help="COCO annotation file (image heights and widths)")
    p.add_argument("--canvases", default=None,
                   help='JSON [[H, W], ...]; default: the config\'s model.canvas_sizes')
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    canvases = json.loads(args.canvases) if args.canvases else cfg.model.canvas_sizes
    with open(args.annotations) as f:
        images = json.load(f)["images"]
    min_size, max_size = max(cfg.input.min_size_train), cfg.input.max_size_train
    sizes = [resized_shape(im["height"], im["width"], min_size, max_size) for im in images]
    cost = padding_cost(sizes, cfg.solver.images_per_gpu, cfg.model.size_divisibility, canvases)
    print(json.dumps({**asdict(cost), "canvases": canvases, "padded_over_image": cost.padded_mp / cost.image_mp - 1,
                      "canvas_over_padded": cost.canvas_over_padded}))
    return cost


if __name__ == "__main__":
    main()
