"""``GraphedTrainStep``: the trainer's step for ``train.cuda_graphs: true``.

It has ``TrainStep``'s interface (``accumulate``, ``__call__``, ``optimizer``,
``scheduler``, ``scaler``, ``device``, ``world_size``) so that the loop, the hooks and the
checkpoints take it as they take ``TrainStep``. Each call:

1. pads the batch to its canvas on the host (``StaticForward.batch``) and copies it to
   the device;
2. runs ``GuardedStaticStep`` (built at the first call, after a resume has loaded the
   optimizer: the captured graph holds the addresses of the momentum buffers and of
   the learning rates, which become 0-d device tensors);
3. steps the LR scheduler, which fills those LR tensors in place, so the captured
   graph follows the schedule;
4. returns a ``StepResult`` whose losses, gradient norm, ``skip_flag`` and
   ``nonfinite_flag`` are fresh device copies (a replay overwrites the graph's outputs):
   nothing is read back. ``skipped`` and ``nonfinite`` are False; the hooks read the
   flags at logging points (``MetricsWriter``, ``NonFiniteGuard``: ``nonfinite_flag``
   counts, as ``nonfinite`` does) or use ``skip_flag`` on the device (``EMAHook``).

``check_graphed_config`` refuses, in one line naming the key, what the captured step
cannot run.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from detector.config import Config
from detector.engine.amp import AmpSettings
from detector.engine.graphed_step import GuardedStaticStep, check_cuda_graphs, check_optimizer
from detector.engine.static_step import StaticForward
from detector.engine.step import StepResult

Batch = Tuple[List[Tensor], List[Dict[str, Any]]]


def check_graphed_config(cfg: Config, world_size: int, device: torch.device,
                         capture: bool = True) -> None:
    """One-line ``ValueError`` for what ``train.cuda_graphs`` does not run: another
    device than CUDA (when ``capture``), several processes (the captured step holds no
    gradient all-reduce), ``solver.accumulate_steps`` > 1, an optimizer other than SGD."""
    if capture:
        check_cuda_graphs(cfg, device)
    if world_size > 1:
        raise ValueError(f"config key 'train.cuda_graphs' runs on one process, got {world_size}: the captured "
                         "step has no gradient all-reduce (DDP); turn it off for multi-process training")
    if cfg.solver.accumulate_steps != 1:
        raise ValueError("config key 'solver.accumulate_steps' must be 1 with train.cuda_graphs, got "
                         f"{cfg.solver.accumulate_steps}")
    if cfg.solver.optimizer != "sgd":
        raise ValueError(f"config key 'solver.optimizer' must be sgd with train.cuda_graphs, got {cfg.solver.optimizer}")


class GraphedTrainStep:
    """``TrainStep``'s interface over ``GuardedStaticStep`` (see the module docstring).

    Args:
        forward: the static forward (its ``batch``, ``losses_fn`` and NMS counter).
        optimizer: a fused SGD over the model's parameters.
        scheduler: stepped once per call; it fills the tensor LRs in place.
        amp: autocast settings (off, bfloat16, or float16 with a device-side dynamic loss scale).
        clip_grad_norm: ``solver.clip_grad_norm`` (<= 0: off), applied on the device.
        capture: capture the step in a CUDA graph; False runs the same body eagerly
            (any device: debugging, and the CPU tests of this wiring).
    """

    world_size = 1

    def __init__(self, forward: StaticForward, optimizer: torch.optim.Optimizer, scheduler: Any,
                 amp: AmpSettings = AmpSettings(), clip_grad_norm: float = 0.0, capture: bool = True) -> None:
        check_optimizer(optimizer)
        self.forward, self.optimizer, self.scheduler, self.amp = forward, optimizer, scheduler, amp
        self.model = forward.model
        self.clip_grad_norm = float(clip_grad_norm)
        self.capture = bool(capture)
        self.device = self.model.device
        # float16: the step scales the loss on the device with this scaler's tensors;
        # checkpoints save and restore it as they do TrainStep's.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=amp.uses_scaler)
        self.guarded: Optional[GuardedStaticStep] = None

    @property
    def nonfinite_steps(self) -> Tensor:
        """0-d float32 device tensor: the steps skipped so far (read it at logging points)."""
        return self.guarded.nonfinite_steps if self.guarded is not None else torch.zeros((), device=self.device)

    def __call__(self, images: List[Tensor], targets: List[Dict[str, Any]], stop_requested: bool = False) -> StepResult:
        return self.accumulate([(images, targets)], stop_requested)

    def accumulate(self, batches: Sequence[Batch], stop_requested: bool = False) -> StepResult:
        """One step on ``batches[0]`` (exactly one: ``solver.accumulate_steps`` is 1)."""
        if len(batches) != 1:
            raise ValueError(f"config key 'solver.accumulate_steps' must be 1 with train.cuda_graphs, got {len(batches)}")
        images, targets = batches[0]
        batch = self.forward.batch(images, targets)
        if self.guarded is None:
            self.guarded = GuardedStaticStep(self.model, self.forward.losses_fn, self.optimizer, self.amp,
                                             self.clip_grad_norm, self.capture, self.forward.nms_unconverged,
                                             self.scaler)
        losses, grad_norm, stats = self.guarded(batch)
        self.scheduler.step()
        return StepResult(losses.clone(), self.guarded.loss_names, grad_norm.clone(), skipped=False,
                          nonfinite=False, stop=bool(stop_requested), stats=stats.clone(),
                          stat_names=self.guarded.stat_names, skip_flag=self.guarded.found_inf.clone(),
                          nonfinite_flag=self.guarded.nonfinite_now.clone())
