"""Checks of a training checkpoint before ``--resume`` restores it.

A checkpoint is input like any other: a crafted or damaged file must stop with one line
naming the file and the field, never a traceback or a silently wrong run. Every check
here runs before anything is restored:

- the loop position (``iteration``, ``epoch``, ``epoch_position``) has integer types and
  ranges that agree with each other, with the LR schedule's position and with the
  number of batches per epoch of this run's data;
- ``best_value`` is a finite number or null, ``world_size`` a positive integer;
- each rank's RNG states (``rng.per_rank[r]``) restore: they are tried on this process
  and the current states put back (one mechanism for any malformed entry);
- the optimizer state is of this run's optimizer type (recorded as ``optimizer_type``;
  inferred from the parameter groups of older files) with the same parameter groups;
- each optimizer state tensor (momentum, Adam moments) has its parameter's shape, and
  every one is finite;
- the early-stopping record and the EMA weights, where present, have their types (and
  the EMA its model's tensors and shapes: ``check_extras``);
- the labels name the classes they named in the run that wrote it (``check_class_names``).

Also: ``warn_config_changes``, the warning that lists the keys a resumed run changes.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from detector.config import Config, ConfigError, config_from_dict, config_to_dict
from detector.data.classes import first_other_label
from detector.messages import DetectorError, first_line
from detector.modeling.trained_config import trained_class_names
from detector.modeling.weights import nonfinite_names

logger = logging.getLogger(__name__)

INT64_MAX = 2**63 - 1


class CheckpointError(DetectorError, RuntimeError):
    """A training checkpoint that cannot be read or does not fit."""


def _is_int(value: Any) -> bool:
    return type(value) is int or (isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point()
                                   and value.dtype != torch.bool)


def _int_field(state: Dict[str, Any], name: str, path: Path, default: Optional[int] = None, low: int = 0,
               high: int = INT64_MAX) -> int:
    """``state[name]`` as an int in ``low..high`` (``default`` where absent and allowed)."""
    if name not in state and default is not None:
        return default
    value = state.get(name)
    if not _is_int(value):
        raise CheckpointError(f"--resume: {path}: field '{name}' must be an integer, got {_show(value)}")
    value = int(value)
    if not low <= value <= high:
        raise CheckpointError(f"--resume: {path}: field '{name}' is {value}; it must be in {low}..{high}")
    return value


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, torch.Tensor) else f"a tensor {tuple(value.shape)} {value.dtype}"
    return text if len(text) <= 60 else text[:57] + "..."


def check_loop_position(state: Dict[str, Any], path: Path, batches_per_epoch: Optional[int],
                        world_size: int) -> None:
    """The fields of the loop position, the schedule, ``best_value`` and ``world_size``
    (see the module docstring). ``batches_per_epoch``: this rank's batches per epoch
    now (None: not checked); ``world_size``: this run's."""
    iteration = _int_field(state, "iteration", path)
    _int_field(state, "epoch", path, default=0, high=iteration)
    saved_world = _int_field(state, "world_size", path, default=world_size, low=1, high=2**31)
    limit = INT64_MAX
    if batches_per_epoch is not None:
        # The same world size splits the data the same way; another one, at most the whole set.
        limit = batches_per_epoch if saved_world == world_size else batches_per_epoch * world_size
    position = _int_field(state, "epoch_position", path, default=0)
    if position > limit:  # a sound checkpoint of a larger training set, or a crafted field
        raise CheckpointError(f"--resume: {path}: field 'epoch_position' is {position}, past the {limit} batches of an "
                              "epoch of this run's training set: has the training set changed since the checkpoint? "
                              "Resume with its data, or start from its weights with --weights")
    scheduler = state.get("scheduler")
    if not isinstance(scheduler, dict) or not _is_int(scheduler.get("last_epoch")):
        raise CheckpointError(f"--resume: {path}: field 'scheduler.last_epoch' must be an integer, got "
                              f"{_show(scheduler.get('last_epoch') if isinstance(scheduler, dict) else scheduler)}")
    if int(scheduler["last_epoch"]) != iteration:
        raise CheckpointError(f"--resume: {path}: field 'scheduler.last_epoch' is {int(scheduler['last_epoch'])} but "
                              f"'iteration' is {iteration}; the LR schedule steps once per iteration")
    best = state.get("best_value")
    if best is not None and (isinstance(best, bool) or not isinstance(best, (int, float)) or not math.isfinite(best)):
        raise CheckpointError(f"--resume: {path}: field 'best_value' must be a finite number or null, got {_show(best)}")


def batch_geometry_position(state: Dict[str, Any], path: Path, cfg: Config, world_size: int) -> int:
    """The checkpoint's ``epoch_position`` (batches of its ``images_per_gpu`` on each of its
    ``world_size`` ranks) in this run's batches: the same number of images of the epoch
    done, rounded down (it was taken as batches: a resume with 2 images a batch where the
    checkpoint had 1 skipped half the epoch's rest). A run trained by epochs whose
    optimizer steps per epoch (``solver.iters_per_epoch``) changed is refused: its
    ``max_iter`` would be another number of epochs (a run stopped after 2 of 4, exit 0).

    Raises:
        CheckpointError: one line naming the settings that changed.
    """
    position = _int_field(state, "epoch_position", path, default=0)
    saved = state.get("config") if isinstance(state.get("config"), dict) else {}
    solver = saved.get("solver") if isinstance(saved.get("solver"), dict) else {}
    old_ipg, old_world = solver.get("images_per_gpu"), state.get("world_size", world_size)
    if not (_is_int(old_ipg) and _is_int(old_world) and old_ipg > 0 and old_world > 0):
        return position  # an older or hand-made checkpoint: taken as it is
    s = cfg.solver
    changed = ", ".join(f"{name} {a} -> {b}" for name, a, b in (
        ("solver.images_per_gpu", old_ipg, s.images_per_gpu), ("ranks", old_world, world_size),
        ("solver.accumulate_steps", solver.get("accumulate_steps", s.accumulate_steps), s.accumulate_steps))
        if a != b)
    old_per_epoch = solver.get("iters_per_epoch")
    if s.max_epochs > 0 and _is_int(old_per_epoch) and 0 < old_per_epoch != s.iters_per_epoch:
        raise CheckpointError(
            f"--resume: {path} trains by epochs at {old_per_epoch} optimizer steps an epoch; this run makes "
            f"{s.iters_per_epoch} ({changed or 'the training set changed'}): its {s.max_epochs} epochs would end at "
            f"iteration {s.max_iter} instead of {s.max_epochs * old_per_epoch}. Resume with the checkpoint's batch "
            "settings and ranks")
    old_images, new_images = int(old_ipg) * int(old_world), s.images_per_gpu * world_size
    if position and old_images != new_images:
        converted = position * old_images // new_images
        logger.warning("resume: %s: the epoch's %d batches of %d images done are %d batches of %d images (%s)",
                       path.name, position, old_images, converted, new_images, changed)
        return converted
    return position


def check_rng_states(state: Dict[str, Any], path: Path,
                     get_state: Any, set_state: Any) -> None:
    """Each ``rng.per_rank[r]`` restores (tried with ``set_state``; the states of
    ``get_state()`` are put back afterwards). Absent ``rng``: nothing to check."""
    if "rng" not in state:
        return
    rng = state["rng"]
    per_rank = rng.get("per_rank") if isinstance(rng, dict) else None
    if not isinstance(per_rank, list):
        raise CheckpointError(f"--resume: {path}: field 'rng' must be {{'per_rank': [one entry per rank]}}, "
                              f"got {_show(rng)}")
    current = get_state()
    try:
        for r, entry in enumerate(per_rank):
            try:
                if not isinstance(entry, dict):
                    raise TypeError(f"expected a mapping, got {type(entry).__name__}")
                set_state(entry)
            except Exception as exc:  # noqa: BLE001 - any failure to restore is the file's fault
                raise CheckpointError(f"--resume: {path}: field 'rng.per_rank[{r}]' does not restore: "
                                      f"{type(exc).__name__}: {first_line(exc)}") from None
    finally:
        set_state(current)


# torch optimizer class -> the keys only its parameter groups hold (to name an older file's type).
_GROUP_SIGNS = {"SGD": ("momentum", "dampening", "nesterov"), "AdamW": ("betas", "eps", "amsgrad")}
SOLVER_NAMES = {"SGD": "sgd", "AdamW": "adamw"}


def optimizer_type(saved: Dict[str, Any]) -> Optional[str]:
    """The optimizer class name of a saved optimizer state, from its parameter groups."""
    groups = saved.get("param_groups") or []
    keys = set(groups[0]) if groups and isinstance(groups[0], dict) else set()
    found = [name for name, signs in _GROUP_SIGNS.items() if all(k in keys for k in signs)]
    return found[0] if len(found) == 1 else None


def check_optimizer_state(state: Dict[str, Any], optimizer: torch.optim.Optimizer, path: Path) -> None:
    """The saved optimizer is this run's type with the same parameter-group structure."""
    saved = state.get("optimizer")
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups) or not isinstance(saved.get("state"), dict):
        raise CheckpointError(f"--resume: {path}: field 'optimizer' must hold 'state' and 'param_groups' "
                              "(a list of groups with 'params'), as torch's Optimizer.state_dict() writes")
    now = type(optimizer).__name__
    recorded = state.get("optimizer_type")
    was = recorded if isinstance(recorded, str) else optimizer_type(saved)
    if was is not None and was != now:
        setting = SOLVER_NAMES.get(was)
        advice = f"resume with solver.optimizer={setting}" if setting else "resume with the optimizer it was written by"
        raise CheckpointError(
            f"--resume: {path} holds the state of a {was} optimizer but this run's solver.optimizer="
            f"{SOLVER_NAMES.get(now, now)} builds {now}; {advice}, or start from its weights with --weights")
    saved_sizes: List[int] = [len(g["params"]) for g in groups]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != sizes:
        raise CheckpointError(
            f"--resume: {path}: its optimizer has {len(saved_sizes)} parameter group(s) of {saved_sizes} parameters, "
            f"this run's has {len(sizes)} of {sizes}; solver.param_groups, the weight-decay settings of norms and "
            "biases, or the trained layers (model.freeze_at, model.norm) differ from the run that wrote it")
    _check_optimizer_tensors(saved, optimizer, path)


def _check_optimizer_tensors(saved: Dict[str, Any], optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Each parameter's saved state is a dict whose non-scalar tensors (momentum, Adam
    moments) have the parameter's shape (torch copies them unchecked: a wrong shape
    crashed the process at the first step), all finite."""
    per_param = saved["state"]
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups):
        for pid, param in zip(saved_group["params"], group["params"]):
            entry = per_param.get(pid)
            if entry is None:
                continue
            if not isinstance(entry, dict):
                raise CheckpointError(f"--resume: {path}: field 'optimizer.state[{pid}]' must be a dict, got {_show(entry)}")
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                    raise CheckpointError(
                        f"--resume: {path}: field 'optimizer.state[{pid}].{key}' has shape {list(value.shape)}, its "
                        f"parameter {list(param.shape)}")
    bad = nonfinite_names((f"optimizer.state[{pid}].{key}", value) for pid, entry in per_param.items()
                          if isinstance(entry, dict) for key, value in entry.items())
    if bad:
        raise CheckpointError(f"--resume: {path}: field '{bad[0]}' holds NaN or Inf values"
                              + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))


def _is_number(value: Any, integer: bool = False) -> bool:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    kinds = (int,) if integer else (int, float)
    return not isinstance(value, bool) and isinstance(value, kinds) and math.isfinite(value)


def check_extras(state: Dict[str, Any], path: Path, model: torch.nn.Module) -> None:
    """``early_stop`` (None, or ``{"best": number or None, "best_iteration": int or None,
    "wait": int >= 0}``) and ``ema`` (None, or ``{"model": this model's state dict,
    "updates": int >= 0}``), as the early-stopping and EMA hooks write them."""
    early = state.get("early_stop")
    if early is not None:
        if not isinstance(early, dict):
            raise CheckpointError(f"--resume: {path}: field 'early_stop' must be a dict, got {_show(early)}")
        for key, integer, optional in (("best", False, True), ("best_iteration", True, True), ("wait", True, False)):
            value = early.get(key) if optional else early.get(key, 0)
            if optional and value is None:
                continue
            if not _is_number(value, integer) or (integer and int(value) < 0):
                kind = "an integer >= 0" if integer else "a finite number"
                raise CheckpointError(f"--resume: {path}: field 'early_stop.{key}' must be {kind}"
                                      f"{' or null' if optional else ''}, got {_show(value)}")
    ema = state.get("ema")
    if ema is None:
        return
    weights = ema.get("model") if isinstance(ema, dict) else None
    if not isinstance(weights, dict) or not (_is_number(ema.get("updates"), True) and int(ema["updates"]) >= 0):
        raise CheckpointError(f"--resume: {path}: field 'ema' must hold 'model' (a state dict) and 'updates' (an "
                              f"integer >= 0), as the EMA hook writes them")
    expected = model.state_dict()
    for name, tensor in expected.items():
        value = weights.get(name)
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            got = ("missing" if value is None else f"of shape {list(value.shape)}" if isinstance(value, torch.Tensor)
                   else _show(value))
            raise CheckpointError(f"--resume: {path}: field 'ema.model' does not fit this model: '{name}' is {got}, "
                                  f"the model's {list(tensor.shape)}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise CheckpointError(f"--resume: {path}: field 'ema.model' has '{extra[0]}', which this model has not")
    bad = nonfinite_names((f"ema.model.{k}", v) for k, v in weights.items())
    if bad:
        raise CheckpointError(f"--resume: {path}: field '{bad[0]}' holds NaN or Inf values")


def _diff(a: Dict[str, Any], b: Dict[str, Any], prefix: str = "") -> List[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out.extend(_diff(va, vb, f"{prefix}{k}."))
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} -> {vb!r}")
    return out


def check_class_names(state: Dict[str, Any], path: Path, cfg: Config) -> None:
    """Refuse to resume a run whose labels would name other classes than in the run that
    wrote ``state`` (its stored ``data.class_names`` against this run's, both contiguous
    labels): the data's categories were renamed or renumbered since, and each label would
    go on training on another class. (Another class count fails the model's fit first.)"""
    trained, names = trained_class_names(state), list(cfg.data.class_names)
    label = first_other_label(trained, names) if cfg.data.label_space == "contiguous" else None
    if label is None:
        return
    raise CheckpointError(
        f"--resume: {path}: label {label} is {trained[label - 1]!r} in the run that wrote it but {names[label - 1]!r} "
        "in this run's data (data.class_names): resumed, each such label would train on another class; restore "
        "the data's categories, or start a new run from its weights (--weights)")


def warn_config_changes(stored: Any, cfg: Config) -> None:
    """Log the config keys that differ between a checkpoint's stored config and ``cfg``."""
    if not isinstance(stored, dict):
        return
    try:
        changed = _diff(config_to_dict(config_from_dict(stored)), config_to_dict(cfg))
        if changed:
            logger.warning("resume: config differs from the checkpoint's in: %s", ", ".join(changed))
    except (ConfigError, ValueError) as exc:
        logger.warning("resume: stored config not readable (%s)", exc)
