"""Optimizer with rule-based parameter groups, and the warmup + decay LR schedule.

Parameter groups::

    solver.param_groups: [{match: "backbone.body", lr_mult: 0.1},
                          {match: "roi_heads.box_predictor", lr_mult: 10}]

A parameter takes the first rule whose ``match`` is a substring of its name (the
``module.`` prefix of a DDP-wrapped model is removed first); parameters no rule
matches use multiplier 1. Inside each rule, norm-layer parameters take
``solver.weight_decay_norm`` and biases take ``solver.bias_lr_mult`` and
``solver.weight_decay_bias``. Parameters with ``requires_grad=False`` are never given
to the optimizer.

The schedule multiplies every group's base LR by the same factor (linear warmup,
then multistep or cosine decay), so the LR ratios between groups hold throughout.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from detector.config import Config

logger = logging.getLogger(__name__)

NORM_TYPES: Tuple[type, ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)


def scaled_lr(cfg: Config, world_size: int) -> float:
    """``solver.lr`` scaled linearly with the effective batch of one optimizer step
    (``images_per_gpu * world_size * accumulate_steps``) against ``solver.reference_batch_size``, unless ``solver.scale_lr`` is false."""
    s = cfg.solver
    if not s.scale_lr:
        return s.lr
    if s.reference_batch_size <= 0:
        raise ValueError(f"solver.reference_batch_size must be > 0, got {s.reference_batch_size}")
    total = s.images_per_gpu * world_size * s.accumulate_steps
    return s.lr * total / s.reference_batch_size


def _strip_ddp(name: str) -> str:
    return name[len("module.") :] if name.startswith("module.") else name


def build_param_groups(model: nn.Module, cfg: Config, base_lr: float) -> List[Dict[str, Any]]:
    """Split the trainable parameters of ``model`` into optimizer groups.

    Returns a list of dicts with keys ``params``, ``lr``, ``weight_decay``, ``name``
    (e.g. ``"backbone.body"``, ``"backbone.body/norm"``, ``"default/bias"``) and
    ``lr_mult`` (the group's LR over ``base_lr``). Every trainable parameter is in
    exactly one group; frozen parameters are in none. Groups keep the model's
    parameter order.
    """
    s = cfg.solver
    wd_bias = s.weight_decay if s.weight_decay_bias is None else s.weight_decay_bias
    groups: Dict[str, Dict[str, Any]] = {}
    seen: set = set()
    for module_name, module in model.named_modules():
        is_norm = isinstance(module, NORM_TYPES)
        for pname, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            full = _strip_ddp(f"{module_name}.{pname}" if module_name else pname)
            rule_name, lr_mult, wd_mult = "default", 1.0, 1.0
            for rule in s.param_groups:
                if rule.match and rule.match in full:
                    rule_name, lr_mult, wd_mult = rule.match, rule.lr_mult, rule.weight_decay_mult
                    break
            if is_norm:
                kind, wd = "/norm", s.weight_decay_norm
            elif pname == "bias":
                kind, wd, lr_mult = "/bias", wd_bias, lr_mult * s.bias_lr_mult
            else:
                kind, wd = "", s.weight_decay
            name = rule_name + kind
            group = groups.setdefault(
                name,
                {"params": [], "lr": base_lr * lr_mult, "weight_decay": wd * wd_mult, "name": name, "lr_mult": lr_mult},
            )
            group["params"].append(param)
    for rule in s.param_groups:
        if not any(g["name"].split("/")[0] == rule.match for g in groups.values()):
            logger.warning("solver.param_groups rule match=%r matched no trainable parameter", rule.match)
    return list(groups.values())


def build_optimizer(model: nn.Module, cfg: Config, world_size: int = 1, log: bool = True) -> torch.optim.Optimizer:
    """SGD with momentum or AdamW over the groups of ``build_param_groups``; with ``log``,
    one info line describes it (a caller that builds several, e.g. a benchmark, logs one).

    Pass the DDP-wrapped model (after any SyncBN conversion), so the optimizer holds
    the very parameters DDP synchronises.
    """
    s = cfg.solver
    lr = scaled_lr(cfg, world_size)
    groups = build_param_groups(model, cfg, lr)
    if not groups:
        raise ValueError("the model has no trainable parameters (check model.freeze_at)")
    # The fused kernels (CPU and CUDA) are much faster than the per-parameter loop:
    # on a 2-core CPU an SGD step over ResNet-18 takes ~20 ms instead of ~600 ms.
    params = [p for g in groups for p in g["params"]]
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    if s.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            groups, lr=lr, momentum=s.momentum, nesterov=s.nesterov, weight_decay=s.weight_decay, fused=fused
        )
    elif s.optimizer == "adamw":
        if len(s.betas) != 2:
            raise ValueError(f"solver.betas must have 2 values, got {s.betas}")
        opt = torch.optim.AdamW(
            groups, lr=lr, betas=(s.betas[0], s.betas[1]), weight_decay=s.weight_decay, fused=fused
        )
    else:
        raise ValueError(f"solver.optimizer must be 'sgd' or 'adamw', got {s.optimizer!r}")
    if not log:
        return opt
    n = sum(p.numel() for g in groups for p in g["params"])
    logger.info(
        "optimizer %s, base lr %.6g (world size %d), %d groups, %d trainable parameters: %s",
        s.optimizer, lr, world_size, len(groups), n,
        ", ".join(f"{g['name']}(lr x{g['lr_mult']:g}, wd {g['weight_decay']:g}, {len(g['params'])} tensors)" for g in groups),
    )
    return opt


def lr_factor(
    it: int,
    max_iter: int,
    schedule: str = "multistep",
    steps: List[int] | Tuple[int, ...] = (),
    gamma: float = 0.1,
    warmup_iters: int = 0,
    warmup_factor: float = 0.001,
    final_factor: float = 0.0,
) -> float:
    """The LR multiplier at iteration ``it`` (0-based): warmup times decay.

    Warmup: linear from ``warmup_factor`` at 0 to 1 at ``warmup_iters``.
    multistep: ``gamma ** (number of steps <= it)``. cosine: from 1 at 0 to
    ``final_factor`` at ``max_iter``.
    """
    if schedule == "multistep":
        decay = gamma ** bisect.bisect_right(sorted(steps), it)
    elif schedule == "cosine":
        t = min(it, max_iter) / max(1, max_iter)
        decay = final_factor + (1.0 - final_factor) * 0.5 * (1.0 + math.cos(math.pi * t))
    else:
        raise ValueError(f"solver.schedule must be 'multistep' or 'cosine', got {schedule!r}")
    if it < warmup_iters:
        alpha = it / warmup_iters
        decay *= warmup_factor * (1.0 - alpha) + alpha
    return decay


class WarmupLRScheduler(torch.optim.lr_scheduler.LRScheduler):
    """Per-iteration schedule: ``lr_g(it) = base_lr_g * lr_factor(it)`` for every group g.

    Call ``step()`` once after every optimizer step. Its ``state_dict`` holds only
    plain data (loads with ``torch.load(weights_only=True)``).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_iter: int,
        schedule: str = "multistep",
        steps: List[int] | Tuple[int, ...] = (),
        gamma: float = 0.1,
        warmup_iters: int = 0,
        warmup_factor: float = 0.001,
        final_factor: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        if schedule not in ("multistep", "cosine"):
            raise ValueError(f"solver.schedule must be 'multistep' or 'cosine', got {schedule!r}")
        bad = [s for s in steps if s <= 0]
        if bad:
            raise ValueError(f"solver.steps {list(steps)} must be positive iteration numbers; bad: {bad}")
        if any(s >= max_iter for s in steps):
            logger.warning("solver.steps %s: steps at or after solver.max_iter=%d have no effect", list(steps), max_iter)
        if warmup_iters >= max_iter > 0:
            reached = warmup_factor + (1.0 - warmup_factor) * (max_iter - 1) / warmup_iters
            logger.warning("solver.warmup_iters=%d >= solver.max_iter=%d: the whole run is warm-up, its last step "
                           "takes %.3g of solver.lr; lower solver.warmup_iters", warmup_iters, max_iter, reached)
        self.max_iter = int(max_iter)
        self.schedule = schedule
        self.steps = sorted(int(s) for s in steps)
        self.gamma = float(gamma)
        self.warmup_iters = int(warmup_iters)
        self.warmup_factor = float(warmup_factor)
        self.final_factor = float(final_factor)
        super().__init__(optimizer, last_epoch)

    def factor(self, it: int) -> float:
        return lr_factor(
            it, self.max_iter, self.schedule, self.steps, self.gamma,
            self.warmup_iters, self.warmup_factor, self.final_factor,
        )

    def get_lr(self) -> List[float]:  # type: ignore[override]
        f = self.factor(self.last_epoch)
        return [base * f for base in self.base_lrs]

    def continue_at(self, iteration: int) -> None:
        """Resume the schedule at ``iteration`` (steps taken so far) with this
        scheduler's own settings (from the current config): every group's LR becomes
        ``base_lr * factor(iteration)``, exactly what stepping there would give. A
        tensor LR (``train.cuda_graphs``: a captured step reads it) is filled in place."""
        self.last_epoch = int(iteration)
        self._step_count = int(iteration) + 1
        values = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = values


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> WarmupLRScheduler:
    s = cfg.solver
    return WarmupLRScheduler(
        optimizer,
        max_iter=s.max_iter,
        schedule=s.schedule,
        steps=s.steps if s.schedule == "multistep" else (),
        gamma=s.gamma,
        warmup_iters=s.warmup_iters,
        warmup_factor=s.warmup_factor,
        final_factor=s.cosine_final_lr_factor,
    )


def resolve_epoch_schedule(cfg: Config, batches_per_epoch: int) -> Config:
    """``solver.max_epochs`` / ``solver.steps_epochs`` converted to ``solver.max_iter`` /
    ``solver.steps`` (optimizer steps); ``cfg`` itself where training is by iterations.

    Args:
        batches_per_epoch: loader batches of one epoch on one rank (``len(loader)``,
            i.e. the data set size over ``images_per_gpu * world_size``).

    Returns:
        a copy with ``iters_per_epoch = batches_per_epoch // accumulate_steps``,
        ``max_iter = max_epochs * iters_per_epoch`` and ``steps = steps_epochs * iters_per_epoch``
        (``steps`` kept when ``steps_epochs`` is empty); the epochs are kept.
    """
    s = cfg.solver
    if s.max_epochs <= 0:
        return cfg
    per_epoch = batches_per_epoch // s.accumulate_steps
    if per_epoch < 1:
        raise ValueError(f"solver.max_epochs: an epoch of {batches_per_epoch} batches gives no optimizer step with "
                         f"solver.accumulate_steps={s.accumulate_steps}")
    solver = dataclasses.replace(s, iters_per_epoch=per_epoch, max_iter=s.max_epochs * per_epoch,
                                 steps=[e * per_epoch for e in s.steps_epochs] if s.steps_epochs else list(s.steps))
    logger.info("solver.max_epochs=%d: %d optimizer steps an epoch, solver.max_iter=%d, solver.steps=%s",
                s.max_epochs, per_epoch, solver.max_iter, solver.steps)
    return dataclasses.replace(cfg, solver=solver)
