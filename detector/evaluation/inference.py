"""The inference loop: the model over a loader, detections in original image
coordinates, and (optionally) the training losses on the validation set; and the
model over image files with the detections drawn (``tools/infer.py``).

Distributed use: each rank runs its own shard (``InferenceSampler``: contiguous, no
duplicates) and returns its part; :func:`detector.evaluation.evaluate` gathers them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from tqdm import tqdm

from detector.data.files import DataError, decode_image, decoded_warnings
from detector.files import atomic_write, output_folder

from .input_files import output_paths
from .plots import render
from .results import Detections
from .static_inference import StaticDetector, StaticSettings
from .tta import TTASettings, tta_forward

logger = logging.getLogger(__name__)

LOSS_NAMES = ("loss_rpn_cls", "loss_rpn_box", "loss_roi_cls", "loss_roi_box")


@dataclass
class InferenceOutput:
    """One rank's detections.

    Attributes:
        detections: D detections (int64 image and category ids, ``bbox`` ``x, y, w, h``
            in original-image pixels), grouped by image in loader order, each image's
            detections in the model's order. Ids stay integers end to end: an id past
            2**53 would not survive a float64.
        image_ids: the image ids run, in loader order (images without detections too).
        seconds: model time per image (batch time / batch size), synchronised on CUDA.
    """

    detections: Detections
    image_ids: List[int] = field(default_factory=list)
    seconds: List[float] = field(default_factory=list)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module of a DistributedDataParallel (or DataParallel) wrapper.

    Evaluation must not go through DDP's forward: its buffer broadcast is a collective,
    and shards of different lengths would hang it.
    """
    return model.module if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) else model


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device, enabled: bool, dtype: torch.dtype):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextlib.contextmanager
def inference_run(device: torch.device, amp: bool) -> Iterator[None]:
    """The grad mode for a run of inference batches over fixed weights, each batch's
    forward under its own autocast when ``amp``.

    Without ``amp``: ``torch.inference_mode()``. With it: ``torch.no_grad()`` and an
    autocast context held open, itself off, around the run. Autocast casts a weight to
    the low-precision dtype once and keeps the copy (its weight cache) until the
    outermost autocast context exits, so held open, each weight is cast once per run
    instead of once per use in every batch (a copy kernel and about 4 host operations
    each; a weight used on every FPN level, like the RPN head's, was cast once per
    level). Under ``inference_mode`` autocast keeps no such cache, hence ``no_grad``.
    The weights must not change inside: the cache is dropped on leaving this context
    only.
    """
    if not amp:
        with torch.inference_mode():
            yield
        return
    with torch.no_grad(), torch.autocast(device_type=device.type, enabled=False):
        yield


def to_original_boxes(boxes: torch.Tensor, target: Mapping[str, Any]) -> torch.Tensor:
    """Boxes from the transformed image back to the original file's pixels.

    Args:
        boxes: [M, 4] xyxy in the coordinates of the image the model saw.
        target: with ``scale`` = (sx, sy) = transformed size / original size and
            ``orig_size`` = (h, w).

    Returns:
        float32 [M, 4] xyxy divided by (sx, sy, sx, sy), clipped to [0, w] x [0, h].
    """
    boxes = boxes.detach().float().cpu()
    scale = torch.as_tensor(target["scale"], dtype=torch.float32).reshape(2)
    sx, sy = float(scale[0]), float(scale[1])
    out = boxes / torch.tensor([sx, sy, sx, sy], dtype=torch.float32)
    h, w = (int(v) for v in torch.as_tensor(target["orig_size"]).reshape(2).tolist())
    out[:, 0::2] = out[:, 0::2].clamp(0, w)
    out[:, 1::2] = out[:, 1::2].clamp(0, h)
    return out


def detections_of_image(
    image_id: int, boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, label_to_category_id: Mapping[int, int],
    skip_unmapped: bool = False,
) -> Detections:
    """One image's detections (``boxes`` [M, 4] xyxy original pixels, ``scores`` [M],
    ``labels`` [M] 1..K mapped to original category ids) as :class:`Detections`: int64
    ids, float64 ``bbox`` ``x, y, w, h`` and scores.

    A label ``label_to_category_id`` lacks is a ValueError, or with ``skip_unmapped``
    (labels = category ids, ``data.label_space: category_id``) a detection left out: an
    unused id slot, which no ground truth category can match. An ``image_id`` outside
    int64 is a ValueError naming it."""
    if skip_unmapped:
        keep = torch.tensor([int(lab) in label_to_category_id for lab in labels.tolist()], dtype=torch.bool)
        boxes, scores, labels = boxes[keep], scores.cpu()[keep], labels[keep]
    b = boxes.detach().double().cpu().numpy().reshape(-1, 4)
    try:
        cats = np.array([label_to_category_id[int(lab)] for lab in labels.tolist()], dtype=np.int64)
    except KeyError as exc:
        raise ValueError(f"model predicted label {exc.args[0]}, which the dataset's label_to_category_id lacks") from None
    if not -(2**63) <= int(image_id) < 2**63:
        raise ValueError(f"image_id {image_id} does not fit a 64-bit integer")
    return Detections(
        image_id=np.full(b.shape[0], int(image_id), dtype=np.int64),
        category_id=cats.reshape(-1),
        bbox=np.concatenate([b[:, :2], b[:, 2:] - b[:, :2]], axis=1),
        score=scores.detach().double().cpu().numpy().reshape(-1),
    )


def run_inference(
    model: nn.Module,
    loader: Iterable,
    label_to_category_id: Mapping[int, int],
    amp: bool = False,
    amp_dtype: torch.dtype = torch.float16,
    progress: bool = True,
    skip_unmapped: bool = False,
    tta: Optional[TTASettings] = None,
    static: Optional[StaticSettings] = None,
) -> InferenceOutput:
    """Run ``model`` in eval mode over ``loader``, under :func:`inference_run`.

    Args:
        model: a detector (or its DDP wrapper) following the model contract.
        loader: yields ``(images, targets)``; targets carry ``image_id``, ``scale``,
            ``orig_size``.
        label_to_category_id: label 1..K -> original category id.
        amp: autocast the forward pass (``amp_dtype``; device-agnostic).
        progress: show a tqdm bar (the caller turns it off on ranks other than 0).
        skip_unmapped: leave out detections whose label ``label_to_category_id`` lacks
            (see :func:`detections_of_image`) instead of raising.
        tta: test-time augmentation (``detector.evaluation.tta``); None = one plain pass.
        static: run the batches through a ``StaticDetector`` (``eval.static``, and
            ``eval.cuda_graphs``: captured); None = the model's eager forward.

    The model's train/eval mode is restored afterwards.
    """
    net = unwrap(model)
    device = model_device(net)
    was_training = net.training
    net.eval()
    static_detector = StaticDetector(net, static) if static is not None else None
    parts: List[Detections] = []
    image_ids: List[int] = []
    seconds: List[float] = []
    try:
        total = len(loader) if hasattr(loader, "__len__") else None
        bar = tqdm(loader, total=total, desc="eval", disable=not progress, dynamic_ncols=True, mininterval=1.0)
        with inference_run(device, amp):
            for images, targets in bar:
                _sync(device)
                start = time.perf_counter()
                with _autocast(device, amp, amp_dtype):
                    outputs = (static_detector(list(images)) if static_detector is not None
                               else _forward(net, list(images), [t["orig_size"] for t in targets], tta))
                _sync(device)
                elapsed = time.perf_counter() - start
                seconds.extend([elapsed / max(len(images), 1)] * len(images))
                for out, target in zip(outputs, targets):
                    image_id = int(target["image_id"])
                    boxes = to_original_boxes(out["boxes"], target)
                    parts.append(detections_of_image(image_id, boxes, out["scores"], out["labels"].cpu(),
                                                     label_to_category_id, skip_unmapped))
                    image_ids.append(image_id)
    finally:
        net.train(was_training)
    if static_detector is not None:
        static_detector.report()
    return InferenceOutput(detections=Detections.concatenate(parts), image_ids=image_ids, seconds=seconds)


def _forward(net: nn.Module, images: List[torch.Tensor], orig_sizes: Sequence[Any],
             tta: Optional[TTASettings]) -> List[Dict[str, torch.Tensor]]:
    """``net(images)``, or with ``tta`` its test-time augmented detections (same frame).

    Raises:
        ValueError: with ``tta``, an image not at its original size (a data set or
            transform built without ``eval.tta.sizes`` resized it: TTA would resize it again).
    """
    if tta is None:
        return net(images)
    sizes = [tuple(int(v) for v in torch.as_tensor(s).reshape(2).tolist()) for s in orig_sizes]
    for img, size in zip(images, sizes):
        if tuple(img.shape[-2:]) != size:
            raise ValueError(f"eval.tta: an image of {size[0]}x{size[1]} arrives resized to "
                             f"{img.shape[-2]}x{img.shape[-1]}; build the data set or transform from the config "
                             "with eval.tta.sizes (its eval transform keeps the original size)")
    return tta_forward(net, images, sizes, tta)


@contextlib.contextmanager
def train_mode_with_frozen_norm(model: nn.Module):
    """The model in train mode (so it returns losses) with every normalisation layer
    in eval mode (running statistics neither used from the batch nor updated); all
    modes restored on exit."""
    modes = {m: m.training for m in model.modules()}
    try:
        model.train()
        for m in model.modules():
            if isinstance(m, (_NormBase, nn.GroupNorm, nn.LayerNorm)):
                m.eval()
        yield model
    finally:
        for m, mode in modes.items():
            m.training = mode


def compute_val_loss(
    model: nn.Module,
    loader: Iterable,
    amp: bool = False,
    amp_dtype: torch.dtype = torch.float16,
    progress: bool = True,
) -> Dict[str, float]:
    """The four training losses on a validation loader (this rank's images).

    The model runs in train mode under ``torch.no_grad()`` with its norm layers in eval
    mode; the RNG state (proposal/RoI sampling draws from it) is saved and restored so
    an evaluation during training does not change the training run's random stream.
    With ``amp`` each weight is cast once for the whole loader, as in
    :func:`inference_run` (an autocast context, itself off, held open around the batches).

    Returns:
        ``{"sum": {loss_name: sum over images of the per-batch loss x batch size},
        "count": number of images}`` -- the caller reduces over ranks and divides.
    """
    net = unwrap(model)
    device = model_device(net)
    sums = {k: 0.0 for k in LOSS_NAMES}
    count = 0
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), train_mode_with_frozen_norm(net), torch.no_grad(), \
            torch.autocast(device_type=device.type, enabled=False):
        bar = tqdm(loader, desc="val loss", disable=not progress, dynamic_ncols=True, mininterval=1.0)
        for images, targets in bar:
            with _autocast(device, amp, amp_dtype):
                losses = net(list(images), [dict(t) for t in targets])
            n = len(images)
            for k in LOSS_NAMES:
                sums[k] += float(losses[k].float()) * n
            count += n
    return {"sum": sums, "count": count}


# --------------------------------------------------------------------------- image files


def read_rgb(path: str | Path, apply_exif: bool = False) -> np.ndarray:
    """uint8 [H, W, 3] RGB, read as the data sets read their images
    (``detector.data.files.decode_image``: any bit depth scaled as ``to_rgb8`` does; an
    EXIF orientation applied when ``apply_exif``, ``data.apply_exif``, else read as stored;
    the data sets' warnings naming the file: ``detector.data.files.decoded_warnings``).

    Raises:
        FileNotFoundError: no such file.
        DataError: the file is unreadable or its pixel type has no 8-bit scale (named).
    """
    decoded = decode_image(str(path), apply_exif=apply_exif)
    for message in decoded_warnings(str(path), decoded, apply_exif):
        logger.warning("%s", message)
    return decoded.array


@torch.inference_mode()
def predict_image(
    model: nn.Module,
    image: np.ndarray,
    transform: Optional[Callable] = None,
    score_thresh: float = 0.5,
    tta: Optional[TTASettings] = None,
) -> Dict[str, torch.Tensor]:
    """Detections of one image, in its own pixel coordinates.

    Args:
        model: a detector in eval mode (or its DDP wrapper).
        image: uint8 [H, W, 3] RGB.
        transform: the eval transform (``build_transforms(cfg, is_train=False)``) to
            resize the image like the evaluation does; None = the image as is.
        score_thresh: detections below it are dropped.
        tta: test-time augmentation (``detector.evaluation.tta``); None = one plain pass.

    Returns:
        ``boxes`` float32 [M, 4] xyxy original pixels, ``scores`` [M], ``labels`` [M].
    """
    net = unwrap(model)
    h, w = image.shape[:2]
    if transform is not None:
        tensor, _, _ = transform(image, np.zeros((0, 4), np.float32), np.zeros((0,), np.int64))
    else:
        tensor = torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))
    new_h, new_w = tensor.shape[-2:]
    target = {
        "scale": torch.tensor([new_w / w, new_h / h], dtype=torch.float32),
        "orig_size": torch.tensor([h, w]),
    }
    # (the model moves the image to its device; TTA resizes it on the CPU first)
    out = _forward(net, [tensor], [(h, w)], tta)[0]
    keep = out["scores"] >= score_thresh
    return {
        "boxes": to_original_boxes(out["boxes"][keep], target),
        "scores": out["scores"][keep].float().cpu(),
        "labels": out["labels"][keep].cpu(),
    }


def draw_predictions(image: np.ndarray, det: Dict[str, torch.Tensor], class_names: Sequence[str]) -> torch.Tensor:
    """uint8 [3, H', W'] with boxes and ``name score`` captions drawn on ``image``
    (uint8 [H, W, 3]) in their class colours, a legend of the classes drawn; small images
    scaled up (see :func:`detector.evaluation.plots.render`)."""
    captions = [
        f"{class_names[int(lab) - 1] if 0 < int(lab) <= len(class_names) else lab} {float(s):.2f}"
        for lab, s in zip(det["labels"], det["scores"])
    ]
    return render(image, det["boxes"], captions, pred_classes=det["labels"], class_names=class_names).image


def predict_files(
    model: nn.Module,
    paths: Sequence[Path],
    output_dir: str | Path,
    class_names: Sequence[str],
    transform: Optional[Callable] = None,
    score_thresh: float = 0.5,
    tta: Optional[TTASettings] = None,
    apply_exif: bool = False,
) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Detect on each file, write ``<output_dir>/<stem>.png`` with the boxes drawn
    (names checked first by ``output_paths``; each file written atomically).

    A file that cannot be read (missing, corrupt, unsupported pixel type) is skipped with
    a warning naming it; the others are still processed. ``tta``: see :func:`predict_image`.
    ``apply_exif`` (``data.apply_exif``): files are read as training and evaluation read
    them (``read_rgb``); the boxes and the sizes are those of the array read.

    Returns:
        ``(records, skipped)``: one JSON-ready record per readable file (``file``,
        ``height``, ``width``, ``boxes`` xyxy, ``scores``, ``labels``, ``names``), and one
        message per skipped file.
    """
    targets = output_paths(paths, output_dir)  # refused before any work: see output_paths
    output_folder(output_dir)
    net = unwrap(model)
    was_training = net.training
    net.eval()
    records: List[Dict[str, Any]] = []
    skipped: List[str] = []
    try:
        for path, target in zip(paths, targets):
            try:
                image = read_rgb(path, apply_exif)
            except (FileNotFoundError, DataError) as exc:
                logger.warning("skipped: %s", exc)
                skipped.append(str(exc))
                continue
            det = predict_image(net, image, transform, score_thresh, tta)
            drawn = draw_predictions(image, det, class_names)
            picture = Image.fromarray(drawn.permute(1, 2, 0).numpy())
            atomic_write(target, lambda f: picture.save(f, format="PNG"))
            labels = det["labels"].tolist()
            records.append(
                {
                    "file": str(path),
                    "height": int(image.shape[0]),
                    "width": int(image.shape[1]),
                    "boxes": [[round(v, 2) for v in b] for b in det["boxes"].tolist()],
                    "scores": [round(s, 4) for s in det["scores"].tolist()],
                    "labels": labels,
                    "names": [class_names[lab - 1] if 0 < lab <= len(class_names) else str(lab) for lab in labels],
                }
            )
            logger.info("%s: %d detections", path, len(labels))
    finally:
        net.train(was_training)
    return records, skipped
