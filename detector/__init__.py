"""detector: a reference Faster R-CNN training application on PyTorch."""

__version__ = "0.1.0"
