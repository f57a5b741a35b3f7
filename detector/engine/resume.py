"""Resuming a run from a training checkpoint: ``load_training_state`` checks the file is
a training checkpoint of this architecture with a valid training state
(``detector.engine.resume_checks``) and restores it (else ``CheckpointError``, one line
naming the file); ``resume_training`` returns where the loop continues
(``ResumePoint``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn

from detector.config import Config
from detector.engine.checkpointing import Checkpointer, TrainingState, get_rng_state, load_checkpoint, set_rng_state
from detector.engine.optim import WarmupLRScheduler
from detector.engine.resume_checks import (
    CheckpointError,
    batch_geometry_position,
    check_class_names,
    check_extras,
    check_loop_position,
    check_optimizer_state,
    check_rng_states,
    warn_config_changes,
)
from detector.messages import first_line
from detector.modeling.weights import WeightsError, load_weights

logger = logging.getLogger(__name__)

_REQUIRED = ("model", "optimizer", "scheduler", "iteration")


def _load_optimizer_state(optimizer: torch.optim.Optimizer, saved: Dict[str, Any]) -> None:
    """The optimizer's per-parameter state (momentum, Adam moments) from ``saved``;
    its hyperparameters (LR, weight decay, momentum...) stay the current config's, so a
    resumed run may change them (e.g. a lower ``solver.lr`` after a divergence)."""
    config_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    changed = sorted({k for g, cfg_g in zip(optimizer.param_groups, config_groups)
                      for k, v in cfg_g.items() if g.get(k) != v and k not in ("lr", "initial_lr")})
    for group, cfg_group in zip(optimizer.param_groups, config_groups):
        group.update(cfg_group)
    if changed:
        logger.warning("resume: optimizer settings %s follow the current config, not the checkpoint", changed)


def _other_checkpoint_hint(path: Path) -> str:
    """``"; the folder also holds iter_0000130.pth: ..."`` naming the newest other
    numbered checkpoint beside ``path`` (none: ``""``)."""
    others = [p for p in sorted(path.parent.glob("iter_*.pth")) if p.name != path.name and p.is_file()]
    if not others:
        return ""
    return f"; the folder also holds {others[-1].name}: --resume {others[-1]} continues from it"


def load_training_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler: WarmupLRScheduler, scaler: torch.amp.GradScaler, cfg: Config,
                        batches_per_epoch: Optional[int] = None, world_size: int = 1) -> Dict[str, Any]:
    """Check that ``path`` is a training checkpoint of this model, with a valid training
    state (``detector.engine.resume_checks``: loop position against
    ``batches_per_epoch`` and ``world_size``, RNG states, optimizer type and groups),
    then restore model, optimizer state, the schedule's position and the scaler from it;
    LRs and other hyperparameters follow ``cfg``. Returns the whole checkpoint dict.

    Raises:
        CheckpointError: one line naming ``path`` and the problem (for another
            architecture: the first mismatched keys and shapes).
    """
    try:
        state = load_checkpoint(path)
    except CheckpointError as exc:  # unreadable: a numbered checkpoint beside it may be whole
        raise CheckpointError(f"{exc}{_other_checkpoint_hint(path)}") from None
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"--resume: {path} is not a training checkpoint (no {', '.join(missing)}); "
                              "to start from its weights use --weights instead")
    try:
        load_weights(model, state["model"], strict=True, name=str(path))
    except WeightsError as exc:  # another architecture: names the first mismatched keys and shapes
        raise CheckpointError(f"--resume: {exc}") from None
    check_class_names(state, path, cfg)
    state["epoch_position"] = batch_geometry_position(state, path, cfg, world_size)
    check_loop_position(state, path, batches_per_epoch, world_size)
    if int(state["iteration"]) > cfg.solver.max_iter:  # equal: a finished run, evaluated again
        raise CheckpointError(f"--resume: {path} is at iteration {int(state['iteration'])}, past solver.max_iter="
                              f"{cfg.solver.max_iter}: raise solver.max_iter to train on, or evaluate it with "
                              "tools/eval.py")
    check_rng_states(state, path, get_rng_state, set_rng_state)
    check_optimizer_state(state, optimizer, path)
    check_extras(state, path, model)
    try:
        _load_optimizer_state(optimizer, state["optimizer"])
        scheduler.continue_at(int(state["scheduler"]["last_epoch"]))
        if state.get("scaler") and scaler.is_enabled():
            scaler.load_state_dict(state["scaler"])
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"--resume: {path} does not fit this run's model or optimizer: {first_line(exc)}") from None
    warn_config_changes(state.get("config"), cfg)
    return state


@dataclass
class ResumePoint:
    """Where a resumed run continues: the loop position, the best metric value so far
    and this rank's RNG state to restore once the first epoch's iterator exists (None:
    the streams restart)."""

    iteration: int
    epoch: int
    epoch_position: int
    best_value: Optional[float]
    rng_state: Optional[Dict[str, Any]]
    extras: Optional[Dict[str, Any]] = None  # the checkpoint's early_stop and ema entries


def resume_training(path: Path, state_fn: TrainingState, checkpointer: Checkpointer, rank: int,
                    batches_per_epoch: Optional[int] = None) -> ResumePoint:
    """Restore the run of ``path`` into ``state_fn``'s model, optimizer, scheduler and
    scaler (``load_training_state``; ``batches_per_epoch``: this rank's, to check the
    checkpoint's position against), count the folder's checkpoints as this run's
    (``checkpointer.register_existing``) and return where the loop continues.

    Raises:
        CheckpointError: one line naming ``path`` and the problem.
    """
    s = state_fn
    state = load_training_state(path, s.model, s.optimizer, s.scheduler, s.scaler, s.cfg, batches_per_epoch,
                                s.world_size)
    point = ResumePoint(int(state["iteration"]), int(state.get("epoch", 0)), int(state.get("epoch_position", 0)),
                        state.get("best_value"), None, {k: state.get(k) for k in ("early_stop", "ema")})
    per_rank = (state.get("rng") or {}).get("per_rank") or []
    if len(per_rank) != s.world_size:
        logger.warning("resume: checkpoint written by %d ranks, now %d; RNG streams restart", len(per_rank), s.world_size)
    point.rng_state = per_rank[rank] if rank < len(per_rank) else None
    checkpointer.register_existing(path, point.iteration)
    logger.info("resumed from %s at iteration %d (epoch %d, batch %d)", path, point.iteration,
                point.epoch, point.epoch_position)
    return point
