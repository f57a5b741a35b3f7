"""The weights that tools/eval.py evaluates, tools/infer.py runs and tools/export.py
exports: one rule for the three, so that what is deployed is what was measured."""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from detector.config import Config
from detector.data import check_trained_classes
from detector.modeling.trained_config import warn_other_settings
from detector.modeling.weights import LoadReport, load_model_weights, uses_ema_weights


def load_trained_weights(model: nn.Module, cfg: Config, weights: str,
                         class_names: Optional[Sequence[str]]) -> LoadReport:
    """Load ``weights`` (a training checkpoint, a state dict, or a torchvision weights
    name) into ``model`` strictly, as training evaluated them: a checkpoint's EMA weights
    where ``uses_ema_weights(cfg)`` (``train.ema.enabled`` and ``eval.use_ema``). Then
    refuse labels named otherwise than in the run that trained them
    (``check_trained_classes``, against ``class_names``, this config's names of labels
    1..K; not checked where None) and warn once about the settings that differ from that
    run's (``warn_other_settings``).

    Raises:
        WeightsError: the weights cannot be read or do not fit ``model``;
        DataError: a label is named otherwise than in the training run.
    """
    report = load_model_weights(model, weights, use_ema=uses_ema_weights(cfg))
    if class_names is not None:
        check_trained_classes(cfg, report.trained_classes, class_names, weights)
    warn_other_settings(report.trained_settings, cfg, weights)
    return report
