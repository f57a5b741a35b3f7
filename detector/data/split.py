"""Stratified train/val(/test) splits and k folds of a COCO JSON or a VOC image set
(``tools/split_dataset.py``).

Stratification is by boxes: every class should have about the same share of its boxes in
each split as the split's share of the images (the target fraction). The assignment is an
iterative stratification in the spirit of Sechidis, Tsoumakas and Vlahavas (2011), "On
the stratification of multi-label data", adapted to box counts:

1. each split ``j`` gets a fixed number of images, ``fractions[j] * N`` rounded by largest
   remainder (so the sizes sum to N);
2. repeatedly take the class with the fewest boxes still unassigned (the rarest first;
   ties in a seeded random order), and place each unassigned image holding it (in a
   seeded random order) into the split that still wants the most boxes of that class,
   among the splits with room left; ties go to the split with the most room, then at
   random;
3. images without boxes fill the remaining room;
4. a seeded local search then swaps pairs of images between splits while a swap lowers
   ``sum over classes c and splits j of (boxes_cj - fraction_j * boxes_c)^2 / boxes_c``
   (step 2 places the most frequent classes last, into whatever room is left; the swaps
   repair that, and keep every split's image count).

Everything random comes from ``numpy.random.default_rng(seed)``: the same seed and input
give the same splits. Boxes that always travel together (many boxes of a class in one
image) limit how close the shares can get; see ``docs/data.md``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from .coco import parse_coco
from .dataset import Issues
from .files import DataError
from .schema import load_coco_json, raise_error
from .voc_xml import read_voc_split, read_voc_xml
from detector.files import output_folder, write_text
from detector.messages import DetectorError

SPLIT_NAMES = ("train", "val", "test")


class SplitError(DetectorError, ValueError):
    """A split request that cannot be met (bad fractions, an empty split, too many folds)."""


@dataclass
class LabelledImages:
    """What the splitter needs of a data set: one key per image (COCO image id or VOC
    id), its box count per class, and the class names (index = class)."""

    keys: List[Any]
    counts: List[Counter]  # per image: class index -> number of boxes
    class_names: List[str]


# ---------------------------------------------------------------------------- assignment


def split_sizes(num_images: int, fractions: Sequence[float]) -> np.ndarray:
    """Images per split: ``fractions * num_images`` rounded by largest remainder, summing
    to ``num_images``.

    Raises:
        SplitError: fractions that are not positive or do not sum to 1, or a split that
            would get no image.
    """
    fr = np.asarray(fractions, dtype=np.float64)
    if len(fr) < 2 or not np.all(np.isfinite(fr)) or (fr <= 0).any():
        raise SplitError(f"--fractions must be 2 or 3 positive numbers, got {' '.join(f'{f:g}' for f in fr)}")
    if abs(fr.sum() - 1.0) > 1e-6:
        raise SplitError(f"--fractions {' '.join(f'{f:g}' for f in fr)} sum to {fr.sum():g}, not 1")
    exact = fr * num_images
    sizes = np.floor(exact).astype(np.int64)
    order = sorted(range(len(fr)), key=lambda j: (-(exact[j] - sizes[j]), j))
    for j in order[: num_images - int(sizes.sum())]:
        sizes[j] += 1
    for j, size in enumerate(sizes):
        if size == 0:
            name = SPLIT_NAMES[j] if len(fr) <= len(SPLIT_NAMES) else f"split {j}"
            raise SplitError(f"split '{name}' (fraction {fr[j]:g}) of {num_images} images would be empty")
    return sizes


def stratified_assign(
    counts: Sequence[Mapping[int, int]], fractions: Sequence[float], seed: int, swap_passes: int = 20
) -> np.ndarray:
    """The split index (0..S-1) of every image, stratified by boxes per class.

    Args:
        counts: per image, class -> number of boxes.
        fractions: target share of the images per split (sum 1).
        seed: seeds every random choice.
        swap_passes: swap attempts per image in the refinement (0 = none).

    Returns:
        int64 ``[N]``; split ``j`` holds exactly ``split_sizes(N, fractions)[j]`` images.
    """
    rng = np.random.default_rng(seed)
    fr = np.asarray(fractions, dtype=np.float64)
    room = split_sizes(len(counts), fr).astype(np.float64)
    totals: Counter = Counter()
    for c in counts:
        totals.update(c)
    wanted = {cls: fr * n for cls, n in totals.items()}  # boxes each split still wants, per class
    unassigned = Counter(totals)
    order = rng.permutation(len(counts))
    holding = {cls: [i for i in order if counts[i].get(cls)] for cls in totals}
    tiebreak = dict(zip(sorted(totals), rng.permutation(len(totals))))
    split_of = np.full(len(counts), -1, dtype=np.int64)

    def place(i: int, j: int) -> None:
        split_of[i] = j
        room[j] -= 1
        for cls, n in counts[i].items():
            wanted[cls][j] -= n
            unassigned[cls] -= n

    while any(n > 0 for n in unassigned.values()):
        rarest = min((cls for cls, n in unassigned.items() if n > 0), key=lambda cls: (unassigned[cls], tiebreak[cls]))
        for i in holding[rarest]:
            if split_of[i] >= 0:
                continue
            open_splits = np.flatnonzero(room > 0)
            keys = [(wanted[rarest][j], room[j], rng.random()) for j in open_splits]
            place(i, int(open_splits[max(range(len(keys)), key=keys.__getitem__)]))
    for i in order:
        if split_of[i] < 0:
            place(i, int(np.argmax(room)))
    refine_by_swaps(counts, split_of, fr, rng, swap_passes)
    return split_of


def refine_by_swaps(
    counts: Sequence[Mapping[int, int]], split_of: np.ndarray, fractions: np.ndarray, rng: np.random.Generator,
    passes: int,
) -> None:
    """Swap random pairs of images in different splits, in place, when the swap lowers
    ``sum_{c,j} (boxes_cj - fractions_j * boxes_c)^2 / boxes_c``; ``passes * N`` attempts."""
    n = len(counts)
    if n < 2 or passes <= 0:
        return
    num_classes = 1 + max((cls for c in counts for cls in c), default=-1)
    per_split = [[0] * num_classes for _ in fractions]  # boxes per split and class
    totals = [0] * num_classes
    for c, j in zip(counts, split_of.tolist()):
        for cls, k in c.items():
            per_split[j][cls] += k
            totals[cls] += k
    target = [[f * t for t in totals] for f in fractions.tolist()]
    items = [tuple(c.items()) for c in counts]
    where = split_of.tolist()
    for _ in range(passes):
        for i, k in rng.integers(n, size=(n, 2)).tolist():
            a, b = where[i], where[k]
            if a == b:
                continue
            change = dict(items[k])  # boxes that split a gains (and b loses) per class
            for cls, m in items[i]:
                change[cls] = change.get(cls, 0) - m
            delta = 0.0
            for cls, d in change.items():
                if d:
                    pa, pb, ta, tb = per_split[a][cls], per_split[b][cls], target[a][cls], target[b][cls]
                    delta += ((pa + d - ta) ** 2 - (pa - ta) ** 2 + (pb - d - tb) ** 2 - (pb - tb) ** 2) / totals[cls]
            if delta < -1e-9:
                where[i], where[k] = b, a
                for cls, d in change.items():
                    per_split[a][cls] += d
                    per_split[b][cls] -= d
    split_of[:] = where


def kfold_assign(counts: Sequence[Mapping[int, int]], k: int, seed: int) -> np.ndarray:
    """The fold (0..k-1) of every image: a stratified split into k equal parts.

    Raises:
        SplitError: ``k < 2`` or more folds than images.
    """
    if k < 2:
        raise SplitError(f"--folds must be at least 2, got {k}")
    if k > len(counts):
        raise SplitError(f"--folds {k} is more than the {len(counts)} images: a fold would be empty")
    return stratified_assign(counts, [1.0 / k] * k, seed)


# ---------------------------------------------------------------------------- reading


def read_coco_images(ann_file: str | os.PathLike) -> tuple[LabelledImages, Dict[str, Any]]:
    """Image ids and boxes per class of a COCO instances JSON (validated like training
    does, bad input raises ``DataError`` naming it), and the raw JSON to write from."""
    records, class_names, _, _ = parse_coco(ann_file, "", Issues(strict=True, log_skips=False))
    data = load_coco_json(str(ann_file))
    counts = [Counter((r.labels - 1).tolist()) for r in records]
    return LabelledImages([r.image_id for r in records], counts, class_names), data


def read_voc_images(root: str | os.PathLike, split: Optional[str] = None) -> LabelledImages:
    """VOC ids and objects per class name: the ids of ``ImageSets/Main/<split>.txt``, or
    of every ``Annotations/*.xml`` when ``split`` is None. Every object counts (difficult
    too). A missing, broken or badly typed XML file (see ``voc_xml.read_voc_xml``) raises
    ``DataError`` naming it."""
    root = Path(root)
    if split:
        split_file = root / "ImageSets" / "Main" / f"{split}.txt"
        ids = list(dict.fromkeys(read_voc_split(split_file)))
    else:
        ids = sorted(p.stem for p in (root / "Annotations").glob("*.xml"))
        if not ids:
            raise FileNotFoundError(f"no VOC annotation files in {root / 'Annotations'}")
        spaced = next((i for i in ids if len(i.split()) != 1), None)
        if spaced is not None:  # the lists written would not read back
            raise DataError(f"{root / 'Annotations' / (spaced + '.xml')}: a VOC image id cannot hold spaces (an "
                            "image-set list takes one id a line): rename the file and its image")
    names_per_image = []
    for vid in ids:
        parsed = read_voc_xml(root / "Annotations" / f"{vid}.xml", raise_error)
        names_per_image.append([obj.name for obj in parsed.objects])
    class_names = sorted({n for names in names_per_image for n in names})
    index = {n: i for i, n in enumerate(class_names)}
    counts = [Counter(index[n] for n in names) for names in names_per_image]
    return LabelledImages(ids, counts, class_names)


# ---------------------------------------------------------------------------- writing


def coco_subset(data: Mapping[str, Any], image_ids: set) -> Dict[str, Any]:
    """The COCO dict restricted to ``image_ids``: every other key (info, licenses,
    categories, ...) kept as it is, images and annotations in their original order."""
    return {
        **data,
        "images": [im for im in data["images"] if im.get("id") in image_ids],
        "annotations": [a for a in data.get("annotations", []) if a.get("image_id") in image_ids],
    }


def split_plan(names: Sequence[str], split_of: np.ndarray, folds: bool) -> Dict[str, np.ndarray]:
    """Output name -> boolean image mask. Fractions: ``train``, ``val`` (, ``test``).
    Folds: ``train_fold{j}`` (all but fold j) and ``val_fold{j}`` (fold j)."""
    if not folds:
        return {names[j]: split_of == j for j in range(len(names))}
    plan = {}
    for j in range(int(split_of.max()) + 1):
        plan[f"train_fold{j}"] = split_of != j
        plan[f"val_fold{j}"] = split_of == j
    return plan


def count_table(images: LabelledImages, split_of: np.ndarray, columns: Sequence[str]) -> str:
    """Boxes per class and images per split (count and share of the class's total)."""
    width = max([len("images")] + [len(n) for n in images.class_names])
    head = f"{'class':<{width}}  {'total':>6}" + "".join(f"  {c:>14}" for c in columns)
    lines = [head]
    per_split = [Counter() for _ in columns]
    for c, j in zip(images.counts, split_of):
        per_split[j].update(c)
    rows = [(name, [per_split[j][i] for j in range(len(columns))]) for i, name in enumerate(images.class_names)]
    rows = [(name, values) for name, values in rows if sum(values)]  # classes with boxes
    rows.append(("images", [int((split_of == j).sum()) for j in range(len(columns))]))
    for name, values in rows:
        total = sum(values)
        cells = "".join(f"  {v:>6} ({v / total if total else 0:.2f})" for v in values)
        lines.append(f"{name:<{width}}  {total:>6}{cells}")
    return "\n".join(lines)


def write_splits(
    out_dir: str | os.PathLike,
    images: LabelledImages,
    plan: Mapping[str, np.ndarray],
    coco_data: Optional[Mapping[str, Any]] = None,
    overwrite: bool = False,
) -> List[Path]:
    """Write ``<out_dir>/<name>.json`` (COCO, when ``coco_data`` is given) or
    ``<out_dir>/<name>.txt`` (VOC image-set lists) for every entry of ``plan``.

    Raises:
        SplitError: a file to write exists and ``overwrite`` is False (nothing written).
    """
    out = Path(out_dir)
    suffix = ".json" if coco_data is not None else ".txt"
    paths = [out / f"{name}{suffix}" for name in plan]
    existing = [p for p in paths if p.exists()]
    if existing and not overwrite:
        raise SplitError(f"{existing[0]} exists; pass --overwrite to replace it")
    output_folder(out, "--out")
    for path, mask in zip(paths, plan.values()):
        keys = [k for k, m in zip(images.keys, mask) if m]
        if coco_data is not None:
            text = json.dumps(coco_subset(coco_data, set(keys)))
        else:
            text = "".join(f"{k}\n" for k in keys)
        write_text(path, text)
    return paths


def check_outputs_apart_from_input(out_dir: str | os.PathLike, plan: Mapping[str, np.ndarray], suffix: str,
                                   source: Optional[Path]) -> None:
    """No file to write may be ``source``, the file split (``--out`` its own folder and
    ``--overwrite``: each run halved the set in place).

    Raises:
        SplitError: one line naming the file.
    """
    if source is None or not source.exists():
        return
    for name in plan:
        target = Path(out_dir) / f"{name}{suffix}"
        if target.exists() and os.path.samefile(target, source):
            raise SplitError(f"--out {out_dir}: {target} is the input being split ({source}); write the splits into "
                             "another folder")


# ---------------------------------------------------------------------------- the whole job


def split_dataset(
    out_dir: str | os.PathLike,
    annotations: Optional[str | os.PathLike] = None,
    voc_root: Optional[str | os.PathLike] = None,
    voc_split: Optional[str] = None,
    fractions: Optional[Sequence[float]] = None,
    folds: Optional[int] = None,
    seed: int = 0,
    overwrite: bool = False,
) -> tuple[List[Path], str]:
    """Split a COCO JSON (``annotations``) or a VOC image set (``voc_root``, optional
    ``voc_split``) by ``fractions`` (2 or 3, summing to 1: train/val/test) or into
    ``folds`` stratified folds; write the files (see ``write_splits``).

    Returns:
        ``(paths written, per-class count table)``; the table's columns are the splits,
        or for folds the validation folds.

    Raises:
        SplitError, DataError, FileNotFoundError: one-line messages naming the problem.
    """
    if (annotations is None) == (voc_root is None):
        raise SplitError("give exactly one of --annotations or --voc-root")
    if (fractions is None) == (folds is None):
        raise SplitError("give exactly one of --fractions or --folds")
    if fractions is not None and len(fractions) not in (2, 3):
        raise SplitError(f"--fractions takes 2 (train val) or 3 (train val test) numbers, got {len(fractions)}")
    coco_data = None
    if annotations is not None:
        images, coco_data = read_coco_images(annotations)
    else:
        images = read_voc_images(voc_root, voc_split)
    if not images.keys:
        raise SplitError(f"{annotations or voc_root}: no images to split")
    if folds is not None:
        split_of = kfold_assign(images.counts, folds, seed)
        columns = [f"fold{j}" for j in range(folds)]
    else:
        split_of = stratified_assign(images.counts, fractions, seed)
        columns = list(SPLIT_NAMES[: len(fractions)])
    plan = split_plan(columns, split_of, folds=folds is not None)
    source = Path(annotations) if annotations is not None else Path(voc_root) / "ImageSets" / "Main" / f"{voc_split}.txt"
    check_outputs_apart_from_input(out_dir, plan, ".json" if annotations is not None else ".txt",
                                   source if annotations is not None or voc_split else None)
    paths = write_splits(out_dir, images, plan, coco_data, overwrite)
    return paths, count_table(images, split_of, columns)
