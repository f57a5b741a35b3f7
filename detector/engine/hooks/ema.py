"""``EMAHook`` (updates the weights' moving average after every step taken) and
``PairedValidator`` (evaluates the model and its EMA copy together)."""

from __future__ import annotations

from typing import Callable, Dict

from torch import nn

from detector.engine.ema import ModelEMA
from detector.engine.train_loop import HookBase, LoopState


class EMAHook(HookBase):
    """``ema.update(model)`` after each iteration whose optimizer step was taken (a
    skipped step leaves the average as it is, like the weights; a step flagged on the
    device, ``train.cuda_graphs``, moves it by 0 without a host read)."""

    def __init__(self, ema: ModelEMA, model: nn.Module) -> None:
        self.ema = ema
        self.model = model

    def after_step(self, state: LoopState) -> None:
        flag = getattr(state.step, "skip_flag", None)
        if flag is not None:
            self.ema.update(self.model, skip=flag)  # decided on the device
        elif state.step is not None and not state.step.skipped:
            self.ema.update(self.model)


class PairedValidator:
    """Callable ``(iteration) -> metrics``: ``main``'s metrics under their names (they
    choose ``best.pth`` and drive early stopping) and ``other``'s under ``prefix/``
    (e.g. ``ema/AP``), so TensorBoard shows both as ``eval/AP`` and ``eval/ema/AP``."""

    def __init__(self, main: Callable[[int], Dict[str, float]], other: Callable[[int], Dict[str, float]],
                 prefix: str) -> None:
        self.main, self.other, self.prefix = main, other, prefix

    def __call__(self, iteration: int) -> Dict[str, float]:
        metrics = dict(self.main(iteration) or {})
        metrics.update({f"{self.prefix}/{k}": v for k, v in (self.other(iteration) or {}).items()})
        return metrics
