"""Preparing torch and the model for training: determinism flags, the norm policy
(SyncBN), device, memory format, compilation and the DDP wrapper."""

from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

import torch
from torch import nn

from detector.config import Config

logger = logging.getLogger(__name__)


def configure_torch(cfg: Config, device: Optional[torch.device] = None) -> None:
    """``train.deterministic`` (deterministic algorithms, cuDNN) and ``train.cudnn_benchmark``.

    On CUDA (``device``), deterministic mode also changes RoIAlign: torchvision then runs
    its deterministic Python version, compiled by ``torch.compile`` in each process at its
    first call, which the log says (the first step takes a minute or more)."""
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        if device is not None and device.type == "cuda":
            logger.info("train.deterministic on cuda: torchvision's RoIAlign runs its deterministic version, "
                        "compiled by torch.compile at the first step (a minute or more); "
                        "train.deterministic=false keeps its CUDA kernel")
    torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark and not cfg.train.deterministic


def _revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace ``nn.SyncBatchNorm`` layers by ``nn.BatchNorm2d`` with the same state."""
    out = module
    if isinstance(module, nn.SyncBatchNorm):
        out = nn.BatchNorm2d(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        out.load_state_dict(module.state_dict())
        out.train(module.training)
        if module.affine:
            out.weight.requires_grad_(module.weight.requires_grad)
            out.bias.requires_grad_(module.bias.requires_grad)
    for name, child in module.named_children():
        out.add_module(name, _revert_sync_batchnorm(child))
    return out


def apply_norm_policy(model: nn.Module, cfg: Config, device: torch.device, world_size: int) -> nn.Module:
    """``model.norm: syncbn``: convert BatchNorm layers to ``nn.SyncBatchNorm`` on CUDA.

    PyTorch's SyncBatchNorm runs only on GPUs, so on a CPU device the model keeps
    plain BatchNorm (statistics per process) and a warning says so. FrozenBN layers
    are not BatchNorm and stay frozen.
    """
    if cfg.model.norm != "syncbn":
        return model
    if device.type != "cuda":
        logger.warning(
            "model.norm=syncbn: SyncBatchNorm needs CUDA; on %s the model uses plain BatchNorm "
            "(per-process batch statistics)", device.type,
        )
        return _revert_sync_batchnorm(model)
    if world_size > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        logger.info("converted BatchNorm layers to SyncBatchNorm across %d processes", world_size)
    return model


def apply_speed_options(model: nn.Module, cfg: Config) -> nn.Module:
    """``train.channels_last`` (4-d weights in NHWC; convolutions then keep activations
    NHWC) and ``train.compile_backbone`` (``torch.compile`` of ``model.backbone`` in
    place, so state-dict names stay; one static graph per canvas of ``model.canvas_sizes``),
    in place. Returns ``model``."""
    if cfg.train.channels_last:
        model.to(memory_format=torch.channels_last)
    if cfg.train.compile_backbone:
        backbone = getattr(model, "backbone", None)
        if backbone is None:
            raise ValueError("train.compile_backbone=true but the model has no 'backbone' attribute")
        backbone.compile(dynamic=False)
    return model


def prepare_model(model: nn.Module, cfg: Config, device: torch.device, world_size: int) -> Tuple[nn.Module, nn.Module]:
    """Norm policy, device, ``train.channels_last``, ``train.compile_backbone`` (in place:
    state-dict keys unchanged), training mode, and DDP when ``world_size > 1``
    (``train.ddp_bucket_cap_mb``, ``train.ddp_gradient_as_bucket_view``).

    Returns ``(model to train, the same model without the DDP wrapper)``.
    """
    model = apply_norm_policy(model, cfg, device, world_size)
    model.to(device)
    apply_speed_options(model, cfg)
    model.train()
    if world_size <= 1:
        return model, model
    ddp = nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.train.ddp_bucket_cap_mb,
        gradient_as_bucket_view=cfg.train.ddp_gradient_as_bucket_view,
    )
    return ddp, model
