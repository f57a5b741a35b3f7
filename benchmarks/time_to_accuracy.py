"""Time to accuracy (``tools/benchmark.py --task time-to-accuracy``): the project's training against
torchvision's ``references/detection`` recipe, each for the same wall-clock budget,
both scored by the same evaluator.

The two runs, one after the other in this process, on the same device and AMP setting:

- ``ours``: the engine's real training path, :func:`detector.engine.trainer.build_trainer`
  with the config's model, optimizer, schedule, gradient clipping and augmentation.
  A :class:`BudgetHook` asks the loop to stop when the budget is spent. Periodic
  evaluation and periodic checkpoints are turned off (their time is not training
  time); logging stays as the config says. The run folder is a temporary directory.
- ``torchvision``: :class:`torchvision.models.detection.FasterRCNN` with the same
  backbone, FPN, anchors, samplers and head sizes
  (:func:`benchmarks.torchvision_ref.build_torchvision_model`), from random
  initialisation as ours, trained as ``references/detection`` (``train.py`` and
  ``engine.train_one_epoch``) trains it: SGD over every trainable parameter, momentum
  0.9, weight decay 1e-4 (norm layers and biases included), LR ``0.02 / 16`` per image
  of the step (the reference's 0.02 for 8 GPUs x 2 images, scaled linearly), linear
  warm-up from 1/1000 over ``min(1000, len(loader) - 1)`` iterations of the first
  epoch, ``MultiStepLR``, the loss read back every iteration and a non-finite loss
  ending the run, no gradient clipping. Its batches come from the same loader
  (``build_train_loader``: same images, augmentation and images per step).

The schedule under a time budget. Both schedules keep the length the config defines
(``solver.max_iter`` iterations) and are not compressed to the budget: ours decays
at ``solver.steps``; torchvision's ``MultiStepLR`` takes the same iterations as its
milestones (the reference counts them in epochs, 16 and 22 of 26, and steps it once
per epoch; here it is stepped every iteration so that both decay at the same
iteration). A run ends when the budget is spent or at ``solver.max_iter``, whichever
comes first; ``iterations`` and ``stopped_by`` say which.

The budget rule, the same for both: training time runs from the request of the first
batch to the end of the last step (model building, the final checkpoint and
evaluation are not in it). After each step, once the elapsed time plus that step's
duration reaches the budget, the next step is the last; so a run ends with the step
during which the budget runs out and may pass it by about one step. ``train_s`` is
measured. Both steps read one value back from the device every iteration (ours its
flags, torchvision's its loss), so the time is the device's.

Evaluation: :func:`detector.evaluation.evaluate` on the config's val split for both
(torchvision's model behind :class:`TorchvisionInputs`, which takes the project's
uint8 batches), its time reported as ``eval_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from detector.config import Config
from detector.engine.amp import resolve_amp
from detector.data import build_dataset, resolve_num_classes
from detector.data.loader import build_train_loader
from detector.distributed import resolve_device, seed_everything
from detector.engine.hooks import NonFiniteLossError
from detector.engine.optim import scaled_lr
from detector.engine.setup import configure_torch
from detector.engine.train_loop import HookBase, LoopState
from detector.engine.trainer import build_trainer
from detector.evaluation import evaluate

from .batches import cycle_epochs
from .timing import synchronize
from .torchvision_ref import build_torchvision_model, reference_optimizer, reference_step

logger = logging.getLogger(__name__)

SCHEDULE_NOTE = (
    "both schedules keep the config's length (solver.max_iter) and are not compressed to the budget; "
    "ours decays at solver.steps, torchvision's MultiStepLR at the same iterations (stepped per iteration, "
    "where the reference steps per epoch at epochs 16 and 22 of 26); a run ends at the budget or at "
    "solver.max_iter, whichever comes first"
)
BUDGET_REASON = "the time budget"  # LoopState.stop_requested set by BudgetHook
BUDGET_NOTE = (
    "training time runs from the first batch request to the end of the last step; once the elapsed time "
    "plus the last step's time reaches the budget the next step is the last, so a run may pass the budget "
    "by about one step; evaluation is timed separately"
)


def _loadavg() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on Linux
        return None


class Deadline:
    """The wall-clock budget of one run (seconds), shared rule of both runs.

    ``begin()`` when the first batch is requested; ``step_done()`` after every step
    returns True once the elapsed time plus the duration of the step just done
    reaches the budget (the next step should be the last)."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = float(budget_s)
        self.start = self.last_end = 0.0

    def begin(self) -> None:
        self.start = self.last_end = time.perf_counter()

    def step_done(self) -> bool:
        now = time.perf_counter()
        step_s, self.last_end = now - self.last_end, now
        return self.elapsed_s + step_s >= self.budget_s

    @property
    def elapsed_s(self) -> float:
        """Seconds from ``begin()`` to the end of the last step."""
        return self.last_end - self.start


class BudgetHook(HookBase):
    """Asks the training loop to stop when the :class:`Deadline` is (about to be)
    spent, and counts the images trained. Put it last in the trainer's hooks, so the
    other hooks' work in an iteration is part of the training time."""

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self.images = 0

    def before_train(self, state: LoopState) -> None:
        self.deadline.begin()

    def after_step(self, state: LoopState) -> None:
        self.images += state.batch_images
        if self.deadline.step_done() and state.stop_requested is None:
            state.stop_requested = BUDGET_REASON


class TorchvisionInputs(nn.Module):
    """torchvision's detection model fed the project's batches: uint8 ``[3, H, W]`` host
    images become float 0..1 on the model's device, and targets keep ``boxes``
    (float32 ``[N, 4]`` xyxy pixels) and ``labels`` (int64 ``[N]``), moved there, as
    the reference's loop moves them. Training mode returns torchvision's loss dict,
    eval mode its detections (boxes in the input image's pixels)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: List[Tensor], targets: Optional[List[Dict[str, Any]]] = None) -> Any:
        device = next(self.model.parameters()).device
        images = [img.to(device, non_blocking=True).float().div_(255.0) for img in images]
        if targets is not None:
            targets = [{"boxes": t["boxes"].to(device, non_blocking=True),
                        "labels": t["labels"].to(device, non_blocking=True)} for t in targets]
        return self.model(images, targets)


def _run_record(name: str, iterations: int, images: int, train_s: float, stopped_by: str,
                load_start: Optional[List[float]], lr_last: float) -> Dict[str, Any]:
    return {
        "name": name,
        "iterations": int(iterations),
        "images": int(images),
        "train_s": round(train_s, 3),
        "images_per_s": round(images / train_s, 3) if train_s > 0 else 0.0,
        "stopped_by": stopped_by,
        "lr_last": lr_last,
        "loadavg_start": load_start,
        "loadavg_train_end": _loadavg(),
    }


def train_ours(cfg: Config, budget_s: float, output_dir: str) -> Tuple[Optional[nn.Module], Dict[str, Any]]:
    """The engine's training for ``budget_s`` seconds (or ``solver.max_iter``).

    Returns ``(trained model or None after a non-finite stop, run record)``."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, output_dir=output_dir, eval_period=-1, checkpoint_period=0))
    load_start = _loadavg()
    deadline = Deadline(budget_s)
    hook = BudgetHook(deadline)
    trainer = build_trainer(cfg, overwrite=True)
    trainer.hooks.append(hook)
    model: Optional[nn.Module] = trainer.model_without_ddp
    try:
        result = trainer.train()
        iterations = result.iteration
        reason = trainer.state.stop_requested
        stopped_by = "solver.max_iter" if result.status == "finished" else "budget" if reason == BUDGET_REASON else str(reason)
    except NonFiniteLossError as exc:
        iterations, stopped_by, model = trainer.iteration, f"non-finite loss: {exc}", None
    finally:
        trainer.close()
    lr_last = float(trainer.step.scheduler.get_last_lr()[0])
    recipe = {
        "step": "detector.engine.trainer.build_trainer (Trainer, TrainStep and hooks)",
        "optimizer": cfg.solver.optimizer,
        "lr": scaled_lr(cfg, 1),
        "schedule": f"{cfg.solver.schedule}, warm-up {cfg.solver.warmup_iters} iterations from "
                    f"{cfg.solver.warmup_factor}, steps {list(cfg.solver.steps)}, max_iter {cfg.solver.max_iter}",
        "clip_grad_norm": cfg.solver.clip_grad_norm,
        "off_for_the_run": "periodic evaluation and checkpoints (train.eval_period=-1, train.checkpoint_period=0)",
    }
    record = _run_record("ours", iterations, hook.images, deadline.elapsed_s, stopped_by, load_start, lr_last)
    record["recipe"] = recipe
    del trainer  # its loader's workers go with it
    return model, record


def train_torchvision(cfg: Config, device: torch.device, budget_s: float) -> Tuple[Optional[nn.Module], Dict[str, Any]]:
    """torchvision's FasterRCNN trained as ``references/detection`` trains it (see the
    module docstring) for ``budget_s`` seconds (or ``solver.max_iter``), on the
    project's training loader. Returns ``(model or None after a non-finite loss, run record)``."""
    load_start = _loadavg()
    configure_torch(cfg)
    seed_everything(cfg.train.seed)
    model = TorchvisionInputs(build_torchvision_model(cfg)).to(device)
    model.train()
    amp = resolve_amp(cfg.train.amp, device)
    loader = build_train_loader(cfg, build_dataset(cfg, "train", True), 0, 1)
    batches_per_epoch = len(loader)
    optimizer, warmup, decay, recipe = reference_optimizer(model, cfg, batches_per_epoch)
    scaler = torch.amp.GradScaler(device.type) if amp.uses_scaler else None

    deadline = Deadline(budget_s)
    deadline.begin()
    batches = cycle_epochs(loader)
    iterations = images = 0
    last, finite, stopped_by = False, True, "solver.max_iter"
    try:
        while iterations < cfg.solver.max_iter:
            batch_images, targets = next(batches)
            loss_value = reference_step(model, optimizer, batch_images, targets, amp, scaler, device)
            if not math.isfinite(loss_value):
                deadline.step_done()
                finite = False
                stopped_by = f"non-finite loss ({loss_value}) at iteration {iterations + 1}; the reference exits here"
                break
            if iterations < batches_per_epoch:  # the reference's warm-up scheduler lives in epoch 0
                warmup.step()
            decay.step()
            iterations += 1
            images += len(batch_images)
            crossing = deadline.step_done()
            if last:
                stopped_by = "budget"
                break
            last = crossing
    finally:
        batches.close()  # shuts the loader's workers down
    record = _run_record("torchvision", iterations, images, deadline.elapsed_s, stopped_by, load_start,
                         float(optimizer.param_groups[0]["lr"]))
    record["recipe"] = recipe
    return (model if finite else None), record


def score(model: nn.Module, val_dataset: Any, cfg: Config, device: torch.device) -> Dict[str, Any]:
    """AP and AP50 of ``model`` on ``val_dataset`` by :func:`detector.evaluation.evaluate`,
    and the seconds it took (inference and scoring)."""
    eval_cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, compute_val_loss=False))
    synchronize(device)
    t0 = time.perf_counter()
    metrics = evaluate(model, val_dataset, eval_cfg)
    synchronize(device)
    return {"AP": float(metrics["AP"]), "AP50": float(metrics["AP50"]), "eval_s": round(time.perf_counter() - t0, 3)}


def benchmark_time_to_accuracy(cfg: Config, budget_s: float) -> Dict[str, Any]:
    """Train ours, then torchvision's recipe, ``budget_s`` seconds each; score both.

    Returns ``{"time_to_accuracy": {"budget_s", "device", "amp", "threads", "schedule", "budget_rule",
    "runs": {"ours": R, "torchvision": R}}}`` where each R has ``iterations``,
    ``images``, ``train_s``, ``images_per_s``, ``stopped_by``, ``AP``, ``AP50``
    (None when a non-finite loss ended the run), ``eval_s``, ``lr_last``, ``recipe``
    and the load average at the start and at the end of training."""
    if not budget_s > 0:
        raise ValueError(f"--budget-s must be > 0, got {budget_s}")
    cfg = resolve_num_classes(cfg)
    device = resolve_device(cfg.train.device)
    amp = resolve_amp(cfg.train.amp, device)
    val_dataset = build_dataset(cfg, "val", False)
    runs: Dict[str, Dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="time_to_accuracy_ours_") as run_dir:
        logger.info("time to accuracy: ours for %.0f s on %s", budget_s, device)
        model, runs["ours"] = train_ours(cfg, budget_s, run_dir)
        runs["ours"].update(_score_or_none(model, val_dataset, cfg, device))
        del model
    logger.info("time to accuracy: torchvision's recipe for %.0f s on %s", budget_s, device)
    model, runs["torchvision"] = train_torchvision(cfg, device, budget_s)
    runs["torchvision"].update(_score_or_none(model, val_dataset, cfg, device))
    return {"time_to_accuracy": {
        "budget_s": float(budget_s),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "amp": amp.enabled,
        "amp_dtype": str(amp.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "images_per_step": cfg.solver.images_per_gpu,
        "val_images": len(val_dataset),
        "schedule": SCHEDULE_NOTE,
        "budget_rule": BUDGET_NOTE,
        "runs": runs,
    }}


def _score_or_none(model: Optional[nn.Module], val_dataset: Any, cfg: Config, device: torch.device) -> Dict[str, Any]:
    if model is None:
        return {"AP": None, "AP50": None, "eval_s": 0.0}
    return score(model, val_dataset, cfg, device)


def format_time_to_accuracy(result: Dict[str, Any]) -> str:
    """A small table of a ``--task time-to-accuracy`` result."""
    t = result["time_to_accuracy"]
    lines = [f"task=time-to-accuracy budget {t['budget_s']:.0f} s per run, device={t['device']} amp={t['amp']} "
             f"threads={t['threads']} images/step={t['images_per_step']} val images={t['val_images']}",
             f"  {'run':<12s} {'AP':>6s} {'AP50':>6s} {'iters':>6s} {'images/s':>9s} {'train s':>8s} "
             f"{'eval s':>7s}  {'stopped by':<16s} load (start -> end of training)"]
    for name, r in t["runs"].items():
        ap = "-" if r["AP"] is None else f"{r['AP']:.3f}"
        ap50 = "-" if r["AP50"] is None else f"{r['AP50']:.3f}"
        lines.append(f"  {name:<12s} {ap:>6s} {ap50:>6s} {r['iterations']:>6d} {r['images_per_s']:>9.2f} "
                     f"{r['train_s']:>8.1f} {r['eval_s']:>7.1f}  {r['stopped_by'][:16]:<16s} "
                     f"{r['loadavg_start']} -> {r['loadavg_train_end']}")
    lines.append(f"  schedule: {t['schedule']}")
    return "\n".join(lines)
