"""The generated "shapes" demo data set, written in COCO format.

    python tools/make_shapes.py --out data/shapes --train 600 --val 100 --seed 0

writes::

    DIR/train.json   DIR/train/<tag>_000001.jpg ...
    DIR/val.json     DIR/val/<tag>_000001.jpg ...
    DIR/shapes_params.json   (the settings and generator version)

``<tag>`` (8 hex digits) stands for the settings: a folder regenerated with other settings
(``ensure_shapes``) names its images otherwise, so that a run still reading the old set
stops at its next image, naming the file that is gone, instead of reading the new
images with the old boxes.

Three classes told apart by shape only: ``circle`` (id 1), ``rectangle`` (id 2, aspect
0.5..2), ``triangle`` (id 3, randomly rotated, not degenerate). Colours vary within a
class. Each image has 1 to 6 objects whose larger bounding side runs from max(14 px, 12%)
to 60% of the shorter image side (rectangles keep their shorter side >= 70% of that
minimum), drawn anti-aliased over a textured, noisy background (smooth noise, stripes, a
colour gradient, pixel noise); later objects may cover part of earlier ones,
but no object is more than ~35% covered. Image sides are drawn independently from
``[min_side, max_side]`` (so the aspect ratio varies). Boxes are the exact extent of the
drawn geometry, ``[x, y, w, h]`` in continuous pixel coordinates, rounded to 0.01 px.

Each image comes from its own random generator seeded by ``(seed, split, index)``, so the
same seed gives byte-identical files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import cv2
import numpy as np
from PIL import Image, ImageDraw

from .files import path_within

logger = logging.getLogger(__name__)

CLASS_NAMES: Tuple[str, ...] = ("circle", "rectangle", "triangle")
MIN_OBJECT_SIDE = 14.0  # pixels, the smallest bounding-box side of a generated object
MIN_OBJECT_FRACTION = 0.12  # of the shorter image side
MAX_OBJECT_FRACTION = 0.6  # of the shorter image side
MAX_COVERED = 0.35  # at most this fraction of a box may be overlapped by another box
SUPERSAMPLE = 4  # anti-aliasing factor for the object masks
JPEG_QUALITY = 92
# Bump when the generator's output changes: ensure_shapes then regenerates old folders.
GENERATOR_VERSION = 2
PARAMS_FILE = "shapes_params.json"
# The files the generator wrote, one relative path a line: regenerating deletes these and
# nothing else (a run folder or any other file a user put in the folder stays).
MANIFEST_FILE = "shapes_files.txt"
_SPLIT_CODES = {"train": 1, "val": 2, "test": 3}


def _background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A textured background, float32 [h, w, 3] in 0..255."""
    base = rng.uniform(40, 215, size=3)
    # Colour gradient across the image.
    gy, gx = np.mgrid[0:h, 0:w].astype(np.float32)
    direction = rng.uniform(-1, 1, size=(2, 3)) * 50
    img = base + (gx[..., None] / w - 0.5) * direction[0] + (gy[..., None] / h - 0.5) * direction[1]
    # Smooth noise: a small random grid upsampled.
    cells = int(rng.integers(3, 9))
    grid = rng.normal(0, 1, size=(cells, cells, 3)).astype(np.float32)
    smooth = cv2.resize(grid, (w, h), interpolation=cv2.INTER_CUBIC)
    img = img + smooth * rng.uniform(8, 25)
    # Faint stripes with a random orientation and period.
    if rng.random() < 0.6:
        theta = rng.uniform(0, math.pi)
        period = rng.uniform(6, 30)
        phase = (gx * math.cos(theta) + gy * math.sin(theta)) * (2 * math.pi / period)
        img = img + (np.sin(phase)[..., None] * rng.uniform(5, 18) * rng.uniform(0.5, 1, size=3))
    return img.astype(np.float32)


def _shape_geometry(rng: np.random.Generator, cls: int, side: float, min_side: float) -> Tuple[str, np.ndarray]:
    """Geometry of one object centred at the origin: ("circle", [r]) or ("polygon", [K,2]).

    ``side`` is the larger side of its bounding box; a rectangle's shorter side is kept
    at ``0.7 * min_side`` or more."""
    if cls == 1:
        return "circle", np.array([side / 2.0])
    if cls == 2:
        aspect = math.exp(rng.uniform(math.log(0.5), math.log(2.0)))
        w, h = side * math.sqrt(aspect), side / math.sqrt(aspect)
        scale = side / max(w, h)  # keep the larger side = side
        w, h = w * scale, h * scale
        grow = max(1.0, 0.7 * min_side / min(w, h))
        w, h = w * grow, h * grow
        return "polygon", np.array([[-w / 2, -h / 2], [w / 2, -h / 2], [w / 2, h / 2], [-w / 2, h / 2]])
    # Triangle: vertices on a circle at roughly 120 degrees apart, jittered, rotated.
    theta0 = rng.uniform(0, 2 * math.pi)
    angles = theta0 + np.array([0.0, 2 * math.pi / 3, 4 * math.pi / 3]) + rng.uniform(-0.25, 0.25, size=3)
    pts = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    extent = (pts.max(0) - pts.min(0)).max()
    pts = pts * (side / extent)
    pts = pts - (pts.max(0) + pts.min(0)) / 2  # centre the bounding box
    return "polygon", pts


def _geometry_box(kind: str, geom: np.ndarray) -> np.ndarray:
    if kind == "circle":
        r = float(geom[0])
        return np.array([-r, -r, r, r])
    return np.array([geom[:, 0].min(), geom[:, 1].min(), geom[:, 0].max(), geom[:, 1].max()])


def _render_mask(kind: str, geom: np.ndarray, cx: float, cy: float, h: int, w: int) -> np.ndarray:
    """Anti-aliased coverage mask float32 [h, w] in 0..1 of a shape centred at (cx, cy)."""
    s = SUPERSAMPLE
    canvas = Image.new("L", (w * s, h * s), 0)
    draw = ImageDraw.Draw(canvas)
    if kind == "circle":
        r = float(geom[0])
        draw.ellipse([(cx - r) * s, (cy - r) * s, (cx + r) * s - 1, (cy + r) * s - 1], fill=255)
    else:
        pts = [((x + cx) * s, (y + cy) * s) for x, y in geom]
        draw.polygon(pts, fill=255)
    mask = np.asarray(canvas, dtype=np.float32).reshape(h, s, w, s).mean(axis=(1, 3)) / 255.0
    return mask


def _covered_fraction(box: np.ndarray, others: Sequence[np.ndarray]) -> float:
    worst = 0.0
    area = (box[2] - box[0]) * (box[3] - box[1])
    for o in others:
        iw = min(box[2], o[2]) - max(box[0], o[0])
        ih = min(box[3], o[3]) - max(box[1], o[1])
        if iw > 0 and ih > 0:
            inter = iw * ih
            o_area = (o[2] - o[0]) * (o[3] - o[1])
            worst = max(worst, inter / area, inter / o_area)
    return worst


def _object_colour(rng: np.random.Generator, background: np.ndarray) -> np.ndarray:
    """A random saturated colour that stands out from the mean ``background`` colour."""
    best, best_dist = None, -1.0
    for _ in range(12):
        hsv = np.array([[[rng.uniform(0, 180), rng.uniform(100, 255), rng.uniform(90, 255)]]], np.float32)
        rgb = cv2.cvtColor(hsv.astype(np.uint8), cv2.COLOR_HSV2RGB)[0, 0].astype(np.float32)
        dist = float(np.linalg.norm(rgb - background))
        if dist > best_dist:
            best, best_dist = rgb, dist
        if dist > 90:
            break
    return best


def generate_image(rng: np.random.Generator, min_side: int, max_side: int) -> Tuple[np.ndarray, List[Dict]]:
    """One image (uint8 [H, W, 3] RGB) and its objects: dicts with ``bbox`` [x, y, w, h],
    ``category_id`` (1..3) and ``area`` (visible mask pixels, before later occlusion)."""
    w = int(rng.integers(min_side, max_side + 1))
    h = int(rng.integers(min_side, max_side + 1))
    img = _background(rng, h, w)
    short = min(h, w)
    # Object sizes scale with the image (the detector sees images resized to one shorter
    # side), from max(14 px, 12% of the shorter side) to 60% of it.
    min_obj = max(MIN_OBJECT_SIDE, MIN_OBJECT_FRACTION * short)
    max_obj = max(min_obj + 1, MAX_OBJECT_FRACTION * short)
    n = int(rng.integers(1, 7))
    boxes: List[np.ndarray] = []
    objects: List[Dict] = []
    for _ in range(n):
        for _attempt in range(30):
            cls = int(rng.integers(1, len(CLASS_NAMES) + 1))
            side = math.exp(rng.uniform(math.log(min_obj), math.log(max_obj)))
            kind, geom = _shape_geometry(rng, cls, side, min_obj)
            rel = _geometry_box(kind, geom)
            bw, bh = rel[2] - rel[0], rel[3] - rel[1]
            if bw > w - 2 or bh > h - 2:
                continue
            cx = rng.uniform(1 - rel[0], w - 1 - rel[2])
            cy = rng.uniform(1 - rel[1], h - 1 - rel[3])
            box = rel + np.array([cx, cy, cx, cy])
            if _covered_fraction(box, boxes) > MAX_COVERED:
                continue
            mask = _render_mask(kind, geom, cx, cy, h, w)
            region = mask > 0.5
            colour = _object_colour(rng, img[region].mean(axis=0) if region.any() else img.mean(axis=(0, 1)))
            # A gentle shading gradient across the object.
            gy, gx = np.mgrid[0:h, 0:w].astype(np.float32)
            shade = ((gx - cx) * rng.uniform(-1, 1) + (gy - cy) * rng.uniform(-1, 1)) / max(bw, bh) * 30
            fill = np.clip(colour + shade[..., None], 0, 255)
            img = img * (1 - mask[..., None]) + fill * mask[..., None]
            boxes.append(box)
            x1, y1, x2, y2 = (round(float(v), 2) for v in box)
            objects.append({"bbox": [x1, y1, round(x2 - x1, 2), round(y2 - y1, 2)], "category_id": cls,
                            "area": round(float(mask.sum()), 2)})
            break
    img = img + rng.normal(0, rng.uniform(3, 10), size=img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8), objects


def generate_split(out: Path, split: str, num_images: int, seed: int, min_side: int, max_side: int,
                   prefix: str = "") -> Path:
    """Write ``out/<split>/<prefix>NNNNNN.jpg`` and ``out/<split>.json``; return the JSON path."""
    if split not in _SPLIT_CODES:
        raise ValueError(f"shapes split must be one of {sorted(_SPLIT_CODES)}, got {split!r}")
    if not (8 <= min_side <= max_side):
        raise ValueError(f"shapes sides need 8 <= min_side <= max_side, got min_side={min_side}, max_side={max_side}")
    image_dir = out / split
    image_dir.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for i in range(num_images):
        rng = np.random.default_rng([seed, _SPLIT_CODES[split], i])
        array, objects = generate_image(rng, min_side, max_side)
        image_id = i + 1
        file_name = f"{prefix}{image_id:06d}.jpg"
        Image.fromarray(array).save(image_dir / file_name, quality=JPEG_QUALITY)
        images.append({"id": image_id, "file_name": file_name, "height": int(array.shape[0]),
                       "width": int(array.shape[1])})
        for obj in objects:
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "iscrowd": 0, **obj})
    data = {
        "info": {"description": "detector shapes demo set", "seed": seed, "split": split},
        "images": images,
        "annotations": annotations,
        "categories": [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(CLASS_NAMES)],
    }
    ann_file = out / f"{split}.json"
    ann_file.write_text(json.dumps(data, separators=(",", ":")))
    return ann_file


def shapes_params(num_train: int, num_val: int, seed: int, min_side: int, max_side: int) -> Dict[str, int]:
    return {"version": GENERATOR_VERSION, "num_train": int(num_train), "num_val": int(num_val), "seed": int(seed),
            "min_side": int(min_side), "max_side": int(max_side)}


def settings_tag(params: Dict[str, int]) -> str:
    """8 hex digits that stand for ``params`` (``shapes_params``): the image names' prefix."""
    return hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:8]


def generate_shapes(out: str | os.PathLike, num_train: int, num_val: int, seed: int = 0,
                    min_side: int = 96, max_side: int = 224) -> Path:
    """Write the train and val splits under ``out`` (created if needed),
    ``out/shapes_files.txt`` listing the files written and ``out/shapes_params.json``
    recording how they were made."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    params = shapes_params(num_train, num_val, seed, min_side, max_side)
    prefix = f"{settings_tag(params)}_"
    written = []
    for split, count in (("train", num_train), ("val", num_val)):
        ann_file = generate_split(out, split, count, seed, min_side, max_side, prefix=prefix)
        written += [f"{split}/{img['file_name']}" for img in json.loads(ann_file.read_text())["images"]]
        written.append(ann_file.name)
    (out / MANIFEST_FILE).write_text("".join(f"{name}\n" for name in written))
    (out / PARAMS_FILE).write_text(json.dumps(params, sort_keys=True))
    return out


SPLIT_FILES = ("train.json", "val.json")  # what a folder of COCO data names as this generator does


def folder_state(root: Path, wanted: Dict[str, int]) -> Tuple[str, Optional[str]]:
    """What ``root`` is to the generator asked for ``wanted`` (``shapes_params``), and why:

    - ``"current"``: it wrote the folder with these settings;
    - ``"stale"``: it wrote it with other settings, or an older generator did (the reason);
    - ``"foreign"``: a split JSON (``train.json``, ``val.json``) it did not write is there:
      someone's own data, never written over;
    - ``"empty"``: the folder is missing, or holds nothing the generator writes.
    """
    params_file = root / PARAMS_FILE
    if params_file.is_file():
        try:
            have = json.loads(params_file.read_text())
        except ValueError:
            return "stale", f"{params_file} is not valid JSON"
        if have != wanted:
            diff = ", ".join(f"{k}: {have.get(k)} -> {v}" for k, v in wanted.items() if have.get(k) != v)
            return "stale", f"it was generated with other settings ({diff})"
        return "current", None
    try:
        info = json.loads((root / "train.json").read_text()).get("info", {})
    except (OSError, ValueError, AttributeError):
        info = None
    if isinstance(info, dict) and info.get("description") == "detector shapes demo set":
        return "stale", "it was written by an older version of the generator"
    taken = [name for name in SPLIT_FILES if (root / name).exists()]
    return ("foreign", f"{root / taken[0]} is not a file this generator wrote") if taken else ("empty", None)


@contextlib.contextmanager
def _folder_lock(root: Path) -> Iterator[None]:
    """An exclusive lock (``flock`` on a sibling file) so that several processes on one
    machine generate a folder once; a no-op where ``fcntl`` is missing."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_shapes(root: str | os.PathLike, num_train: int, num_val: int, seed: int = 0,
                  min_side: int = 96, max_side: int = 224) -> Path:
    """Generate the shapes set at ``root`` unless it is there with these settings.

    By ``folder_state``: a missing or empty folder (or one that holds only other files)
    is generated into; a folder this generator wrote with other settings (or an older
    generator version) is regenerated, with a warning: the files it wrote
    (``shapes_files.txt``) are replaced, and anything else in the folder is left alone; a
    folder whose split JSONs it did not write is used as it is. The new images have
    other names (``settings_tag``), so a run that still reads the old set stops with the
    name of a file that is gone, never pairs a new image with an old image's boxes.
    Generation happens in a temporary sibling folder whose files then move into
    ``root``, under a file lock, so several processes (ranks) starting at once generate
    it once.
    """
    root = Path(root)
    wanted = shapes_params(num_train, num_val, seed, min_side, max_side)
    if folder_state(root, wanted)[0] in ("current", "foreign"):
        return root
    with _folder_lock(root):
        state, reason = folder_state(root, wanted)
        if state in ("current", "foreign"):
            return root  # another process made it meanwhile, or not ours to touch
        if state == "stale":
            logger.warning("regenerating the shapes data set at %s: %s (a run still reading the old set stops at "
                           "its next image: its files are gone)", root, reason)
        else:
            logger.info("generating the shapes data set at %s (train=%d, val=%d, seed=%d, sides %d..%d)",
                        root, num_train, num_val, seed, min_side, max_side)
        tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        generate_shapes(tmp, num_train, num_val, seed, min_side, max_side)
        if root.exists():
            if state == "stale":
                _remove_generated(root)
            _move_generated(tmp, root)
        else:
            os.rename(tmp, root)
    return root


def _generated_files(root: Path) -> List[str]:
    """The files of ``root`` this generator wrote (relative paths): its manifest, or,
    from an older generator without one, each split's JSON and the images it lists."""
    manifest = root / MANIFEST_FILE
    if manifest.is_file():
        names = [line for line in manifest.read_text().splitlines() if line]
    else:
        names = []
        for split in _SPLIT_CODES:
            try:
                images = json.loads((root / f"{split}.json").read_text()).get("images", [])
                names += [f"{split}/{img['file_name']}" for img in images]
            except (OSError, ValueError, AttributeError, KeyError, TypeError):
                continue
            names.append(f"{split}.json")
    return [*names, MANIFEST_FILE, PARAMS_FILE]


def _remove_generated(root: Path) -> None:
    """Delete the files the generator wrote in ``root`` (see ``_generated_files``) and
    the split folders left empty; nothing else: a generator never deletes what it did
    not write."""
    for name in _generated_files(root):
        path = path_within(str(root), name)
        if path is not None and os.path.isfile(path) and not os.path.islink(path):
            os.unlink(path)
    for split in _SPLIT_CODES:
        with contextlib.suppress(OSError):  # absent, or holds files the generator did not write
            (root / split).rmdir()


def _move_generated(src: Path, root: Path) -> None:
    """Move the generated files of ``src`` into ``root`` (the parameters file last, so
    a folder is complete once it names its parameters), then remove ``src``."""
    for name in _generated_files(src):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(src / name, root / name)
    shutil.rmtree(src)
