"""A COCO-style instances file of any size for the ``records`` case (``--task data
--records-file``), written entry by entry so that its memory stays small:

    python -m benchmarks.coco_file /tmp/train118k.json 118287 860001
"""

from __future__ import annotations

import argparse
import json
import os
from typing import List, Optional

import numpy as np


def write_coco_file(path: str | os.PathLike, num_images: int, num_boxes: int, seed: int = 0) -> None:
    """Write a COCO-style instances file of ``num_images`` 640x480 images (files absent)
    and ``num_boxes`` boxes of 80 categories on random images, one entry at a time (the
    memory stays small whatever the size; COCO train2017: 118287 images, 860001 boxes)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        f.write('{"info": {}, "licenses": [], "categories": [')
        f.write(", ".join(json.dumps({"id": k, "name": f"c{k}", "supercategory": "x"}) for k in range(1, 81)))
        f.write('], "images": [')
        for i in range(1, num_images + 1):
            f.write(("" if i == 1 else ", ") + f'{{"id": {i}, "file_name": "{i:012d}.jpg", "width": 640, '
                    f'"height": 480, "license": 1, "date_captured": "2013-11-14 11:18:45"}}')
        f.write('], "annotations": [')
        for start in range(0, num_boxes, 100_000):
            n = min(100_000, num_boxes - start)
            image = rng.integers(1, num_images + 1, n)
            cat = rng.integers(1, 81, n)
            xy = np.round(rng.uniform(0, [300, 170], (n, 2)), 2)
            wh = np.round(rng.uniform(1, 300, (n, 2)), 2)
            for j in range(n):
                a = start + j + 1
                f.write(("" if a == 1 else ", ") + f'{{"id": {a}, "image_id": {image[j]}, "category_id": {cat[j]}, '
                        f'"bbox": [{xy[j, 0]}, {xy[j, 1]}, {wh[j, 0]}, {wh[j, 1]}], "area": '
                        f'{round(float(wh[j, 0] * wh[j, 1]), 2)}, "iscrowd": 0, "segmentation": [[1, 2, 3, 4, 5, 6]]}}')
        f.write("]}")


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description="Write a generated COCO-style annotation file of any size.")
    p.add_argument("out", help="the JSON file to write")
    p.add_argument("num_images", type=int)
    p.add_argument("num_boxes", type=int)
    args = p.parse_args(argv)
    write_coco_file(args.out, args.num_images, args.num_boxes)


if __name__ == "__main__":
    main()
