"""``build_train_step``: which training step a config runs, for the trainer and the
benchmarks alike.

- the model's own forward in ``TrainStep`` (the default);
- ``train.static_step``: ``TrainStep`` over the compiled ``StaticForward`` (with several
  processes the step averages the gradients itself: the forward bypasses DDP);
- ``train.cuda_graphs``: ``GraphedTrainStep``, the static step with its SGD step and
  the non-finite guard captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Any, Union

from torch import nn

from detector.config import Config
from detector.engine.amp import AmpSettings
from detector.engine.graphed_train_step import GraphedTrainStep, check_graphed_config
from detector.engine.static_step import static_forward
from detector.engine.step import TrainStep


def build_train_step(cfg: Config, model: nn.Module, model_without_ddp: nn.Module, optimizer: Any, scheduler: Any,
                     amp: AmpSettings, world_size: int, eager_static: bool = False) -> Union[TrainStep, GraphedTrainStep]:
    """The step ``cfg`` asks for (see the module docstring); refusals in one line first.

    Args:
        model: the model the optimizer trains (DDP-wrapped with several processes).
        model_without_ddp: the ``FasterRCNN`` itself.
        eager_static: the static step uncompiled and ``train.cuda_graphs`` uncaptured:
            the same step run eagerly, on any device (to debug it; the CPU tests).
    """
    device = next(model_without_ddp.parameters()).device
    if cfg.train.cuda_graphs:
        check_graphed_config(cfg, world_size, device, capture=not eager_static)
    forward = static_forward(cfg, model_without_ddp, world_size, eager=eager_static)
    if cfg.train.cuda_graphs and forward is not None:
        return GraphedTrainStep(forward, optimizer, scheduler, amp, cfg.solver.clip_grad_norm, capture=not eager_static)
    return TrainStep(model, optimizer, scheduler, amp, cfg.solver.clip_grad_norm, world_size, forward=forward,
                     average_gradients=forward is not None and world_size > 1)
