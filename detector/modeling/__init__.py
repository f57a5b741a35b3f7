"""Faster R-CNN model: ResNet-FPN backbone, RPN, ROI heads. Entry point: ``build_model``."""

from .build import build_model
from .faster_rcnn import FasterRCNN
from .losses import weighted_smooth_l1
from .weights import LoadReport, WeightsError, load_initial_weights, load_weights, read_weights_file

__all__ = [
    "build_model",
    "FasterRCNN",
    "LoadReport",
    "WeightsError",
    "load_initial_weights",
    "load_weights",
    "read_weights_file",
    "weighted_smooth_l1",
]
