"""Speed and memory benchmarks: training step, inference, data loading, COCO scoring.

Every timed task follows the same recipe:

- ``warmup`` untimed iterations first (allocator, caches, lazy initialisation, workers);
- then ``iters`` timed iterations, each bracketed by ``torch.cuda.synchronize()`` on
  CUDA so the time is the device's, not the launch queue's;
- the result is the median time per iteration (seconds), its spread (mean, std, min,
  max, inter-quartile range), images per second from the median, and peak memory:
  ``torch.cuda.max_memory_allocated`` on CUDA, the process's peak resident set size on
  CPU (``VmHWM``, reset per iteration through ``/proc/self/clear_refs`` where the
  kernel allows it, else the lifetime ``ru_maxrss`` of ``resource.getrusage``).

``--compare-torchvision`` builds :class:`torchvision.models.detection.FasterRCNN` with
the same backbone, FPN, anchors, samplers, head sizes, thresholds and normalisation
(:func:`build_torchvision_model`) and times it on the same cached batches in the same
process. The two models alternate iteration by iteration (the order flips every
iteration), so background load on a shared machine affects both alike. The reported
``ratio`` is ours / torchvision in images per second (> 1: ours is faster).

Entry point: :func:`run_benchmark` (``tools/benchmark.py`` parses arguments and calls it).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import platform
import resource
import statistics
import tempfile
import time
from functools import partial
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from detector.config import Config, config_to_dict
from detector.distributed import resolve_device

logger = logging.getLogger(__name__)

TASKS = ("train", "infer", "data", "eval", "memory")

Batch = Tuple[List[torch.Tensor], List[Dict[str, Any]]]


# --------------------------------------------------------------------------- memory


def _read_proc_status_bytes(field: str) -> Optional[int]:
    """A memory field of /proc/self/status (``VmHWM``: peak resident set since the
    last reset; ``VmRSS``: current resident set), in bytes; None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_memory(device: torch.device) -> bool:
    """Reset the peak-memory counter. Returns False where it cannot be reset (then the
    CPU figure is the lifetime peak of the process)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak RSS (VmHWM) to the current RSS
        return True
    except OSError:
        return False


def current_memory_bytes(device: torch.device) -> int:
    """Memory in use now: CUDA allocated bytes, or the resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    rss = _read_proc_status_bytes("VmRSS")
    return int(rss) if rss is not None else 0


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory since the last :func:`reset_peak_memory`: CUDA max allocated bytes,
    or the CPU peak RSS in bytes (``VmHWM``; ``ru_maxrss`` where /proc is absent)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _read_proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def memory_kind(device: torch.device) -> str:
    return "cuda_max_memory_allocated" if device.type == "cuda" else "cpu_peak_rss"


# --------------------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize_times(times: Sequence[float], images_per_iter: float) -> Dict[str, float]:
    """Median and spread of per-iteration times (seconds) and images per second.

    Returns a dict with ``iters``, ``median_s``, ``mean_s``, ``std_s``, ``min_s``,
    ``max_s``, ``iqr_s`` (75th minus 25th percentile), ``images_per_iter`` and
    ``images_per_s`` (``images_per_iter / median_s``).
    """
    if not times:
        raise ValueError("summarize_times: no timed iterations (iters must be >= 1)")
    arr = np.asarray(times, dtype=np.float64)
    median = float(np.median(arr))
    q25, q75 = np.percentile(arr, [25, 75])
    return {
        "iters": int(arr.size),
        "median_s": median,
        "mean_s": float(arr.mean()),
        "std_s": float(arr.std(ddof=1)) if arr.size > 1 else 0.0,
        "min_s": float(arr.min()),
        "max_s": float(arr.max()),
        "iqr_s": float(q75 - q25),
        "images_per_iter": float(images_per_iter),
        "images_per_s": float(images_per_iter / median) if median > 0 else float("inf"),
    }


class Runner:
    """Times one callable per iteration and tracks its peak memory.

    ``fn(i)`` runs iteration ``i`` and returns the number of images it processed;
    ``prepare(i)``, if given, runs first, outside the timed region (e.g. fresh copies
    of inputs that the timed code mutates).
    """

    def __init__(self, name: str, fn: Callable[[int], int], device: torch.device,
                 prepare: Optional[Callable[[int], None]] = None):
        self.name = name
        self.fn = fn
        self.prepare = prepare
        self.device = device
        self.times: List[float] = []
        self.cpu_times: List[float] = []
        self.images: List[int] = []
        self.peak_bytes = 0
        self.peak_delta_bytes = 0

    def run(self, i: int, timed: bool = True) -> None:
        if self.prepare is not None:
            self.prepare(i)
        synchronize(self.device)
        reset_peak_memory(self.device)
        before = current_memory_bytes(self.device)
        c0 = time.process_time()
        t0 = time.perf_counter()
        n = self.fn(i)
        synchronize(self.device)
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0
        peak = peak_memory_bytes(self.device)
        if timed:
            self.times.append(dt)
            self.cpu_times.append(cpu)
            self.images.append(n)
            self.peak_bytes = max(self.peak_bytes, peak)
            self.peak_delta_bytes = max(self.peak_delta_bytes, peak - before)

    def summary(self) -> Dict[str, Any]:
        out: Dict[str, Any] = summarize_times(self.times, statistics.mean(self.images) if self.images else 0)
        out["times_s"] = [round(t, 6) for t in self.times]
        # CPU seconds of this process (all its threads) per iteration: on a shared
        # machine a steadier measure of the work done than the wall-clock time.
        out["cpu_median_s"] = float(np.median(self.cpu_times))
        out["cpu_times_s"] = [round(t, 6) for t in self.cpu_times]
        out["peak_memory_bytes"] = int(self.peak_bytes)
        out["peak_memory_delta_bytes"] = int(self.peak_delta_bytes)
        out["peak_memory_mib"] = round(self.peak_bytes / 2**20, 1)
        out["memory_kind"] = memory_kind(self.device)
        return out


def run_interleaved(runners: Sequence[Runner], iters: int, warmup: int) -> None:
    """Warm each runner up, then alternate them iteration by iteration (the order
    flips every iteration) so slow phases of a shared machine hit all of them alike."""
    for r in runners:
        for i in range(warmup):
            r.run(i, timed=False)
    for i in range(iters):
        order = list(runners) if i % 2 == 0 else list(reversed(runners))
        for r in order:
            r.run(warmup + i, timed=True)


# --------------------------------------------------------------------------- batches


def batches_from_loader(loader: Any, num_batches: int, pin: bool = False) -> List[Batch]:
    """The first ``num_batches`` batches of a loader, kept in memory (pinned if asked)."""
    out: List[Batch] = []
    it = iter(loader)
    for _ in range(num_batches):
        try:
            images, targets = next(it)
        except StopIteration:
            break
        if pin:
            images = [img.pin_memory() for img in images]
        out.append((list(images), list(targets)))
    del it
    if not out:
        raise ValueError("the data loader gave no batches (is the split empty?)")
    return out


def synthetic_batches(
    num_batches: int,
    batch_size: int,
    min_size: int,
    max_size: int,
    num_classes: int,
    seed: int = 0,
    max_objects: int = 8,
) -> List[Batch]:
    """Random uint8 images already at the input size (shorter side ``min_size``, 4:3
    landscape, longer side capped at ``max_size``) with 1..max_objects random boxes.

    For timing the model where the data set is not on this machine. Images are
    ``[3, H, W]`` uint8; targets hold ``boxes`` float32 [N, 4] xyxy and ``labels`` int64.
    """
    g = torch.Generator().manual_seed(seed)
    h = int(min_size)
    w = int(min(max_size, round(min_size * 4 / 3)))
    out: List[Batch] = []
    for b in range(num_batches):
        images, targets = [], []
        for k in range(batch_size):
            images.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g))
            n = int(torch.randint(1, max_objects + 1, (1,), generator=g))
            xy = torch.rand(n, 2, generator=g) * torch.tensor([w * 0.8, h * 0.8])
            wh = (torch.rand(n, 2, generator=g) * 0.5 + 0.05) * torch.tensor([w, h])
            boxes = torch.cat([xy, torch.minimum(xy + wh, torch.tensor([w - 1.0, h - 1.0]))], dim=1)
            labels = torch.randint(1, num_classes + 1, (n,), generator=g)
            targets.append(
                {
                    "boxes": boxes.float(),
                    "labels": labels.long(),
                    "image_id": b * batch_size + k,
                    "orig_size": torch.tensor([h, w]),
                    "scale": torch.ones(2),
                }
            )
        out.append((images, targets))
    return out


def cached_batches(cfg: Config, is_train: bool, num_batches: int, synthetic: bool, pin: bool) -> List[Batch]:
    """Batches to time the model on: real ones from the configured data set (through
    the real transforms and loader), or :func:`synthetic_batches`."""
    if synthetic:
        if is_train:
            size, max_size, bs = cfg.input.min_size_train[0], cfg.input.max_size_train, cfg.solver.images_per_gpu
        else:
            size, max_size, bs = cfg.input.min_size_test, cfg.input.max_size_test, cfg.eval.images_per_gpu
        batches = synthetic_batches(num_batches, bs, size, max_size, cfg.model.num_classes, seed=cfg.train.seed)
        if pin:
            batches = [([img.pin_memory() for img in ims], tg) for ims, tg in batches]
        return batches
    from detector.data import build_dataset
    from detector.data.loader import build_test_loader, build_train_loader

    cfg = copy.deepcopy(cfg)
    cfg.data.persistent_workers = False
    if is_train:
        dataset = build_dataset(cfg, "train", is_train=True)
        loader = build_train_loader(cfg, dataset, 0, 1)
    else:
        dataset = build_dataset(cfg, "val", is_train=False)
        loader = build_test_loader(cfg, dataset, 0, 1)
    return batches_from_loader(loader, num_batches, pin=pin)


# --------------------------------------------------------------------------- models


def build_ours(cfg: Config, device: torch.device) -> nn.Module:
    from detector.modeling import build_model

    model = build_model(cfg)
    return model.to(device)


def _tv_norm_layer(cfg: Config) -> Callable[[int], nn.Module]:
    from torchvision.ops import FrozenBatchNorm2d

    norm, eps = cfg.model.norm, cfg.model.norm_eps
    if norm == "frozen_bn":
        return partial(FrozenBatchNorm2d, eps=eps)
    if norm in ("bn", "syncbn"):  # SyncBN is BN in a single process
        return partial(nn.BatchNorm2d, eps=eps)
    if norm == "gn":
        return lambda c: nn.GroupNorm(min(cfg.model.gn_groups, c), c, eps=eps)
    raise ValueError(f"model.norm={norm!r} has no torchvision counterpart")


def _freeze_bn(parent: nn.Module, name: str) -> None:
    """Replace BatchNorm2d ``parent.<name>`` (or every one inside it) by torchvision's
    FrozenBatchNorm2d with the same statistics."""
    from torchvision.ops import FrozenBatchNorm2d

    module = getattr(parent, name)
    if isinstance(module, nn.BatchNorm2d):
        frozen = FrozenBatchNorm2d(module.num_features, eps=module.eps)
        frozen.weight.copy_(module.weight.detach())
        frozen.bias.copy_(module.bias.detach())
        frozen.running_mean.copy_(module.running_mean)
        frozen.running_var.copy_(module.running_var)
        setattr(parent, name, frozen)
        return
    for child in list(dict(module.named_children())):
        _freeze_bn(module, child)


def _no_resize_transform(cfg: Config) -> nn.Module:
    """torchvision's GeneralizedRCNNTransform without its resize step.

    The batches given to both models are already at the input size (resizing is done
    once, in the data workers); torchvision's transform would otherwise run a bilinear
    interpolation on every image even at scale 1. Normalisation, batching (padding to
    a multiple of ``size_divisible``) and post-processing are torchvision's own.
    """
    from torchvision.models.detection.transform import GeneralizedRCNNTransform

    class NoResizeTransform(GeneralizedRCNNTransform):
        def resize(self, image, target=None):  # type: ignore[override]
            return image, target

    return NoResizeTransform(
        min_size=cfg.input.min_size_test,
        max_size=cfg.input.max_size_test,
        image_mean=list(cfg.model.pixel_mean),
        image_std=list(cfg.model.pixel_std),
        size_divisible=cfg.model.size_divisibility,
    )


def build_torchvision_model(cfg: Config) -> nn.Module:
    """torchvision's ``FasterRCNN`` with the configuration of ``cfg``: the same ResNet
    depth, norm layer (FrozenBN/BN/GN, eps), frozen stages, FPN stages and channels,
    anchors, RPN/ROI samplers and thresholds, RoIAlign, head sizes and normalisation.
    Its transform does not resize (see :func:`_no_resize_transform`)."""
    import torchvision
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.backbone_utils import BackboneWithFPN
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
    from torchvision.models.detection.rpn import RPNHead
    from torchvision.ops import MultiScaleRoIAlign
    from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

    m = cfg.model
    norm_layer = _tv_norm_layer(cfg)
    resnet = getattr(torchvision.models, m.backbone)(weights=None, norm_layer=norm_layer)
    # freeze_at: 0 none, 1 stem, 2 stem+layer1, ..., 5 everything (torchvision's
    # trainable_layers = 5 - freeze_at). Frozen stages' BatchNorms become FrozenBN.
    frozen = ["conv1", "bn1", "layer1", "layer2", "layer3", "layer4"][: (m.freeze_at + 1 if m.freeze_at else 0)]
    for name in frozen:
        module = getattr(resnet, name)
        module.requires_grad_(False)
        if m.norm in ("bn", "syncbn"):
            _freeze_bn(resnet, name)
    stage2 = resnet.inplanes // 8  # channels of layer1 (64 or 256)
    stages = list(m.return_stages)
    return_layers = {f"layer{s}": str(i) for i, s in enumerate(stages)}
    in_channels = [stage2 * 2 ** (s - 1) for s in stages]
    backbone = BackboneWithFPN(
        resnet, return_layers, in_channels, m.fpn_channels, extra_blocks=LastLevelMaxPool(),
        norm_layer=None if m.norm == "frozen_bn" else norm_layer,
    )

    sizes = tuple(tuple(float(s) for s in level) for level in m.anchors.sizes)
    ratios = (tuple(float(r) for r in m.anchors.aspect_ratios),) * len(sizes)
    anchor_gen = AnchorGenerator(sizes, ratios)
    rpn_head = RPNHead(m.fpn_channels, anchor_gen.num_anchors_per_location()[0], conv_depth=cfg.rpn.conv_depth)
    r = cfg.roi_heads
    pooler = MultiScaleRoIAlign([str(i) for i in range(len(stages))], r.pooler_resolution, r.sampling_ratio)
    box_head = TwoMLPHead(m.fpn_channels * r.pooler_resolution**2, r.representation_size)
    predictor = FastRCNNPredictor(r.representation_size, m.num_classes + 1)
    model = FasterRCNN(
        backbone,
        num_classes=None,
        min_size=cfg.input.min_size_test,
        max_size=cfg.input.max_size_test,
        image_mean=list(m.pixel_mean),
        image_std=list(m.pixel_std),
        rpn_anchor_generator=anchor_gen,
        rpn_head=rpn_head,
        rpn_pre_nms_top_n_train=cfg.rpn.pre_nms_topk_train,
        rpn_pre_nms_top_n_test=cfg.rpn.pre_nms_topk_test,
        rpn_post_nms_top_n_train=cfg.rpn.post_nms_topk_train,
        rpn_post_nms_top_n_test=cfg.rpn.post_nms_topk_test,
        rpn_nms_thresh=cfg.rpn.nms_thresh,
        rpn_fg_iou_thresh=cfg.rpn.fg_iou_thresh,
        rpn_bg_iou_thresh=cfg.rpn.bg_iou_thresh,
        rpn_batch_size_per_image=cfg.rpn.batch_size_per_image,
        rpn_positive_fraction=cfg.rpn.positive_fraction,
        rpn_score_thresh=cfg.rpn.score_thresh,
        box_roi_pool=pooler,
        box_head=box_head,
        box_predictor=predictor,
        box_score_thresh=r.score_thresh,
        box_nms_thresh=r.nms_thresh,
        box_detections_per_img=r.detections_per_img,
        box_fg_iou_thresh=r.fg_iou_thresh,
        box_bg_iou_thresh=r.bg_iou_hi,
        box_batch_size_per_image=r.batch_size_per_image,
        box_positive_fraction=r.positive_fraction,
        bbox_reg_weights=tuple(r.box_coder_weights),
    )
    model.transform = _no_resize_transform(cfg)
    return model


def copy_matching_weights(src: nn.Module, dst: nn.Module) -> Tuple[int, int]:
    """Copy every tensor of ``src``'s state dict whose name and shape ``dst`` has.

    With the same weights both models see the same proposals and detections, so the
    work they do per step is the same. Returns (copied, total in ``dst``)."""
    src_sd = src.state_dict()
    dst_sd = dst.state_dict()
    n = 0
    with torch.no_grad():
        for k, v in dst_sd.items():
            s = src_sd.get(k)
            if s is not None and s.shape == v.shape:
                v.copy_(s)
                n += 1
    return n, len(dst_sd)


def apply_speed_options(model: nn.Module, cfg: Config, device: torch.device) -> nn.Module:
    """The ``train.*`` speed options: ``channels_last`` (4-d weights in NHWC; convolutions
    then keep activations NHWC), ``cudnn_benchmark`` (CUDA only) and ``compile_backbone``
    (``torch.compile`` of ``model.backbone`` in place, so state-dict names stay)."""
    if cfg.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = bool(cfg.train.cudnn_benchmark)
    if cfg.train.compile_backbone:
        backbone = getattr(model, "backbone", None)
        if backbone is None:
            raise ValueError("train.compile_backbone=true but the model has no 'backbone' attribute")
        backbone.compile()
    return model


def _autocast(cfg: Config, device: torch.device):
    if not cfg.train.amp.enabled:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.train.amp.dtype == "bfloat16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def _build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """The training optimizer (parameter groups and all), at the LR of the first
    warm-up iteration so that a randomly initialised model does not diverge while timed."""
    from detector.engine.optim import build_optimizer

    opt = build_optimizer(model, cfg)
    for g in opt.param_groups:
        g["lr"] = g["lr"] * cfg.solver.warmup_factor
    return opt


def _targets_to(targets: Sequence[Dict[str, Any]], device: torch.device) -> List[Dict[str, Any]]:
    return [
        {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
        for t in targets
    ]


def _tv_images(images: Sequence[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    """uint8 [3,H,W] -> float 0..1 on ``device`` (torchvision's input convention)."""
    return [img.to(device, non_blocking=True).float().div_(255.0) for img in images]


def make_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: Config,
    device: torch.device,
    torchvision_api: bool,
) -> Callable[[Batch], Dict[str, torch.Tensor]]:
    """One training step: forward (autocast if ``train.amp.enabled``), sum of losses,
    backward, optimizer step, ``zero_grad(set_to_none=True)``. No host sync.

    ``torchvision_api``: convert the uint8 images to float 0..1 on the device and move
    the targets first (torchvision's convention); ours takes uint8 host tensors as they
    come from the loader and moves them itself.
    """
    scaler = None
    if cfg.train.amp.enabled and cfg.train.amp.dtype == "float16" and device.type == "cuda":
        scaler = torch.amp.GradScaler(device.type)

    def step(batch: Batch) -> Dict[str, torch.Tensor]:
        images, targets = batch
        if torchvision_api:
            images = _tv_images(images, device)
            targets = [{"boxes": t["boxes"], "labels": t["labels"]} for t in targets]
            targets = _targets_to(targets, device)
        with _autocast(cfg, device):
            losses = model(images, targets)
        loss = sum(v.float() for v in losses.values())
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if torchvision_api:
            # torchvision's references/detection/engine.py reads the loss back every
            # iteration (``loss_value = losses_reduced.item()``) to check it is finite.
            float(loss.detach())
        return losses

    return step


def make_trainer_step(model: nn.Module, cfg: Config, device: torch.device, output_dir: str) -> Tuple[Callable[[Batch], Any], nn.Module]:
    """The project's real hot loop: ``Trainer.run_step`` (autocast, float32 loss sum,
    GradScaler, gradient norm, the non-finite check with its one read-back, optimizer
    and LR scheduler step). The Trainer applies the ``train.*`` speed options itself.

    Returns ``(step, model as prepared by the Trainer)``. ``output_dir`` receives the
    Trainer's config.yaml and an empty metrics.jsonl.
    """
    import dataclasses

    from detector.distributed import DistInfo
    from detector.engine.trainer import Trainer

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=output_dir, tensorboard=False))
    trainer = Trainer(cfg, dist_info=DistInfo(0, 1, 0, device), model=model, train_loader=[])

    def step(batch: Batch) -> Any:
        images, targets = batch
        return trainer.run_step(images, targets)

    step.trainer = trainer  # type: ignore[attr-defined]  # keeps its writers alive
    return step, trainer.model


def make_infer_step(model: nn.Module, cfg: Config, device: torch.device, torchvision_api: bool) -> Callable[[Batch], Any]:
    """One inference batch under ``torch.inference_mode`` (autocast if ``eval.amp``)."""

    def step(batch: Batch) -> Any:
        images, _ = batch
        with torch.inference_mode():
            if torchvision_api:
                images = _tv_images(images, device)
            ctx = torch.autocast(device.type, dtype=torch.bfloat16 if device.type == "cpu" else torch.float16) if cfg.eval.amp else contextlib.nullcontext()
            with ctx:
                return model(images)

    return step


# --------------------------------------------------------------------------- machine


def machine_info(device: torch.device) -> Dict[str, Any]:
    """What the figures were measured on."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: Dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "torch": torch.__version__,
        "device": str(device),
    }
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


# --------------------------------------------------------------------------- tasks


def _ratio(ours: Dict[str, Any], theirs: Dict[str, Any]) -> Dict[str, float]:
    """ours / torchvision in images per second, from medians and pair by pair."""
    pairs = [b / a for a, b in zip(ours["times_s"], theirs["times_s"]) if a > 0]
    return {
        "ratio": ours["images_per_s"] / theirs["images_per_s"] if theirs["images_per_s"] > 0 else float("nan"),
        "ratio_pairwise_median": float(np.median(pairs)) if pairs else float("nan"),
        "ratio_cpu_time": theirs["cpu_median_s"] / ours["cpu_median_s"] if ours["cpu_median_s"] > 0 else float("nan"),
    }


def _model_info(model: nn.Module) -> Dict[str, int]:
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def benchmark_model(
    cfg: Config,
    task: str,
    iters: int,
    warmup: int,
    compare_torchvision: bool,
    num_batches: int = 4,
    synthetic: bool = False,
    same_weights: bool = True,
    torchvision_options: bool = False,
) -> Dict[str, Any]:
    """Time the training step (``task="train"``) or inference (``"infer"``) of our
    model on batches cached in memory, alternating with torchvision's if asked.

    Ours trains through ``Trainer.run_step`` (the real hot loop, with the ``train.*``
    speed options of ``cfg``); torchvision's through :func:`make_train_step`, at its
    defaults unless ``torchvision_options`` (then with the same ``train.*`` options).
    ``same_weights``: copy our weights into torchvision's model where names and shapes
    match, so both see the same proposals and detections."""
    device = resolve_device(cfg.train.device)
    is_train = task == "train"
    torch.manual_seed(cfg.train.seed)
    batches = cached_batches(cfg, is_train, num_batches, synthetic, pin=device.type == "cuda")
    ours = build_ours(cfg, device)
    models: Dict[str, nn.Module] = {"ours": ours}
    out: Dict[str, Any] = {"models": {"ours": _model_info(ours)}}
    if compare_torchvision:
        tv = build_torchvision_model(cfg).to(device)
        if same_weights:
            copied, total = copy_matching_weights(ours, tv)
            out["torchvision_weights_copied"] = f"{copied}/{total}"
        if torchvision_options:
            tv = apply_speed_options(tv, cfg, device)
        models["torchvision"] = tv
        out["models"]["torchvision"] = _model_info(tv)
    out["torchvision_options"] = "same as ours" if torchvision_options else "torchvision defaults"

    runners = []
    with tempfile.TemporaryDirectory(prefix="detector_bench_") as tmp:
        for name, model in models.items():
            tv_api = name == "torchvision"
            if is_train and not tv_api:
                step, models[name] = make_trainer_step(model, cfg, device, tmp)
                out["ours_step"] = "detector.engine.trainer.Trainer.run_step"
            elif is_train:
                model.train()
                step = make_train_step(model, _build_optimizer(model, cfg), cfg, device, tv_api)
            else:
                model = apply_speed_options(model, cfg, device) if not tv_api else model
                model.eval()
                step = make_infer_step(model, cfg, device, tv_api)

            def fn(i: int, step=step) -> int:
                batch = batches[i % len(batches)]
                step(batch)
                return len(batch[0])

            runners.append(Runner(name, fn, device))
        run_interleaved(runners, iters, warmup)
    out["runs"] = {r.name: r.summary() for r in runners}
    out["images_per_iter"] = out["runs"]["ours"]["images_per_iter"]
    out["batch_shapes"] = [[list(img.shape) for img in b[0]] for b in batches]
    if compare_torchvision:
        out.update(_ratio(out["runs"]["ours"], out["runs"]["torchvision"]))
    return out


def cycle_epochs(loader: Iterable[Batch]) -> Iterator[Batch]:
    """The loader's batches epoch after epoch, calling ``batch_sampler.set_epoch`` before
    each epoch as training does. Raises ValueError if an epoch gives no batch."""
    epoch = 0
    while True:
        sampler = getattr(loader, "batch_sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        count = 0
        for batch in loader:
            count += 1
            yield batch
        if count == 0:
            raise ValueError("the data loader gave no batches (is the split empty?)")
        epoch += 1


def benchmark_train_loader(cfg: Config, iters: int, warmup: int) -> Dict[str, Any]:
    """The training step fed by the real loader (workers, pinned memory): time per
    iteration including the wait for the next batch, and that wait alone."""
    from detector.data import build_dataset
    from detector.data.loader import build_train_loader

    device = resolve_device(cfg.train.device)
    torch.manual_seed(cfg.train.seed)
    dataset = build_dataset(cfg, "train", is_train=True)
    loader = build_train_loader(cfg, dataset, 0, 1)
    tmp = tempfile.TemporaryDirectory(prefix="detector_bench_")
    step, _ = make_trainer_step(build_ours(cfg, device), cfg, device, tmp.name)
    waits: List[float] = []
    batches = cycle_epochs(loader)

    def fn(i: int) -> int:
        t0 = time.perf_counter()
        batch = next(batches)
        if i >= warmup:
            waits.append(time.perf_counter() - t0)
        step(batch)
        return len(batch[0])

    runner = Runner("ours_loader", fn, device)
    run_interleaved([runner], iters, warmup)
    summary = runner.summary()
    summary["data_wait_median_s"] = float(np.median(waits)) if waits else 0.0
    summary["data_wait_max_s"] = float(np.max(waits)) if waits else 0.0
    summary["num_workers"] = cfg.data.num_workers
    batches.close()  # shuts the loader's workers down
    tmp.cleanup()
    return {"runs": {"ours_loader": summary}}


def benchmark_data(cfg: Config, iters: int, warmup: int) -> Dict[str, Any]:
    """Loader throughput: time per batch of ``build_train_loader`` (decoding, the
    albumentations pipeline, collate, ``cfg.data.num_workers`` workers), no model."""
    from detector.data import build_dataset
    from detector.data.loader import build_train_loader

    device = torch.device("cpu")
    dataset = build_dataset(cfg, "train", is_train=True)
    loader = build_train_loader(cfg, dataset, 0, 1)
    batches = cycle_epochs(loader)

    def fn(i: int) -> int:
        images, _ = next(batches)
        return len(images)

    runner = Runner("loader", fn, device)
    run_interleaved([runner], iters, warmup)
    summary = runner.summary()
    summary["num_workers"] = cfg.data.num_workers
    summary["dataset_len"] = len(dataset)
    batches.close()
    return {"runs": {"loader": summary}, "images_per_iter": summary["images_per_iter"]}


def benchmark_eval(
    cfg: Config,
    iters: int,
    warmup: int,
    gt_file: Optional[str] = None,
    results_file: Optional[str] = None,
    num_images: int = 500,
    boxes_per_image: int = 30,
) -> Dict[str, Any]:
    """COCO scoring speed, interleaved: pycocotools called directly (the documented
    sequence, ``detector.evaluation.bench.pycocotools_direct``) against our
    ``coco_evaluate`` with each backend and ``score_detections`` (every metric: COCO,
    VOC, IoU, confusion matrix). Inputs are a given gt/results pair or the evaluation
    helper's synthetic COCO-like case (``generate_case``); fresh copies of them are made
    outside the timed region. Checks that the 12 COCO numbers agree."""
    from detector.evaluation.bench import generate_case, pycocotools_direct
    from detector.evaluation.coco import COCO_METRIC_NAMES, coco_evaluate
    from detector.evaluation.scoring import score_detections

    device = torch.device("cpu")
    if gt_file:
        with open(gt_file) as f:
            gt = json.load(f)
        with open(results_file) as f:  # type: ignore[arg-type]
            results = json.load(f)
        source: Dict[str, Any] = {"gt": gt_file, "results": results_file}
    else:
        gt, results = generate_case(num_images, boxes_per_image, seed=cfg.train.seed)
        source = {"generated_images": num_images, "boxes_per_image": boxes_per_image}
    source.update(images=len(gt["images"]), gt_boxes=len(gt["annotations"]), detections=len(results))
    n_img = len(gt["images"])
    stats: Dict[str, np.ndarray] = {}
    inputs: Dict[str, Any] = {}

    def fresh(i: int) -> None:
        inputs["gt"], inputs["results"] = copy.deepcopy(gt), copy.deepcopy(results)

    def twelve(metrics: Dict[str, float]) -> np.ndarray:
        return np.array([metrics[k] for k in COCO_METRIC_NAMES])

    scorers: Dict[str, Callable[[Dict[str, Any], List[Dict[str, Any]]], np.ndarray]] = {
        "pycocotools_direct": lambda g, r: np.asarray(pycocotools_direct(g, r))[:12],
        "ours_pycocotools": lambda g, r: twelve(coco_evaluate(g, r, backend="pycocotools").metrics),
    }
    try:
        import faster_coco_eval  # noqa: F401

        scorers["ours_faster"] = lambda g, r: twelve(coco_evaluate(g, r, backend="faster").metrics)
    except ImportError:
        logger.warning("faster-coco-eval is not installed; timing the pycocotools backend only")
    scorers["ours_all_metrics"] = lambda g, r: twelve(score_detections(g, r, backend=cfg.eval.backend).metrics)

    runners = []
    for name, scorer in scorers.items():
        def run(i: int, name=name, scorer=scorer) -> int:
            stats[name] = scorer(inputs["gt"], inputs["results"])
            return n_img

        runners.append(Runner(name, run, device, prepare=fresh))
    run_interleaved(runners, iters, warmup)
    out: Dict[str, Any] = {"runs": {r.name: r.summary() for r in runners}, "source": source, "images_per_iter": n_img}
    ref = stats["pycocotools_direct"]
    out["max_abs_diff_vs_pycocotools"] = {k: float(np.max(np.abs(v - ref))) for k, v in stats.items()}
    ref_ips = out["runs"]["pycocotools_direct"]["images_per_s"]
    out["ratio_vs_pycocotools"] = {k: r["images_per_s"] / ref_ips for k, r in out["runs"].items()}
    return out


# --------------------------------------------------------------------------- memory of a run


def _process_tree(root_pid: int) -> List[int]:
    """``root_pid`` and all its descendants (from /proc/*/stat)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _proc_kib(path: str, field: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure_command_memory(cmd: List[str], interval_s: float = 0.2) -> Dict[str, Any]:
    """Run ``cmd`` and sample the memory of its whole process tree (the trainer and its
    data-loader workers) every ``interval_s``.

    Returns ``returncode``, ``wall_s``, ``peak_tree_rss_bytes`` (sum of the processes'
    resident sets: counts pages shared between them once per process, an upper bound),
    ``peak_tree_pss_bytes`` (proportional set size: shared pages split between the
    sharers, the tree's real footprint) and ``peak_largest_process_rss_bytes``
    (``ru_maxrss`` of the largest child, what ``/usr/bin/time -v`` reports).
    """
    import subprocess

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    peak_rss = peak_pss = 0
    samples = 0
    while proc.poll() is None:
        pids = _process_tree(proc.pid)
        rss = sum(_proc_kib(f"/proc/{p}/status", "VmRSS:") for p in pids)
        pss = sum(_proc_kib(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        samples += 1
        time.sleep(interval_s)
    wall = time.perf_counter() - t0
    largest = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {
        "command": cmd,
        "returncode": proc.returncode,
        "wall_s": round(wall, 2),
        "samples": samples,
        "peak_tree_rss_bytes": peak_rss * 1024,
        "peak_tree_pss_bytes": peak_pss * 1024,
        "peak_largest_process_rss_bytes": largest * 1024,
    }


# --------------------------------------------------------------------------- profile


def profile_train_step(
    cfg: Config,
    warmup: int = 2,
    row_limit: int = 10,
    synthetic: bool = False,
    torchvision_model: bool = False,
    trace_path: Optional[str] = None,
) -> Dict[str, Any]:
    """``torch.profiler`` over one training step after ``warmup`` steps.

    Returns ``top_ops``: the ``row_limit`` operators with the largest self time (CPU,
    or CUDA on a GPU) as dicts (name, self/total time in ms, calls, share of the step),
    and ``table``: the profiler's own text table.
    """
    from torch.profiler import ProfilerActivity, profile

    device = resolve_device(cfg.train.device)
    torch.manual_seed(cfg.train.seed)
    batches = cached_batches(cfg, True, 2, synthetic, pin=device.type == "cuda")
    tmp = tempfile.TemporaryDirectory(prefix="detector_bench_")
    if torchvision_model:
        model = build_torchvision_model(cfg).to(device)
        model.train()
        step = make_train_step(model, _build_optimizer(model, cfg), cfg, device, True)
    else:
        step, _ = make_trainer_step(build_ours(cfg, device), cfg, device, tmp.name)
    for i in range(warmup):
        step(batches[i % len(batches)])
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step(batches[0])
        synchronize(device)
    tmp.cleanup()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    sort_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events) or 1.0
    rows = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:row_limit]
    top = [
        {
            "name": e.key,
            "self_ms": round(getattr(e, attr) / 1000.0, 3),
            "total_ms": round(e.cpu_time_total / 1000.0, 3),
            "calls": int(e.count),
            "self_share": round(getattr(e, attr) / total, 4),
        }
        for e in rows
    ]
    return {
        "model": "torchvision" if torchvision_model else "ours",
        "step_self_ms": round(total / 1000.0, 3),
        "top_ops": top,
        "table": events.table(sort_by=sort_key, row_limit=row_limit),
    }


# --------------------------------------------------------------------------- entry


def run_benchmark(
    cfg: Config,
    task: str,
    iters: int = 10,
    warmup: int = 3,
    compare_torchvision: bool = False,
    loader: bool = True,
    synthetic: bool = False,
    num_batches: int = 4,
    profile: bool = False,
    gt_file: Optional[str] = None,
    results_file: Optional[str] = None,
    config_path: Optional[str] = None,
    overrides: Optional[List[str]] = None,
    torchvision_options: bool = False,
    threads: int = 0,
    eval_images: int = 500,
    eval_boxes: int = 30,
) -> Dict[str, Any]:
    """Run one benchmark task and return its JSON-ready result.

    Args:
        task: ``train`` (cached batches, then the real loader unless ``loader=False``),
            ``infer``, ``data`` (loader throughput) or ``eval`` (COCO scoring).
        iters: timed iterations (>= 1); warmup: untimed ones before.
        compare_torchvision: also time torchvision's FasterRCNN (train/infer).
        synthetic: random batches at the input size instead of the configured data.
        num_batches: distinct batches cached in memory and cycled through.
        profile: add a ``torch.profiler`` summary of one training step (train only).
        torchvision_options: give torchvision's model our ``train.*`` speed options too
            (default: torchvision as it comes).
        threads: ``torch.set_num_threads`` (0: leave PyTorch's default).
        eval_images, eval_boxes: size of the generated case of ``task="eval"``.

    Returns a dict with ``task``, ``config``, ``machine``, ``iters``, ``warmup``,
    ``runs`` (name -> :func:`summarize_times` fields plus ``peak_memory_bytes``,
    ``memory_kind``, ``times_s``) and, when compared, ``ratio`` (ours / torchvision,
    images per second).
    """
    if task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}; got {task!r}")
    if iters < 1:
        raise ValueError(f"--iters must be >= 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    if compare_torchvision and task not in ("train", "infer"):
        raise ValueError(f"--compare-torchvision applies to --task train or infer, not {task!r}")
    if threads < 0:
        raise ValueError(f"--threads must be >= 0, got {threads}")
    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(cfg.train.device) if task in ("train", "infer") else torch.device("cpu")
    result: Dict[str, Any] = {
        "task": task,
        "config": config_path,
        "overrides": list(overrides or []),
        "machine": machine_info(device),
        "device": str(device),
        "iters": iters,
        "warmup": warmup,
        "synthetic": synthetic,
        "options": {
            "channels_last": cfg.train.channels_last,
            "cudnn_benchmark": cfg.train.cudnn_benchmark,
            "compile_backbone": cfg.train.compile_backbone,
            "amp": cfg.train.amp.enabled,
            "amp_dtype": cfg.train.amp.dtype,
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    t0 = time.perf_counter()
    if task in ("train", "infer"):
        result.update(
            benchmark_model(cfg, task, iters, warmup, compare_torchvision, num_batches, synthetic,
                            torchvision_options=torchvision_options)
        )
        if task == "train" and loader and not synthetic:
            result["runs"].update(benchmark_train_loader(cfg, iters, warmup)["runs"])
        if task == "train" and profile:
            result["profile"] = {"ours": profile_train_step(cfg, synthetic=synthetic)}
            if compare_torchvision:
                result["profile"]["torchvision"] = profile_train_step(cfg, synthetic=synthetic, torchvision_model=True)
    elif task == "data":
        result.update(benchmark_data(cfg, iters, warmup))
    elif task == "memory":
        if config_path is None:
            raise ValueError("--task memory runs tools/train.py and needs the config path")
        train_py = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools", "train.py")
        import sys

        result["memory"] = measure_command_memory([sys.executable, train_py, "--config", config_path, *(overrides or [])])
        result["runs"] = {}
    else:
        result.update(benchmark_eval(cfg, iters, warmup, gt_file, results_file, eval_images, eval_boxes))
    result["wall_s"] = round(time.perf_counter() - t0, 3)
    try:
        result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        pass
    result["config_resolved"] = config_to_dict(cfg)
    return result


def format_summary(result: Dict[str, Any]) -> str:
    """A short human-readable table of a :func:`run_benchmark` result."""
    lines = [f"task={result['task']} device={result['device']} iters={result['iters']} warmup={result['warmup']}"]
    mem_unit = "MiB"
    for name, r in result["runs"].items():
        lines.append(
            f"  {name:<20s} median {r['median_s'] * 1000:9.1f} ms/iter (cpu {r['cpu_median_s'] * 1000:9.1f})  (IQR {r['iqr_s'] * 1000:7.1f}, "
            f"min {r['min_s'] * 1000:8.1f}, max {r['max_s'] * 1000:8.1f})  {r['images_per_s']:8.2f} images/s  "
            f"peak {r['peak_memory_mib']:8.1f} {mem_unit} ({r['memory_kind']})"
        )
    if "ratio" in result:
        lines.append(
            f"  ours / torchvision images/s: {result['ratio']:.3f} (median of per-iteration pairs "
            f"{result['ratio_pairwise_median']:.3f}; by CPU time {result['ratio_cpu_time']:.3f}; "
            f"torchvision with {result['torchvision_options']})"
        )
    if "ratio_vs_pycocotools" in result:
        for k, v in result["ratio_vs_pycocotools"].items():
            lines.append(f"  {k} / pycocotools_direct speed: {v:.3f} (max |stat diff| {result['max_abs_diff_vs_pycocotools'][k]:.2e})")
    if "memory" in result:
        m = result["memory"]
        lines.append(
            f"  {' '.join(m['command'][1:])}: exit {m['returncode']}, {m['wall_s']:.0f} s, peak tree RSS "
            f"{m['peak_tree_rss_bytes'] / 2**30:.2f} GiB, peak tree PSS {m['peak_tree_pss_bytes'] / 2**30:.2f} GiB, "
            f"largest process {m['peak_largest_process_rss_bytes'] / 2**30:.2f} GiB"
        )
    for name, prof in (result.get("profile") or {}).items():
        lines.append(f"  profile ({name}), one training step, top operators by self time:")
        for op in prof["top_ops"]:
            lines.append(f"    {op['name']:<45s} {op['self_ms']:9.2f} ms  {op['self_share'] * 100:5.1f}%  x{op['calls']}")
    return "\n".join(lines)
