"""``ModelEMA``: an exponential moving average of the model's weights (``train.ema``).

After every optimizer step that was taken, each floating-point tensor of the EMA copy
(parameters and buffers, BatchNorm statistics included) moves toward the model's:
``ema = d * ema + (1 - d) * model``; integer buffers (``num_batches_tracked``) are
copied. The decay ramps up over the first updates, ``d = decay * (1 - exp(-n / warmup))``
after ``n`` updates (``warmup`` 0: ``decay`` from the start), so the early, fast-moving
weights are not frozen into the average. ``n`` is stored, so a resumed run continues
the same average.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn


class ModelEMA:
    """The EMA copy ``module`` of ``model`` (without DDP), kept in eval mode, no gradients.

    Args:
        model: the model to average (its weights now are the start of the average).
        decay: the final decay, in (0, 1).
        warmup: updates over which the decay ramps up (``>= 0``).
    """

    def __init__(self, model: nn.Module, decay: float, warmup: int = 0) -> None:
        if not 0.0 < decay < 1.0 or warmup < 0:
            raise ValueError(f"train.ema needs 0 < decay < 1 and warmup >= 0, got {decay}, {warmup}")
        self.module = copy.deepcopy(model).eval()
        self.module.requires_grad_(False)
        self.decay, self.warmup, self.updates = float(decay), int(warmup), 0

    def decay_at(self, updates: int) -> float:
        """The decay used for update number ``updates`` (1-based)."""
        if self.warmup == 0:
            return self.decay
        return self.decay * (1.0 - math.exp(-updates / self.warmup))

    @torch.no_grad()
    def update(self, model: nn.Module, skip: Optional[Tensor] = None) -> None:
        """One step of the average toward ``model`` (same architecture, without DDP).

        ``skip``: a 0-d device flag of a step that decided on the device
        (``train.cuda_graphs``); where it is 1 the average does not move, without a host
        read. Such an update still counts in ``updates`` (the decay's ramp then counts
        iterations, skipped ones included)."""
        self.updates += 1
        weight = 1.0 - self.decay_at(self.updates)
        ema_f, model_f = self._float_pairs(model)
        if not ema_f:
            return
        if skip is None:
            torch._foreach_lerp_(ema_f, model_f, weight)
        else:  # ema += weight * (1 - skip) * (model - ema), the weight a device tensor
            delta = torch._foreach_sub(model_f, ema_f)
            torch._foreach_mul_(delta, weight * (1.0 - skip))
            torch._foreach_add_(ema_f, delta)

    def _float_pairs(self, model: nn.Module) -> Tuple[List[Tensor], List[Tensor]]:
        """The average's floating-point tensors and the model's matching ones; integer
        buffers (``num_batches_tracked``) are copied from the model on the way (a skipped
        step left the model's as they were)."""
        ema_f, model_f = [], []
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.is_floating_point():
                ema_f.append(e)
                model_f.append(m.detach())
            else:
                e.copy_(m)
        return ema_f, model_f

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.updates = int(state["updates"])
