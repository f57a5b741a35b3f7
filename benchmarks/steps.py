"""The timed steps: ours (the engine's ``TrainStep``), torchvision's training step as
its references/detection loop runs it, and an inference batch."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torch import nn

from detector.config import Config
from detector.engine.amp import resolve_amp
from detector.engine.optim import build_lr_scheduler, build_optimizer
from detector.engine.setup import apply_speed_options as engine_speed_options, configure_torch, prepare_model
from detector.engine.step_choice import build_train_step
from detector.evaluation.static_inference import StaticDetector, static_settings
from detector.modeling import build_model

from .batches import Batch
from .torchvision_ref import reference_step


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


def build_train_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """The training optimizer (parameter groups and all), at the LR of the first
    warm-up iteration so that a randomly initialised model does not diverge while timed."""

    opt = build_optimizer(model, cfg, log=False)  # torchvision's model: the log line describes ours
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


def make_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config,
                    device: torch.device) -> Callable[[Batch], float]:
    """torchvision's training step on a cached batch: the uint8 images converted to float
    0..1 and the targets moved to ``device`` (torchvision's input convention), then
    :func:`reference_step` with autocast as ``train.amp`` resolves on ``device``.
    A non-finite loss raises ``FloatingPointError``, where the reference would stop."""
    amp = resolve_amp(cfg.train.amp, device)
    scaler = torch.amp.GradScaler(device.type) if amp.uses_scaler else None

    def step(batch: Batch) -> float:
        images, targets = batch
        targets = _targets_to([{"boxes": t["boxes"], "labels": t["labels"]} for t in targets], device)
        loss = reference_step(model, optimizer, _tv_images(images, device), targets, amp, scaler, device)
        if not math.isfinite(loss):  # its step would skip the backward pass: no comparable time
            raise FloatingPointError(f"torchvision's training loss is {loss}; its reference loop stops here")
        return loss

    return step


def make_ours_train_step(model: nn.Module, cfg: Config, device: torch.device,
                         log_optimizer: bool = False) -> Tuple[Callable[[Batch], Any], nn.Module]:
    """The engine's own training step as the trainer chooses it
    (``detector.engine.step_choice.build_train_step``: with ``train.static_step`` the
    compiled static forward, with ``train.cuda_graphs`` the captured step), by default
    ``detector.engine.step.TrainStep`` (autocast,
    float32 loss sum, GradScaler, gradient norm and clipping, the non-finite check with
    its one read-back, optimizer and LR scheduler step), on the model as the Trainer
    prepares it (``configure_torch`` and ``prepare_model``: norm policy, device and the
    ``train.*`` speed options), with the Trainer's optimizer and scheduler.

    Returns ``(step, the prepared model)``; ``step(batch)`` returns the ``StepResult``.
    ``log_optimizer``: log the optimizer's line (once per benchmark: the caller decides).
    """
    configure_torch(cfg)
    model, _ = prepare_model(model, cfg, device, world_size=1)
    optimizer = build_optimizer(model, cfg, 1, log=log_optimizer)
    train_step = build_train_step(cfg, model, model, optimizer, build_lr_scheduler(optimizer, cfg),
                                  resolve_amp(cfg.train.amp, device), world_size=1)

    def step(batch: Batch) -> Any:
        images, targets = batch
        return train_step(images, targets)

    return step, model


def make_infer_step(model: nn.Module, cfg: Config, device: torch.device, torchvision_api: bool) -> Callable[[Batch], Any]:
    """One inference batch (autocast if ``eval.amp``): torchvision's under
    ``torch.inference_mode``, as its reference evaluation runs; ours as
    ``detector.evaluation.run_inference`` runs a batch, to be called inside
    ``inference_run`` (without it, under ``no_grad`` and with each batch's weight casts)."""
    dtype = torch.bfloat16 if device.type == "cpu" else torch.float16
    settings = None if torchvision_api else static_settings(cfg)
    forward = model if settings is None else StaticDetector(model, settings)  # eval.static, eval.cuda_graphs

    def step(batch: Batch) -> Any:
        images, _ = batch
        with torch.inference_mode() if torchvision_api else torch.no_grad():
            if torchvision_api:
                images = _tv_images(images, device)
            with torch.autocast(device.type, dtype=dtype) if cfg.eval.amp else contextlib.nullcontext():
                return forward(images)

    return step


def make_step(model: nn.Module, cfg: Config, device: torch.device, task: str,
              torchvision_api: bool, log_optimizer: bool = False) -> Tuple[Callable[[Batch], Any], nn.Module]:
    """The timed step of ``task`` for ``model``: for ``"train"`` ours is the engine's
    ``TrainStep`` (:func:`make_ours_train_step`), torchvision's its reference iteration
    (:func:`make_train_step`); for ``"infer"`` one batch in eval mode
    (:func:`make_infer_step`), ours with the ``train.*`` speed options.

    Returns ``(step, the model it runs)``; ``log_optimizer``: see :func:`make_ours_train_step`."""
    if task == "train" and not torchvision_api:
        return make_ours_train_step(model, cfg, device, log_optimizer)
    if task == "train":
        model.train()
        return make_train_step(model, build_train_optimizer(model, cfg), cfg, device), model
    model = model if torchvision_api else apply_speed_options(model, cfg, device)
    model.eval()
    return make_infer_step(model, cfg, device, torchvision_api), model
