"""One training iteration: ``TrainStep``.

forward (under autocast when AMP is on) -> float32 loss sum -> backward (scaled by a
``GradScaler`` for float16) -> unscale -> gradient norm and clipping -> the non-finite
check -> optimizer step (or a skipped step) -> LR scheduler step.

A skipped step leaves the training state as it was: no optimizer step (parameters and
optimizer state untouched), the model's buffers (BatchNorm's running statistics, which
the forward pass already updated) restored from a snapshot taken before the forward
pass (``detector.engine.buffer_guard``), and the GradScaler's scale kept unless the
skip is its own float16 overflow calibration. Only the scheduler advances, so that the
schedule follows the iteration count.

``accumulate`` takes several micro-batches for one optimizer step
(``solver.accumulate_steps``); ``__call__`` is the one-batch case.

The step reads back ONE small tensor from the device per call: the flags
``[non-finite, stop requested]``, all-reduced across ranks under DDP so that every
rank skips (or stops) together. Losses, the gradient norm and the samplers' statistics
(the ``stats`` of the model's ``TrainingLosses``) stay on the device; the caller reads
them at logging points only. docs/training.md says where a device-side
skip would remove the read-back on CUDA.

The trainer and the benchmark both use this class; it needs nothing but the model,
the optimizer, the scheduler and the AMP settings.

``average_gradients`` (the static step on several processes): the ``forward`` calls the
model's parts directly, past DDP's hooks, so the step does DDP's two jobs itself: it
broadcasts rank 0's buffers before the first forward pass (``broadcast_buffers``) and
averages the gradients after the last backward pass (one all-reduce per dtype,
``detector.distributed.all_reduce_mean_``). The result is DDP's; only the overlap of the
all-reduce with the backward pass is lost.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

# Mixed-precision settings come from ``detector.engine.amp.resolve_amp``, the one place that
# turns ``train.amp`` into them for a device.
from detector.distributed import all_reduce_mean_, broadcast_
from detector.engine.amp import AmpSettings
from detector.engine.buffer_guard import BufferSnapshot
from detector.modeling.training_stats import stats_of


@dataclass
class StepResult:
    """What one ``TrainStep`` call returns.

    Attributes:
        losses: float32 ``[1 + L]`` on the device: the total, then the model's losses
            in the order of ``loss_names[1:]`` (sorted names). Not synchronised.
        loss_names: ``("total_loss", *sorted loss names)``.
        grad_norm: 0-d float32 tensor on the device, the total L2 norm of the unscaled
            gradients before clipping.
        skipped: no optimizer step was taken (on any rank): the loss or a gradient was
            not finite somewhere.
        nonfinite: the loss was not finite on some rank, or, without a float16
            GradScaler, a gradient. A float16 overflow of the gradients is the scaler's
            normal calibration (it lowers its scale): skipped, but not ``nonfinite``.
        stop: some rank asked to stop (a signal); every rank sees the same value.
        stats: float32 ``[S]`` on the device: the samplers' statistics (the model's
            ``TrainingLosses.stats``), each the mean over the micro-batches where it is
            defined (NaN where it is defined in none). Not synchronised.
        stat_names: their names, sorted (empty when the forward returns none).
        skip_flag: None, or (the step of ``train.cuda_graphs``, which decides on the
            device and reads nothing back) a 0-d float32 device tensor, 1.0 when the
            step was skipped (``skipped``'s meaning); ``skipped`` and ``nonfinite`` are
            then False and the hooks read the flags at logging points.
        nonfinite_flag: with ``skip_flag``, 1.0 when the step counts as non-finite
            (``nonfinite``'s meaning: a float16 overflow sets ``skip_flag`` only); left
            None, it is ``skip_flag`` (every skip non-finite).
    """

    losses: Tensor
    loss_names: Tuple[str, ...]
    grad_norm: Tensor
    skipped: bool
    nonfinite: bool
    stop: bool
    stats: Tensor = field(default_factory=lambda: torch.zeros(0))
    stat_names: Tuple[str, ...] = ()
    skip_flag: Optional[Tensor] = None
    nonfinite_flag: Optional[Tensor] = None

    def __post_init__(self) -> None:
        if self.nonfinite_flag is None:
            self.nonfinite_flag = self.skip_flag


class TrainStep:
    """A callable doing one training iteration; see the module docstring.

    Args:
        model: the detector (possibly DDP-wrapped); in training mode it returns a dict
            of scalar losses.
        optimizer: its parameter groups hold every parameter to train.
        scheduler: stepped once per call (skipped steps included, so the schedule
            follows the iteration count).
        amp: autocast settings (``detector.engine.amp.resolve_amp``).
        clip_grad_norm: max total L2 norm of the gradients; ``<= 0`` turns clipping off.
        world_size: processes in the default process group (> 1: the flags are all-reduced).
        scaler: a GradScaler to use (e.g. restored from a checkpoint); by default one is
            made, enabled for float16 AMP only.
        forward: ``forward(images, targets) -> losses`` used instead of ``model`` (the
            static step: ``engine.static_step.StaticForward``); None calls ``model``.
        average_gradients: broadcast the buffers and average the gradients across the
            ``world_size`` ranks here (a ``forward`` that bypasses DDP; module docstring).
            A parameter without a gradient on a rank counts as a zero gradient, as in DDP.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        amp: AmpSettings = AmpSettings(),
        clip_grad_norm: float = 0.0,
        world_size: int = 1,
        scaler: Optional[torch.amp.GradScaler] = None,
        forward: Optional[Callable[[List[Tensor], List[Dict[str, Any]]], Dict[str, Tensor]]] = None,
        average_gradients: bool = False,
    ) -> None:
        self.model = model
        self.forward = forward if forward is not None else model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.amp = amp
        self.clip_grad_norm = float(clip_grad_norm)
        self.world_size = int(world_size)
        self.params: List[Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        if not self.params:
            raise ValueError("the optimizer has no parameters to train")
        self.device = self.params[0].device
        self.scaler = scaler if scaler is not None else torch.amp.GradScaler(self.device.type, enabled=amp.uses_scaler)
        self.buffers = BufferSnapshot(model)
        self._is_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        self.average_gradients = bool(average_gradients) and self.world_size > 1
        # [0, 1] on the device: the stop flag is picked from it without a host-to-device copy.
        self._zero_one = torch.tensor([0.0, 1.0], device=self.device)

    def __call__(self, images: List[Tensor], targets: List[Dict[str, Any]], stop_requested: bool = False) -> StepResult:
        """Train on one batch: ``images`` (list of ``[3, H, W]`` float tensors) and their
        ``targets`` (dicts with ``boxes`` ``[N, 4]`` xyxy pixels and ``labels`` ``[N]``)."""
        return self.accumulate([(images, targets)], stop_requested)

    def accumulate(self, batches: Sequence[Tuple[List[Tensor], List[Dict[str, Any]]]],
                   stop_requested: bool = False) -> StepResult:
        """One optimizer step over ``len(batches)`` micro-batches (``solver.accumulate_steps``).

        Each micro-batch's loss is divided by their number before its backward pass, so
        the accumulated gradient is the gradient of the mean of the micro-batch losses:
        for equal micro-batches of per-image-normalised losses that is the loss of the
        joint batch (see docs/training.md). Under DDP the gradients are all-reduced once,
        after the last micro-batch (``no_sync`` on the others). The reported losses are
        that mean; so are the statistics."""
        if not batches:
            raise ValueError("accumulate needs at least one micro-batch")
        self.optimizer.zero_grad(set_to_none=True)
        if self.average_gradients:
            broadcast_(list(self.model.buffers()), self.world_size)
        self.buffers.take()  # BatchNorm's running statistics change in the forward pass
        names: Tuple[str, ...] = ()
        parts = torch.zeros((), device=self.device)
        stats: List[Dict[str, Tensor]] = []
        for i, (images, targets) in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last or not self._is_ddp else self.model.no_sync():
                names, micro, micro_stats = self._forward_backward(images, targets, 1.0 / len(batches))
            parts = parts + micro
            stats.append(micro_stats)
        if self.average_gradients:
            all_reduce_mean_(self._dense_grads(), self.world_size)
        return self._finish(names, parts, bool(stop_requested), *mean_stats(stats, self.device))

    def _forward_backward(self, images: List[Tensor], targets: List[Dict[str, Any]],
                          weight: float) -> Tuple[Tuple[str, ...], Tensor, Dict[str, Tensor]]:
        """Forward and backward of one micro-batch; its weighted losses ``[L]`` (float32,
        detached) in the order of the returned sorted names, and its statistics."""
        with torch.autocast(device_type=self.device.type, dtype=self.amp.dtype, enabled=self.amp.enabled):
            loss_dict = self.forward(images, targets)
        names = tuple(sorted(loss_dict))
        parts = torch.stack([loss_dict[k].float() for k in names])  # losses summed in float32
        if weight != 1.0:
            parts = parts * weight
        self.scaler.scale(parts.sum()).backward()
        return names, parts.detach(), stats_of(loss_dict)

    def _dense_grads(self) -> List[Tensor]:
        """The gradient of every parameter that requires one, a missing one made zero (the
        same tensors on each rank)."""
        for p in self.params:
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params if p.grad is not None]

    def _finish(self, names: Tuple[str, ...], parts: Tensor, stop_requested: bool, stat_names: Tuple[str, ...],
                stats: Tensor) -> StepResult:
        """Unscale, norm, clip, the non-finite check, then the optimizer step or the skip."""
        total = parts.sum()
        self.scaler.unscale_(self.optimizer)  # no-op when the scaler is disabled
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True).float()
        else:
            grad_norm = torch.zeros((), device=self.device)
        # A non-finite gradient makes the norm non-finite. The last flag: the gradients need
        # clipping (clip_grads_with_norm_'s factor max / (norm + 1e-6) below 1; at or above 1
        # it multiplies by exactly 1, so skipping it then changes no bit).
        clip = self.clip_grad_norm / (grad_norm + 1e-6) < 1 if self.clip_grad_norm > 0 else self._zero_one[0] > 0
        flags = torch.stack([
            (~torch.isfinite(total)).float(),
            (~torch.isfinite(grad_norm)).float(),
            self._zero_one[int(stop_requested)],
            clip.float(),
        ])
        if self.world_size > 1:
            dist.all_reduce(flags)
        bad_loss, bad_grads, stop, clip_needed = (flags > 0).tolist()  # the one host read-back of the iteration
        skipped = bad_loss or bad_grads
        nonfinite = bad_loss or (bad_grads and not self.scaler.is_enabled())
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.buffers.restore()
        else:
            if clip_needed:
                torch.nn.utils.clip_grads_with_norm_(self.params, self.clip_grad_norm, grad_norm, foreach=True)
            # The gradients are unscaled and known finite: step the optimizer directly
            # (GradScaler.step would read its inf flag back a second time).
            self.optimizer.step()
        if self.scaler.is_enabled():
            # A float16 overflow of the gradients lowers the scale (on the device); a
            # non-finite loss is no scale problem: the scale and its growth count stay.
            self.scaler.update(self.scaler.get_scale() if nonfinite else None)
        step_scheduler(self.scheduler, skipped)
        losses = torch.cat([total.reshape(1), parts])
        return StepResult(losses, ("total_loss", *names), grad_norm.detach(), skipped, nonfinite, stop, stats,
                          stat_names)


# torch's warning when a scheduler's first step comes before any optimizer step.
_SCHEDULER_FIRST_WARNING = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


def step_scheduler(scheduler: Any, skipped: bool) -> None:
    """``scheduler.step()``: the schedule counts iterations, skipped ones included. A
    skipped first iteration (a float16 scale that overflows, a NaN) would make torch warn
    that the scheduler stepped before the optimizer and "skips the first value of the
    schedule", which is not so here: that warning is silenced for a skipped step only."""
    if not skipped:
        scheduler.step()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SCHEDULER_FIRST_WARNING, category=UserWarning)
        scheduler.step()


@torch.no_grad()
def mean_stats(per_batch: Sequence[Dict[str, Tensor]], device: torch.device) -> Tuple[Tuple[str, ...], Tensor]:
    """The statistics of several micro-batches -> their sorted names (those of any
    micro-batch) and float32 ``[S]``: per name the mean over the micro-batches where it
    is defined (not NaN and present), on the device, without a host read."""
    names = tuple(sorted({k for stats in per_batch for k in stats}))
    if not names:
        return (), torch.empty(0, device=device)
    if len(per_batch) == 1:  # (one operator per step without accumulation)
        return names, torch.stack([per_batch[0][k].float() for k in names])
    missing = torch.full((), float("nan"), device=device)
    rows = torch.stack([torch.stack([stats.get(k, missing).float() for k in names]) for stats in per_batch])
    return names, torch.nanmean(rows, dim=0)
