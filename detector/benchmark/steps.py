"""The timed steps: ours (the engine's ``TrainStep``), torchvision's training step as
its references/detection loop runs it, and an inference batch."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torch import nn

from detector.config import Config, resolve_amp
from detector.engine.optim import build_lr_scheduler, build_optimizer
from detector.engine.setup import apply_speed_options as engine_speed_options, configure_torch, prepare_model
from detector.engine.step import TrainStep
from detector.modeling import build_model

from .batches import Batch


def build_ours(cfg: Config, device: torch.device) -> nn.Module:
    model = build_model(cfg)
    return model.to(device)


def apply_speed_options(model: nn.Module, cfg: Config, device: torch.device) -> nn.Module:
    """The ``train.*`` speed options as the trainer applies them
    (``engine.setup.apply_speed_options``: ``channels_last``, ``compile_backbone``), plus
    ``cudnn_benchmark`` (CUDA only), for a model the trainer does not prepare (torchvision's)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = bool(cfg.train.cudnn_benchmark)
    return engine_speed_options(model, cfg)


def _autocast(cfg: Config, device: torch.device):
    amp = resolve_amp(cfg.train.amp, device)
    if not amp.enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=amp.dtype)


def build_train_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """The training optimizer (parameter groups and all), at the LR of the first
    warm-up iteration so that a randomly initialised model does not diverge while timed."""

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
    """One training step: forward (autocast as ``train.amp`` resolves on ``device``), sum of losses,
    backward, optimizer step, ``zero_grad(set_to_none=True)``. No host sync.

    ``torchvision_api``: convert the uint8 images to float 0..1 on the device and move
    the targets first (torchvision's convention); ours takes uint8 host tensors as they
    come from the loader and moves them itself.
    """
    scaler = None
    if resolve_amp(cfg.train.amp, device).uses_scaler:
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


def make_ours_train_step(model: nn.Module, cfg: Config, device: torch.device) -> Tuple[Callable[[Batch], Any], nn.Module]:
    """The engine's own training step, ``detector.engine.step.TrainStep`` (autocast,
    float32 loss sum, GradScaler, gradient norm and clipping, the non-finite check with
    its one read-back, optimizer and LR scheduler step), on the model as the Trainer
    prepares it (``configure_torch`` and ``prepare_model``: norm policy, device and the
    ``train.*`` speed options), with the Trainer's optimizer and scheduler.

    Returns ``(step, the prepared model)``; ``step(batch)`` returns the ``StepResult``.
    """
    configure_torch(cfg)
    model, _ = prepare_model(model, cfg, device, world_size=1)
    optimizer = build_optimizer(model, cfg, 1)
    train_step = TrainStep(model, optimizer, build_lr_scheduler(optimizer, cfg), resolve_amp(cfg.train.amp, device),
                           cfg.solver.clip_grad_norm, world_size=1)

    def step(batch: Batch) -> Any:
        images, targets = batch
        return train_step(images, targets)

    return step, model


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
