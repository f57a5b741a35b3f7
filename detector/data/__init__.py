"""Data: COCO / VOC / generated shapes data sets, albumentations transforms, samplers
and loaders. See docs/data.md for formats, coordinates and the bad-input policy.

The modules, one job each: ``files`` (reading images, JSON, paths confined to a root),
``dataset`` (the base ``DetectionDataset`` and the box policy), ``coco``, ``voc`` and
``shapes`` (one per format), ``transforms``, ``samplers``, ``loader``, ``build`` (data
sets from the config), ``classes`` (the number and names of the classes), ``check``
and ``split`` (behind ``tools/check_dataset.py`` and ``tools/split_dataset.py``). This package only re-exports their public names.

Importing it imports albumentations, which asks PyPI for a newer version unless the
environment variable ``NO_ALBUMENTATIONS_UPDATE=1`` is set: the tools set it when they
start (as the tests' ``conftest.py`` does); set it in your own programs to start offline
without a wait.
"""

from .build import FORMATS, build_dataset, cache_in, check_data_paths
from .classes import (
    category_id_class_names,
    check_trained_classes,
    check_val_classes,
    class_names_for,
    data_num_classes,
    first_other_label,
    resolve_class_names,
    resolve_num_classes,
)
from .coco import CocoDetection, coco_label_map
from .dataset import DetectionDataset
from .files import DataError, load_image
from .loader import build_test_loader, build_train_loader
from .transforms import build_transforms
from .voc import VOC_CLASSES, VOCDetection

__all__ = [
    "FORMATS",
    "VOC_CLASSES",
    "CocoDetection",
    "DataError",
    "DetectionDataset",
    "VOCDetection",
    "build_dataset",
    "cache_in",
    "build_test_loader",
    "build_train_loader",
    "build_transforms",
    "category_id_class_names",
    "check_trained_classes",
    "check_val_classes",
    "class_names_for",
    "check_data_paths",
    "coco_label_map",
    "data_num_classes",
    "first_other_label",
    "load_image",
    "resolve_class_names",
    "resolve_num_classes",
]
