"""``EarlyStopping``: patience on the validation metric that chooses ``best.pth``
(``train.best_metric``, larger is better), and ``metric_value``, the one rule for what
counts as a measured value.

A missing metric is never an improvement: absent from the evaluation, not finite, or
-1, which pycocotools reports for an AP or AR it cannot compute (no ground truth in the
val set, or none in an area range). It neither writes ``best.pth`` nor counts toward
the patience (the run cannot be judged, so it is not stopped on it).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional

from detector.config import Config, ConfigError
from detector.evaluation.report import HIGHER_IS_BETTER, LOWER_IS_BETTER

MISSING_SENTINEL = -1.0  # pycocotools: "no ground truth for this metric"


def check_best_metric(cfg: Config) -> None:
    """``train.best_metric`` must be a metric the evaluation writes, and one that is
    larger when better: ``best.pth`` and the patience keep the largest value.

    Raises:
        ConfigError: one line naming the key, before training (it was a warning at the
            first evaluation and no ``best.pth``; an error measure kept the worst model).
    """
    name = cfg.train.best_metric
    if name in LOWER_IS_BETTER:
        raise ConfigError(f"config key 'train.best_metric' is {name!r}, which is smaller when better; best.pth and "
                          f"train.early_stop keep the largest value: choose one of {', '.join(HIGHER_IS_BETTER)}")
    if name not in HIGHER_IS_BETTER:
        raise ConfigError(f"config key 'train.best_metric' is {name!r}, not a metric the evaluation writes: choose "
                          f"one of {', '.join(HIGHER_IS_BETTER)}")


def metric_value(metrics: Mapping[str, float], name: str) -> Optional[float]:
    """``metrics[name]`` where it is a measured value, else None (see the module docstring)."""
    value = metrics.get(name)
    if value is None or not math.isfinite(value) or value == MISSING_SENTINEL:
        return None
    return float(value)


class EarlyStopping:
    """Counts evaluations without an improvement of more than ``min_delta`` over the best
    value so far; ``update`` returns the reason to stop once there are ``patience`` in a row.

    Args:
        metric: the metric's name (for the messages).
        patience: evaluations without improvement before stopping; ``0`` turns it off.
        min_delta: the least increase that counts as an improvement (absolute, >= 0).
    """

    def __init__(self, metric: str, patience: int, min_delta: float = 0.0) -> None:
        if patience < 0 or min_delta < 0:
            raise ValueError(f"train.early_stop needs patience >= 0 and min_delta >= 0, got {patience}, {min_delta}")
        self.metric = metric
        self.patience = int(patience)
        self.min_delta = float(min_delta)
        self.best: Optional[float] = None
        self.best_iteration: Optional[int] = None
        self.wait = 0

    @property
    def enabled(self) -> bool:
        return self.patience > 0

    @property
    def exhausted(self) -> bool:
        """The patience ran out (e.g. in the run a checkpoint was written by)."""
        return self.enabled and self.wait >= self.patience

    def update(self, value: Optional[float], iteration: int) -> Optional[str]:
        """Take one evaluation's value (None: missing); the one-line reason to stop, or None."""
        if not self.enabled or value is None:
            return None
        if self.best is None or value > self.best + self.min_delta:
            self.best, self.best_iteration, self.wait = value, iteration, 0
            return None
        self.wait += 1
        return self.reason(iteration) if self.exhausted else None

    def reason(self, iteration: int) -> str:
        return (f"early stopping at iteration {iteration}: {self.metric} has not improved by more than "
                f"{self.min_delta:g} in {self.wait} evaluations (train.early_stop.patience={self.patience}); "
                f"best {self.metric} {self.best:.4f} at iteration {self.best_iteration}")

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.best, "best_iteration": self.best_iteration, "wait": self.wait}

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        """Restore a ``state_dict`` (None, from an older checkpoint: start counting afresh)."""
        state = state or {}
        self.best = state.get("best")
        self.best_iteration = state.get("best_iteration")
        self.wait = int(state.get("wait", 0))
