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

With ``capture=True`` (CUDA only) the body runs a few times on a side stream, then is
captured once into a ``torch.cuda.CUDAGraph``; each call copies the batch in and
replays. With ``capture=False`` the same body runs eagerly, on any device: that is how
the guard is tested on a CPU. Learning rates become 0-d device tensors that the LR
scheduler fills in place, so the captured graph follows the schedule.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from detector.config import Config
from detector.engine.amp import AmpSettings
from detector.modeling.static_forward import StaticBatch

LossFn = Callable[[StaticBatch], Tuple[Dict[str, Tensor], Dict[str, Tensor], Tensor]]
WARMUP_STEPS = 3


def prepare_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Make a fused or foreach SGD capturable: 0-d tensor learning rates on ``device``
    and zero momentum buffers (a first step would otherwise create them from a
    skipped update). Raises ``ValueError`` for any other optimizer."""
    groups = optimizer.param_groups
    if not isinstance(optimizer, torch.optim.SGD) or not all(g["fused"] or g["foreach"] for g in groups):
        raise ValueError("config key 'train.cuda_graphs' needs a fused or foreach SGD (solver.optimizer: sgd)")
    for g in groups:
        if not isinstance(g["lr"], Tensor):
            g["lr"] = torch.tensor(float(g["lr"]), device=device)
        if g["momentum"] != 0:
            for p in g["params"]:
                optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))


def nonfinite_flag(total: Tensor, grad_norm: Tensor) -> Tensor:
    """0-d float32: 1 when the loss or the gradient norm (any gradient) is not finite."""
    return (~torch.isfinite(total.float() + grad_norm.float())).float()


class GuardedStaticStep:
    """One guarded training iteration on a ``StaticBatch`` (see the module docstring).

    Args:
        model: the ``FasterRCNN`` in training mode.
        losses_fn: ``batch -> (losses, stats, nms_unconverged)`` (``StaticForward.losses_fn``).
        optimizer: a fused or foreach SGD over the model's parameters.
        amp: autocast settings (bfloat16 or off: float16's GradScaler is not captured).
        clip_grad_norm: max total gradient norm; <= 0 turns clipping off.
        capture: capture the body in a CUDA graph (CUDA only).

    Attributes:
        nonfinite_steps: 0-d float32 device tensor, the skipped steps so far.
    """

    def __init__(self, model: nn.Module, losses_fn: LossFn, optimizer: torch.optim.Optimizer,
                 amp: AmpSettings = AmpSettings(), clip_grad_norm: float = 0.0, capture: bool = False) -> None:
        if amp.uses_scaler:
            raise ValueError("config key 'train.amp.dtype' float16 needs a GradScaler, which the guarded static "
                             "step does not run: use bfloat16")
        self.model, self.losses_fn, self.optimizer, self.amp = model, losses_fn, optimizer, amp
        self.clip_grad_norm = float(clip_grad_norm)
        self.params: List[Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.device = self.params[0].device
        if capture and self.device.type != "cuda":
            raise ValueError(f"config key 'train.cuda_graphs' needs a CUDA device, got {self.device.type}")
        prepare_optimizer(optimizer, self.device)
        self.found_inf = torch.zeros((), device=self.device)
        optimizer.found_inf = self.found_inf  # read by the fused/foreach SGD step, on the device
        self.nonfinite_steps = torch.zeros((), device=self.device)
        self.buffers = [b for b in model.buffers()]
        self.saved = [b.clone() for b in self.buffers]
        self.capture = capture
        self.graph: Optional["torch.cuda.CUDAGraph"] = None
        self.inputs: Optional[StaticBatch] = None
        self.outputs: Tuple[Tensor, Tensor] = (torch.zeros(0), torch.zeros(()))
        self.loss_names: Tuple[str, ...] = ()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def body(self, batch: StaticBatch) -> Tuple[Tensor, Tensor]:
        """The iteration's device work; returns ``[1 + L]`` losses (total first) and the
        gradient norm, both on the device."""
        for saved, buf in zip(self.saved, self.buffers):
            saved.copy_(buf)
        torch._foreach_zero_(self.params_with_grad())
        with torch.autocast(self.device.type, dtype=self.amp.dtype, enabled=self.amp.enabled):
            losses, _, _ = self.losses_fn(batch)
        self.loss_names = ("total_loss", *sorted(losses))
        parts = torch.stack([losses[k].float() for k in sorted(losses)])
        total = parts.sum()
        total.backward()
        grads = self.params_with_grad()
        grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True).float()
        if self.clip_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.clip_grad_norm, grad_norm, foreach=True)
        self.found_inf.copy_(nonfinite_flag(total, grad_norm))
        self.optimizer.step()
        bad = self.found_inf > 0
        for saved, buf in zip(self.saved, self.buffers):
            buf.copy_(torch.where(bad, saved, buf))
        self.nonfinite_steps.add_(self.found_inf)
        return torch.cat([total.detach().reshape(1), parts.detach()]), grad_norm.detach()

    def _state_tensors(self) -> List[Tensor]:
        """Everything a step changes: parameters, buffers, momentum buffers, the counter."""
        momentum = [s["momentum_buffer"] for s in self.optimizer.state.values() if "momentum_buffer" in s]
        return [p.data for p in self.params] + list(self.buffers) + momentum + [self.nonfinite_steps]

    def params_with_grad(self) -> List[Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def __call__(self, batch: StaticBatch) -> Tuple[Tensor, Tensor]:
        """Train on ``batch``; ``(losses [1 + L], grad_norm)`` on the device (names in
        ``loss_names``). Captured steps return the same output tensors every call."""
        if not self.capture:
            return self.body(batch)
        if self.graph is None:
            self._capture(batch)
        for dst, src in zip(self.inputs, batch):
            dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.outputs

    def _capture(self, batch: StaticBatch) -> None:
        """Warm up on a side stream, then capture the body. The warm-up steps are undone
        (parameters, buffers, momentum and the counter restored), so the first replay
        is the first training step."""
        self.inputs = StaticBatch(*(t.clone() for t in batch))
        state = self._state_tensors()
        before = [t.clone() for t in state]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_STEPS):
                self.body(self.inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        with torch.no_grad():
            torch._foreach_copy_(state, before)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self.body(self.inputs)


def check_cuda_graphs(cfg: Config, device: torch.device) -> None:
    """One-line ``ValueError`` when ``train.cuda_graphs`` is on and ``device`` is not
    CUDA (the config itself refuses it without ``train.static_step``)."""
    if cfg.train.cuda_graphs and device.type != "cuda":
        raise ValueError(f"config key 'train.cuda_graphs' needs a CUDA device, got {device}")
