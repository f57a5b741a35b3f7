"""Loading a training checkpoint for ``--resume``: one-line errors, never a traceback.

``load_training_state`` reads the file with ``weights_only=True`` and restores model,
optimizer, scheduler and AMP scaler. A file that is empty, truncated, corrupt, not a
training checkpoint, or written for another architecture raises ``CheckpointError``
with one line naming the file and what is wrong (for another architecture: the first
mismatched keys and shapes).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List

import torch
from torch import nn

from detector.config import Config, ConfigError, config_from_dict, config_to_dict
from detector.engine import checkpoint as ckpt
from detector.engine.checkpoint import CheckpointError
from detector.engine.optim import WarmupLRScheduler
from detector.messages import first_line
from detector.modeling.weights import WeightsError, load_weights

logger = logging.getLogger(__name__)

_REQUIRED = ("model", "optimizer", "scheduler", "iteration")


def _diff(a: Dict[str, Any], b: Dict[str, Any], prefix: str = "") -> List[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out.extend(_diff(va, vb, f"{prefix}{k}."))
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} -> {vb!r}")
    return out


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


def load_training_state(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: WarmupLRScheduler,
    scaler: torch.amp.GradScaler,
    cfg: Config,
) -> Dict[str, Any]:
    """Restore model, optimizer state, the schedule's position and the scaler from the
    checkpoint ``path``; LRs and other hyperparameters follow ``cfg``. Returns the
    whole checkpoint dict (iteration, epoch, RNG states, ...).

    Raises:
        CheckpointError: one line naming ``path`` and the problem.
    """
    state = ckpt.load_checkpoint(path)
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"--resume: {path} is not a training checkpoint (no {', '.join(missing)}); "
                              "to start from its weights use --weights instead")
    try:
        load_weights(model, state["model"], strict=True, name=str(path))
    except WeightsError as exc:  # another architecture: names the first mismatched keys and shapes
        raise CheckpointError(f"--resume: {exc}") from None
    try:
        _load_optimizer_state(optimizer, state["optimizer"])
        scheduler.continue_at(int(state["scheduler"]["last_epoch"]))
        if state.get("scaler") and scaler.is_enabled():
            scaler.load_state_dict(state["scaler"])
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        first = first_line(exc)
        raise CheckpointError(f"--resume: {path} does not fit this run's model or optimizer: {first}") from None
    stored = state.get("config")
    if isinstance(stored, dict):
        try:
            changed = _diff(config_to_dict(config_from_dict(stored)), config_to_dict(cfg))
            if changed:
                logger.warning("resume: config differs from the checkpoint's in: %s", ", ".join(changed))
        except (ConfigError, ValueError) as exc:
            logger.warning("resume: stored config not readable (%s)", exc)
    return state
