"""Bbox-aware albumentations pipelines built from the config.

Resizing happens here only (the model never resizes): the shorter side becomes ``s``
(training: drawn from ``input.min_size_train``; evaluation: ``input.min_size_test``)
unless that makes the longer side exceed ``max_size``; i.e. the scale is
``min(s / short, max_size / long)`` (Faster R-CNN's rule), and the new size is the
rounded ``(w * scale, h * scale)``. The scale actually applied per axis,
``(sx, sy) = new size / original size``, is put in each target as ``scale``, so
``boxes_original = boxes / [sx, sy, sx, sy]``.

Boxes go through albumentations in ``pascal_voc`` format (``[x1, y1, x2, y2]`` pixels),
are clipped to the image, and a box that a transform pushes out of the image (zero area
left) is dropped together with its label.

Large-scale jitter (``input.lsj``, training only) replaces that resize: the image is
scaled to fit a ``size x size`` square times a factor drawn from ``[min_scale,
max_scale]``, then a random ``size x size`` window is cut from it, padded with zeros at
the bottom and right where the image is smaller (``LargeScaleJitter``). Copy-paste
(``input.copy_paste``, training only) then pastes box regions of another training
image, itself transformed by the same pipeline (copy_paste.py).

Randomness: in training every sample's random numbers (shorter side, flip, colour) come
from generators seeded by ``(seed, epoch, sample position)`` (``sample_generators``), so an
augmented sample is a pure function of that triple and of the image: the same whatever
the number of workers or ranks, and the same after a resume. There is no augmentation
random state to save in a checkpoint.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import albumentations as A
import cv2
import numpy as np
import torch

from detector.config import Config

from .copy_paste import CopyPasteSettings, paste_objects


def sample_generators(seed: int, epoch: int, position: int, stream: int = 0) -> Tuple[np.random.Generator, random.Random]:
    """The numpy and python generators that draw one sample's augmentation.

    Both are seeded from ``np.random.SeedSequence`` over ``(seed, epoch, position)``
    (each taken modulo 2**64), so nearby triples give independent streams. ``stream`` > 0
    gives further independent streams of the same sample (copy-paste: 1 draws the
    partner and the objects, 2 transforms the partner).
    """
    entropy = [int(v) % 2**64 for v in (seed, epoch, position)] + ([int(stream)] if stream else [])
    np_seq, py_seq = np.random.SeedSequence(entropy).spawn(2)
    py_seed = int.from_bytes(py_seq.generate_state(4, dtype=np.uint32).tobytes(), "little")
    return np.random.default_rng(np_seq), random.Random(py_seed)


def resized_shape(height: int, width: int, min_size: int, max_size: int) -> Tuple[int, int]:
    """(new_h, new_w) for a shorter side of ``min_size`` with the longer side capped at ``max_size``."""
    scale = min(min_size / min(height, width), max_size / max(height, width))
    return max(1, int(round(height * scale))), max(1, int(round(width * scale)))


def resize_array(img: np.ndarray, new_h: int, new_w: int) -> np.ndarray:
    """``[H, W, C]`` -> ``[new_h, new_w, C]``: bilinear, ``cv2.INTER_AREA`` when shrinking
    by more than 2x in both sides (the resize of every pipeline here; test-time
    augmentation uses it too). The same array when the size does not change."""
    h, w = img.shape[:2]
    if (new_h, new_w) == (h, w):
        return img
    interp = cv2.INTER_AREA if new_h * 2 < h and new_w * 2 < w else cv2.INTER_LINEAR
    return cv2.resize(img, (new_w, new_h), interpolation=interp)


class ResizeShortestEdge(A.DualTransform):
    """Resize so the shorter side is a random choice of ``min_sizes`` and the longer side
    is at most ``max_size`` (bilinear; ``cv2.INTER_AREA`` when shrinking by more than 2x).

    Boxes are kept in albumentations' normalised form, so they need no change.
    """

    def __init__(self, min_sizes: Sequence[int], max_size: int, p: float = 1.0) -> None:
        super().__init__(p=p)
        if not min_sizes or any(int(s) <= 0 for s in min_sizes) or max_size <= 0:
            raise ValueError(f"ResizeShortestEdge needs positive sizes, got min_sizes={list(min_sizes)}, max_size={max_size}")
        self.min_sizes = tuple(int(s) for s in min_sizes)
        self.max_size = int(max_size)

    def get_params_dependent_on_data(self, params: Dict[str, Any], data: Dict[str, Any]) -> Dict[str, Any]:
        h, w = params["shape"][:2]
        s = self.min_sizes[0] if len(self.min_sizes) == 1 else self.py_random.choice(self.min_sizes)
        new_h, new_w = resized_shape(h, w, s, self.max_size)
        return {"new_h": new_h, "new_w": new_w}

    def apply(self, img: np.ndarray, new_h: int = 0, new_w: int = 0, **params: Any) -> np.ndarray:
        return resize_array(img, new_h, new_w)

    def apply_to_bboxes(self, bboxes: np.ndarray, **params: Any) -> np.ndarray:
        return bboxes  # normalised coordinates do not change under a resize

    def get_transform_init_args_names(self) -> Tuple[str, ...]:
        return ("min_sizes", "max_size")


class LargeScaleJitter(A.DualTransform):
    """Large-scale jitter: resize by ``r * size / max(h, w)`` with ``r`` uniform in
    ``[min_scale, max_scale]`` (bilinear; ``cv2.INTER_AREA`` when shrinking by more than
    2x), then cut a random ``size x size`` window, zero-padded at the bottom and right
    where the resized image is smaller. Output: ``[size, size, C]``.

    Boxes (albumentations' normalised form) follow the resize and the window; the
    pipeline clips them to the window and drops those left with no area.
    """

    def __init__(self, size: int, min_scale: float, max_scale: float, p: float = 1.0) -> None:
        super().__init__(p=p)
        if size <= 0 or not (0 < min_scale <= max_scale):
            raise ValueError(f"LargeScaleJitter needs size > 0 and 0 < min_scale <= max_scale, got size={size}, "
                             f"min_scale={min_scale}, max_scale={max_scale}")
        self.size, self.min_scale, self.max_scale = int(size), float(min_scale), float(max_scale)

    def get_params_dependent_on_data(self, params: Dict[str, Any], data: Dict[str, Any]) -> Dict[str, Any]:
        h, w = params["shape"][:2]
        scale = self.py_random.uniform(self.min_scale, self.max_scale) * self.size / max(h, w)
        new_h, new_w = max(1, int(round(h * scale))), max(1, int(round(w * scale)))
        x0 = self.py_random.randint(0, max(0, new_w - self.size))
        y0 = self.py_random.randint(0, max(0, new_h - self.size))
        return {"new_h": new_h, "new_w": new_w, "x0": x0, "y0": y0}

    def apply(self, img: np.ndarray, new_h: int = 0, new_w: int = 0, x0: int = 0, y0: int = 0,
              **params: Any) -> np.ndarray:
        h, w = img.shape[:2]
        interp = cv2.INTER_AREA if new_h * 2 < h and new_w * 2 < w else cv2.INTER_LINEAR
        resized = img if (new_h, new_w) == (h, w) else cv2.resize(img, (new_w, new_h), interpolation=interp)
        if resized.ndim == 2:
            resized = resized[..., None]
        window = resized[y0:y0 + self.size, x0:x0 + self.size]
        out = np.zeros((self.size, self.size, *resized.shape[2:]), dtype=img.dtype)
        out[:window.shape[0], :window.shape[1]] = window
        return out.reshape(self.size, self.size, *img.shape[2:])

    def apply_to_bboxes(self, bboxes: np.ndarray, new_h: int = 0, new_w: int = 0, x0: int = 0, y0: int = 0,
                        **params: Any) -> np.ndarray:
        out = np.array(bboxes, dtype=np.float64, copy=True)
        if out.size:
            out[:, [0, 2]] = (out[:, [0, 2]] * new_w - x0) / self.size
            out[:, [1, 3]] = (out[:, [1, 3]] * new_h - y0) / self.size
        return out.astype(np.asarray(bboxes).dtype)

    def get_transform_init_args_names(self) -> Tuple[str, ...]:
        return ("size", "min_scale", "max_scale")


class DetectionTransform:
    """Apply an albumentations pipeline (and copy-paste) to ``(image, boxes, labels)``.

    Call: ``image`` uint8 ``[H, W, 3]``, ``boxes`` float32 ``[N, 4]`` xyxy pixels,
    ``labels`` int64 ``[N]``, and optionally ``key = (epoch, position)`` -> ``(image uint8
    tensor [3, H', W'], boxes float32 tensor [M, 4], labels int64 tensor [M])``; boxes
    pushed out are dropped with their labels (copy-paste may add boxes).

    With a ``key`` the sample's random numbers come from ``sample_generators(seed, epoch,
    position)``: the output depends on nothing else (this is how the training loader
    calls it). Without one, the pipeline draws from its own running stream, seeded by
    ``seed`` at construction, and copy-paste is off.

    Args:
        transforms: albumentations transforms, applied in order.
        seed: the run's seed (``train.seed``).
        copy_paste: copy-paste settings, or None; it needs a source (``set_source``).
    """

    def __init__(self, transforms: List[A.BasicTransform], seed: int = 0,
                 copy_paste: Optional[CopyPasteSettings] = None) -> None:
        self.seed = int(seed)
        self.copy_paste = copy_paste
        self.source: Optional[Callable[[int], Tuple[np.ndarray, np.ndarray, np.ndarray]]] = None
        self.source_size = 0
        self.pipeline = A.Compose(
            transforms,
            bbox_params=A.BboxParams(format="pascal_voc", label_fields=["labels"], clip=True,
                                     filter_invalid_bboxes=True, min_area=0.0, min_visibility=0.0),
        )
        # One shared stream for all transforms (albumentations' own seeding would give each
        # transform an identical copy, i.e. correlated draws).
        self.pipeline.set_random_state(np.random.default_rng(self.seed % 2**64), random.Random(self.seed))

    def set_source(self, source: Callable[[int], Tuple[np.ndarray, np.ndarray, np.ndarray]], size: int) -> None:
        """Where copy-paste takes its partner images: ``source(i)`` for ``i`` in
        ``0..size-1`` gives ``(image, boxes, labels)`` as this transform takes them."""
        if size <= 0:
            raise ValueError(f"set_source: the copy-paste source needs at least one item, got size={size}")
        self.source, self.source_size = source, int(size)

    def _apply(self, image: np.ndarray, boxes: np.ndarray, labels: np.ndarray,
               key: Optional[Tuple[int, int]], stream: int = 0) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pipeline on one sample: (image [H', W', C], boxes float32 [M, 4], labels int64 [M])."""
        if key is not None:
            self.pipeline.set_random_state(*sample_generators(self.seed, *key, stream=stream))
        boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
        out = self.pipeline(image=image, bboxes=boxes, labels=labels)
        img = out["image"]
        if img.ndim == 2:
            img = img[..., None]
        out_boxes = np.asarray(out["bboxes"], dtype=np.float32).reshape(-1, 4)
        out_labels = np.asarray(out["labels"], dtype=np.int64).reshape(-1)
        return img, out_boxes, out_labels

    def _paste(self, sample: Tuple[np.ndarray, np.ndarray, np.ndarray],
               key: Tuple[int, int]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copy-paste onto the transformed ``sample``: with probability ``prob``, the partner
        item drawn from the sample's stream 1, transformed with stream 2, is pasted."""
        settings = self.copy_paste
        if settings is None or self.source is None:
            return sample
        rng, _ = sample_generators(self.seed, *key, stream=1)
        if rng.random() >= settings.prob:
            return sample
        partner = self.source(int(rng.integers(self.source_size)))
        p_image, p_boxes, p_labels = self._apply(*partner, key=key, stream=2)
        return paste_objects(*sample, p_image, p_boxes, p_labels, rng, settings.max_objects, settings.min_visible)

    def __call__(self, image: np.ndarray, boxes: np.ndarray, labels: np.ndarray,
                 key: Optional[Tuple[int, int]] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sample = self._apply(image, boxes, labels, key)
        if key is not None:
            sample = self._paste(sample, key)
        img, out_boxes, out_labels = sample
        image_t = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))
        # Drop anything degenerate the pipeline left (should not happen with filtering on).
        keep = (out_boxes[:, 2] > out_boxes[:, 0]) & (out_boxes[:, 3] > out_boxes[:, 1])
        return image_t, torch.from_numpy(out_boxes[keep]), torch.from_numpy(out_labels[keep])

    def __repr__(self) -> str:
        return f"DetectionTransform({self.pipeline.transforms}, seed={self.seed}, copy_paste={self.copy_paste})"


def build_transforms(cfg: Config, is_train: bool, seed: Optional[int] = None) -> DetectionTransform:
    """The train pipeline (random shorter side from ``input.min_size_train`` capped at
    ``input.max_size_train``, or large-scale jitter with ``input.lsj``; horizontal flip with ``input.hflip_prob``, optional colour
    jitter; copy-paste settings with ``input.copy_paste``, its source set by
    ``build_dataset``) or the eval pipeline (deterministic resize to ``input.min_size_test`` /
    ``input.max_size_test``; with test-time augmentation, ``eval.tta.sizes``, no resize:
    each TTA pass resizes the original image itself). ``seed``: the run's seed (default: a
    random one)."""
    inp = cfg.input
    copy_paste = None
    if is_train:
        lsj = inp.lsj
        transforms: List[A.BasicTransform] = [
            LargeScaleJitter(lsj.size, lsj.min_scale, lsj.max_scale) if lsj.enabled
            else ResizeShortestEdge(inp.min_size_train, inp.max_size_train)]
        if inp.hflip_prob > 0:
            transforms.append(A.HorizontalFlip(p=inp.hflip_prob))
        if inp.color_jitter:
            transforms.append(A.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2, hue=0.02, p=0.8))
        cp = inp.copy_paste
        if cp.enabled:
            copy_paste = CopyPasteSettings(cp.prob, cp.max_objects, cp.min_visible)
    else:
        transforms = [A.NoOp()] if cfg.eval.tta.sizes else [ResizeShortestEdge([inp.min_size_test], inp.max_size_test)]
    return DetectionTransform(transforms, seed=seed if seed is not None else random.randrange(2**31),
                              copy_paste=copy_paste)
