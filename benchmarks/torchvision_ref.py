"""torchvision's ``FasterRCNN`` configured like a project config, and the one place that
trains it as torchvision's ``references/detection`` does (its optimizer, warm-up and
``engine.train_one_epoch`` iteration): the counterpart of ``--compare-torchvision`` and
``--task time-to-accuracy``."""

from __future__ import annotations

import contextlib
import logging
import math
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torchvision
from torch import nn
from torchvision.models.detection import FasterRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.rpn import RPNHead
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import FrozenBatchNorm2d, MultiScaleRoIAlign
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

from detector.config import Config
from detector.engine.amp import AmpSettings

logger = logging.getLogger(__name__)


def _tv_norm_layer(cfg: Config) -> Callable[[int], nn.Module]:
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


def _tv_backbone(cfg: Config) -> BackboneWithFPN:
    """torchvision's ResNet of ``model.backbone`` with the config's norm layer, frozen
    stages and FPN stages and channels, as ``BackboneWithFPN``."""
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
    return BackboneWithFPN(
        resnet, return_layers, in_channels, m.fpn_channels, extra_blocks=LastLevelMaxPool(),
        norm_layer=None if m.norm == "frozen_bn" else norm_layer,
    )


def build_torchvision_model(cfg: Config) -> nn.Module:
    """torchvision's ``FasterRCNN`` with the configuration of ``cfg``: the same ResNet
    depth, norm layer (FrozenBN/BN/GN, eps), frozen stages, FPN stages and channels,
    anchors, RPN/ROI samplers and thresholds, RoIAlign, head sizes and normalisation.
    Its transform does not resize (see :func:`_no_resize_transform`)."""

    m = cfg.model
    backbone = _tv_backbone(cfg)
    sizes = tuple(tuple(float(s) for s in level) for level in m.anchors.sizes)
    ratios = (tuple(float(r) for r in m.anchors.aspect_ratios),) * len(sizes)
    anchor_gen = AnchorGenerator(sizes, ratios)
    rpn_head = RPNHead(m.fpn_channels, anchor_gen.num_anchors_per_location()[0], conv_depth=cfg.rpn.conv_depth)
    r = cfg.roi_heads
    pooler = MultiScaleRoIAlign([str(i) for i in range(len(m.return_stages))], r.pooler_resolution, r.sampling_ratio)
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


# torchvision's references/detection: lr 0.02 for 8 GPUs x 2 images, scaled linearly.
REFERENCE_LR_PER_IMAGE = 0.02 / 16
REFERENCE_MOMENTUM = 0.9
REFERENCE_WEIGHT_DECAY = 1e-4
REFERENCE_WARMUP_FACTOR = 1.0 / 1000
REFERENCE_MAX_WARMUP_ITERS = 1000

def reference_warmup_iters(batches_per_epoch: int) -> int:
    """``min(1000, len(loader) - 1)`` as the reference's first epoch, at least 1 (with
    0, ``LinearLR`` would hold the LR at 1/1000 for good)."""
    return max(1, min(REFERENCE_MAX_WARMUP_ITERS, batches_per_epoch - 1))


def reference_optimizer(model: nn.Module, cfg: Config, batches_per_epoch: int) -> Tuple[Any, Any, Any, Dict[str, Any]]:
    """The reference's SGD over every trainable parameter, its first-epoch ``LinearLR``
    warm-up and the ``MultiStepLR`` at ``solver.steps`` iterations (see the module
    docstring). Returns ``(optimizer, warmup, decay, recipe description)``."""
    lr = REFERENCE_LR_PER_IMAGE * cfg.solver.images_per_gpu
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=REFERENCE_MOMENTUM, weight_decay=REFERENCE_WEIGHT_DECAY)
    decay = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(cfg.solver.steps), gamma=cfg.solver.gamma)
    warmup_iters = reference_warmup_iters(batches_per_epoch)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=REFERENCE_WARMUP_FACTOR, total_iters=warmup_iters)
    recipe = {
        "step": "torchvision references/detection engine.train_one_epoch, written out in benchmarks.torchvision_ref",
        "optimizer": f"SGD(momentum={REFERENCE_MOMENTUM}, weight_decay={REFERENCE_WEIGHT_DECAY}), torch's defaults "
                     "otherwise, every trainable parameter",
        "lr": lr,
        "schedule": f"LinearLR warm-up {warmup_iters} iterations from {REFERENCE_WARMUP_FACTOR}, MultiStepLR at "
                    f"iterations {list(cfg.solver.steps)} (gamma {cfg.solver.gamma}), max_iter {cfg.solver.max_iter}",
        "clip_grad_norm": 0.0,
    }
    return optimizer, warmup, decay, recipe


def reference_step(model: nn.Module, optimizer: torch.optim.Optimizer, images: List[torch.Tensor],
                   targets: List[Dict[str, Any]], amp: AmpSettings, scaler: Optional[torch.amp.GradScaler],
                   device: torch.device) -> float:
    """One iteration of torchvision's references/detection ``engine.train_one_epoch``:
    the forward under autocast (``amp``), the sum of the losses, its value read back
    (the reference's per-iteration ``losses_reduced.item()``) and, unless it is not
    finite (the reference exits there, before the backward pass), ``zero_grad``,
    backward and the optimizer step (through ``scaler`` for float16).

    ``images`` and ``targets`` are as the model takes them. Returns the loss value."""
    autocast = torch.autocast(device.type, dtype=amp.dtype) if amp.enabled else contextlib.nullcontext()
    with autocast:
        loss_dict = model(images, targets)
        losses = sum(loss_dict.values())
    loss_value = float(losses.detach())
    if not math.isfinite(loss_value):
        bad = {k: float(v) for k, v in loss_dict.items() if not math.isfinite(float(v))}
        logger.warning("torchvision's losses are not finite: %s (autocast %s)", bad,
                       amp.dtype if amp.enabled else "off")
        return loss_value
    optimizer.zero_grad()
    if scaler is not None:
        scaler.scale(losses).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        losses.backward()
        optimizer.step()
    return loss_value
