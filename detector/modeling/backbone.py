"""ResNet + FPN backbone with torchvision's parameter layout.

``ResNetFPN.body`` holds torchvision ResNet's stem and stages under their own names
(``conv1``, ``bn1``, ``layer1`` ... ``layer4``) and ``ResNetFPN.fpn`` is
``torchvision.ops.FeaturePyramidNetwork`` with ``LastLevelMaxPool``, so the state
dict matches ``torchvision.models.detection.fasterrcnn_resnet50_fpn``'s
``backbone.*`` keys.

Norm layers (``model.norm``):

- ``frozen_bn``: ``FrozenBatchNorm2d`` (fixed affine, no statistics updates); the FPN
  has no norm (torchvision layout, its convs have a bias).
- ``bn``: ``BatchNorm2d`` in the ResNet and the FPN (FPN convs then have no bias).
- ``syncbn``: built as ``bn``; the trainer converts it with
  ``nn.SyncBatchNorm.convert_sync_batchnorm`` before wrapping in DDP.
- ``gn``: ``GroupNorm(model.gn_groups)`` in the ResNet and the FPN.

Frozen stages (``model.freeze_at``): their parameters get ``requires_grad=False``
and their BatchNorm layers become ``FrozenBatchNorm2d`` so that training does not
change their statistics either.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Dict, List, Sequence

import torch.nn.functional as F
import torchvision
from torch import Tensor, nn
from torchvision.ops import FeaturePyramidNetwork
from torchvision.ops import FrozenBatchNorm2d as _TVFrozenBatchNorm2d
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

from ..ops import stem_max_pool, stem_pool_by_views
from .weights import torchvision_state_dict

logger = logging.getLogger(__name__)

RESNETS: Dict[str, Callable[..., torchvision.models.ResNet]] = {
    "resnet18": torchvision.models.resnet18,
    "resnet34": torchvision.models.resnet34,
    "resnet50": torchvision.models.resnet50,
    "resnet101": torchvision.models.resnet101,
}
NORMS = ("frozen_bn", "bn", "syncbn", "gn")
STAGE_NAMES = ["conv1", "layer1", "layer2", "layer3", "layer4"]  # stage 0 = stem


class FrozenBatchNorm2d(_TVFrozenBatchNorm2d):
    """``torchvision.ops.FrozenBatchNorm2d`` (same buffers and state dict) whose forward
    uses the fused inference ``batch_norm`` kernel when no gradient flows through it
    (one pass over the activations instead of a multiply and an add: the eval-mode
    forward of a ResNet-50 is ~7 % faster on CPU). With a gradient it keeps
    torchvision's multiply-add, which saves no activation for the backward pass.

    ``eps <= 0`` (torchvision's COCO weights use ``eps=0.0``) always takes torchvision's
    multiply-add, so the output is bit-identical to ``torchvision.ops.FrozenBatchNorm2d``:
    some torch releases (2.11) refuse ``F.batch_norm`` with ``eps <= 0``."""

    def forward(self, x: Tensor) -> Tensor:
        if x.requires_grad or self.eps <= 0.0:
            return super().forward(x)
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            training=False, momentum=0.0, eps=self.eps)


def norm_factory(norm: str, eps: float = 1e-5, gn_groups: int = 32) -> Callable[[int], nn.Module]:
    """A callable ``channels -> norm layer`` for ``model.norm``."""
    if norm == "frozen_bn":
        return lambda c: FrozenBatchNorm2d(c, eps=eps)
    if norm in ("bn", "syncbn"):
        return lambda c: nn.BatchNorm2d(c, eps=eps)
    if norm == "gn":
        return lambda c: nn.GroupNorm(min(gn_groups, c), c, eps=eps)
    raise ValueError(f"model.norm must be one of {', '.join(NORMS)}, got '{norm}'")


def freeze_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every ``BatchNorm2d`` in ``module`` by a ``FrozenBatchNorm2d`` with its
    statistics and affine parameters (in place for children; returns the module)."""
    if isinstance(module, nn.BatchNorm2d):
        frozen = FrozenBatchNorm2d(module.num_features, eps=module.eps)
        if module.affine:
            frozen.weight.copy_(module.weight.detach())
            frozen.bias.copy_(module.bias.detach())
        if module.track_running_stats:
            frozen.running_mean.copy_(module.running_mean)
            frozen.running_var.copy_(module.running_var)
        return frozen
    for name, child in module.named_children():
        new = freeze_batchnorm(child)
        if new is not child:
            setattr(module, name, new)
    return module


class ResNetBody(nn.Module):
    """ResNet stem and stages 1..max(return_stages); returns the chosen stage outputs.

    Output: ``OrderedDict`` name ``str(i)`` -> ``[N, C_s, H / 2^(s+1), W / 2^(s+1)]`` for
    the i-th returned stage s.
    """

    def __init__(self, resnet: torchvision.models.ResNet, return_stages: Sequence[int]) -> None:
        super().__init__()
        self.return_stages = list(return_stages)
        self.conv1 = resnet.conv1
        self.bn1 = resnet.bn1
        self.relu = resnet.relu
        self.maxpool = resnet.maxpool
        last = max(self.return_stages)
        for s in range(1, last + 1):
            setattr(self, f"layer{s}", getattr(resnet, f"layer{s}"))
        self.num_stages = last

    def forward(self, x: Tensor) -> "OrderedDict[str, Tensor]":
        x = self.relu(self.bn1(self.conv1(x)))
        x = stem_max_pool(x) if stem_pool_by_views(self.maxpool, x) else self.maxpool(x)
        out: "OrderedDict[str, Tensor]" = OrderedDict()
        for s in range(1, self.num_stages + 1):
            x = getattr(self, f"layer{s}")(x)
            if s in self.return_stages:
                out[str(len(out))] = x
        return out


class ResNetFPN(nn.Module):
    """ResNet body + FPN (+ max-pooled extra level).

    Attributes:
        out_channels: FPN channels.
        strides: nominal stride of each output level, e.g. ``[4, 8, 16, 32, 64]``.
        pooled_levels: names of the levels used for RoI pooling (all but ``"pool"``).

    Forward: ``[N, 3, H, W]`` -> ``OrderedDict`` ``"0", "1", ..., "pool"`` ->
    ``[N, out_channels, H_l, W_l]``.
    """

    def __init__(self, body: ResNetBody, in_channels: List[int], out_channels: int,
                 fpn_norm: Callable[[int], nn.Module] | None) -> None:
        super().__init__()
        self.body = body
        self.fpn = FeaturePyramidNetwork(in_channels, out_channels, extra_blocks=LastLevelMaxPool(),
                                         norm_layer=fpn_norm)
        self.out_channels = out_channels
        stage_strides = [2 ** (s + 1) for s in body.return_stages]
        self.strides = stage_strides + [stage_strides[-1] * 2]
        self.pooled_levels = [str(i) for i in range(len(stage_strides))]

    def forward(self, x: Tensor) -> "OrderedDict[str, Tensor]":
        return self.fpn(self.body(x))


def load_backbone_weights(resnet: nn.Module, weights_name: str, norm: str) -> None:
    """Load torchvision ImageNet weights (e.g. ``"ResNet50_Weights.IMAGENET1K_V1"``) into a
    ResNet built with ``norm``. Downloads through torchvision's cache. For ``gn`` the
    BatchNorm statistics are dropped (GroupNorm keeps only the affine parameters).

    Raises:
        WeightsError: an unknown name or a failed download (offline), one line naming
            the file, where to put it, and ``model.backbone_weights=`` (random init)."""
    state = torchvision_state_dict(weights_name, key="model.backbone_weights",
                                   instead="set model.backbone_weights= to start from random initialisation")
    if norm == "gn":
        state = {k: v for k, v in state.items() if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    missing, unexpected = resnet.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    logger.info("backbone weights %s loaded (%d missing, %d unexpected keys)", weights_name,
                len(missing), len(unexpected))
    if missing:
        raise ValueError(f"model.backbone_weights '{weights_name}' lacks keys, e.g. {missing[:3]}")


def build_resnet_fpn(
    depth_name: str = "resnet50",
    norm: str = "frozen_bn",
    norm_eps: float = 1e-5,
    gn_groups: int = 32,
    freeze_at: int = 2,
    return_stages: Sequence[int] = (1, 2, 3, 4),
    fpn_channels: int = 256,
    backbone_weights: str = "",
) -> ResNetFPN:
    """Build a ResNet-FPN backbone.

    Args:
        depth_name: resnet18 | resnet34 | resnet50 | resnet101.
        norm: frozen_bn | bn | syncbn | gn.
        norm_eps: epsilon of the norm layers.
        gn_groups: groups for ``gn``.
        freeze_at: leading stages frozen: 0 none, 1 stem, 2 stem + layer1, ..., 5 all.
        return_stages: stages (1..4) that feed the FPN, increasing.
        fpn_channels: FPN output channels.
        backbone_weights: torchvision weights name, "" = random init.
    """
    if depth_name not in RESNETS:
        raise ValueError(f"model.backbone must be one of {', '.join(RESNETS)}, got '{depth_name}'")
    stages = list(return_stages)
    if not stages or sorted(set(stages)) != stages or stages[0] < 1 or stages[-1] > 4:
        raise ValueError(f"model.return_stages must be increasing values in 1..4, got {stages}")
    if not 0 <= freeze_at <= 5:
        raise ValueError(f"model.freeze_at must be in 0..5, got {freeze_at}")
    make_norm = norm_factory(norm, norm_eps, gn_groups)
    resnet = RESNETS[depth_name](weights=None, norm_layer=make_norm)
    if backbone_weights:
        load_backbone_weights(resnet, backbone_weights, norm)

    # Freeze the leading stages.
    for stage in range(freeze_at):
        modules = [resnet.conv1, resnet.bn1] if stage == 0 else [getattr(resnet, f"layer{stage}")]
        for module in modules:
            for p in module.parameters():
                p.requires_grad_(False)
    if norm in ("bn", "syncbn") and freeze_at > 0:
        resnet.bn1 = freeze_batchnorm(resnet.bn1)
        for stage in range(1, freeze_at):
            freeze_batchnorm(getattr(resnet, f"layer{stage}"))

    expansion = 4 if depth_name in ("resnet50", "resnet101") else 1
    in_channels = [64 * 2 ** (s - 1) * expansion for s in stages]
    fpn_norm = None if norm == "frozen_bn" else make_norm
    return ResNetFPN(ResNetBody(resnet, stages), in_channels, fpn_channels, fpn_norm)
