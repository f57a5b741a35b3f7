"""Faster R-CNN model: ResNet-FPN backbone, RPN, ROI heads. Entry point: ``build_model``."""

from .build import build_model
from .faster_rcnn import FasterRCNN
from .losses import weighted_smooth_l1

__all__ = ["build_model", "FasterRCNN", "weighted_smooth_l1"]
