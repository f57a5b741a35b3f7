"""The static step with its optimizer step, guarded on the device, and captured in a
CUDA graph (``train.cuda_graphs: true``).

``GuardedStaticStep`` runs one training iteration without reading anything on the host:

1. copy the batch into fixed input tensors, save the model's buffers (BatchNorm
   running statistics and counters);
2. zero the gradients in place (a captured graph needs their addresses fixed);
3. the static losses under autocast, their float32 sum, backward;
4. gradient norm (and clipping, ``solver.clip_grad_norm``) with foreach kernels;
5. ``found_inf`` = 1 when the loss or a gradient is not finite (GradScaler's idea);
6. the fused SGD step, which skips its update on the device when ``found_inf`` is 1
   (the optimizer's ``found_inf`` attribute, as GradScaler sets it): parameters and
   momentum buffers stay as they were;
7. the buffers saved in 1 come back where ``found_inf`` is 1, and ``nonfinite_steps``
   counts the step (read it at logging points).

With float16 AMP a GradScaler's dynamic scale runs on the device too: the loss is scaled
before 3's backward, the gradients unscaled after it, and the scale updated after 7
(``update_scale``), all without a host read, so GPUs without bfloat16 (V100, T4) can
capture the step as well.

With ``capture=True`` (CUDA only) the body runs a few times on a side stream, then is
captured into a ``torch.cuda.CUDAGraph``, once per canvas of ``model.canvas_sizes``;
each call copies the batch into its canvas's input tensors and replays. With ``capture=False`` the same body runs eagerly, on any device: that is how
the guard is tested on a CPU. Learning rates become 0-d device tensors that the LR
scheduler fills in place, so the captured graph follows the schedule.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from detector.config import Config
from detector.engine.amp import AmpSettings
from detector.engine.buffer_guard import BufferSnapshot
from detector.modeling.static_forward import StaticBatch

LossFn = Callable[[StaticBatch], Tuple[Dict[str, Tensor], Dict[str, Tensor], Tensor]]
Outputs = Tuple[Tensor, Tensor, Tensor]  # losses [1 + L], gradient norm, sampler statistics [S]
WARMUP_STEPS = 3


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """One-line ``ValueError`` unless ``optimizer`` is a fused SGD (the one whose step
    honours a device-side ``found_inf``)."""
    if not isinstance(optimizer, torch.optim.SGD) or not all(g.get("fused") for g in optimizer.param_groups):
        raise ValueError("config key 'solver.optimizer' must be sgd (fused, on CPU or CUDA parameters) "
                         f"with train.cuda_graphs, got {type(optimizer).__name__}")


def prepare_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Make a fused SGD capturable: 0-d float32 tensor learning rates on ``device``
    (an LR scheduler then fills them in place: ``torch.optim.lr_scheduler`` and
    ``WarmupLRScheduler.continue_at`` do) and zero momentum buffers (a first step
    would otherwise create them from a skipped update; with zero buffers the first
    update equals the eager one). Raises ``ValueError`` for any other optimizer."""
    check_optimizer(optimizer)
    for g in optimizer.param_groups:
        if not isinstance(g["lr"], Tensor) or g["lr"].device != device:
            g["lr"] = torch.tensor(float(g["lr"]), device=device)
        if g["momentum"] != 0:
            for p in g["params"]:
                optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))


def update_scale(scaler: torch.amp.GradScaler, found_inf: Tensor, keep: Tensor) -> None:
    """``GradScaler.update()`` on the device, as a captured graph can run it: the scale
    backs off after a step with ``found_inf`` (0-d float32, 1.0: skipped) and grows after
    ``growth_interval`` clean steps in a row; where ``keep`` (0-d bool: the loss itself was
    not finite) the scale and its growth count stay as they were, as ``TrainStep`` keeps
    them (a NaN loss is no overflow to calibrate). ``scaler`` must have its device
    tensors (``_lazy_init_scale_growth_tracker``)."""
    scale, tracker = scaler._scale, scaler._growth_tracker
    old_scale, old_tracker = scale.clone(), tracker.clone()
    torch._amp_update_scale_(scale, tracker, found_inf.reshape(1), scaler.get_growth_factor(),
                             scaler.get_backoff_factor(), scaler.get_growth_interval())
    scale.copy_(torch.where(keep, old_scale, scale))
    tracker.copy_(torch.where(keep, old_tracker, tracker))


def nonfinite_flag(total: Tensor, grad_norm: Tensor) -> Tensor:
    """0-d float32: 1 when the loss or the gradient norm (any gradient) is not finite."""
    return (~torch.isfinite(total.float() + grad_norm.float())).float()


class GuardedStaticStep:
    """One guarded training iteration on a ``StaticBatch`` (see the module docstring).

    Args:
        model: the ``FasterRCNN`` in training mode.
        losses_fn: ``batch -> (losses, stats, nms_unconverged)`` (``StaticForward.losses_fn``).
        optimizer: a fused SGD over the model's parameters.
        amp: autocast settings (off, bfloat16, or float16 with ``scaler``).
        clip_grad_norm: max total gradient norm; <= 0 turns clipping off.
        capture: capture the body in a CUDA graph (CUDA only).
        nms_unconverged: a 0-d int64 device counter the body adds the proposal NMS's
            non-converged runs to (``StaticForward.nms_unconverged``); None: not counted.
        scaler: an enabled GradScaler for float16 AMP: its scale and growth count become
            device tensors that the body reads and updates (``update_scale``), so the
            captured step scales dynamically and checkpoints save the scaler as usual.

    Attributes:
        found_inf: 0-d float32 device tensor, 1.0 when the last step was skipped.
        nonfinite_now: 0-d float32 device tensor, 1.0 when the last step counts as
            non-finite (``found_inf``, except a float16 overflow: see ``nonfinite_steps``).
        nonfinite_steps: 0-d float32 device tensor, the steps skipped for a non-finite
            loss or gradient so far (with ``scaler``: for a non-finite loss; a gradient
            overflow is the scale's calibration, as in ``TrainStep``).
        loss_names: ``("total_loss", *sorted loss names)``, known after the first call.
    """

    def __init__(self, model: nn.Module, losses_fn: LossFn, optimizer: torch.optim.Optimizer,
                 amp: AmpSettings = AmpSettings(), clip_grad_norm: float = 0.0, capture: bool = False,
                 nms_unconverged: Optional[Tensor] = None, scaler: Optional[torch.amp.GradScaler] = None) -> None:
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        if amp.uses_scaler and self.scaler is None:
            raise ValueError("config key 'train.amp.dtype' float16 needs a GradScaler: pass an enabled one")
        self.model, self.losses_fn, self.optimizer, self.amp = model, losses_fn, optimizer, amp
        self.clip_grad_norm = float(clip_grad_norm)
        self.params: List[Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.device = self.params[0].device
        if capture and self.device.type != "cuda":
            raise ValueError(f"config key 'train.cuda_graphs' needs a CUDA device, got {self.device.type}")
        prepare_optimizer(optimizer, self.device)
        if self.scaler is not None:  # its scale and growth count as device tensors, loaded checkpoints included
            self.scaler._lazy_init_scale_growth_tracker(self.device)
        self.found_inf = torch.zeros((), device=self.device)
        optimizer.found_inf = self.found_inf  # read by the fused SGD step, on the device
        self.nonfinite_steps = torch.zeros((), device=self.device)
        self.nonfinite_now = torch.zeros((), device=self.device)
        self.nms_unconverged = nms_unconverged
        self.snapshot = BufferSnapshot(model)
        self.capture = capture
        # One graph per canvas (``model.canvas_sizes``): its input copies and outputs.
        self.graphs: Dict[Tuple[int, ...], Tuple["torch.cuda.CUDAGraph", StaticBatch, Outputs]] = {}
        self.loss_names: Tuple[str, ...] = ()
        self.stat_names: Tuple[str, ...] = ()
        optimizer.zero_grad(set_to_none=True)  # the first backward creates the gradients the step uses

    def body(self, batch: StaticBatch) -> Outputs:
        """The iteration's device work; returns ``[1 + L]`` losses (total first), the
        gradient norm and the ``[S]`` sampler statistics (``stat_names``), on the device. The gradients are zeroed in place (a captured
        graph keeps their addresses); a parameter the static losses do not reach keeps
        ``grad`` None, so the SGD step leaves it alone, as the eager step does."""
        self.snapshot.take()  # BatchNorm's running statistics change in the forward pass
        grads = self.params_with_grad()
        if grads:  # (none before the first backward)
            torch._foreach_zero_(grads)
        # No autocast weight cache under capture: cached casts would outlive the graph's inputs.
        with torch.autocast(self.device.type, dtype=self.amp.dtype, enabled=self.amp.enabled,
                            cache_enabled=not self.capture):
            losses, stats, unconverged = self.losses_fn(batch)
        if self.nms_unconverged is not None:
            self.nms_unconverged.add_(unconverged.sum())
        self.stat_names = tuple(sorted(stats))
        self.loss_names = ("total_loss", *sorted(losses))
        parts = torch.stack([losses[k].float() for k in sorted(losses)])
        total = parts.sum()
        if self.scaler is None:
            total.backward()
        else:  # float16: the loss scaled, the gradients unscaled, as GradScaler does
            (total * self.scaler._scale).backward()
            inv_scale = self.scaler._scale.double().reciprocal().float()
            overflow = torch.zeros(1, device=self.device)  # (the gradient norm below says it too)
            torch._amp_foreach_non_finite_check_and_unscale_(self.params_with_grad(), overflow, inv_scale)
        grads = self.params_with_grad()
        grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True).float()
        if self.clip_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.clip_grad_norm, grad_norm, foreach=True)
        self.found_inf.copy_(nonfinite_flag(total, grad_norm))
        self.optimizer.step()
        self.snapshot.restore_where(self.found_inf > 0)
        if self.scaler is None:
            self.nonfinite_now.copy_(self.found_inf)
        else:  # a gradient overflow with a finite loss is the scale's calibration, not counted
            bad_loss = ~torch.isfinite(total)
            self.nonfinite_now.copy_(bad_loss.float())
            update_scale(self.scaler, self.found_inf, keep=bad_loss)
        self.nonfinite_steps.add_(self.nonfinite_now)
        stat_values = (torch.stack([stats[k].float() for k in self.stat_names]) if self.stat_names
                       else torch.zeros(0, device=self.device))
        return torch.cat([total.detach().reshape(1), parts.detach()]), grad_norm.detach(), stat_values.detach()

    def _state_tensors(self) -> List[Tensor]:
        """Everything a step changes: parameters, buffers, momentum buffers, counters."""
        momentum = [s["momentum_buffer"] for s in self.optimizer.state.values() if "momentum_buffer" in s]
        counters = [self.nonfinite_steps] + ([self.nms_unconverged] if self.nms_unconverged is not None else [])
        if self.scaler is not None:
            counters += [self.scaler._scale, self.scaler._growth_tracker]
        return [p.data for p in self.params] + list(self.model.buffers()) + momentum + counters

    def params_with_grad(self) -> List[Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def __call__(self, batch: StaticBatch) -> Outputs:
        """Train on ``batch``; ``(losses [1 + L], grad_norm, stats [S])`` on the device
        (names in ``loss_names`` and ``stat_names``). Captured steps return the same output tensors every call of a
        canvas: copy them to keep them. The first batch of each canvas captures its graph."""
        if not self.capture:
            return self.body(batch)
        key = tuple(batch.images.shape)
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch)
        graph, inputs, outputs = self.graphs[key]
        for dst, src in zip(inputs, batch):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return outputs

    def _capture(self, batch: StaticBatch) -> Tuple["torch.cuda.CUDAGraph", StaticBatch, Outputs]:
        """Warm up on a side stream, then capture the body into a new graph (its own
        memory pool); returns ``(graph, its input tensors, its outputs)``. The warm-up
        steps are undone (parameters, buffers, momentum, the counters and the device's
        random state restored), so the first replay is the next training step and draws
        what the eager step would."""
        inputs = StaticBatch(*(t.clone() for t in batch))
        state = self._state_tensors()
        before = [t.clone() for t in state]
        rng = torch.cuda.get_rng_state(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_STEPS):
                self.body(inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        with torch.no_grad():
            torch._foreach_copy_(state, before)
        torch.cuda.set_rng_state(rng, self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.body(inputs)
        return graph, inputs, outputs


def check_cuda_graphs(cfg: Config, device: torch.device) -> None:
    """One-line ``ValueError`` when ``train.cuda_graphs`` is on and ``device`` is not
    CUDA (the config itself refuses it without ``train.static_step``)."""
    if cfg.train.cuda_graphs and device.type != "cuda":
        raise ValueError(f"config key 'train.cuda_graphs' needs a CUDA device, got {device}")
